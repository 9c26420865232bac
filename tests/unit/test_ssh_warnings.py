"""asyncssh's CryptographyDeprecationWarnings are quiet; every other warning still shows."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# What an older asyncssh (before it read its ciphers from cryptography's decrepit module) does at import with a
# cryptography of 43 or later: a CryptographyDeprecationWarning attributed to asyncssh.crypto.cipher, then (the
# same category from another module, and another category from asyncssh) two that must still show.
EMIT = """
import warnings
import tui.link  # what every client path imports before asyncssh
from cryptography.utils import CryptographyDeprecationWarning as C
warnings.warn_explicit("TripleDES has been moved", C, "cipher.py", 30, module="asyncssh.crypto.cipher")
warnings.warn_explicit("Blowfish has been moved", C, "cipher.py", 31, module="asyncssh")
warnings.warn_explicit("ours: still shown", C, "mine.py", 1, module="myapp")
warnings.warn_explicit("asyncssh: still shown", UserWarning, "connection.py", 2, module="asyncssh.connection")
"""


def test_asyncssh_crypto_deprecation_warnings_are_quiet_and_nothing_else_is() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", EMIT], cwd=REPO, capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin"}
    )
    assert proc.returncode == 0, proc.stderr
    assert "TripleDES" not in proc.stderr and "Blowfish" not in proc.stderr, proc.stderr
    assert "ours: still shown" in proc.stderr and "asyncssh: still shown" in proc.stderr, proc.stderr
