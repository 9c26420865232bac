"""The engine as torchrun ranks on the CPU (gloo): two ranks of one node, and two torchrun "nodes" on 127.0.0.1.

Each rank is the threaded engine (two drafter threads inside); ranks meet once per step in one all-reduce.
What is pinned: the acceptance command exits 0; drafter weights are equal on every rank after N steps (each
rank writes a digest, compared here); a rank leaves without interpreter teardown; every batch index is trained
exactly once per epoch across the world; a stop seen by one rank stops every rank at the same step; a node whose
torchrun agent is killed stops the other node within seconds, non-zero, with an error naming the peer rank.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_until
from torchrun_support import TINY_ENGINE_TOML, complete_events, wait_listening

from engine.trainer.data.sources import shipped_corpus_path

REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 150.0

TINY_TOML = TINY_ENGINE_TOML


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env() -> dict[str, str]:
    e = dict(os.environ)
    e["PYTHONPATH"] = str(REPO) + os.pathsep + e.get("PYTHONPATH", "")
    e.pop("SPECDEC_EVENTS", None)
    e.pop("SPECDEC_RUN_DIR", None)
    e["OMP_NUM_THREADS"] = "1"
    return e


TEARDOWN_HOOK = """
import atexit, os, sys
from pathlib import Path

def _mark():
    who = "rank" if sys.argv[0].endswith(os.path.join("engine", "trainer", "__main__.py")) else "other"
    Path(os.environ["TEARDOWN_MARKS"], f"{who}.{os.getpid()}").touch()

atexit.register(_mark)
"""


def teardown_marks(tmp: Path, e: dict[str, str]) -> Path:
    """A sitecustomize on PYTHONPATH that leaves a mark for every process that runs interpreter teardown (its
    atexit handlers): the torchrun agent does, a rank must not (gloo/store destructors there can SIGABRT)."""
    site, marks = tmp / "site", tmp / "marks"
    site.mkdir()
    marks.mkdir()
    (site / "sitecustomize.py").write_text(TEARDOWN_HOOK, encoding="utf-8")
    e["PYTHONPATH"] = str(site) + os.pathsep + e["PYTHONPATH"]
    e["TEARDOWN_MARKS"] = str(marks)
    return marks


def failed(proc: subprocess.CompletedProcess[str]) -> str:
    """What a failed torchrun printed: the tails, and a rank's fatal error (faulthandler's thread stacks come
    before its long list of extension modules, which alone would fill the stderr tail)."""
    fatal = proc.stderr.find("Fatal Python error")
    head = proc.stderr[fatal : fatal + 4000] + "\n...\n" if fatal >= 0 else ""
    return proc.stdout[-3000:] + head + proc.stderr[-3000:]


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def write_config(tmp: Path, corpus_lines: int | None = None, **extra: Any) -> Path:
    text = TINY_TOML
    if corpus_lines is None:
        text += 'data = "random"\n'
    else:
        corpus = tmp / "corpus.jsonl"
        lines = shipped_corpus_path().read_text(encoding="utf-8").splitlines()[:corpus_lines]
        corpus.write_text("\n".join(lines) + "\n", encoding="utf-8")
        text += f"data = {json.dumps(str(corpus))}\n"
    for key, value in extra.items():
        text += f"{key} = {json.dumps(value)}\n"
    path = tmp / "engine.toml"
    path.write_text(text, encoding="utf-8")
    return path


def rank_records(out: Path) -> dict[int, dict[str, Any]]:
    return {int(p.stem[4:]): json.loads(p.read_text()) for p in sorted((out / "ranks").glob("rank*.json"))}


def events(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def run_end(path: Path) -> dict[str, Any]:
    ends = [e for e in events(path) if e["kind"] == "run_end"]
    assert ends, f"no run_end in {path}"
    return ends[-1]


def trained_global(position: dict[str, Any], rank: int, world: int) -> list[int]:
    """The global batch indices a rank's ledger (local indices) records as trained."""
    local = list(range(position["watermark"])) + list(position["done"])
    return sorted(i * world + rank for i in local)


@pytest.mark.slow
def test_acceptance_command_trains_cpu_demo_as_two_gloo_ranks(tmp_path: Path) -> None:
    out = tmp_path / "run"
    cmd = torchrun("--standalone", "--nproc-per-node", "2", "-m", "engine.trainer", "--preset", "cpu-demo")
    cmd += ["--set", "steps=20", "--output-dir", str(out)]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    took = time.monotonic() - t0
    assert proc.returncode == 0, failed(proc)
    records = rank_records(out)
    assert sorted(records) == [0, 1]
    # cpu-demo is independent mode (a two-point learning-rate sweep): each drafter is averaged with the same
    # drafter on the other rank, so drafter k's weights are equal across ranks and the two drafters differ.
    for name in ("drafter0", "drafter1"):
        assert records[0]["weights_sha256"][name] == records[1]["weights_sha256"][name]
    assert records[0]["weights_sha256"]["drafter0"] != records[0]["weights_sha256"]["drafter1"]
    assert records[0]["step"] == records[1]["step"] == 20
    # Rank 0 wrote the checkpoint with both ranks' data positions; rank 1 its events beside rank 0's.
    meta = json.loads((out / "checkpoints" / "step_00000020" / "meta.json").read_text())
    assert meta["world_size"] == 2 and sorted(meta["rank_positions"]) == ["0", "1"]
    assert {e.get("rank") for e in events(out / "events.jsonl")} == {0}
    steps1 = [e for e in events(out / "events.rank1.jsonl") if e["kind"] == "step"]
    assert steps1 and all(e["rank"] == 1 and e["world_size"] == 2 for e in steps1)
    assert "[rank 1] step=" in proc.stdout
    print(f"acceptance command: {took:.1f} s")


@pytest.mark.slow
def test_two_ranks_of_two_replicas_keep_equal_weights_and_train_every_index_once_per_epoch(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # 40 conversations, batch 2: 20 batches per epoch; 2 ranks x 2 replicas x 10 steps = 40 batches = 2 epochs.
    config = write_config(tmp_path, corpus_lines=40, steps=10, checkpoint_every=4, output_dir=str(out))
    cmd = torchrun("--standalone", "--nproc-per-node", "2", "-m", "engine.trainer", "--config", str(config))
    e = env()
    marks = teardown_marks(tmp_path, e)
    proc = subprocess.run(cmd, cwd=tmp_path, env=e, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, failed(proc)
    # Both ranks left without interpreter teardown (the agent ran it: the hook works).
    kinds = sorted(p.name.split(".")[0] for p in marks.iterdir())
    assert "other" in kinds and "rank" not in kinds, kinds
    records = rank_records(out)
    digests = {d for r in records.values() for d in r["weights_sha256"].values()}
    assert len(digests) == 1, f"drafter weights differ across ranks/replicas: {records}"
    assert all(r["step"] == 10 for r in records.values())
    first = events(out / "events.jsonl")
    conversations = next(int(e["detail"].split()[0]) for e in first if "to train on" in e.get("detail", ""))
    batches_per_epoch = conversations // 2
    trained = sorted(g for rank, r in records.items() for g in trained_global(r["data_position"]["replicas"], rank, 2))
    assert trained == list(range(40)), trained  # each global index exactly once: no gaps, no repeats
    for epoch in range(40 // batches_per_epoch):
        in_epoch = [g for g in trained if g // batches_per_epoch == epoch]
        assert len(in_epoch) == len(set(in_epoch)) == batches_per_epoch
    # The periodic checkpoint at step 8 holds every rank's position at that step.
    meta = json.loads((out / "checkpoints" / "step_00000008" / "meta.json").read_text())
    assert {r: p["replicas"]["watermark"] for r, p in meta["rank_positions"].items()} == {"0": 16, "1": 16}


@pytest.mark.slow
def test_a_rank_leaving_while_the_store_answers_late_exits_cleanly_not_by_sigabrt(tmp_path: Path) -> None:
    """Seen once in a full run: both ranks finished, then rank 1 died on exit with "terminate called without an
    active exception" (SIGABRT) and torchrun exited 1. The heartbeat thread (a daemon) was inside ``store.add`` when
    the interpreter finalized; the binding's GIL re-acquire then ends the thread with pthread_exit through a noexcept
    C++ frame. Here the store's host answers 0.2 s late, so the call is in flight when the rank leaves (6 of 6 runs
    aborted so before ``close`` joined the thread)."""
    worker = REPO / "tests" / "integration" / "slow_store_exit.py"
    cmd = torchrun("--standalone", "--nproc-per-node", "2", str(worker), "0.2")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    output = proc.stdout + proc.stderr
    assert "terminate called" not in output, output[-3000:]
    assert proc.returncode == 0, output[-3000:]
    assert "rank 1 left cleanly: True" in output and "rank 0 left cleanly: True" in output, output[-3000:]


@pytest.mark.slow
def test_sigterm_to_one_rank_stops_every_rank_at_the_same_step_and_resume_continues(tmp_path: Path) -> None:
    out = tmp_path / "run"
    config = write_config(tmp_path, steps=100_000, step_delay_s=0.05, output_dir=str(out))
    cmd = torchrun("--standalone", "--nproc-per-node", "2", "-m", "engine.trainer", "--config", str(config))
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        rank1_events = out / "events.rank1.jsonl"
        pid = wait_for_step_then_pid(rank1_events, step=5, timeout_s=RUN_TIMEOUT_S)
        os.kill(pid, signal.SIGTERM)  # one rank only: the stop is agreed through the per-step all-reduce
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output[-3000:]
    records = rank_records(out)
    assert records[0]["step"] == records[1]["step"] >= 5
    assert records[0]["weights_sha256"] == records[1]["weights_sha256"]
    ends = [run_end(out / "events.jsonl"), run_end(rank1_events)]
    assert all(e["ok"] for e in ends) and ends[1]["reason"] == "SIGTERM"
    stopped_at = records[0]["step"]
    assert (out / "checkpoints" / f"step_{stopped_at:08d}" / "meta.json").exists()

    # Resume as one process: the two ranks' ledgers become one, nothing trained twice.
    more = subprocess.run(
        [sys.executable, "-m", "engine.trainer", "--config", str(config), "--set", f"steps={stopped_at + 2}"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
    )
    assert more.returncode == 0, failed(more)
    assert f"resumed from step_{stopped_at:08d}" in more.stdout
    meta = json.loads((out / "checkpoints" / f"step_{stopped_at + 2:08d}" / "meta.json").read_text())
    # Two ranks x two replicas trained 4 * stopped_at global indices; one process then two steps of two replicas.
    assert meta["data_position"]["replicas"] == {"watermark": 4 * stopped_at + 4, "done": []}


@pytest.mark.slow
def test_a_stop_while_the_data_is_tokenized_ends_every_rank_as_stopped_within_seconds(tmp_path: Path) -> None:
    """SIGTERM to the torchrun agent (it forwards it to every rank) while node 0's first rank tokenizes and rank 1
    waits for its cache: rank 0 leaves its tokenizing at once, rank 1's wait breaks, and both end ok as stopped
    (rank 1 naming the peer that left first), not one stopped and one failed."""
    out = tmp_path / "run"
    data = tmp_path / "chat.jsonl"
    data.write_bytes(shipped_corpus_path().read_bytes() * 4)  # 6000 conversations: seconds of tokenizing
    config = tmp_path / "engine.toml"
    config.write_text(TINY_TOML + f"data = {json.dumps(str(data))}\nsteps = 100\noutput_dir = {json.dumps(str(out))}\n")
    cmd = torchrun("--standalone", "--nproc-per-node", "2", "-m", "engine.trainer", "--config", str(config))
    proc = subprocess.Popen(
        cmd,
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        wait_until(
            lambda: (
                any(e.get("detail", "").startswith("tokenized ") for e in complete_events(out / "events.jsonl"))
                or proc.poll() is not None
            ),
            RUN_TIMEOUT_S,
            "rank 0's first tokenizing progress line",
        )
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGTERM)  # the agent, as a stop of the whole run reaches it
        output, _ = proc.communicate(timeout=60)
        stop_s = time.monotonic() - t0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ends = [run_end(out / "events.jsonl"), run_end(out / "events.rank1.jsonl")]
    assert ends[0]["ok"] and ends[0]["reason"] == f"stopped (SIGTERM) while tokenizing {data}", ends[0]
    assert ends[1]["ok"], ends[1]
    assert re.fullmatch(
        r"stopped \(SIGTERM\) while the run was built; peer rank 0 \(node 0, \S+ pid \d+\) left first",
        ends[1]["reason"],
    ), ends[1]["reason"]
    assert not any(e["kind"] == "step" for path in out.glob("events*.jsonl") for e in events(path))
    assert "setup failed" not in output, output[-3000:]
    assert stop_s < 20.0, f"the ranks took {stop_s:.1f} s to stop"


def wait_for_step_then_pid(path: Path, step: int, timeout_s: float) -> int:
    """The pid of the rank writing ``path`` once it has reported ``step`` (bounded wait on the file)."""

    def stepped() -> int | None:
        evs = complete_events(path)
        pid = next((e["pid"] for e in evs if e.get("stage") == "distributed"), None)
        if pid is not None and any(e["kind"] == "step" and e["step"] >= step for e in evs):
            return int(pid)
        return None

    return wait_until(stepped, timeout_s, f"step {step} in {path}", interval_s=0.2)


@pytest.mark.slow
@pytest.mark.parametrize("victim", [1, 0], ids=["kill-node1", "kill-node0-the-rendezvous-host"])
def test_killing_one_node_agent_stops_the_other_node_naming_the_peer_rank(tmp_path: Path, victim: int) -> None:
    survivor = 1 - victim
    port = free_port()
    config = write_config(tmp_path, steps=100_000, step_delay_s=0.05)
    procs: list[subprocess.Popen[str]] = []
    outs = [tmp_path / f"node{n}" for n in (0, 1)]
    try:
        for n in (0, 1):
            cmd = torchrun(
                "--nnodes", "2", "--node-rank", str(n), "--nproc-per-node", "1", "--max-restarts", "0",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                "-m", "engine.trainer", "--config", str(config), "--output-dir", str(outs[n]),
            )  # fmt: skip
            log = (tmp_path / f"node{n}.log").open("w")  # closed with the test's tmp_path
            node = subprocess.Popen(
                cmd, cwd=tmp_path, env=env(), stdout=log, stderr=subprocess.STDOUT, text=True, start_new_session=True
            )
            procs.append(node)
            if n == 0:  # node 0's agent hosts the rendezvous store, as the endpoint's machine does
                wait_listening(port, RUN_TIMEOUT_S)
        for n in (0, 1):  # both nodes train together: each rank has stepped
            wait_for_step_then_pid(outs[n] / "events.jsonl", step=3, timeout_s=RUN_TIMEOUT_S)
        t0 = time.monotonic()
        os.killpg(procs[victim].pid, signal.SIGKILL)  # the node's torchrun agent (its worker has its own session)
        code = procs[survivor].wait(timeout=60)
        stop_s = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
    assert code != 0
    end = run_end(outs[survivor] / "events.jsonl")
    assert not end["ok"] and f"peer rank {victim} (node {victim}" in end["reason"], end["reason"]
    # Named either way it learns of it: the victim's worker says it is failing in the step's all-reduce, or its
    # process is found gone after the collective broke.
    assert "is gone" in end["reason"] or "left the run" in end["reason"], end["reason"]
    orphan = run_end(outs[victim] / "events.jsonl")  # the killed node's worker saw its agent go and left
    assert not orphan["ok"] and "torchrun agent" in orphan["reason"]
    assert stop_s < 20.0, f"node {survivor} stopped {stop_s:.1f} s after node {victim}'s agent was killed"
    print(f"kill-to-stop: {stop_s:.2f} s")
