"""The SSH transport against a real OpenSSH sshd on 127.0.0.1 (fixture in conftest.py), and the pct hop.

Every client passes -i and --known-hosts explicitly; the user's ~/.ssh is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_until_async

from tui.link import ship
from tui.link.events import ClientEvent, ConnectionEvent
from tui.link.session import ConnectOptions, open_session
from tui.link.transport import SshTransport, Target

pytestmark = pytest.mark.ssh

STABLE_HOST_KEYS = ("hostname", "boot_id", "kernel", "python", "cpu_count")
STABLE_GPU_KEYS = ("index", "name", "uuid", "mem_total_mib", "simulated")


def _status(cli: Callable[..., Any], target: str, *extra: str) -> dict[str, Any]:
    r = cli("status", target, "--json", "--simulate-gpus", "3", *extra)
    assert r.returncode == 0, r.output
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _stable(snap: dict[str, Any]) -> dict[str, Any]:
    return {
        "host": {k: snap["host"].get(k) for k in STABLE_HOST_KEYS},
        "gpus": [{k: g.get(k) for k in STABLE_GPU_KEYS} for g in snap["gpus"]],
        "capabilities": {k: v.get("ok") for k, v in (snap.get("capabilities") or {}).items()},
        "simulated": snap.get("simulated"),
        "keys": sorted(k for k in snap if k in ("host", "gpus", "processes", "run", "anomalies")),
    }


def test_status_over_ssh_equals_status_over_local(sshd: Any, cli: Callable[..., Any], run_root: Path) -> None:
    remote = _status(cli, sshd.target, *sshd.args(), "--run-root", str(run_root))
    local = _status(cli, "local", "--run-root", str(run_root))
    assert _stable(remote) == _stable(local)
    assert len(remote["gpus"]) == 3 and all(g["simulated"] for g in remote["gpus"])
    assert remote["host"]["run_root"] == local["host"]["run_root"] == str(run_root)


def _installed_bundle(run_root: Path) -> Path:
    found = sorted((run_root / "agent").glob("*.pyz"))
    assert len(found) == 1, found
    return found[0]


async def test_first_connect_ships_the_bundle_and_a_corrupt_one_is_replaced(sshd: Any, run_root: Path) -> None:
    # In-process, so the bundle cannot change between the two connects while someone edits engine/.
    opts = sshd.options(run_root)
    bundle = ship.agent_bundle()

    async def connect_once() -> dict[str, Any]:
        session = open_session(sshd.target, opts)
        await session.connect()
        try:
            return await session.request("ping", timeout_s=30)
        finally:
            await session.close()

    assert not (run_root / "agent").exists()
    await connect_once()
    installed = _installed_bundle(run_root)
    assert installed.name == bundle.name
    assert installed.name == f"{ship.protocol.AGENT_VERSION}-{bundle.sha256[:16]}.pyz"
    assert hashlib.sha256(installed.read_bytes()).hexdigest() == bundle.sha256
    tree = installed.with_suffix("")
    wire = tree / "engine" / "protocol" / "wire.py"
    wire.write_text("raise SystemExit('tampered')\n")  # the extracted copy is re-checked
    installed.write_bytes(b"#!/usr/bin/env python3\nraise SystemExit('tampered')\n")
    await connect_once()
    assert hashlib.sha256(installed.read_bytes()).hexdigest() == bundle.sha256
    assert "tampered" not in wire.read_text()
    assert not [p for p in installed.parent.iterdir() if ".tmp" in p.name or ".old" in p.name]


def test_unknown_host_key_is_refused_with_exit_3_and_the_fingerprint(sshd: Any, cli: Callable[..., Any]) -> None:
    r = cli("status", sshd.target, *sshd.args(known_hosts=sshd.empty_known_hosts))
    assert r.returncode == 3, r.output
    assert sshd.host_key_fingerprint in r.stderr
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> {sshd.empty_known_hosts}" in r.stderr
    assert "out of band" in r.stderr
    assert "Traceback" not in r.output


def test_changed_host_key_is_refused_with_the_warning(sshd: Any, cli: Callable[..., Any]) -> None:
    r = cli("status", sshd.target, *sshd.args(known_hosts=sshd.changed_known_hosts))
    assert r.returncode == 3, r.output
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in r.stderr
    assert sshd.host_key_fingerprint in r.stderr
    assert "Traceback" not in r.output


def test_authentication_failure_exits_3(sshd: Any, cli: Callable[..., Any]) -> None:
    r = cli("status", sshd.target, *sshd.args(identity=sshd.stranger_identity))
    assert r.returncode == 3, r.output
    assert "authentication failed" in r.stderr
    assert "Traceback" not in r.output


def test_refused_port_exits_3(sshd: Any, cli: Callable[..., Any]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connection refused
        args = sshd.args()
        args[args.index("-p") + 1] = str(port)
        r = cli("status", sshd.target, *args)
    assert r.returncode == 3, r.output
    assert "cannot connect" in r.stderr and "Traceback" not in r.output


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A TCP port that accepts connections and never says a word (a host that hangs mid-handshake)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        srv.settimeout(0.1)
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except OSError:
                continue

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join(2)
    for c in conns:
        c.close()
    srv.close()


def test_silent_host_exits_3_within_the_connect_timeout(
    sshd: Any, cli: Callable[..., Any], silent_listener: int
) -> None:
    args = sshd.args()
    args[args.index("-p") + 1] = str(silent_listener)
    args[args.index("--connect-timeout") + 1] = "1.5"
    r = cli("status", sshd.target, *args)
    assert r.returncode == 3, r.output
    assert "within 1.5 s" in r.stderr
    assert r.elapsed_s < 1.5 + 3.0  # the timeout plus interpreter start-up


def test_missing_python_on_host_exits_3(sshd: Any, cli: Callable[..., Any], run_root: Path) -> None:
    args = sshd.args()
    args[args.index("--python") + 1] = "/nonexistent/python3"
    r = cli("status", sshd.target, *args, "--run-root", str(run_root))
    assert r.returncode == 3, r.output
    assert "no `/nonexistent/python3` on the host" in r.stderr
    assert "Traceback" not in r.output


def test_pct_hop_through_the_shim(sshd: Any, cli: Callable[..., Any], run_root: Path) -> None:
    # The shim on the sshd's PATH stands in for Proxmox `pct exec CTID -- ...` (see conftest.py).
    direct = _status(cli, sshd.target, *sshd.args(), "--run-root", str(run_root))
    hopped = _status(cli, sshd.target, *sshd.args(), "--run-root", str(run_root), "--pct", str(sshd.pct_ctid))
    assert _stable(hopped) == _stable(direct)


def test_pct_hop_with_a_wrong_ctid_exits_3(sshd: Any, cli: Callable[..., Any], run_root: Path) -> None:
    r = cli("status", sshd.target, *sshd.args(), "--run-root", str(run_root), "--pct", "999")
    assert r.returncode == 3, r.output
    assert "pct exec 999" in r.stderr and "999.conf' does not exist" in r.stderr and "pct list" in r.stderr
    assert "Traceback" not in r.output


def test_pct_ctid_must_be_an_integer(cli: Callable[..., Any]) -> None:
    r = cli("status", "local", "--pct", "200;reboot")
    assert r.returncode == 2
    assert "container id" in r.stderr


def test_missing_pct_exits_3(cli: Callable[..., Any], run_root: Path, tmp_path: Path) -> None:
    # Local target on a "node" whose PATH has no pct.
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin"}
    assert not any(Path(d, "pct").exists() for d in env["PATH"].split(":"))
    r = cli("status", "local", "--pct", "200", "--run-root", str(run_root), env=env)
    assert r.returncode == 3, r.output
    assert "`pct` is not available" in r.stderr


def test_local_pct_hop_through_the_shim(sshd: Any, cli: Callable[..., Any], run_root: Path) -> None:
    env = {"PATH": f"{sshd.shim_dir}:{os.environ['PATH']}"}
    r = cli(
        "status", "local", "--pct", str(sshd.pct_ctid), "--run-root", str(run_root), "--python", sys.executable,
        "--json", env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.output
    assert _installed_bundle(run_root).is_file()  # shipped through the hop


NASTY_ARGS = ["it's", 'say "hi"', "a b  c", "x; touch /tmp/pwned-specdec", "$(id -u)", "`id`", "$HOME", "*", "\\n", ""]


@pytest.mark.parametrize("pct", [False, True], ids=["ssh", "ssh+pct"])
async def test_arguments_reach_the_host_literally(sshd: Any, pct: bool) -> None:
    opts = sshd.options(pct=sshd.pct_ctid if pct else None)
    transport = SshTransport(Target.parse(sshd.target), opts)
    try:
        argv = transport._host_argv([sys.executable, "-c", "import json,sys; print(json.dumps(sys.argv[1:]))"])
        done = await transport._run([*argv, *NASTY_ARGS], b"", timeout_s=30)
    finally:
        await transport.close()
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == NASTY_ARGS
    assert not Path("/tmp/pwned-specdec").exists()


def test_launch_of_missing_script_over_ssh_fails_within_two_seconds(
    sshd: Any, cli: Callable[..., Any], run_root: Path
) -> None:
    # Warm the bundle first so the timing covers the launch, not the one-off upload.
    assert cli("status", sshd.target, *sshd.args(), "--run-root", str(run_root)).returncode == 0
    r = cli(
        "launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--wait", "first-step", "--json",
        "--", "bash", "/does/not/exist.sh",
    )  # fmt: skip
    assert r.returncode == 1, r.output
    obj = json.loads(r.stdout)
    assert set(obj) >= {"ok", "milestone", "stage", "cause", "exit_code", "signal", "elapsed_s", "last_lines"}
    assert obj["ok"] is False and obj["exit_code"] == 127, r.output
    assert any("/does/not/exist.sh" in line and "No such file" in line for line in obj["last_lines"])
    # The promise is on the host: launch to failure named within 2 s. The whole command adds interpreter start,
    # imports and the SSH handshake (0.9 s in all on an idle box; more when other tests load the 2 cores).
    assert obj["elapsed_s"] < 2.0, f"failure named {obj['elapsed_s']:.2f} s after the launch"
    assert r.elapsed_s < 5.0, f"the whole command took {r.elapsed_s:.2f} s"


def test_launch_args_with_shell_metacharacters_reach_the_job_literally(
    sshd: Any, cli: Callable[..., Any], run_root: Path
) -> None:
    code = "import json,sys; print(json.dumps(sys.argv[1:])); print('step=1', flush=True)"
    r = cli(
        "launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--wait", "first-step", "--json",
        "--", sys.executable, "-c", code, *NASTY_ARGS,
    )  # fmt: skip
    assert r.returncode == 0, r.output
    run_id = json.loads(r.stdout)["run_id"]
    out = (run_root / "runs" / run_id / "output.log").read_text().splitlines()
    assert json.loads(out[0]) == NASTY_ARGS


def test_job_survives_the_client_leaving_and_a_new_status_finds_it(
    sshd: Any, cli: Callable[..., Any], run_root: Path
) -> None:
    r = cli(
        "launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--wait", "started", "--json",
        "--", "sleep", "300",
    )  # fmt: skip
    assert r.returncode == 0, r.output
    run_id = json.loads(r.stdout)["run_id"]
    try:
        # The launching client has exited and its SSH connection is closed; a new one sees the job alive.
        snap = _status(cli, sshd.target, *sshd.args(), "--run-root", str(run_root))
        assert snap["run"]["run_id"] == run_id
        assert snap["run"]["state"] == "running"
        pid = snap["run"]["pid"]
        os.kill(pid, 0)
    finally:
        stop = cli("stop", sshd.target, *sshd.args(), "--run-root", str(run_root), "--grace", "2")
    assert stop.returncode == 0, stop.output


async def test_session_reconnects_and_resumes_log_and_engine_events_without_gap_or_duplicate(
    sshd: Any, cli: Callable[..., Any], run_root: Path
) -> None:
    import asyncio

    script = (
        "import json, os, time\n"
        "events = open(os.environ['SPECDEC_EVENTS'], 'a')\n"
        "for i in range(400):\n"
        "    print(f'line {i:04d}', flush=True)\n"
        "    events.write(json.dumps({'t': time.time(), 'kind': 'heartbeat', 'thread': 'w', 'step': i}) + '\\n')\n"
        "    events.flush()\n"
        "    time.sleep(0.01)\n"
    )
    r = cli(
        "launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--wait", "output",
        "--", sys.executable, "-c", script,
    )  # fmt: skip
    assert r.returncode == 0, r.output
    opts = sshd.options(run_root)
    session = open_session(sshd.target, opts)
    session.backoff_base_s = 0.1
    received = bytearray()
    steps: list[int] = []
    states: list[str] = []
    done = asyncio.Event()

    def on_event(ev: ClientEvent) -> None:
        from engine import protocol

        if isinstance(ev, protocol.LogEvent):
            assert ev.offset == len(received), "gap or duplicate in the resumed log"
            received.extend(ev.raw)
            if received.count(b"\n") >= 400:
                done.set()
        elif isinstance(ev, protocol.EngineLineEvent) and isinstance(ev.event, protocol.HeartbeatEvent):
            assert ev.event.step is not None
            steps.append(ev.event.step)
        elif isinstance(ev, ConnectionEvent):
            states.append(ev.state)

    session.add_event_listener(on_event)
    await session.connect()
    try:
        await session.start_streams(gpu_interval_s=1.0, procs_interval_s=1.0)
        await wait_until_async(lambda: len(received) > 200, 10, "200 log bytes", observe=lambda: len(received))
        first_pid = session.agent.pid if session.agent else None
        transport = session.transport
        assert isinstance(transport, SshTransport)
        transport.drop_connection()  # the link dies under the session
        await asyncio.wait_for(done.wait(), 30)
        await wait_until_async(lambda: len(steps) >= 400, 10, "400 step events", observe=lambda: len(steps))
        assert session.agent is not None and session.agent.pid != first_pid
    finally:
        await session.close()
    assert "reconnecting" in states and states.count("connected") >= 2
    expected = "".join(f"line {i:04d}\n" for i in range(400)).encode()
    assert bytes(received) == expected
    assert steps == list(range(400))  # engine events resumed from their offset: none lost, none twice


def test_attach_argv_quotes_the_remote_command(sshd: Any) -> None:
    opts = ConnectOptions(identity=str(sshd.identity), port=sshd.port, known_hosts=str(sshd.known_hosts), pct=200)
    argv = SshTransport(Target.parse(sshd.target), opts).attach_argv("specdec-run-1")
    assert argv[:2] == ["ssh", "-t"] and f"UserKnownHostsFile={sshd.known_hosts}" in argv
    assert shlex.split(argv[-1]) == ["pct", "exec", "200", "--", "tmux", "attach-session", "-t", "specdec-run-1"]


def test_connect_refuses_an_unknown_host_key_before_drawing_anything(sshd: Any, cli: Callable[..., Any]) -> None:
    r = cli("connect", sshd.target, *sshd.args(known_hosts=sshd.empty_known_hosts))
    assert r.returncode == 3, r.output
    assert sshd.host_key_fingerprint in r.stderr and "Traceback" not in r.output


def test_engine_launched_over_ssh_runs_from_the_shipped_bundle(
    sshd: Any, cli: Callable[..., Any], run_root: Path
) -> None:
    r = cli(
        "launch", sshd.target, *sshd.args(), "--run-root", str(run_root), "--wait", "first-step", "--timeout", "120",
        "--json",
    )  # fmt: skip
    try:
        assert r.returncode == 0, r.output
        run_dir = run_root / "runs" / json.loads(r.stdout)["run_id"]
        launch = json.loads((run_dir / "launch.json").read_text())
        assert launch["command"][1:] == ["-m", "engine.trainer", "--preset", "cpu-demo"]
        tree = _installed_bundle(run_root).with_suffix("")
        assert (tree / "engine" / "trainer" / "__main__.py").is_file()
        assert "step=" in (run_dir / "output.log").read_text()
    finally:
        cli("stop", sshd.target, *sshd.args(), "--run-root", str(run_root), "--grace", "10")


def test_kill_stale_yes_over_ssh_lists_then_signals_only_the_stand_in_holder(
    sshd: Any, cli: Callable[..., Any], run_root: Path
) -> None:
    # The sshd sessions see SPECDEC_DEV_DIR = sshd.dev_dir: a process holding a file named nvidia0 there is a holder.
    device = sshd.dev_dir / "nvidia0"
    device.write_text("")
    hold = "import sys, time\nf = open(sys.argv[1])\nprint('holding', flush=True)\ntime.sleep(120)\n"
    holder = subprocess.Popen([sys.executable, "-c", hold, str(device)], stdout=subprocess.PIPE)
    decoy = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"holding\n"
        listed = cli("kill-stale", sshd.target, *sshd.args(), "--run-root", str(run_root), "--dry-run", "--json")
        assert listed.returncode == 0, listed.output
        pids = [c["pid"] for c in json.loads(listed.stdout)["candidates"]]
        assert holder.pid in pids and decoy.pid not in pids
        done = cli(
            "kill-stale", sshd.target, *sshd.args(), "--run-root", str(run_root), "--yes", "--grace", "2", "--json"
        )
        assert done.returncode == 0, done.output
        obj = json.loads(done.stdout)
        assert holder.pid in [c["pid"] for c in obj["candidates"]] and obj["failed"] == []
        assert holder.wait(10) is not None
        assert decoy.poll() is None  # holds no device: never touched
    finally:
        for p in (holder, decoy):
            if p.poll() is None:
                p.kill()
                p.wait(10)
        device.unlink()


def ssh_home(tmp_path: Path, sshd: Any, extra: str = "", identity: Path | None = None) -> Path:
    """A private HOME (so the ~/.ssh/config read is the test's, never the user's) whose config has the alias
    gpu-box-alias for the test sshd, with IDENTITY (default: the authorized key) and EXTRA lines."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(
        f"Host gpu-box-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User {sshd.user}\n"
        f"  IdentityFile {identity or sshd.identity}\n{extra}"
    )
    return home


def test_host_alias_from_ssh_config_is_honoured(
    sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path
) -> None:
    home = ssh_home(tmp_path, sshd)
    r = cli(
        "status", "gpu-box-alias", "--known-hosts", str(sshd.known_hosts), "--python", sys.executable,
        "--run-root", str(run_root), "--json", env={"HOME": str(home)},
    )  # fmt: skip
    assert r.returncode == 0, r.output
    assert json.loads(r.stdout)["host"]["run_root"] == str(run_root)


def test_user_known_hosts_file_from_ssh_config_is_honoured(
    sshd: Any, cli: Callable[..., Any], run_root: Path, tmp_path: Path
) -> None:
    home = ssh_home(tmp_path, sshd, f"  UserKnownHostsFile {tmp_path / 'absent'} {sshd.known_hosts}\n")
    r = cli(
        "status", "gpu-box-alias", "--python", sys.executable, "--run-root", str(run_root), "--json",
        env={"HOME": str(home)},
    )  # fmt: skip
    assert r.returncode == 0, r.output
    assert json.loads(r.stdout)["host"]["run_root"] == str(run_root)


def test_user_known_hosts_file_without_the_key_names_that_file(
    sshd: Any, cli: Callable[..., Any], tmp_path: Path
) -> None:
    home = ssh_home(tmp_path, sshd, "  UserKnownHostsFile ~/.ssh/gpu_known_hosts\n")
    (home / ".ssh" / "gpu_known_hosts").write_text("")
    (home / ".ssh" / "known_hosts").write_text((sshd.known_hosts).read_text())  # the default is not consulted
    r = cli("status", "gpu-box-alias", "--python", sys.executable, env={"HOME": str(home)})
    assert r.returncode == 3, r.output
    assert "is unknown (not in ~/.ssh/gpu_known_hosts)" in r.stderr
    assert f"ssh-keyscan -p {sshd.port} 127.0.0.1 >> ~/.ssh/gpu_known_hosts" in r.stderr


def test_user_known_hosts_file_none_trusts_no_key(sshd: Any, cli: Callable[..., Any], tmp_path: Path) -> None:
    home = ssh_home(tmp_path, sshd, "  UserKnownHostsFile none\n")
    (home / ".ssh" / "known_hosts").write_text((sshd.known_hosts).read_text())
    r = cli("status", "gpu-box-alias", "--python", sys.executable, env={"HOME": str(home)})
    assert r.returncode == 3, r.output
    assert "UserKnownHostsFile none" in r.stderr and "refusing to connect" in r.stderr


def run_on_terminal(argv: list[str], answers: list[tuple[bytes, bytes]], timeout_s: float = 60.0) -> tuple[int, str]:
    """Run ARGV with a pseudo-terminal as its controlling terminal; each time the output shows the next prompt of
    ANSWERS, type its answer. Returns (exit status, everything the terminal showed)."""
    import fcntl
    import termios
    import time

    repo = Path(__file__).resolve().parents[2]
    master, slave = os.openpty()
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.Popen(
        argv,
        stdin=slave,
        stdout=slave,
        stderr=slave,
        env=env,
        cwd=str(repo),
        start_new_session=True,
        preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0),  # the pty becomes the new session's terminal
    )
    os.close(slave)
    shown = b""
    typed = 0
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(master, 4096)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            shown += chunk
            # answer i goes in once its prompt has appeared one more time than the answers before it that share it
            while typed < len(answers) and shown.count(answers[typed][0]) > sum(
                1 for prompt, _ in answers[:typed] if prompt == answers[typed][0]
            ):
                os.write(master, answers[typed][1])
                typed += 1
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), shown.decode("utf-8", "replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def locked_copy(identity: Path, tmp_path: Path, passphrase: str) -> Path:
    """The authorized key, re-encrypted with PASSPHRASE (the server accepts it; the client must decrypt it)."""
    key = tmp_path / "id_locked"
    key.write_bytes(identity.read_bytes())
    key.chmod(0o600)
    subprocess.run(["ssh-keygen", "-q", "-p", "-P", "", "-N", passphrase, "-f", str(key)], check=True)
    return key


def test_passphrase_is_asked_on_a_terminal_checked_and_never_shown(sshd: Any, run_root: Path, tmp_path: Path) -> None:
    key = locked_copy(sshd.identity, tmp_path, "correct horse")
    prompt = f"Enter passphrase for key '{key}': ".encode()
    argv = [sys.executable, "-m", "tui", "status", sshd.target, *sshd.args(identity=key), "--run-root", str(run_root)]
    rc, shown = run_on_terminal([*argv, "--json"], [(prompt, b"battery staple\n"), (prompt, b"correct horse\n")])
    assert rc == 0, shown
    assert shown.count("Enter passphrase for key") == 2 and "Incorrect passphrase." in shown
    assert f'"run_root": "{run_root}"' in shown
    assert "correct horse" not in shown and "battery staple" not in shown  # no echo, never printed


def test_three_wrong_passphrases_exit_3_before_connecting(sshd: Any, tmp_path: Path) -> None:
    key = locked_copy(sshd.identity, tmp_path, "correct horse")
    prompt = f"Enter passphrase for key '{key}': ".encode()
    argv = [sys.executable, "-m", "tui", "status", sshd.target, *sshd.args(identity=key)]
    rc, shown = run_on_terminal(argv, [(prompt, b"no\n"), (prompt, b"nope\n"), (prompt, b"still no\n")])
    assert rc == 3, shown
    assert shown.count("Incorrect passphrase.") == 3 and "3 incorrect passphrases; nothing was started" in shown
    assert "Traceback" not in shown


def test_passphrase_protected_identity_file_from_ssh_config_says_what_to_do(
    sshd: Any, cli: Callable[..., Any], tmp_path: Path
) -> None:
    home = ssh_home(tmp_path, sshd, identity=locked_copy(sshd.identity, tmp_path, "correct horse"))
    r = cli(
        "status", "gpu-box-alias", "--known-hosts", str(sshd.known_hosts), "--python", sys.executable,
        env={"HOME": str(home), "SSH_AUTH_SOCK": ""},
    )  # fmt: skip
    assert r.returncode == 3, r.output
    assert "Traceback" not in r.output and "correct horse" not in r.output
    assert "~/.ssh/config names for this host is passphrase-protected" in r.stderr, r.stderr
    assert "ssh-add" in r.stderr and "pass it with -i to be asked for its passphrase" in r.stderr


def test_passphrase_protected_identity_exits_3_with_a_sentence(
    sshd: Any, cli: Callable[..., Any], tmp_path: Path
) -> None:
    key = tmp_path / "locked_ed25519"
    subprocess.run(
        ["ssh-keygen", "-q", "-t", "ed25519", "-N", "correct horse", "-f", str(key)], check=True, capture_output=True
    )
    r = cli("status", sshd.target, *sshd.args(identity=key))
    assert r.returncode == 3, r.output
    assert "passphrase-protected" in r.stderr and "ssh-add" in r.stderr
    assert "Traceback" not in r.output and "correct horse" not in r.output
