"""The headless commands: one session per command, one line of output or one JSON object, an exit code.

- ``common``: the options every command shares, opening the session, exit codes and printing.
- ``run``: the commands that act (launch, stop, restart, kill-stale).
- ``monitor``: the commands that look (status, runs, logs, doctor, stacks).
- ``nodes``: launch, status, stop, restart, logs and kill-stale over several nodes (one session per node).

They see the host through ``tui.link`` and compose launches with ``tui.relaunch``; never the dashboard.
"""
