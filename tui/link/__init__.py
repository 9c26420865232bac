"""Reaching the host's agent: everything between a front end and the agent's stdio.

- ``session``: one connection (commands with one reply each, decoded events to listeners, reconnect and
  resume); ``AgentSession`` is the facade every caller holds.
- ``transport``: how the agent is reached (local subprocess, asyncssh, a ``pct exec`` hop) and started.
- ``ship``: the agent bundle (the engine package as one zipapp) a host with only ``python3`` receives.
- ``events``: the events listeners get, decoded once into engine.protocol's dataclasses.

Nothing here knows a profile, a screen or a command-line option beyond ``ConnectOptions``.
"""

from __future__ import annotations

import warnings


def quiet_asyncssh_crypto_warnings() -> None:
    """Ignore the CryptographyDeprecationWarnings that asyncssh's own modules raise (an older asyncssh with a newer
    cryptography prints five at import, e.g. "TripleDES has been moved", before every command's output, burying the
    host-key warning). Only that category, only from asyncssh's modules: every other warning still shows."""
    try:
        from cryptography.utils import CryptographyDeprecationWarning
    except ImportError:  # no cryptography: no asyncssh either, nothing to quiet
        return
    warnings.filterwarnings("ignore", category=CryptographyDeprecationWarning, module=r"asyncssh(\.|$)")


quiet_asyncssh_crypto_warnings()  # before any module of this package imports asyncssh
