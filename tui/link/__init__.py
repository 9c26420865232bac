"""Reaching the host's agent: everything between a front end and the agent's stdio.

- ``session``: one connection (commands with one reply each, decoded events to listeners, reconnect and
  resume); ``AgentSession`` is the facade every caller holds.
- ``transport``: how the agent is reached (local subprocess, asyncssh, a ``pct exec`` hop) and started.
- ``ship``: the agent bundle (the engine package as one zipapp) a host with only ``python3`` receives.
- ``events``: the events listeners get, decoded once into engine/protocol.py's dataclasses.

Nothing here knows a profile, a screen or a command-line option beyond ``ConnectOptions``.
"""
