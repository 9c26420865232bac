"""Security: host keys (every headless command, and a reconnect that meets a changed key), no secret written
anywhere, and nothing listening on a non-loopback address.

CLIENT's tests already pin `status` and `connect` against unknown and changed keys; these extend the refusal to
every other headless command, show that nothing ran on the host and known_hosts was not written, and that a
session whose host key changes between two connections refuses the reconnect instead of resuming.
"""

from __future__ import annotations

import asyncio
import os
import re
import socket
import stat
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from adv_support import agent_pid_of, ssh_options, sshd_session_of
from support.waiting import wait_until_async

from tui.link.events import ConnectionEvent
from tui.link.session import open_session

pytestmark = pytest.mark.ssh

HEADLESS = [
    ["status", "--json"],
    ["launch", "--json", "--wait", "started", "--", "touch", "/tmp/specdec-adversarial-should-not-run"],
    ["logs", "-n", "5"],
    ["stop", "--grace", "1"],
    ["restart", "--grace", "1"],
    ["kill-stale", "--yes", "--json"],
    ["stacks"],
    ["doctor"],
]


@pytest.mark.parametrize("which", ["unknown", "changed"])
def test_every_headless_command_refuses_a_host_key_it_cannot_verify(
    sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path, which: str
) -> None:
    source = sshd.empty_known_hosts if which == "unknown" else sshd.changed_known_hosts
    known = tmp_path / "known_hosts"
    known.write_bytes(source.read_bytes())
    before = known.read_bytes()
    for cmd in HEADLESS:
        r = cli(cmd[0], sshd.target, *sshd.args(known_hosts=known), "--run-root", str(run_root), *cmd[1:])
        assert r.returncode == 3, f"{cmd[0]}: {r.output}"
        if which == "unknown":
            assert sshd.host_key_fingerprint in r.output and "unknown" in r.output, r.output
        else:
            assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.output, r.output
            assert sshd.host_key_fingerprint in r.output
        assert "Traceback" not in r.output
    assert known.read_bytes() == before  # never written without an explicit accept
    assert list(run_root.iterdir()) == []  # nothing shipped, nothing launched
    assert not Path("/tmp/specdec-adversarial-should-not-run").exists()


@pytest.mark.parametrize("pct", [False, True], ids=["ssh", "ssh+pct"])
async def test_a_reconnect_that_meets_a_changed_host_key_fails_instead_of_resuming(
    sshd: Any, run_root: Path, tmp_path: Path, pct: bool
) -> None:
    known = tmp_path / "known_hosts"
    known.write_bytes(sshd.known_hosts.read_bytes())
    session = open_session(
        sshd.target, ssh_options(sshd, run_root, known_hosts=str(known), pct=sshd.pct_ctid if pct else None)
    )
    session.backoff_base_s = 0.05
    details: list[tuple[str, str]] = []
    session.add_event_listener(
        lambda ev: details.append((ev.state, ev.detail)) if isinstance(ev, ConnectionEvent) else None
    )
    await session.connect()
    try:
        agent_pid = agent_pid_of(session)
        known.write_bytes(sshd.changed_known_hosts.read_bytes())  # from now on the server's key does not match
        server = sshd_session_of(agent_pid)
        os.kill(server, 9)
        await wait_until_async(lambda: session.state == "failed", 20, "the session to give up on the changed key")
        await asyncio.sleep(0.5)
        assert session.state == "failed"  # and it stays failed: no retry loop against a possible MITM
    finally:
        await session.close()
    failed = [d for s, d in details if s == "failed"]
    assert failed and "REMOTE HOST IDENTIFICATION HAS CHANGED" in failed[0], details
    assert [s for s, _ in details].count("connected") == 1


# -- no secret written ----------------------------------------------------------------------------------------

PASSPHRASE = "s3cret-PASS-phrase-4711"
TOKEN = "hf_TOKEN_adversarial_0123456789abcdef"


def _files_containing(root: Path, needle: bytes) -> list[Path]:
    hits = []
    for p in root.rglob("*"):
        if p.is_file() and not p.is_symlink():
            try:
                if needle in p.read_bytes():
                    hits.append(p)
            except OSError:
                continue
    return hits


def _locked_key(tmp_path: Path) -> Path:
    key = tmp_path / "id_locked"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", PASSPHRASE, "-f", str(key)], check=True, capture_output=True
    )
    return key


# Offered in every place a passphrase could be picked up from (the client documents none of them).
PASSPHRASE_ENV = {"SSH_PASSPHRASE": PASSPHRASE, "SPECDEC_PASSPHRASE": PASSPHRASE, "SSH_ASKPASS": "/bin/false"}


def test_a_key_passphrase_in_the_environment_never_reaches_output_or_files(
    sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path
) -> None:
    key = _locked_key(tmp_path)
    outputs = [
        cli(*cmd, sshd.target, *sshd.args(identity=key), "--run-root", str(run_root), env=PASSPHRASE_ENV).output
        for cmd in (["status", "--json"], ["doctor"], ["logs", "-n", "1"])
    ]
    # With the usable key the session works, and the passphrase in the environment still appears nowhere.
    outputs.append(cli("status", sshd.target, *sshd.args(), "--run-root", str(run_root), env=PASSPHRASE_ENV).output)
    assert not [o for o in outputs if PASSPHRASE in o]
    assert not _files_containing(run_root, PASSPHRASE.encode())


def test_a_passphrase_protected_identity_is_refused_with_exit_3_and_a_sentence(
    sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path
) -> None:
    key = _locked_key(tmp_path)
    r = cli("status", sshd.target, *sshd.args(identity=key), "--run-root", str(run_root), env=PASSPHRASE_ENV)
    assert "Traceback" not in r.output, r.output
    assert r.returncode == 3, r.output
    assert re.search(r"passphrase|encrypted", r.output, re.I), r.output


def test_profile_secrets_stay_out_of_logs_events_and_output_and_records_are_private(
    sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path
) -> None:
    config = tmp_path / "p.toml"
    config.write_text(
        '[profiles.tok]\ncommand = ["python3", "-c", "print(\'step=1\', flush=True)"]\n'
        f'env = {{ HF_TOKEN = "{TOKEN}" }}\n'
    )
    outputs = []
    r = cli("launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--config", str(config),
            "--profile", "tok", "--wait", "first-step", "--json")  # fmt: skip
    assert r.returncode == 0, r.output
    outputs.append(r.output)
    human = cli("launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--config", str(config),
                "--profile", "tok", "--wait", "first-step")  # fmt: skip
    assert human.returncode == 0, human.output
    outputs.append(human.output)
    for cmd in (["status", "--json"], ["status"], ["logs", "-n", "50"]):
        res = cli(cmd[0], sshd.target, *sshd.args(), "--run-root", str(run_root), *cmd[1:])
        assert res.returncode == 0, res.output
        outputs.append(res.output)
    assert not [o for o in outputs if TOKEN in o], "a profile secret reached the screen"
    for p in _files_containing(run_root, TOKEN.encode()):
        # The spec must keep the env to relaunch the same run; it is then readable by its owner only.
        assert p.name in ("spec.json", "submitted.json", "launch.json"), f"secret written to {p}"
        assert stat.S_IMODE(p.stat().st_mode) & 0o077 == 0, f"{p} is readable by others"


# -- nothing listens beyond loopback --------------------------------------------------------------------------


def _listening_inodes() -> dict[int, str]:
    """socket inode -> local address of every listening TCP/TCP6 socket on the host."""
    out: dict[int, str] = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == "0A":  # LISTEN
                out[int(f[9])] = f[1][:width]
    return out


def _socket_inodes(pid: int) -> set[int]:
    """The socket inodes among ``pid``'s open files. A fd directory that cannot be read fails the test: the
    callers' only assertion runs over this set, so an empty one from a failed read would pass unchecked."""
    fd_dir = f"/proc/{pid}/fd"
    try:
        fds = os.listdir(fd_dir)
    except OSError as exc:
        pytest.fail(f"cannot read {fd_dir}: {exc}")
    found: set[int] = set()
    for fd in fds:
        try:
            link = os.readlink(f"{fd_dir}/{fd}")
        except FileNotFoundError:
            continue  # closed between the listing and the read (the client's own descriptors come and go)
        if link.startswith("socket:["):
            found.add(int(link[8:-1]))
    return found


def test_socket_inodes_fails_loudly_when_the_fd_directory_cannot_be_read() -> None:
    with socket.socket() as sock:
        assert os.fstat(sock.fileno()).st_ino in _socket_inodes(os.getpid())
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its /proc/<pid>/fd is gone
    with pytest.raises(pytest.fail.Exception, match=f"cannot read /proc/{gone.pid}/fd"):
        _socket_inodes(gone.pid)


LOOPBACK = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1 as /proc/net prints them


async def test_agent_and_client_open_no_listening_socket_beyond_loopback(sshd: Any, run_root: Path) -> None:
    session = open_session(sshd.target, ssh_options(sshd, run_root))
    await session.connect()
    try:
        await session.start_streams(gpu_interval_s=0.2, procs_interval_s=0.2)
        await session.request("status", timeout_s=30.0)
        await session.request("doctor", timeout_s=60.0)
        agent_pid = agent_pid_of(session)
        listening = _listening_inodes()
        for who, pid in (("agent", agent_pid), ("client", os.getpid())):
            for ino in _socket_inodes(pid):
                addr = listening.get(ino)
                assert addr is None or addr.split(":")[0] in LOOPBACK, f"the {who} listens on {addr}"
    finally:
        await session.close()


async def test_the_dashboard_over_ssh_listens_on_nothing_beyond_loopback(
    sshd: Any, run_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No web view exists; the Textual dashboard, live over SSH, opens no listening socket off loopback."""
    from tui.dashboard.app import DashboardApp

    monkeypatch.setenv("SPECDEC_TUI_CONFIG_DIR", str(tmp_path / "tui-config"))
    session = open_session(sshd.target, ssh_options(sshd, run_root, simulate_gpus=2))
    app = DashboardApp(session, gpu_interval_s=0.2, procs_interval_s=0.2)
    async with app.run_test(size=(120, 40)) as pilot:
        await wait_until_async(lambda: app.state.gpus is not None, 30, "the dashboard's first GPU sample")
        await pilot.pause()
        listening = _listening_inodes()
        pids = [os.getpid(), agent_pid_of(session)]
        for pid in pids:
            for ino in _socket_inodes(pid):
                addr = listening.get(ino)
                assert addr is None or addr.split(":")[0] in LOOPBACK, f"pid {pid} listens on {addr}"
        await pilot.press("q")
    await session.close()
