"""One run across two "nodes" from one command line: two real sshd on loopback, two run roots, two tmux servers,
the engine as torchrun ranks meeting over gloo (tui/nodes.py, tui/cli/nodes.py).

Pinned: one `launch --profile` starts both nodes under one run id and waits until both stepped; `status --json`
gives one object per node and the run's combined state; `logs` tags each node's lines (and a further rank's as
node/rank); a node's ranks killed are named with node and rank by `status --json`; one `stop` leaves no rank on
either node; a node that cannot be reached at launch is named and nothing starts anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from support.agent import checkout_env
from support.waiting import wait_until
from torchrun_support import TINY_ENGINE_TOML, complete_events

from engine.host import procs
from engine.supervisor import records

pytestmark = [
    pytest.mark.ssh,
    pytest.mark.tmux,
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux"),
]

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0
ENGINE_TOML = TINY_ENGINE_TOML + 'data = "random"\nsteps = 100000\nstep_delay_s = 0.05\nstop_grace_s = 10\n'


def node_table(s: Any, run_root: Path, port: int | None = None) -> str:
    return (
        f'{{ target = "{s.target}", port = {port or s.port}, identity = "{s.identity}", '
        f'known_hosts = "{s.known_hosts}", python = "{sys.executable}", run_root = "{run_root}" }}'
    )


def write_profile(tmp: Path, nodes: list[str], extra: str = "") -> Path:
    engine = tmp / "engine.toml"
    engine.write_text(ENGINE_TOML, encoding="utf-8")
    cfg = tmp / "config.toml"
    cfg.write_text(
        "[profiles.two]\n"
        f"nodes = [{', '.join(nodes)}]\n"
        f'cwd = "{REPO}"\n'
        'env = { OMP_NUM_THREADS = "1" }\n'
        f"deadlines_s = {{ first-step = {START_TIMEOUT_S} }}\n"
        f"{extra}"
        "[profiles.two.engine]\n"
        f'config = "{engine}"\n',
        encoding="utf-8",
    )
    return cfg


def rank_pids(run_dir: Path) -> dict[int, int]:
    """Global rank -> pid, from the ranks' ``distributed`` stage events in this node's run directory."""
    out: dict[int, int] = {}
    for path in sorted(run_dir.glob("events*.jsonl")):
        for e in complete_events(path):
            if e.get("stage") == "distributed" and isinstance(e.get("rank"), int):
                out[int(e["rank"])] = int(e["pid"])
    return out


def status_json(cli: Callable[..., Any], cfg: Path) -> dict[str, Any]:
    r = cli("status", "--profile", "two", "--config", str(cfg), "--json", timeout_s=60)
    assert r.returncode == 0, r.output
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def stop_both(cli: Callable[..., Any], cfg: Path) -> None:
    with contextlib.suppress(subprocess.TimeoutExpired):
        cli("stop", "--profile", "two", "--config", str(cfg), "--grace", "5", timeout_s=120)


@dataclass
class TwoNodeRun:
    cfg: Path
    labels: list[str]
    run_id: str
    dirs: list[Path]  # the run's directory on each node
    pids: list[dict[int, int]]  # each node's ranks: global rank -> pid
    launch_s: float

    def all_pids(self) -> list[int]:
        return [p for node in self.pids for p in node.values()]


def launch_two(sshds: list[Any], tmp: Path, cli: Callable[..., Any]) -> TwoNodeRun:
    """One ``launch --profile two --wait first-step --json`` over both nodes, checked."""
    roots = [tmp / f"node{n}-root" for n in (0, 1)]
    cfg = write_profile(tmp, [node_table(s, r) for s, r in zip(sshds, roots, strict=True)])
    labels = [f"{s.target}:{s.port}" for s in sshds]
    r = cli("launch", "--profile", "two", "--config", str(cfg), "--wait", "first-step", "--json",
            timeout_s=START_TIMEOUT_S + 60)  # fmt: skip
    try:
        assert r.returncode == 0, r.output
        launched = json.loads(r.stdout)
        assert launched["ok"] and [n["node"] for n in launched["nodes"]] == labels, launched
        assert all(n["ok"] and n["milestone"] == "first-step" for n in launched["nodes"]), launched
        assert launched["rendezvous"].startswith("127.0.0.1:"), launched
        run = run_of(cfg, labels, roots, launched["run_id"])
    except BaseException:
        stop_both(cli, cfg)
        raise
    run.launch_s = r.elapsed_s
    return run


def run_of(cfg: Path, labels: list[str], roots: list[Path], run_id: str) -> TwoNodeRun:
    """Run ``run_id`` on both nodes' run roots, with each node's ranks (one rank per node, a world of two)."""
    dirs = [records.run_dir_for(root, run_id) for root in roots]
    for d in dirs:  # the same run on both nodes, each with its own run root
        assert (d / records.LAUNCH_JSON).exists(), d
    pids = [rank_pids(d) for d in dirs]
    assert sorted([*pids[0], *pids[1]]) == [0, 1], pids
    return TwoNodeRun(cfg, labels, run_id, dirs, pids, 0.0)


def assert_nothing_left(run: TwoNodeRun, said: str) -> None:
    left = [p for p in run.all_pids() if procs.process_alive(p, None)]
    assert not left, f"ranks alive after stop: {left}\n{said}"
    for d in run.dirs:
        launch = records.read_json(d / records.LAUNCH_JSON)
        assert launch is not None
        assert not procs.process_alive(int(launch["pid"]), None), f"{d}: the job is alive after stop"


@pytest.mark.timeout(900)
def test_one_launch_reaches_first_step_on_both_nodes_status_logs_and_restart_cover_both_and_one_stop_ends_both(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    run = launch_two(sshd_pair, tmp_path, cli)
    labels, cfg = run.labels, run.cfg
    try:
        st = status_json(cli, cfg)
        assert [n["node"] for n in st["nodes"]] == labels and all(n["reachable"] for n in st["nodes"]), st
        assert st["run"]["state"] == "running" and st["run"]["run_id"] == run.run_id, st["run"]
        assert st["run"]["running"] == 2, st["run"]
        for n in st["nodes"]:
            assert n["status"]["run"]["run_id"] == run.run_id and n["status"]["run"]["state"] == "running"

        logs = cli("logs", "--profile", "two", "--config", str(cfg), "-n", "200", timeout_s=60)
        assert logs.returncode == 0, logs.output
        lines = logs.stdout.splitlines()
        assert any(ln.startswith(f"[{labels[0]}] ") for ln in lines), logs.stdout[-2000:]
        rank_of_node1 = next(iter(run.pids[1]))
        tagged = f"[{labels[1]}/rank {rank_of_node1}] " if rank_of_node1 > 0 else f"[{labels[1]}] "
        assert any(ln.startswith(tagged) and "step=" in ln for ln in lines), logs.stdout[-2000:]

        # One restart: every node stopped, then one new run over both, stepping on both.
        again = cli("restart", "--profile", "two", "--config", str(cfg), "--grace", "20", "--wait", "first-step",
                    "--json", timeout_s=START_TIMEOUT_S + 60)  # fmt: skip
        assert again.returncode == 0, again.output
        relaunched = json.loads(again.stdout)
        assert relaunched["ok"] and relaunched["run_id"] != run.run_id, relaunched
        assert_nothing_left(run, again.output)  # the first run's ranks, on both nodes
        ends = [[e for e in complete_events(d / "events.jsonl") if e["kind"] == "run_end"] for d in run.dirs]
        # Both ranks stopped cleanly, at the same step (the stop is agreed inside the step's all-reduce).
        assert all(e and e[-1]["ok"] for e in ends) and ends[0][-1]["step"] == ends[1][-1]["step"], ends
        second = run_of(cfg, labels, [d.parent.parent for d in run.dirs], relaunched["run_id"])

        t0 = time.monotonic()
        stop = cli("stop", "--profile", "two", "--config", str(cfg), "--grace", "20", timeout_s=120)
        stop_s = time.monotonic() - t0
        assert stop.returncode == 0, stop.output
        assert_nothing_left(second, stop.output)
    finally:
        stop_both(cli, cfg)
    print(f"two ssh nodes: launch to first-step on both {run.launch_s:.1f} s; one stop ended both in {stop_s:.1f} s")


@pytest.mark.timeout(900)
def test_a_rank_killed_on_one_node_is_named_with_node_and_rank_and_stop_then_leaves_nothing(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    run = launch_two(sshd_pair, tmp_path, cli)
    labels, cfg = run.labels, run.cfg
    try:
        rank_of_node1 = next(iter(run.pids[1]))
        os.kill(run.pids[1][rank_of_node1], signal.SIGKILL)
        t_kill = time.monotonic()

        seen: list[dict[str, Any]] = []

        def named() -> dict[str, Any] | None:
            combined: dict[str, Any] = status_json(cli, cfg)["run"]
            if combined["state"] != "failed":
                return None
            seen.append(combined)
            return combined if "SIGKILL" in (combined["cause"] or "") else None

        failed = wait_until(named, 60, "status --json to name the killed rank and its signal", interval_s=0.2)
        named_s = time.monotonic() - t_kill
        # From the first failed status on (node 0 may say its peer went before node 1 has recorded the kill), the
        # failure sits on node 1 and its rank; then node 1's own cause names the signal.
        assert all((c["failed_node"], c["failed_rank"]) == (labels[1], rank_of_node1) for c in seen), seen
        assert f"rank {rank_of_node1}" in failed["cause"], failed
        human = cli("status", "--profile", "two", "--config", str(cfg))
        assert human.returncode == 0, human.output
        lines = human.stdout.splitlines()
        assert lines[0].startswith(f"run {run.run_id}  state failed"), human.stdout
        assert any(ln.startswith(f"  cause node {labels[1]}: rank {rank_of_node1}") for ln in lines), human.stdout
        assert [ln.split("]")[0] for ln in lines if ln.startswith("  [")] == [f"  [{label}" for label in labels]

        stop = cli("stop", "--profile", "two", "--config", str(cfg), "--grace", "10", timeout_s=120)
        assert stop.returncode == 0, stop.output
        assert_nothing_left(run, stop.output)
    finally:
        stop_both(cli, cfg)
    print(f"a rank killed on node 1: named by status --json {named_s:.2f} s later: {failed['cause'][:160]}")


def test_a_node_that_cannot_be_reached_at_launch_is_named_and_nothing_starts(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    roots = [tmp_path / f"node{n}-root" for n in (0, 1)]
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = int(probe.getsockname()[1])
    cfg = write_profile(tmp_path, [node_table(sshd_pair[0], roots[0]), node_table(sshd_pair[1], roots[1], closed)])
    r = cli("launch", "--profile", "two", "--config", str(cfg), "--wait", "first-step", "--json", timeout_s=120)
    assert r.returncode == 3, r.output
    result = json.loads(r.stdout)
    label = f"{sshd_pair[1].target}:{closed}"
    assert result["unreachable"] == [label] and f"node {label} unreachable" in result["cause"], result
    assert "nothing was started" in result["cause"], result
    for root in roots:
        assert not list(records.runs_dir(root).glob("*")), f"{root}: a run started"


def test_an_unreachable_node_behind_an_ssh_config_alias_is_named_with_the_configs_host_and_port(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    """It said "gpu-b:22" while ~/.ssh/config gives the alias another HostName and Port."""
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = int(probe.getsockname()[1])
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    (home / ".ssh" / "config").write_text(f"Host gpu-b\n  HostName 127.0.0.1\n  Port {closed}\n", encoding="utf-8")
    alias = f'{{ target = "gpu-b", known_hosts = "{sshd_pair[1].known_hosts}", python = "{sys.executable}" }}'
    cfg = write_profile(tmp_path, [node_table(sshd_pair[0], tmp_path / "node0-root"), alias])
    r = cli("launch", "--profile", "two", "--config", str(cfg), "--wait", "started", "--json", env={"HOME": str(home)})
    assert r.returncode == 3, r.output
    cause = json.loads(r.stdout)["cause"]
    assert f"cannot connect to 127.0.0.1:{closed}" in cause and "gpu-b:22" not in cause, cause


# A foreign command (no torch): node 1 cannot start; node 0 steps every 0.2 s. The nodes tell them apart by the
# SPECDEC_NODE_RANK the launch sets.
STEPPING = 'i=0; while :; do i=$((i+1)); echo "step=$i"; sleep 0.2; done'
NODE1_FAILS = (
    f'if [ "$SPECDEC_NODE_RANK" = 1 ]; then echo "train: error: no data on node 1" >&2; exit 3; fi; {STEPPING}'
)


def two_node_profile(sshds: list[Any], tmp: Path) -> tuple[Path, list[Path], list[str]]:
    roots = [tmp / f"node{n}-root" for n in (0, 1)]
    cfg = write_profile(tmp, [node_table(s, r) for s, r in zip(sshds, roots, strict=True)])
    return cfg, roots, [f"{s.target}:{s.port}" for s in sshds]


def test_a_node_that_fails_to_start_is_named_and_the_node_already_started_is_stopped(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    cfg, roots, labels = two_node_profile(sshd_pair, tmp_path)
    try:
        r = cli("launch", "--profile", "two", "--config", str(cfg), "--wait", "first-step", "--json",
                "--", "sh", "-c", NODE1_FAILS, timeout_s=120)  # fmt: skip
        assert r.returncode == 1, r.output
        result = json.loads(r.stdout)
        assert result["failed_node"] == labels[1] and "train: error: no data on node 1" in result["cause"], result
        assert result["cause"].startswith(f"node {labels[1]}: "), result
        assert result["stopped"] == labels, result
        run0 = records.run_dir_for(roots[0], result["run_id"])
        launch0 = records.read_json(run0 / records.LAUNCH_JSON)
        assert launch0 is not None and not procs.process_alive(int(launch0["pid"]), None), "node 0 left running"
        st = status_json(cli, cfg)
        assert [n["status"]["run"]["state"] for n in st["nodes"]] != ["running", "running"], st
        assert st["run"]["state"] == "failed" and st["run"]["failed_node"] == labels[1], st["run"]
    finally:
        stop_both(cli, cfg)


def test_a_launch_refused_as_bad_input_exits_2_and_starts_nothing(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    cfg, roots, labels = two_node_profile(sshd_pair, tmp_path)
    missing = tmp_path / "not-there"
    r = cli("launch", "--profile", "two", "--config", str(cfg), "--cwd", str(missing), "--wait", "first-step",
            "--json", "--", "sh", "-c", STEPPING, timeout_s=120)  # fmt: skip
    assert r.returncode == 2, r.output
    result = json.loads(r.stdout)
    assert result["cause"] == (
        f"node {labels[0]}: launch refused: working directory {missing} does not exist on the host; nothing was started"
    ), result
    assert not any((root / "runs").is_dir() and any((root / "runs").iterdir()) for root in roots)


def agent_pids(run_root: Path) -> list[int]:
    """The agents serving ``run_root`` (their argv names it after --run-root), by /proc."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [w.decode(errors="replace") for w in argv]
        if "--run-root" in words and str(run_root) in words and "--run-dir" not in words and words[0] == sys.executable:
            found.append(int(entry.name))
    return found


@pytest.mark.timeout(300)
def test_logs_follow_merges_both_nodes_tagged_and_one_nodes_lost_link_reconnects_while_the_other_streams(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    cfg, roots, labels = two_node_profile(sshd_pair, tmp_path)
    r = cli("launch", "--profile", "two", "--config", str(cfg), "--wait", "first-step", "--", "sh", "-c", STEPPING,
            timeout_s=120)  # fmt: skip
    follower: subprocess.Popen[str] | None = None
    try:
        assert r.returncode == 0, r.output
        follower = subprocess.Popen(
            [sys.executable, "-m", "tui", "logs", "--profile", "two", "--config", str(cfg), "-f", "-n", "1"],
            cwd=REPO, env=checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        out = Lines(follower.stdout)
        errs = Lines(follower.stderr)
        for label in labels:
            out.wait_for(lambda ln, label=label: ln.startswith(f"[{label}] step="), 60)
        steps_before = {label: out.count(f"[{label}] step=") for label in labels}
        killed = agent_pids(roots[1])
        assert killed, "node 1's agent not found"
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        errs.wait_for(lambda ln: ln.startswith(f"[{labels[1]}] [reconnecting"), 30)
        errs.wait_for(lambda ln: ln.startswith(f"[{labels[1]}] [reconnected"), 60)
        mark = len(out.lines)
        out.wait_for(lambda ln: ln.startswith(f"[{labels[1]}] step="), 30, start=mark)  # node 1 streams again
        assert out.count(f"[{labels[0]}] step=") > steps_before[labels[0]]  # node 0 never stopped streaming
        assert not [ln for ln in errs.lines if ln.startswith(f"[{labels[0]}] [reconnecting")], errs.lines
        for label in labels:  # in order per node: each node's steps only go up, none twice (the resume is exact)
            mine = [int(ln.split("step=")[1]) for ln in out.lines if ln.startswith(f"[{label}] step=")]
            assert mine == sorted(set(mine)) and mine == list(range(mine[0], mine[0] + len(mine))), (label, mine)
    finally:
        if follower is not None:
            follower.kill()
            follower.wait()
        stop_both(cli, cfg)


class Lines:
    """A pipe's lines, read by a thread as they come, waited on with a bound."""

    def __init__(self, pipe: Any) -> None:
        import threading

        self.lines: list[str] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._read, args=(pipe,), daemon=True, name="lines").start()

    def _read(self, pipe: Any) -> None:
        for line in pipe:
            with self._lock:
                self.lines.append(line.rstrip("\n"))

    def count(self, prefix: str) -> int:
        with self._lock:
            return sum(1 for ln in self.lines if ln.startswith(prefix))

    def wait_for(self, pred: Callable[[str], bool], timeout_s: float, start: int = 0) -> str:
        def seen() -> str | None:
            with self._lock:
                return next((ln for ln in self.lines[start:] if pred(ln)), None)

        return wait_until(seen, timeout_s, "a line", interval_s=0.05)


def pane_text(widget: Any) -> str:
    rendered = widget.render()
    return str(getattr(rendered, "plain", rendered))


@pytest.mark.timeout(900)
async def test_the_dashboard_launches_and_restarts_on_both_nodes_shows_both_and_names_a_killed_rank_within_5_s(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TMUX", raising=False)  # attach hands this terminal over, as outside tmux
    from support.pilot import wait_until as pilot_wait

    from tui.dashboard.nodes_app import NodesApp
    from tui.dashboard.widgets.charts import Charts
    from tui.dashboard.widgets.gpu_bars import GpuBars
    from tui.dashboard.widgets.proc_tree import ProcTree
    from tui.dashboard.widgets.text_line import TextLine
    from tui.link.session import ConnectOptions
    from tui.nodes import Launched, resolve_nodes
    from tui.profiles import resolve_profile

    cfg, roots, labels = two_node_profile(sshd_pair, tmp_path)
    profile = resolve_profile("two", str(cfg))
    nodes = resolve_nodes([], profile, ConnectOptions(simulate_gpus=2))
    attached: list[list[str]] = []
    app = NodesApp(
        nodes, profile=profile, flush_interval_s=0.05, gpu_interval_s=0.25, procs_interval_s=0.5,
        external_runner=lambda argv: attached.append(argv) or 0,
    )  # fmt: skip

    async def launch_with(pilot: Any, key: str) -> tuple[Launched, float]:
        app.last_launch = None
        t0 = time.monotonic()
        await pilot.press(key)
        await pilot.press("y")
        done: Launched = await pilot_wait(pilot, lambda: app.last_launch, START_TIMEOUT_S, f"{key}'s launch")
        assert done.ok and done.run_id, done.cause
        return done, time.monotonic() - t0

    try:
        async with app.run_test(size=(160, 60)) as pilot:
            screen = app.screen_of_nodes
            await pilot_wait(pilot, lambda: all(n.session and n.session.state == "connected" for n in nodes), 30)
            first, launch_s = await launch_with(pilot, "l")
            assert first.run_id is not None
            run = run_of(cfg, labels, roots, first.run_id)
            again, restart_s = await launch_with(pilot, "r")
            assert again.run_id is not None and again.run_id != first.run_id
            assert_nothing_left(run, "after the dashboard's restart")
            run = run_of(cfg, labels, roots, again.run_id)

            # a, then a node: that node's tmux session, reached through that node's own connection.
            await pilot.press("a")
            await pilot.press("1")
            control = app.controls[labels[1]]
            await pilot_wait(pilot, lambda: control.attach_history, 10, "node 1's attach")
            attach = " ".join(control.attach_history[-1])
            tmux_session = (records.read_json(run.dirs[1] / records.LAUNCH_JSON) or {})["tmux_session"]
            assert str(sshd_pair[1].port) in attach and tmux_session in attach, attach
            assert str(sshd_pair[0].port) not in attach, attach
            while len(app.screen_stack) > 1:  # headless: the attach offers its command to run elsewhere
                app.pop_screen()

            for i, label in enumerate(labels):
                bars = screen.query_one(f"#gpus-{i}", GpuBars)
                assert label in str(bars.border_title)
                await pilot_wait(pilot, lambda bars=bars: len(bars.gpus) == 2, 30, f"node {i}'s two GPUs")
                tree = screen.query_one(f"#procs-{i}", ProcTree)
                rank = next(iter(run.pids[i]))
                await pilot_wait(
                    pilot, lambda tree=tree, rank=rank: f"rank {rank}" in pane_text(tree), 30, f"rank {rank} on {label}"
                )
            log = app.state.log
            await pilot_wait(
                pilot, lambda: all(any(ln.startswith(f"[{lb}") for ln in log.lines) for lb in labels), 30, "both tags"
            )
            failure = screen.query_one("#failure-line", TextLine)
            assert not failure.text.plain.strip(), failure.text.plain
            for i in (0, 1):  # each node's training chart: its own rank's steps
                chart = screen.query_one(f"#charts-{i}", Charts)
                await pilot_wait(pilot, lambda chart=chart: "step" in pane_text(chart), 30, f"node {i}'s chart")
            top = screen.query_one("#run-line", TextLine).text.plain  # the milestones over both nodes
            assert f"run {again.run_id} running" in top and "first-step ✓" in top, top

            rank_of_node1 = next(iter(run.pids[1]))
            os.kill(run.pids[1][rank_of_node1], signal.SIGKILL)
            t_kill = time.monotonic()
            named = f"FAILED rank {rank_of_node1}: node {labels[1]}: "
            await pilot_wait(pilot, lambda: named in failure.text.plain, 30, "the failure on the screen")
            on_screen_s = time.monotonic() - t_kill
            first_said = failure.text.plain
            assert on_screen_s < 5.0, f"the killed rank reached the screen {on_screen_s:.2f} s after the kill"
            # Then the node's own words: its rank's signal (before, maybe, the survivor's "failed or left").
            await pilot_wait(pilot, lambda: "SIGKILL" in failure.text.plain, 30, "the killed node's own cause")
            root_s = time.monotonic() - t_kill
            said = failure.text.plain
            assert said.startswith(f" {named}rank {rank_of_node1} (node ") and "killed by SIGKILL" in said, said

            await pilot.press("s")
            await pilot.press("y")
            await pilot_wait(
                pilot, lambda: not [p for p in run.all_pids() if procs.process_alive(p, None)], 60, "every rank gone"
            )
            await pilot.press("q")
    finally:
        await asyncio.to_thread(stop_both, cli, cfg)
    assert_nothing_left(run, "after the dashboard's stop")
    print(
        f"dashboard over two ssh nodes: l to first step on both {launch_s:.1f} s, r {restart_s:.1f} s; a rank killed "
        f"on node 1 named on the screen {on_screen_s:.2f} s later ({first_said.strip()[:100]}), its own cause "
        f"{root_s:.2f} s later: {said.strip()}"
    )


async def test_the_dashboard_names_a_node_it_cannot_reach_while_the_other_streams(
    sshd_pair: list[Any], tmp_path: Path
) -> None:
    from support.pilot import wait_until as pilot_wait

    from tui.dashboard.nodes_app import NodesApp
    from tui.dashboard.widgets.gpu_bars import GpuBars
    from tui.dashboard.widgets.text_line import TextLine
    from tui.link.session import ConnectOptions
    from tui.nodes import resolve_nodes
    from tui.profiles import resolve_profile

    roots = [tmp_path / f"node{n}-root" for n in (0, 1)]
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        closed = int(probe.getsockname()[1])
    cfg = write_profile(tmp_path, [node_table(sshd_pair[0], roots[0]), node_table(sshd_pair[1], roots[1], closed)])
    nodes = resolve_nodes([], resolve_profile("two", str(cfg)), ConnectOptions(simulate_gpus=2))
    app = NodesApp(nodes, flush_interval_s=0.05, gpu_interval_s=0.25)
    async with app.run_test(size=(160, 50)) as pilot:
        screen = app.screen_of_nodes
        failure = screen.query_one("#failure-line", TextLine)
        t0 = time.monotonic()
        label = f"{sshd_pair[1].target}:{closed}"
        await pilot_wait(pilot, lambda: f"UNREACHABLE: node {label} unreachable" in failure.text.plain, 30)
        named_s = time.monotonic() - t0
        bars = screen.query_one("#gpus-0", GpuBars)
        await pilot_wait(pilot, lambda: len(bars.gpus) == 2, 30, "node 0's GPUs")
        line = screen.query_one("#link-1", TextLine).text.plain
        assert label in line and ("reconnecting" in line or "failed" in line), line
        assert "connected" in screen.query_one("#link-0", TextLine).text.plain
        await pilot.press("q")
    print(f"a node that cannot be reached: named on the screen {named_s:.2f} s after the dashboard started")


def holds(pid: int, device: Path) -> bool:
    """``pid`` has ``device`` open (its fds come and go while it starts: one read can name a closed fd)."""
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd) == str(device):
                return True
        except OSError:
            continue
    return False


def test_kill_stale_lists_and_signals_each_nodes_own_stale_holders(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    cfg, _roots, labels = two_node_profile(sshd_pair, tmp_path)
    device = sshd_pair[1].dev_dir / "nvidia0"  # node 1's stand-in GPU (its agent scans SPECDEC_DEV_DIR)
    device.write_text("")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; f = open(sys.argv[1]); time.sleep(600)",
                               str(device)])  # fmt: skip
    try:
        wait_until(lambda: holds(holder.pid, device), 10, "the holder's device")
        listed = cli("kill-stale", "--profile", "two", "--config", str(cfg), "--dry-run", "--json")
        assert listed.returncode == 0, listed.output
        by_node = {n["node"]: n for n in json.loads(listed.stdout)["nodes"]}
        assert [c["pid"] for c in by_node[labels[1]]["candidates"]] == [holder.pid], by_node
        assert holder.pid not in [c["pid"] for c in by_node[labels[0]]["candidates"]], by_node
        assert holder.poll() is None  # a dry run signals nothing

        done = cli("kill-stale", "--profile", "two", "--config", str(cfg), "--yes", "--grace", "2", "--json")
        assert done.returncode == 0, done.output
        signalled = {n["node"]: n["signalled"] for n in json.loads(done.stdout)["nodes"]}
        assert len(signalled[labels[1]]) == 1 and not signalled[labels[0]], signalled
        assert holder.wait(timeout=30) is not None
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        device.unlink(missing_ok=True)


async def test_in_the_dashboard_one_nodes_lost_link_reconnects_on_its_own_while_the_other_keeps_streaming(
    sshd_pair: list[Any], tmp_path: Path
) -> None:
    from support.pilot import wait_until as pilot_wait

    from tui.dashboard.nodes_app import NodesApp
    from tui.link.events import ConnectionEvent
    from tui.link.session import ConnectOptions
    from tui.nodes import resolve_nodes
    from tui.profiles import resolve_profile

    cfg, roots, labels = two_node_profile(sshd_pair, tmp_path)
    nodes = resolve_nodes([], resolve_profile("two", str(cfg)), ConnectOptions(simulate_gpus=2))
    app = NodesApp(nodes, flush_interval_s=0.05, gpu_interval_s=0.2)
    states: list[list[str]] = [[], []]
    async with app.run_test(size=(160, 50)) as pilot:
        for i, node in enumerate(nodes):
            assert node.session is not None
            node.session.add_event_listener(
                lambda ev, i=i: states[i].append(ev.state) if isinstance(ev, ConnectionEvent) else None
            )
        sampled = [app.state.nodes[label] for label in labels]
        await pilot_wait(pilot, lambda: all(s.gpus is not None for s in sampled), 30, "both nodes' GPU samples")
        killed = agent_pids(roots[1])
        assert killed, "node 1's agent not found"
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
        await pilot_wait(pilot, lambda: "reconnecting" in states[1], 30, "node 1's link to drop")
        node0_t = sampled[0].gpus.t if sampled[0].gpus else 0.0
        await pilot_wait(pilot, lambda: states[1][-1:] == ["connected"], 60, "node 1's link back")
        t1 = sampled[1].gpus.t if sampled[1].gpus else 0.0
        await pilot_wait(pilot, lambda: sampled[1].gpus is not None and sampled[1].gpus.t > t1, 30, "node 1 streams")
        assert sampled[0].gpus is not None and sampled[0].gpus.t > node0_t  # node 0 kept streaming meanwhile
        assert "reconnecting" not in states[0], states[0]
        await pilot.press("q")


@pytest.mark.timeout(900)
def test_under_a_restart_policy_a_rank_killed_on_one_node_restarts_the_run_on_both_nodes_which_step_again(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    roots = [tmp_path / f"node{n}-root" for n in (0, 1)]
    policy = 'restart = { on = ["crash"], max = 1, backoff_s = 1 }\n'
    cfg = write_profile(tmp_path, [node_table(s, r) for s, r in zip(sshd_pair, roots, strict=True)], policy)
    labels = [f"{s.target}:{s.port}" for s in sshd_pair]
    r = cli("launch", "--profile", "two", "--config", str(cfg), "--wait", "first-step", "--json",
            timeout_s=START_TIMEOUT_S + 60)  # fmt: skip
    try:
        assert r.returncode == 0, r.output
        run = run_of(cfg, labels, roots, json.loads(r.stdout)["run_id"])
        rank_of_node1 = next(iter(run.pids[1]))
        os.kill(run.pids[1][rank_of_node1], signal.SIGKILL)
        t_kill = time.monotonic()

        def both_restarted() -> bool:
            return all(records.read_json(d / records.RESTARTS_JSON) for d in run.dirs)

        wait_until(both_restarted, 120, "a restart on both nodes", interval_s=0.5)

        def stepping_again() -> dict[str, Any] | None:
            st = status_json(cli, cfg)
            runs = [n["status"]["run"] for n in st["nodes"]]
            again = all(
                r and r["state"] == "running" and len(r["restarts"]) == 1 and r["restarts"][0].get("restarted_at")
                and (r.get("last_step_at") or 0) > r["restarts"][0]["restarted_at"]  # a step of the new attempt
                for r in runs
            )  # fmt: skip
            return st if again and st["run"]["state"] == "running" else None

        st = wait_until(stepping_again, START_TIMEOUT_S, "both nodes stepping in attempt 2", interval_s=1.0)
        back_s = time.monotonic() - t_kill
        assert st["run"]["run_id"] == run.run_id, st["run"]
    finally:
        stop_both(cli, cfg)
    assert_nothing_left(run, "after the stop")
    print(f"restart policy over two nodes: a rank killed on node 1, both nodes stepping again {back_s:.1f} s later")


def job_alive(run_dir: Path) -> bool:
    launch = records.read_json(run_dir / records.LAUNCH_JSON) or {}
    pid = launch.get("job_pid") or launch.get("pid")
    return bool(pid) and procs.process_alive(int(pid), launch.get("job_start_ticks"))


def launch_other_run(cli: Callable[..., Any], s: Any, root: Path) -> str:
    """A run of its own on one node (not the multi-node run): it becomes that node's current run."""
    r = cli("launch", s.target, *s.args(), "--run-root", str(root), "--wait", "started", "--json",
            "--", "sh", "-c", STEPPING, timeout_s=120)  # fmt: skip
    assert r.returncode == 0, r.output
    run_id: str = json.loads(r.stdout)["run_id"]
    return run_id


@pytest.mark.timeout(300)
def test_a_stop_never_takes_another_profiles_run_that_shares_node_0(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    """Profiles A = [h0, h1] and B = [h0, h2] (here: node 1 under another run root): B's run is node 0's current
    run, over as many nodes at the same ranks, but h1 has no part of it. `stop --profile A` stops nothing."""
    root0, root1, root2 = (tmp_path / f"root{n}" for n in (0, 1, 2))
    command = f"command = {json.dumps(['sh', '-c', STEPPING])}\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    cfg_a = write_profile(tmp_path / "a", [node_table(sshd_pair[0], root0), node_table(sshd_pair[1], root1)], command)
    cfg_b = write_profile(tmp_path / "b", [node_table(sshd_pair[0], root0), node_table(sshd_pair[1], root2)], command)
    try:
        r = cli("launch", "--profile", "two", "--config", str(cfg_b), "--wait", "started", "--json", timeout_s=120)
        assert r.returncode == 0, r.output
        b_run = json.loads(r.stdout)["run_id"]
        stop = cli("stop", "--profile", "two", "--config", str(cfg_a), "--grace", "5", timeout_s=120)
        assert stop.returncode == 1, stop.output
        assert f"nothing stopped: run {b_run} is not over these nodes" in stop.stderr, stop.output
        assert all(job_alive(records.run_dir_for(root, b_run)) for root in (root0, root2)), stop.output
    finally:
        stop_both(cli, cfg_b)


@pytest.mark.timeout(300)
def test_stop_and_restart_over_the_nodes_act_on_the_multi_node_run_by_its_id_never_on_a_nodes_other_run(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    roots = [tmp_path / f"node{n}-root" for n in (0, 1)]
    command = f"command = {json.dumps(['sh', '-c', STEPPING])}\n"
    cfg = write_profile(tmp_path, [node_table(s, r) for s, r in zip(sshd_pair, roots, strict=True)], command)
    labels = [f"{s.target}:{s.port}" for s in sshd_pair]
    other: str | None = None
    try:
        r = cli("launch", "--profile", "two", "--config", str(cfg), "--wait", "first-step", "--json", timeout_s=120)
        assert r.returncode == 0, r.output
        first = json.loads(r.stdout)["run_id"]
        other = launch_other_run(cli, sshd_pair[1], roots[1])  # node 1's current run now: not the multi-node run

        again = cli("restart", "--profile", "two", "--config", str(cfg), "--grace", "5", "--wait", "first-step",
                    "--json", timeout_s=120)  # fmt: skip
        assert again.returncode == 0, again.output
        second = json.loads(again.stdout)["run_id"]
        assert second not in (first, other)
        assert not any(job_alive(records.run_dir_for(root, first)) for root in roots), "the first run left running"
        assert job_alive(records.run_dir_for(roots[1], other)), "the restart stopped node 1's other run"
        assert all(job_alive(records.run_dir_for(root, second)) for root in roots)

        # node 1's current run is the other one again; one stop ends the multi-node run on both, by its id.
        other = launch_other_run(cli, sshd_pair[1], roots[1])
        stop = cli("stop", "--profile", "two", "--config", str(cfg), "--grace", "5", timeout_s=120)
        assert stop.returncode == 0, stop.output
        assert not any(job_alive(records.run_dir_for(root, second)) for root in roots), stop.output
        assert job_alive(records.run_dir_for(roots[1], other)), f"node 1's other run was stopped: {stop.output}"
        node1 = [ln for ln in stop.stdout.splitlines() if ln.startswith(f"[{labels[1]}] ")]
        assert node1 and f"run {second}" in node1[0] and f"current run {other}" in node1[0], stop.stdout

        # Asked by its id, a run that is not the current one of any node stops too.
        stop_other = cli("stop", "--profile", "two", "--config", str(cfg), "--run", other, "--grace", "5")
        assert stop_other.returncode == 0, stop_other.output
        assert not job_alive(records.run_dir_for(roots[1], other))
        assert f"[{labels[0]}] stopped: no run {other} there, nothing stopped" in stop_other.stdout, stop_other.stdout
        absent = cli("stop", "--profile", "two", "--config", str(cfg), "--run", "20200101-000000-0000")
        assert absent.returncode == 1 and "nothing stopped: no node has a run 20200101-000000-0000" in absent.stderr
    finally:
        stop_both(cli, cfg)
        if other is not None:
            s = sshd_pair[1]
            cli("stop", s.target, *s.args(), "--run-root", str(roots[1]), "--run", other, "--grace", "2")


@pytest.mark.timeout(300)
async def test_the_dashboards_r_and_s_act_on_the_multi_node_run_never_on_a_nodes_other_run(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    from support.pilot import wait_until as pilot_wait

    from tui.dashboard.nodes_app import NodesApp
    from tui.link.session import ConnectOptions
    from tui.nodes import Launched, resolve_nodes
    from tui.profiles import resolve_profile

    roots = [tmp_path / f"node{n}-root" for n in (0, 1)]
    command = f"command = {json.dumps(['sh', '-c', STEPPING])}\n"
    cfg = write_profile(tmp_path, [node_table(s, r) for s, r in zip(sshd_pair, roots, strict=True)], command)
    r = await asyncio.to_thread(cli, "launch", "--profile", "two", "--config", str(cfg), "--wait", "first-step",
                                "--json", timeout_s=120)  # fmt: skip
    other: str | None = None
    try:
        assert r.returncode == 0, r.output
        first = json.loads(r.stdout)["run_id"]
        other = await asyncio.to_thread(launch_other_run, cli, sshd_pair[1], roots[1])
        profile = resolve_profile("two", str(cfg))
        nodes = resolve_nodes([], profile, ConnectOptions())
        app = NodesApp(nodes, profile=profile, flush_interval_s=0.05)
        async with app.run_test(size=(160, 50)) as pilot:
            await pilot_wait(pilot, lambda: all(n.session and n.session.state == "connected" for n in nodes), 30)
            await pilot.press("r")
            await pilot.press("y")
            done: Launched = await pilot_wait(pilot, lambda: app.last_launch, 120, "r's launch")
            assert done.ok and done.run_id not in (None, first, other), done.cause
            second = done.run_id
            assert second is not None
            assert not any(job_alive(records.run_dir_for(root, first)) for root in roots), "the first run left running"
            assert job_alive(records.run_dir_for(roots[1], other)), "r stopped node 1's other run"

            other = await asyncio.to_thread(launch_other_run, cli, sshd_pair[1], roots[1])
            await pilot.press("s")
            await pilot.press("y")
            await pilot_wait(
                pilot, lambda: not any(job_alive(records.run_dir_for(root, second)) for root in roots), 60, "s's stop"
            )
            assert job_alive(records.run_dir_for(roots[1], other)), "s stopped node 1's other run"

            def node1_said() -> list[str]:
                head = f"node {nodes[1].label}: stopped: run {second}"
                return [n.message for n in app._notifications if n.message.startswith(head)]

            said = await pilot_wait(pilot, node1_said, 10, "node 1's stop notice")
            assert f"its current run {other} (running) is another run, left as it is" in said[0], said
            await pilot.press("q")
    finally:
        await asyncio.to_thread(stop_both, cli, cfg)
        if other is not None:
            s = sshd_pair[1]
            await asyncio.to_thread(cli, "stop", s.target, *s.args(), "--run-root", str(roots[1]), "--run", other)


class Forwarder:
    """A TCP port on 127.0.0.1 that forwards to a node's sshd while ``up`` and refuses connections while down: the
    node's own machine going away and coming back, as its SSH clients see it."""

    def __init__(self, to_port: int) -> None:
        import threading

        self.to_port = to_port
        self._threads: list[threading.Thread] = []
        self._listener: socket.socket | None = None
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = int(probe.getsockname()[1])

    @property
    def is_up(self) -> bool:
        return self._listener is not None

    def up(self) -> None:
        import threading

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(16)
        self._listener = listener
        thread = threading.Thread(target=self._accept, args=(listener,), daemon=True, name="forward-accept")
        thread.start()
        self._threads.append(thread)

    def down(self) -> None:
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread: close alone would not
            self._listener.close()  # a connect now is refused
            self._listener = None

    def _accept(self, listener: socket.socket) -> None:
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.to_port))
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True, name="forward-pump").start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        for s in (src, dst):
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


@pytest.mark.timeout(300)
def test_logs_follow_streams_the_live_node_while_another_is_down_at_the_start_names_it_and_retries_it(
    sshd_pair: list[Any], tmp_path: Path, cli: Callable[..., Any]
) -> None:
    roots = [tmp_path / f"node{n}-root" for n in (0, 1)]
    forward = Forwarder(sshd_pair[1].port)
    known = tmp_path / "known_hosts_forwarded"  # node 1's own host key, at the forwarded port
    key = sshd_pair[1].known_hosts.read_text().split(" ", 1)[1]
    known.write_text(f"[127.0.0.1]:{forward.port} {key}")
    node1 = node_table(sshd_pair[1], roots[1], forward.port).replace(str(sshd_pair[1].known_hosts), str(known))
    cfg = write_profile(tmp_path, [node_table(sshd_pair[0], roots[0]), node1])
    labels = [f"{sshd_pair[0].target}:{sshd_pair[0].port}", f"{sshd_pair[1].target}:{forward.port}"]
    forward.up()
    follower: subprocess.Popen[str] | None = None
    try:
        r = cli("launch", "--profile", "two", "--config", str(cfg), "--wait", "first-step", "--", "sh", "-c", STEPPING,
                timeout_s=120)  # fmt: skip
        assert r.returncode == 0, r.output
        forward.down()  # node 1 cannot be reached now; its part of the run goes on
        follower = subprocess.Popen(
            [sys.executable, "-m", "tui", "logs", "--profile", "two", "--config", str(cfg), "-f", "-n", "1"],
            cwd=REPO, env=checkout_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        out, errs = Lines(follower.stdout), Lines(follower.stderr)
        errs.wait_for(lambda ln: ln.startswith(f"[{labels[1]}] [reconnecting: "), 30)  # the down node, named
        seen = out.count(f"[{labels[0]}] step=")
        out.wait_for(lambda ln: ln.startswith(f"[{labels[0]}] step="), 15, start=len(out.lines))  # node 0 streams
        assert out.count(f"[{labels[0]}] step=") > seen and not out.count(f"[{labels[1]}]"), out.lines[-5:]

        forward.up()  # node 1 back: it is tried again, then its lines come too
        out.wait_for(lambda ln: ln.startswith(f"[{labels[1]}] step="), 60)
        assert follower.poll() is None
    finally:
        if follower is not None:
            follower.kill()
            follower.wait()
        if not forward.is_up:
            forward.up()  # so the stop reaches node 1's part of the run too
        stop_both(cli, cfg)
        forward.down()
