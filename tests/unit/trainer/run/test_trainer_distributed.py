"""The pieces of the multi-rank engine that need no second process: layouts, devices, data shards, resharded
ledgers, the torchrun command line, rank-tagged events and the gradient weighting across ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.protocol import StepEvent
from engine.trainer.config import ConfigError, from_dict
from engine.trainer.data.dispatch import IndexLedger
from engine.trainer.data.sources import RandomTokenSource
from engine.trainer.run.distributed import ShardedSource, map_devices, reshard
from engine.trainer.run.torchrun import RankInfo, events_path_for_rank, rank_from_env, torchrun_command
from engine.trainer.run.worker import ReplicaGroup
from engine.trainer.threads.control import PeerFailure
from engine.trainer.threads.metrics import EventLog, suggest_split

REPO = Path(__file__).resolve().parents[4]

# --- layout advice ------------------------------------------------------------------------------------------


def test_layout_advice_colocates_when_the_target_fits_beside_the_drafter() -> None:
    # 8B-shape target (bf16 weights + a batch) and its drafter's training on a 141 GB H200: co-located, as
    # measured on 2xH200 (co-located 32.3k tok/s beat the 1:1 split's 31.0k and 1 target + 2 drafters' 22.3k).
    layout = suggest_split(31_000, 31_000, 2, target_gib=17.0, drafter_gib=45.0, gpu_gib=139.8)
    assert (layout.colocated, layout.target_gpus, layout.drafter_gpus) == (True, 2, 2)
    assert "fit" in layout.why
    assert suggest_split(27_000, 9_000, 8).colocated  # memory unknown: co-location is the default


def test_layout_advice_splits_only_when_the_two_do_not_fit_on_one_gpu() -> None:
    layout = suggest_split(27_000, 9_000, 8, target_gib=70.0, drafter_gib=70.0, gpu_gib=139.8)
    assert (layout.colocated, layout.target_gpus, layout.drafter_gpus) == (False, 2, 6)
    assert "exceed" in layout.why
    single = suggest_split(27_000, 9_000, 1, target_gib=70.0, drafter_gib=70.0, gpu_gib=139.8)
    assert not single.colocated and "at least 2 GPUs" in single.why


# --- devices and data ---------------------------------------------------------------------------------------


def test_devices_of_a_rank_per_gpu_are_shifted_to_its_own_gpus() -> None:
    one_per_node = RankInfo(rank=3, world_size=4, local_rank=0, local_world_size=1, launched=True)
    assert map_devices(["cuda:0", "cuda:1"], one_per_node) == ["cuda:0", "cuda:1"]  # the node's GPUs, as named
    second = RankInfo(rank=1, world_size=2, local_rank=1, local_world_size=2, launched=True)
    assert map_devices(["cuda:0"], second) == ["cuda:1"]
    assert map_devices(["cuda:0", "cuda:1"], second) == ["cuda:2", "cuda:3"]
    assert map_devices(["cuda:local", "cpu"], RankInfo(local_rank=5, launched=True)) == ["cuda:5", "cpu"]


def test_each_rank_trains_its_own_share_of_the_batch_indices() -> None:
    inner = RandomTokenSource(300, buckets=[32], batch_size=2, seed=1)
    shards = [ShardedSource(inner, r, 3) for r in range(3)]
    seen = sorted(s.global_index(i) for s in shards for i in range(5))
    assert seen == list(range(15))  # every global index once across the world
    got = shards[2].batch(4)
    assert got.index == 4 and torch.equal(got.input_ids, inner.batch(4 * 3 + 2).input_ids)


def trained_globals(positions: dict[int, dict[str, Any]], world: int) -> set[int]:
    out: set[int] = set()
    for rank, state in positions.items():
        local = list(range(state["watermark"])) + list(state["done"])
        out |= {i * world + rank for i in local}
    return out


def test_resume_with_another_number_of_ranks_keeps_exactly_the_trained_indices() -> None:
    two = {0: {"watermark": 5, "done": [7]}, 1: {"watermark": 4, "done": []}}
    before = trained_globals(two, 2)
    for world in (1, 3, 4):
        after = {r: reshard(two, 2, r, world) for r in range(world)}
        assert trained_globals(after, world) == before
    assert reshard(two, 2, 0, 1) == {"watermark": 9, "done": [14]}


# --- launch, config and events ------------------------------------------------------------------------------


def test_torchrun_command_for_one_and_for_several_nodes() -> None:
    prog = ["torchrun"]
    one = torchrun_command(["--preset", "x"], nproc_per_node=2, nnodes=1, node_rank=0, rdzv_endpoint="", program=prog)
    assert one[:3] == ["torchrun", "--standalone", "--nnodes"] and one[-4:] == ["-m", "engine.trainer", "--preset", "x"]
    two = torchrun_command([], nproc_per_node=8, nnodes=2, node_rank=1, rdzv_endpoint="node0:29500", program=prog)
    assert " ".join(two).startswith(
        "torchrun --nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint node0:29500 --nproc-per-node 8"
    )


def test_specdec_train_prints_the_torchrun_command() -> None:
    argv = ["--print-torchrun", "--nnodes", "2", "--node-rank", "1", "--rdzv-endpoint", "gpu-node0:29500"]
    proc = subprocess.run(
        [sys.executable, "-m", "engine.trainer", *argv, "--preset", "cpu-demo", "--set", "steps=5"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    line = proc.stdout.strip()
    assert "--nnodes 2 --node-rank 1 --rdzv-backend c10d --rdzv-endpoint gpu-node0:29500" in line
    assert line.endswith("-m engine.trainer --nnodes 2 --node-rank 1 --rdzv-endpoint gpu-node0:29500 "
                         "--preset cpu-demo --set steps=5")  # fmt: skip
    assert "--print-torchrun" not in line


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"nnodes": 2}, "rdzv_endpoint: got ''; HOST:PORT"),
        ({"nnodes": 2, "rdzv_endpoint": "node0:70000"}, "port 1..65535"),
        ({"nnodes": 2, "node_rank": 2, "rdzv_endpoint": "node0:29500"}, "node_rank: got 2; this node's rank runs 0..1"),
        ({"nproc_per_node": 0}, "nproc_per_node: an integer >= 1"),
        ({"distributed": "on"}, "distributed: got 'on'; allowed: auto, off"),
        ({"drafter_devices": ["cuda:first"]}, "'cuda:local' (cuda:<LOCAL_RANK>)"),
    ],
)
def test_launch_values_are_checked_with_errors_that_name_the_key(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        from_dict(values)


def test_a_rank_tags_its_events_and_writes_its_own_file_beside_the_first_rank(tmp_path: Path) -> None:
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1"}
    env["MASTER_ADDR"] = "node0"
    info = rank_from_env(env)
    path = events_path_for_rank(tmp_path / "events.jsonl", info)
    assert path.name == "events.rank3.jsonl"
    assert events_path_for_rank(tmp_path / "events.jsonl", RankInfo(rank=2, local_rank=0, launched=True)).name == (
        "events.jsonl"
    )
    lines: list[str] = []

    class Out:
        def write(self, text: str) -> None:
            lines.append(text)

        def flush(self) -> None:
            pass

    log = EventLog(path, stdout=Out(), tags=info.tags(), prefix="[rank 3] ")  # type: ignore[arg-type]
    log.emit(StepEvent(thread="drafter0", step=1))
    log.say("step=1 thread=drafter0")
    log.close()
    event = json.loads(path.read_text())
    assert (event["rank"], event["world_size"], event["node"], event["step"]) == (3, 4, 1, 1)
    assert lines[0] == "[rank 3] step=1 thread=drafter0\n"
    assert rank_from_env({}).tags() == {}  # a plain process adds nothing
    assert not rank_from_env({"RANK": "0", "WORLD_SIZE": "1"}).launched  # no MASTER_ADDR: no world to join


# --- gradient weighting across ranks ------------------------------------------------------------------------


class OtherRank:
    """Stands in for CrossRank: a world of this process plus one other rank with fixed gradients and count."""

    def __init__(self, grads: list[torch.Tensor], count: int, stop: bool = False, failing: bool = False) -> None:
        self.grads, self.count, self.stop, self.failing = grads, count, stop, failing
        self.calls: list[tuple[int, str]] = []

    def all_reduce(
        self,
        models: list[list[torch.Tensor] | None],
        shapes: list[list[torch.Size]],
        counts: list[int],
        stop: bool,
        step: int,
        failing: bool = False,
    ) -> tuple[list[int], bool]:
        self.calls.append((step, threading.current_thread().name))
        if self.failing:
            raise PeerFailure("rank 0 (node 0): peer rank 1 (node 1, host pid 7) failed at step 1 and left the run")
        for grads in models:
            assert grads is not None
            torch._foreach_add_(grads, self.grads)
        return [c + self.count for c in counts], stop or self.stop


def run_replicas(group: ReplicaGroup, grads: list[list[torch.Tensor]]) -> list[Any]:
    results: list[Any] = [None, None]

    def member(r: int) -> None:
        try:
            results[r] = group.all_reduce(r, grads[r], index=r, step=1)
        except BaseException as exc:
            results[r] = exc

    threads = [threading.Thread(target=member, args=(r,), name=f"drafter{r}") for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    return results


def test_gradients_are_averaged_over_every_replica_of_every_rank_in_one_collective_per_step() -> None:
    # Here two replicas with gradients 1 and 2; the other rank contributes one replica with gradient 6:
    # the world's average is (1 + 2 + 6) / 3 = 3 on every replica, and the other rank's stop is agreed.
    other = OtherRank([torch.full((2,), 6.0)], count=1, stop=True)
    ledger = IndexLedger()
    group = ReplicaGroup(
        [0, 1],
        [torch.device("cpu")] * 2,
        lambda: False,
        ledger,
        cross=other,
        shapes=[[torch.Size([2])]],  # type: ignore[arg-type]
    )
    grads = [[torch.full((2,), 1.0)], [torch.full((2,), 2.0)]]
    assert run_replicas(group, grads) == [True, True]
    assert all(torch.equal(g[0], torch.full((2,), 3.0)) for g in grads)
    assert len(other.calls) == 1 and other.calls[0][0] == 1  # one collective, step 1, from one thread
    assert ledger.state() == {"watermark": 2, "done": []}


def test_a_peer_that_failed_is_named_by_every_thread_of_the_rank() -> None:
    other = OtherRank([torch.zeros(2)], count=1, failing=True)
    group = ReplicaGroup(
        [0, 1],
        [torch.device("cpu")] * 2,
        lambda: False,
        IndexLedger(),
        cross=other,
        shapes=[[torch.Size([2])]],  # type: ignore[arg-type]
    )
    results = run_replicas(group, [[torch.ones(2)], [torch.ones(2)]])
    assert all(isinstance(r, PeerFailure) and "peer rank 1 (node 1" in str(r) for r in results), results
