"""engine.host: what is true of the machine, with no notion of agent or supervisor.

The engine's middle floors, each importing only the ones below it (import-linter's layers contract in
pyproject.toml keeps the arrows pointing down; tests/unit/test_import_cycles.py forbids any circle)::

    engine.agent        commands over stdio: status, subscribe, logs, launch/wait/stop/kill-stale/stacks
        |
    engine.supervisor   runs on disk: launch wrapper, a run's records (records/), one module per verb
        |
    engine.host         the machine: processes, GPUs, files that only grow   (engine.stackdump beside it)
        |
    engine.protocol     the wire's dataclasses and encoding

Here:

* ``procs``: the one reader of /proc (stat, status, cmdline, threads, fds, boot id); a process's identity
  is (pid, start ticks), so a reused pid never passes for the one recorded.
* ``holders``: which processes hold an NVIDIA device (fd links joined with NVML's process lists);
  ``host_map``: the Proxmox host's NVML view mapped into a container.
* ``gpus`` (NVML) and ``simulate`` (``--simulate-gpus``) are GPU sources; ``gpu_source`` picks one, so neither
  source imports the other. ``nvml_binding`` finds pynvml; ``capabilities`` says what the host can do.
* ``net``: the route to a peer, a free TCP port, the address SSH reached us at (a rendezvous's place).
* ``appended``: the one reader of files that only grow (offset, identity, carried partial line) and the one
  "last lines of a file"; the agent's log follower and events reader and the supervisor's run scanner use it.
* ``files``: opening a file someone may have planted (no FIFO block, no link followed, regular files only):
  serve-check's lock and log, the trainer's output_dir hold.

Nothing here knows what a run is: a run's records live in engine.supervisor.records.

Stdlib only: this runs on hosts that have nothing but python3 (psutil and pynvml when present).
"""
