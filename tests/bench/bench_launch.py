"""How long after a launch fails does the user hear why? Run on demand: ``python3 tests/bench/bench_launch.py``.

For each failure case, the median over several runs of the time from the job's death (a marker the
job writes just before it dies) or from the deadline, to the `wait` reply that carries the cause,
with real tmux on a private socket: through the local agent (a subprocess speaking JSON lines), and,
with ``--ssh``, through tui.link.session over a throwaway OpenSSH sshd on 127.0.0.1 (the agent shipped and
started over SSH, as for a remote host). The seed workflow learns the same things after `sleep 600`.
"""

from __future__ import annotations

import argparse
import asyncio
import getpass
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "tests")]

from support.agent import AgentClient, AgentPool  # noqa: E402
from support.waiting import wait_until  # noqa: E402

SEED_S = 600.0
DEATHS = ("missing script (exit 127)", "raises at import (exit 1)", "killed by SIGKILL")


def _marker_cmd(kind: str, marker: Path, work: Path) -> list[str]:
    stamp = f"open({str(marker)!r}, 'w').write(repr(time.time()))"
    if kind == "missing script (exit 127)":
        return ["bash", "-c", f'{sys.executable} -c "import time; {stamp}"; exec bash /does/not/exist.sh']
    if kind == "raises at import (exit 1)":
        (work / "broken_mod.py").write_text(f"import time\n{stamp}\nraise RuntimeError('broken at import')\n")
        return [sys.executable, "-c", "import broken_mod"]
    if kind == "killed by SIGKILL":
        return [sys.executable, "-c", f"import os, signal, time; {stamp}; os.kill(os.getpid(), signal.SIGKILL)"]
    raise ValueError(kind)


def one_death(agent: AgentClient, kind: str, work: Path) -> float:
    marker = work / f"died-{time.monotonic_ns()}"
    launched = agent.ok("launch", command=_marker_cmd(kind, marker, work), cwd=str(work))
    reply = agent.request("wait", run_id=launched["run_id"], milestone="first-step", timeout_s=30)
    t_reply = time.time()
    res = reply["result"]
    assert res["ok"] is False and res["cause"], res
    died_at = float(marker.read_text())
    return t_reply - died_at


def one_hang(agent: AgentClient, timeout_s: float) -> float:
    launched = agent.ok("launch", command=["sleep", "600"])
    t_sent = time.monotonic()
    res = agent.ok("wait", run_id=launched["run_id"], milestone="output", timeout_s=timeout_s)
    elapsed = time.monotonic() - t_sent
    assert res["ok"] is False and res["alive"] is True, res
    agent.ok("stop", run_id=launched["run_id"], grace_s=2, release_timeout_s=0)
    return elapsed - timeout_s


class SshHost:
    """A throwaway sshd on 127.0.0.1 with fresh host and user keys (key login only)."""

    def __init__(self, d: Path) -> None:
        binary = shutil.which("sshd") or "/usr/sbin/sshd"
        for name in ("host", "user"):
            subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(d / name)], check=True)
        (d / "authorized_keys").write_text((d / "user.pub").read_text())
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        host_pub = (d / "host.pub").read_text().split()
        self.known_hosts = d / "known_hosts"
        self.known_hosts.write_text(f"[127.0.0.1]:{self.port} {host_pub[0]} {host_pub[1]}\n")
        self.identity = d / "user"
        path = os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"])
        config = d / "sshd_config"
        config.write_text(
            f"Port {self.port}\nListenAddress 127.0.0.1\nHostKey {d / 'host'}\nPidFile {d / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {d / 'authorized_keys'}\nPasswordAuthentication no\nUsePAM no\nStrictModes no\n"
            f"PermitRootLogin prohibit-password\nAllowUsers {getpass.getuser()}\n"
            f"SetEnv PATH={path} SPECDEC_TMUX_SOCKET={os.environ['SPECDEC_TMUX_SOCKET']}\n"
        )
        if os.geteuid() == 0:
            os.makedirs("/run/sshd", mode=0o755, exist_ok=True)
        self.proc = subprocess.Popen([binary, "-D", "-e", "-f", str(config)], stderr=subprocess.DEVNULL)
        wait_until(lambda: self.proc.poll() is not None or self._greets(), 15, "sshd's banner", interval_s=0.05)
        if self.proc.poll() is not None:
            raise RuntimeError("sshd did not start")

    def _greets(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                return sock.recv(64).startswith(b"SSH-")
        except OSError:
            return False

    def close(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


async def ssh_cases(host: SshHost, root: Path, work: Path, runs: int, hang_timeout_s: float) -> list[str]:
    from tui.link.session import ConnectOptions, open_session

    opts = ConnectOptions(
        identity=str(host.identity),
        port=host.port,
        known_hosts=str(host.known_hosts),
        python=sys.executable,
        run_root=str(root),
        connect_timeout_s=15.0,
    )
    session = open_session(f"{getpass.getuser()}@127.0.0.1", opts)
    await session.connect()
    rows: list[str] = []
    try:
        for kind in DEATHS:
            samples = []
            for _ in range(runs):
                marker = work / f"died-{time.monotonic_ns()}"
                launched = await session.request("launch", command=_marker_cmd(kind, marker, work), cwd=str(work))
                res = await session.request(
                    "wait",
                    timeout_s=60,
                    params={"run_id": launched["run_id"], "milestone": "first-step", "timeout_s": 30},
                )
                t_reply = time.time()
                assert res["ok"] is False and res["cause"], res
                samples.append(t_reply - float(marker.read_text()))
            rows.append(summarize(f"ssh: {kind}", samples))
            print(rows[-1], flush=True)
        samples = []
        for _ in range(runs):
            launched = await session.request("launch", command=["sleep", "600"])
            t_sent = time.monotonic()
            res = await session.request(
                "wait",
                timeout_s=60,
                params={"run_id": launched["run_id"], "milestone": "output", "timeout_s": hang_timeout_s},
            )
            samples.append(time.monotonic() - t_sent - hang_timeout_s)
            assert res["ok"] is False and res["alive"] is True, res
            await session.request("stop", timeout_s=60, run_id=launched["run_id"], grace_s=2, release_timeout_s=0)
        rows.append(summarize("ssh: alive, silent past deadline", samples))
        print(rows[-1], flush=True)
    finally:
        await session.close()
    return rows


def summarize(name: str, samples: list[float]) -> str:
    med = statistics.median(samples)
    worst = max(samples)
    return (
        f"{name:<38} n={len(samples):<3} median {med * 1000:6.1f} ms  max {worst * 1000:6.1f} ms  seed {SEED_S:.0f} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--ssh", action="store_true", help="also measure through tui.link.session over loopback SSH")
    parser.add_argument("--hang-timeout", type=float, default=1.0, help="wait timeout for the hung case, s")
    ns = parser.parse_args(argv)
    os.environ.setdefault("SPECDEC_TMUX_SOCKET", f"specdec-bench-{os.getpid()}")
    rows: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        root = Path(tmp) / "run-root"
        root.mkdir()
        pool = AgentPool(root)
        try:
            agent = pool.make()
            cases: list[tuple[str, Callable[[], float]]] = [
                (f"local: {kind}", lambda kind=kind: one_death(agent, kind, work))  # type: ignore[misc]
                for kind in DEATHS
            ]
            cases.append(("local: alive, silent past deadline", lambda: one_hang(agent, ns.hang_timeout)))
            for name, fn in cases:
                samples: list[float] = [fn() for _ in range(ns.runs)]
                rows.append(summarize(name, samples))
                print(rows[-1], flush=True)
            if ns.ssh:
                host = SshHost(Path(tmp))
                try:
                    asyncio.run(ssh_cases(host, root, work, ns.runs, ns.hang_timeout))
                finally:
                    host.close()
        finally:
            pool.close()
            subprocess.run(
                ["tmux", "-L", os.environ["SPECDEC_TMUX_SOCKET"], "kill-server"], capture_output=True, check=False
            )
    info: dict[str, Any] = {"cpus": os.cpu_count(), "python": sys.version.split()[0]}
    print(f"(times: reply received minus the job's death marker, or minus the deadline; {info})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
