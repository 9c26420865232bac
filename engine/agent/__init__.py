"""engine.agent: the host agent, the top floor of the engine (on engine.supervisor and engine.host).

One process per client connection (``python3 -m engine.agent.main``): commands in and events out as JSON
lines on stdio (engine.protocol). The arrows inside point one way, without a circle:

* ``main`` imports the command modules (``monitor_cmds``: status, subscribe, logs, doctor, host map;
  ``run_cmds``: launch, wait, stop, restart, kill-stale, stacks; ``net_cmds``: a multi-node run's
  rendezvous), whose ``@handler`` registrations fill
  the table in ``commands``, and hands that table to the ``server`` (``Agent``: dispatch, one thread per
  command, replies);
* ``commands`` and the command modules import ``server`` for ``Agent`` and ``CommandError``; ``server``
  imports no command module; ``commands`` also holds what the command modules share (``run_dir_arg``: the run
  a command names, else the current one);
* ``run_cmds`` imports ``monitor_cmds`` for the GPU view the monitor keeps; never the other way.

``follow`` turns appended files into log events (engine.host.appended underneath), ``anomalies`` and
``doctor`` judge what the host reports. Machine facts (processes, GPUs, run records) come from
engine.host; run verbs from engine.supervisor.
"""
