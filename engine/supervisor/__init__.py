"""engine.supervisor: supervised runs on disk, on top of engine.host; it never imports engine.agent.

A run is a directory of records kept in one room, the ``records`` package (ids and the layout, the typed
record files and ``run_pids``, atomic writes, the incremental scan of its output and events, all of "why it
failed", and ``read_run``, one module per job), by a wrapper process (``wrapper``, with its restart
policy in ``restart`` and tmux in ``tmux``). What the agent asks of runs is one module per verb:

* ``launch``: validate a LaunchSpec, claim a run directory, start the wrapper under tmux (or setsid);
* ``wait``: watch a run until a milestone, an exit or a deadline (hung: what the process is doing);
* ``stop``: SIGTERM, the grace, SIGKILL, then wait for the run's GPU devices to free;
* ``kill_stale``: list or signal our user's GPU holders outside the current run;
* ``stacks``: every thread's stack of a live run.

``members`` (which processes are the run's, signalled only while provably still the run's) and ``common``
(the error, progress and polling the verbs share) sit under the verbs. Everything acts only on what the
run records name (pid and process group, each checked against its recorded start ticks) or on processes
that hold an NVIDIA device right now, re-checked before every signal. Nothing is ever matched by name.
Stdlib only: this runs on hosts that have nothing but python3.
"""
