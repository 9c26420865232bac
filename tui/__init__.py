"""The client: what runs on your machine, in rooms by use, whose imports point down only.

- ``__main__``: the command line (``specdec-tui``); it picks a front end per command.
- ``cli/`` and ``dashboard/``: the two front ends, the headless commands and the Textual app; neither
  imports the other.
- ``relaunch``, ``profiles``, ``restarts``, ``nodes``, ``timewords``: the run words both front ends share (the one
  launch-spec builder and restart, the profiles' file, a run's restarts in words, one run across several nodes,
  times and durations as printed).
- ``link/``: reaching the agent on the host (session, transport, the shipped bundle, decoded events); callers
  hold one ``AgentSession``.

pyproject.toml's import-linter contracts keep these floors; tests/unit/test_import_cycles.py forbids a cycle.
"""
