"""A real OpenSSH sshd on 127.0.0.1 for the integration tests, plus a `pct` shim.

The session-scoped ``sshd`` fixture generates host and user keys with ssh-keygen, writes its own
sshd_config (key login only, root allowed by key because CI runs as root, no PAM, PidFile in the
temp dir), starts ``sshd -D -e`` on a free port and stops it at the end. It also works for a
non-root user (sshd then only lets that user in, which is the user the tests connect as).

Clients always pass ``-i`` and ``--known-hosts`` explicitly: the user's ~/.ssh is never used.
The sessions it opens get, through ``SetEnv``: a PATH whose first entries are the `pct` shim and
the directory of the interpreter running the tests, the private tmux socket of this test session,
and ``SPECDEC_DEV_DIR`` (a temp dir where tests can put stand-in ``nvidia*`` device files).

The `pct` shim stands in for Proxmox's ``pct exec CTID -- cmd ...``: it checks CTID against the one
configured here and execs the rest, failing like the real one for an unknown container.

``pool`` and ``agent`` are the supervisor tests' agents: real agent subprocesses on a temporary run root, whose
runs are ended at teardown by their recorded process groups (tests/support/agent.py).
"""

from __future__ import annotations

import contextlib
import getpass
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from support.agent import AgentClient, AgentPool
from support.waiting import wait_until

from tui.link.session import ConnectOptions

REPO_ROOT = Path(__file__).resolve().parents[2]
PCT_CTID = 4242
SSH_CONNECT_TIMEOUT_S = 5.0

PCT_SHIM = """#!/bin/sh
# Test stand-in for Proxmox `pct exec CTID -- cmd ...`: checks CTID, then execs the command.
if [ "$1" != "exec" ]; then echo "pct shim: only 'pct exec' is supported" >&2; exit 255; fi
shift
if [ "$1" != "{ctid}" ]; then
    echo "Configuration file 'nodes/testnode/lxc/$1.conf' does not exist" >&2
    exit 255
fi
shift
if [ "$1" != "--" ]; then echo "pct shim: expected '--' after the CTID" >&2; exit 255; fi
shift
exec "$@"
"""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _keygen(path: Path, comment: str) -> str:
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
        check=True,
        capture_output=True,
        timeout=30,
    )
    return path.with_suffix(".pub").read_text().strip() if path.suffix else Path(f"{path}.pub").read_text().strip()


def _banner_ready(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            return s.recv(64).startswith(b"SSH-")
    except OSError:
        return False


@dataclass
class Sshd:
    port: int
    user: str
    dir: Path
    identity: Path  # the user's private key (authorized)
    stranger_identity: Path  # a key the server does not know
    known_hosts: Path  # the server's real host key
    changed_known_hosts: Path  # a different key recorded for the same [host]:port
    empty_known_hosts: Path
    host_key_fingerprint: str  # SHA256:...
    shim_dir: Path
    dev_dir: Path
    pct_ctid: int = PCT_CTID
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"

    @property
    def target(self) -> str:
        return f"{self.user}@{self.host}"

    def args(self, *, known_hosts: Path | None = None, identity: Path | None = None) -> list[str]:
        """The CLI options that reach this sshd: port, key, known_hosts, the test interpreter."""
        return [
            "-p",
            str(self.port),
            "-i",
            str(identity or self.identity),
            "--known-hosts",
            str(known_hosts or self.known_hosts),
            "--python",
            sys.executable,
            "--connect-timeout",
            str(SSH_CONNECT_TIMEOUT_S),
        ]

    def options(self, run_root: Path | None = None, **extra: Any) -> ConnectOptions:
        """The same for an in-process session (``open_session``); ``extra`` sets or overrides any option."""
        kw: dict[str, Any] = {
            "identity": str(self.identity),
            "port": self.port,
            "known_hosts": str(self.known_hosts),
            "python": sys.executable,
            "run_root": str(run_root) if run_root is not None else None,
            "connect_timeout_s": SSH_CONNECT_TIMEOUT_S,
        }
        kw.update(extra)
        return ConnectOptions(**kw)


def _sshd_binary() -> str | None:
    found = shutil.which("sshd")
    if found:
        return found
    return "/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None


class SshdUnavailable(RuntimeError):
    """No OpenSSH server binary on this machine."""


@contextlib.contextmanager
def running_sshd(d: Path, tmux_socket: str) -> Iterator[Sshd]:
    """Generate keys and config under ``d``, start ``sshd -D -e`` on a free loopback port, stop it on exit."""
    binary = _sshd_binary()
    if binary is None or shutil.which("ssh-keygen") is None:
        raise SshdUnavailable("OpenSSH server not installed (tests/run installs it: apt-get install openssh-server)")
    host_key, other_host_key = d / "host_ed25519", d / "other_host_ed25519"
    user_key, stranger_key = d / "id_ed25519", d / "stranger_ed25519"
    host_pub = _keygen(host_key, "test-host")
    other_pub = _keygen(other_host_key, "other-host")
    user_pub = _keygen(user_key, "test-user")
    _keygen(stranger_key, "stranger")
    (d / "authorized_keys").write_text(user_pub + "\n")
    port = _free_port()
    fp = subprocess.run(
        ["ssh-keygen", "-l", "-E", "sha256", "-f", f"{host_key}.pub"], capture_output=True, text=True, check=True
    ).stdout.split()[1]
    known = d / "known_hosts"
    known.write_text(f"[127.0.0.1]:{port} {' '.join(host_pub.split()[:2])}\n")
    changed = d / "known_hosts_changed"
    changed.write_text(f"[127.0.0.1]:{port} {' '.join(other_pub.split()[:2])}\n")
    empty = d / "known_hosts_empty"
    empty.write_text("")

    shim_dir = d / "bin"
    shim_dir.mkdir()
    shim = shim_dir / "pct"
    shim.write_text(PCT_SHIM.replace("{ctid}", str(PCT_CTID)))
    shim.chmod(0o755)
    dev_dir = d / "dev"
    dev_dir.mkdir()
    env = {
        "PATH": os.pathsep.join(
            [str(shim_dir), str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]
        ),
        "SPECDEC_TMUX_SOCKET": tmux_socket,
        "SPECDEC_DEV_DIR": str(dev_dir),
    }
    user = getpass.getuser()
    config = d / "sshd_config"
    config.write_text(
        "\n".join(
            [
                f"Port {port}",
                "ListenAddress 127.0.0.1",
                f"HostKey {host_key}",
                f"PidFile {d / 'sshd.pid'}",
                f"AuthorizedKeysFile {d / 'authorized_keys'}",
                "PubkeyAuthentication yes",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "PermitRootLogin prohibit-password",
                f"AllowUsers {user}",
                "UsePAM no",
                "StrictModes no",
                "PrintMotd no",
                "LogLevel VERBOSE",
                "MaxStartups 100:30:200",
                "MaxSessions 50",
                "SetEnv " + " ".join(f"{k}={v}" for k, v in env.items()),
                "",
            ]
        )
    )
    if os.geteuid() == 0:
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # privilege separation directory
    check = subprocess.run([binary, "-t", "-f", str(config)], capture_output=True, text=True)
    if check.returncode != 0:
        raise RuntimeError(f"sshd rejects its test config: {check.stderr}")
    with open(d / "sshd.log", "wb") as log:
        proc = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_until(lambda: proc.poll() is not None or _banner_ready(port), 15.0, f"sshd to greet on port {port}")
            if proc.poll() is not None:
                raise RuntimeError(f"sshd did not start: {(d / 'sshd.log').read_text(errors='replace')[-2000:]}")
            yield Sshd(
                port=port,
                user=user,
                dir=d,
                identity=user_key,
                stranger_identity=stranger_key,
                known_hosts=known,
                changed_known_hosts=changed,
                empty_known_hosts=empty,
                host_key_fingerprint=fp,
                shim_dir=shim_dir,
                dev_dir=dev_dir,
                env=env,
            )
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


@pytest.fixture(scope="session")
def sshd(tmp_path_factory: pytest.TempPathFactory, tmux_socket: str) -> Iterator[Sshd]:
    """A real sshd on 127.0.0.1 for the whole test session (see the module docstring)."""
    try:
        with running_sshd(tmp_path_factory.mktemp("sshd"), tmux_socket) as server:
            yield server
    except SshdUnavailable as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def sshd_pair(tmp_path_factory: pytest.TempPathFactory, tmux_socket: str) -> Iterator[list[Sshd]]:
    """Two sshd on 127.0.0.1 (two ports, two host keys) as two machines, the second with a tmux server of its own
    (a run id names its tmux session, and one run spans both)."""
    second_socket = f"{tmux_socket}-node1"
    try:
        with (
            running_sshd(tmp_path_factory.mktemp("sshd-node0"), tmux_socket) as first,
            running_sshd(tmp_path_factory.mktemp("sshd-node1"), second_socket) as second,
        ):
            yield [first, second]
    except SshdUnavailable as exc:
        pytest.skip(str(exc))
    finally:
        if shutil.which("tmux"):
            subprocess.run(["tmux", "-L", second_socket, "kill-server"], capture_output=True, timeout=10, check=False)


@pytest.fixture
def pool(tmp_path: Path) -> Iterator[AgentPool]:
    """Agents on a fresh run root; every run they launched is ended at teardown."""
    root = tmp_path / "run-root"
    root.mkdir()
    p = AgentPool(root)
    yield p
    p.close()


@pytest.fixture
def agent(pool: AgentPool) -> AgentClient:
    """One agent of ``pool``."""
    return pool.make()


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str
    elapsed_s: float

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


@pytest.fixture(scope="session")
def cli() -> Callable[..., CliResult]:
    """``cli(*args, env=None, timeout_s=60)``: run ``python -m tui ARGS`` as a subprocess, timed."""

    def run(*args: str, env: dict[str, str] | None = None, timeout_s: float = 60.0) -> CliResult:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = str(REPO_ROOT) + (
            os.pathsep + full_env["PYTHONPATH"] if "PYTHONPATH" in full_env else ""
        )
        full_env.update(env or {})
        t0 = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-m", "tui", *args],
            capture_output=True,
            text=True,
            env=full_env,
            timeout=timeout_s,
            cwd=str(REPO_ROOT),
            check=False,
        )
        return CliResult(done.returncode, done.stdout, done.stderr, time.monotonic() - t0)

    return run
