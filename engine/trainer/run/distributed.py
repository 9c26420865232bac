"""torch.distributed across ranks started by torchrun: each rank is the whole threaded engine over its devices.

Per step, once the drafter threads of a rank have met at their ``ReplicaGroup`` barrier, the thread that
completes the barrier (one thread per rank per step, rounds in the same order on every rank) calls
``CrossRank.all_reduce``: one collective over a flat buffer holding every model's gradient sum, every model's
contributing replica count and the rank's stop flag. So a stop (SIGTERM on any rank, or the steps done) is
agreed on the step where it is seen, and no rank waits in a collective that its peers will never enter.

Data: rank r of a world of W trains the global batch indices r, r + W, r + 2W, ... (``ShardedSource``): the
engine's dispatcher and ledgers count local indices l, global index = l * W + r, so every index is trained once
per epoch across the world and a checkpoint holds each rank's ledger (gathered to rank 0, which writes it).

A peer that dies breaks the next collective at once (gloo: the connection closes; NCCL: the watchdog, or the
timeout); the error names the ranks found gone (same host: their process is gone; other hosts: their store
heartbeat stopped) and the rank exits non-zero so torchrun tears the world down. A rank whose torchrun agent
died (its parent changed) stops too: torchrun starts workers in their own session, so killing an agent's
process group leaves its worker running otherwise.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from engine.trainer.data.dispatch import IndexLedger
from engine.trainer.data.sources import BatchSource, HostBatch
from engine.trainer.run.torchrun import RankInfo
from engine.trainer.threads.control import PeerFailure

LOCAL_DEVICE = "cuda:local"  # a device string meaning cuda:<LOCAL_RANK>
AGENT_DEATH_SIGNAL = signal.SIGUSR2  # sent by the kernel when this rank's torchrun agent dies (SIGUSR1: stacks)
BEAT_KEY = "specdec/beat/{rank}"
BEAT_EVERY_S = 0.5
PROBE_WAIT_S = 1.5  # how long a peer's store heartbeat must stand still for it to be named as gone
BEAT_STOP_S = 10.0  # how long leaving waits for the heartbeat thread's last store call (a slow store's host)


def map_devices(devices: list[str], info: RankInfo) -> list[str]:
    """The devices of this rank. ``cuda:local`` is cuda:<LOCAL_RANK>. With several ranks on a node, the config
    names the devices of one rank and rank L of the node gets them shifted by L times their count: cuda:i
    becomes cuda:(i + L * K), K = the highest index named + 1 (so ``["cuda:0"]`` gives rank L cuda:L)."""
    out: list[str] = []
    named = [int(d.split(":", 1)[1]) for d in devices if d.startswith("cuda:") and d != LOCAL_DEVICE]
    span = max(named) + 1 if named else 1
    for d in devices:
        if d == LOCAL_DEVICE:
            out.append(f"cuda:{info.local_rank}")
        elif info.local_world_size > 1 and (d == "cuda" or d.startswith("cuda:")):
            index = int(d.split(":", 1)[1]) if ":" in d else 0
            out.append(f"cuda:{index + info.local_rank * span}")
        else:
            out.append(d)
    return out


class ShardedSource:
    """Rank ``rank``'s share of ``inner``: local index l is global batch l * world + rank."""

    def __init__(self, inner: BatchSource, rank: int, world_size: int) -> None:
        self.inner = inner
        self.rank = rank
        self.world_size = world_size
        self.buckets = inner.buckets
        self.batch_size = inner.batch_size

    def global_index(self, local: int) -> int:
        return local * self.world_size + self.rank

    def batch(self, index: int) -> HostBatch:
        hb = self.inner.batch(self.global_index(index))
        hb.index = index  # the engine's ledgers count local indices
        return hb

    def describe(self) -> str:
        share = f"rank {self.rank} of {self.world_size} trains batch indices = {self.rank} mod {self.world_size}"
        return f"{self.inner.describe()}; {share}"

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        return self.inner.token_counts(vocab_size)  # the draft vocabulary counts the whole data set


@dataclass
class Peer:
    rank: int
    node: int
    local_rank: int
    host: str
    pid: int


def set_parent_death_signal(signum: int) -> None:
    """Linux: have the kernel send ``signum`` when the parent (the torchrun agent) dies, so this rank learns of it
    at once; the engine's handler checks that the parent really changed (the signal also comes when the thread
    that started this process ends). Elsewhere the engine's half-second parent check stands in."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def describe(peers: list[Peer]) -> str:
    return ", ".join(f"rank {p.rank} (node {p.node}, {p.host} pid {p.pid})" for p in peers)


def _process_gone(pid: int) -> bool:
    """True when ``pid`` no longer runs here (no such process, or a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("Z", "X")


class CrossRank:
    """This rank's process group: the per-step collective, gathers, broadcasts and naming a dead peer."""

    def __init__(self, info: RankInfo, comm_device: torch.device, timeout_s: float, setup_timeout_s: float) -> None:
        self.info = info
        self.rank = info.rank
        self.world_size = info.world_size
        self.device = comm_device
        self.backend = "nccl" if comm_device.type == "cuda" else "gloo"
        self.timeout_s = timeout_s
        timeout = datetime.timedelta(seconds=timeout_s)
        if comm_device.type == "cuda":
            torch.cuda.set_device(comm_device)
            dist.init_process_group(backend=self.backend, timeout=timeout, device_id=comm_device)
        else:
            dist.init_process_group(backend=self.backend, timeout=timeout)
        # Python objects (the peer table, the vocabulary and checkpoint to resume from, ledgers) travel over a gloo
        # group on the CPU whose timeout also covers the setup, where peers wait while rank 0 prepares the data.
        self.cpu_group: Any = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=setup_timeout_s))
        self._parent = os.getppid()  # the torchrun agent that started this rank
        set_parent_death_signal(AGENT_DEATH_SIGNAL)
        self._store: Any = None
        self._beat_thread: threading.Thread | None = None
        self._closing = threading.Event()
        me = Peer(self.rank, info.node, info.local_rank, socket.gethostname(), os.getpid())
        table: list[Any] = [None] * self.world_size
        dist.all_gather_object(table, me, group=self.cpu_group)
        self.peers: list[Peer] = list(table)
        self.positions: dict[int, dict[int, dict[str, Any]]] = {}  # step -> rank -> model name -> ledger state
        self._start_beats()

    # --- liveness ---------------------------------------------------------------------------------------------
    def _start_beats(self) -> None:
        """A counter per rank in the rendezvous store, bumped twice a second: a peer on another host whose
        counter stands still after a failed collective is the one that went away."""
        try:
            from torch.distributed.distributed_c10d import _get_default_store

            self._store = _get_default_store()
        except (ImportError, RuntimeError, ValueError):
            self._store = None
            return

        def beat() -> None:
            key = BEAT_KEY.format(rank=self.rank)
            while not self._closing.wait(BEAT_EVERY_S):
                try:
                    self._store.add(key, 1)
                except (RuntimeError, OSError):
                    return  # the store's host went away: naming falls back to process checks

        self._beat_thread = threading.Thread(target=beat, name="rank-beat", daemon=True)
        self._beat_thread.start()

    def agent_gone(self) -> bool:
        """True when the torchrun agent that started this rank has died (this process was re-parented)."""
        return os.getppid() != self._parent

    def gone_peers(self) -> tuple[list[Peer], list[Peer]]:
        """(peers whose process is gone, peers whose store heartbeat stood still for PROBE_WAIT_S: hung or gone
        on another host); the process check covers this host, the store check every peer while the store lives."""
        host = socket.gethostname()
        others = [p for p in self.peers if p.rank != self.rank]
        gone = [p for p in others if p.host == host and _process_gone(p.pid)]
        rest = [p for p in others if p not in gone]
        silent: list[Peer] = []
        if rest and self._store is not None:
            try:
                before = {p.rank: self._store.add(BEAT_KEY.format(rank=p.rank), 0) for p in rest}
                time.sleep(PROBE_WAIT_S)
                after = {p.rank: self._store.add(BEAT_KEY.format(rank=p.rank), 0) for p in rest}
                silent = [p for p in rest if after[p.rank] == before[p.rank]]
            except (RuntimeError, OSError):
                pass  # the store went with its host; the message lists the peers instead
        return gone, silent

    def failure(self, what: str, exc: BaseException) -> PeerFailure:
        """A PeerFailure that names the ranks found gone or silent."""
        gone, silent = self.gone_peers()
        parts = [f"peer {describe(gone)} is gone"] if gone else []
        parts += [f"peer {describe(silent)} stopped responding (hung, or gone with its host)"] if silent else []
        if not parts:
            others = describe([p for p in self.peers if p.rank != self.rank])
            parts = [f"a peer failed or hung (step collectives time out after {self.timeout_s:.0f} s); peers: {others}"]
        me = f"rank {self.rank} (node {self.info.node})"
        return PeerFailure(f"{me}: {what} failed: {'; '.join(parts)}: {type(exc).__name__}: {exc}")

    # --- collectives ------------------------------------------------------------------------------------------
    def all_reduce(
        self,
        models: list[list[torch.Tensor] | None],
        shapes: list[list[torch.Size]],
        counts: list[int],
        stop: bool,
        step: int,
        failing: bool = False,
    ) -> tuple[list[int], bool]:
        """Sum every model's gradients (``None``: this rank contributes zeros) and replica counts over the ranks,
        in place; returns the world's counts per model and whether any rank asked to stop. ``failing``: this
        rank is aborting (a thread failed, its agent died): the peers raise a PeerFailure naming it instead of
        taking it for a graceful stop."""
        sizes = [sum(s.numel() for s in model) for model in shapes]
        tail_len = len(models) + 1 + self.world_size  # counts, the stop flag, one failing flag per rank
        flat = torch.zeros(sum(sizes) + tail_len, dtype=torch.float32, device=self.device)
        offset = 0
        for grads, size in zip(models, sizes, strict=True):
            pos = offset
            for g in grads or []:
                flat[pos : pos + g.numel()].copy_(g.reshape(-1))
                pos += g.numel()
            offset += size
        flat[offset : offset + len(models)] = torch.tensor(counts, dtype=torch.float32)
        flat[offset + len(models)] = 1.0 if stop or failing else 0.0
        flat[offset + len(models) + 1 + self.rank] = 1.0 if failing else 0.0
        try:
            if self.device.type == "cuda":
                # The calling thread may be any drafter thread of the rank, with its own streams: sync the device.
                torch.cuda.synchronize(self.device)
                with torch.cuda.device(self.device):
                    dist.all_reduce(flat)
                    torch.cuda.current_stream().synchronize()
            else:
                dist.all_reduce(flat)
        except (RuntimeError, OSError, dist.DistBackendError) as exc:
            raise self.failure(f"gradient all-reduce of step {step}", exc) from exc
        tail = flat[offset:].tolist()
        failed = [r for r, flag in enumerate(tail[len(models) + 1 :]) if flag > 0.5 and r != self.rank]
        if failed and not failing:
            who = describe([self.peers[r] for r in failed])
            raise PeerFailure(
                f"rank {self.rank} (node {self.info.node}): peer {who} failed at step {step} and left the run "
                "(its own log says why)"
            )
        offset = 0
        written: dict[str, torch.device] = {}
        for grads, size in zip(models, sizes, strict=True):
            if grads is not None:
                pos = offset
                for g in grads:
                    g.copy_(flat[pos : pos + g.numel()].view_as(g))
                    pos += g.numel()
                    written.setdefault(str(g.device), g.device)
            offset += size
        for d in written.values():
            if d.type == "cuda":
                torch.cuda.synchronize(d)  # the owning threads read these on their own streams next
        return [round(c) for c in tail[: len(models)]], tail[len(models)] > 0.5

    def gather_positions(self, step: int, mine: dict[str, Any]) -> None:
        """Every rank's data positions after ``step``, kept for rank 0's checkpoint of that step."""
        table: list[Any] = [None] * self.world_size
        try:
            dist.all_gather_object(table, mine, group=self.cpu_group)
        except (RuntimeError, OSError, dist.DistBackendError) as exc:
            raise self.failure(f"data-position gather of step {step}", exc) from exc
        self.positions[step] = dict(enumerate(table))
        for old in sorted(self.positions)[:-4]:
            del self.positions[old]

    def broadcast(self, obj: Any, what: str) -> Any:
        """Rank 0's ``obj`` on every rank."""
        box = [obj if self.rank == 0 else None]
        try:
            dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        except (RuntimeError, OSError, dist.DistBackendError) as exc:
            raise self.failure(f"broadcast of {what}", exc) from exc
        return box[0]

    def barrier(self, what: str) -> None:
        try:
            dist.barrier(group=self.cpu_group)
        except (RuntimeError, OSError, dist.DistBackendError) as exc:
            raise self.failure(what, exc) from exc

    def close(self) -> bool:
        """Leave the process group after a clean run (a failed rank exits without it: peers may be gone). The
        heartbeat thread is joined first: a daemon thread still inside ``store.add`` when the interpreter finalizes
        is ended by pthread_exit in the binding's GIL re-acquire, which unwinds a noexcept C++ frame and aborts the
        process ("terminate called without an active exception", SIGABRT: torchrun then fails a finished run).
        False when it is still in that call after BEAT_STOP_S: the caller must then leave without finalizing."""
        self._closing.set()
        beat = self._beat_thread
        if beat is not None:
            beat.join(BEAT_STOP_S)
        dist.destroy_process_group()
        return beat is None or not beat.is_alive()


def start(info: RankInfo, drafter_devices: list[str], timeout_s: float, setup_timeout_s: float) -> CrossRank:
    """Join the torchrun world: NCCL when this rank's drafters are on CUDA (on the first drafter's GPU), else gloo."""
    return CrossRank(info, torch.device(drafter_devices[0]), timeout_s, setup_timeout_s)


def weights_digest(tensors: dict[str, torch.Tensor]) -> str:
    """A SHA-256 over a state dict's names and bytes: equal digests on two ranks mean equal weights."""
    import hashlib

    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().to("cpu").contiguous()
        h.update(name.encode())
        h.update(str(t.dtype).encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def reshard(positions: dict[int, dict[str, Any]], old_world: int, rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s ledger state in a world of ``world_size`` from the ledgers of a world of ``old_world``
    (each in its local indices, global = local * world + rank): resuming with another number of ranks trains
    exactly the global indices not trained yet."""
    old = {r: IndexLedger() for r in range(old_world)}
    for r, state in positions.items():
        old[r].restore(state)

    def done(g: int) -> bool:
        return old[g % old_world].is_done(g // old_world)

    # Every global index below `low` is trained; none above `high` is.
    low = min(old[r].watermark * old_world + r for r in old)
    high = max(max([old[r].watermark - 1, *old[r].state()["done"]]) * old_world + r for r in old)
    start = max(0, -(-(low - rank) // world_size))
    out = IndexLedger(watermark=start)
    local = start
    while local * world_size + rank <= high:
        if done(local * world_size + rank):
            out.mark(local)
        local += 1
    return out.state()
