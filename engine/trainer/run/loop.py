"""A training run (``TrainingRun``): builds target producers and drafter workers from a config, runs them,
watches them, stops them.

All in one process: one producer thread per target device, one worker thread per drafter device, bounded
queues between them, heartbeats and step metrics to events.jsonl, checkpoints periodically and on SIGTERM.
The parts are made by the factories in ``assembly``; the run calls them in order and owns what needs the
run's state (the torchrun world, the checkpoint resumed, failures, checkpoints).
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import IO, Any

import torch

from engine.protocol import VOCAB_COVERAGE_WARN, CheckpointEvent, RunEndEvent, StageEvent
from engine.trainer import checkpoint as ckpt
from engine.trainer.config import DRAFTER_FP8_OFF, HEAD_POSITIONS_TRAINED, TrainerConfig
from engine.trainer.data.dispatch import Dispatcher, IndexLedger
from engine.trainer.data.rows import LoadingStopped
from engine.trainer.data.sources import BatchSource, ConversationSource
from engine.trainer.data.vocab import DraftVocab, build_draft_vocab
from engine.trainer.draft.average import EMA_KEY
from engine.trainer.draft.model import DraftConfig, Drafter
from engine.trainer.run.assembly import (
    attention_impl,
    build_drafters,
    build_producers,
    check_drafter_fp8,
    configure_torch,
    data_source,
    devices_for,
    drafter_training,
    fp8_layouts,
    gradient_shapes,
    load_targets,
    model_ledgers,
    share_streams,
    shared_step,
)
from engine.trainer.run.dir_hold import hold_output_dir
from engine.trainer.run.distributed import AGENT_DEATH_SIGNAL, CrossRank, ShardedSource, reshard, weights_digest
from engine.trainer.run.distributed import start as start_distributed
from engine.trainer.run.fp8_check import check_fp8_targets
from engine.trainer.run.producer import DeviceBatch, Producer, Route
from engine.trainer.run.resume import Claim, claim, data_identity, data_plan, epoch_start
from engine.trainer.run.torchrun import RankInfo, rank_from_env
from engine.trainer.run.worker import DrafterTraining, DrafterWorker, ReplicaGroup, WorkerLinks, WorkerSettings
from engine.trainer.threads.compile import recompile_limit_for, set_recompile_limit
from engine.trainer.threads.control import CheckpointRounds, PeerFailure, ThreadControl, ThreadFailure
from engine.trainer.threads.health import HealthBoard
from engine.trainer.threads.metrics import EventLog, compile_listener, events_path_for
from engine.trainer.threads.queue import BoundedQueue
from engine.trainer.verifier.model import FrozenTarget, load_tokenizer

JOIN_TIMEOUT_S = 30.0
REPLICAS_CHECKPOINT = "replicas"


@dataclass
class ResumePoint:
    """Where a run starts: the draft vocabulary and, when resuming, the checkpoint's path, meta and drafter states
    (rank 0 reads it and broadcasts it, so the ranks need no shared filesystem)."""

    vocab: torch.Tensor  # the draft vocabulary's target ids (DraftVocab.draft_to_target)
    path: Path | None = None  # None: a fresh run
    meta: dict[str, Any] = field(default_factory=dict)
    states: dict[str, dict[str, Any]] = field(default_factory=dict)  # per model name; a drafter that died has none
    replan: bool = False  # the data plan changed (replan_data): the data position starts the checkpoint's epoch over


class TrainingRun:
    def __init__(self, cfg: TrainerConfig, events: EventLog | None = None, rank: RankInfo | None = None) -> None:
        self.cfg = cfg.validate()
        # Who this process is in a torchrun world; a plain process (or distributed = "off") is rank 0 of 1.
        self.info = rank if rank is not None else (rank_from_env() if cfg.distributed == "auto" else RankInfo())
        self.cross: CrossRank | None = None
        self.output_dir = Path(cfg.output_dir).expanduser().resolve()
        self.events = events if events is not None else EventLog(events_path_for(cfg.output_dir))
        self.health = HealthBoard(self.events, stall_after_s=cfg.stall_after_s, starve_after_s=cfg.starve_after_s)
        self.control = ThreadControl(self.events, self.health, cfg.on_thread_error)
        self.control.on_failure.append(self._on_failure)
        self.targets: list[FrozenTarget] = []
        self.producers: list[Producer] = []
        self.workers: list[DrafterWorker] = []
        self.queues: list[BoundedQueue[DeviceBatch]] = []
        self._ledgers: list[IndexLedger] = []  # the trained batch indices per drafter (replicas: one, shared)
        self.group: ReplicaGroup | None = None
        self.dispatcher: Dispatcher | None = None
        self.vocab: DraftVocab | None = None
        self.source: BatchSource | None = None
        self.resumed_from: Path | None = None
        self.claim: Claim | None = None  # rank 0's: this run's id in output_dir and the checkpoint it resumes
        self._dir_hold: IO[bytes] | None = None  # rank 0's hold on output_dir (run/dir_hold.py), for life
        self._data_plan: dict[str, Any] = {}  # recorded in each checkpoint (run/resume.py compares it on resume)
        self.last_checkpoint: Path | None = None  # the newest written (older ones are pruned: keep_checkpoints)
        self._ckpt_lock = threading.Lock()
        self.training_started_at: float | None = None
        self.exit_code: int | None = None
        # A thread is still inside a torch.distributed call: interpreter teardown would abort (SIGABRT), so the
        # process must leave with os._exit once its records are written.
        self.finalize_unsafe = False
        self._stop_seen: float | None = None
        self.progress = ckpt.ProgressRecord(self.output_dir)
        self._last_step_before = self.progress.last_recorded_step()  # read before this run's steps overwrite it
        if self.info.rank == 0:  # the ranks of a node share output_dir: rank 0 keeps the record
            self.events.listeners.append(self.progress.on_event)

    # --- building ---------------------------------------------------------------------------------------------
    def build(self) -> None:
        """Devices, the torchrun world, targets, data, vocabulary, drafters and their workers, producers: each
        from its factory in ``assembly``, in the order every rank follows (its barriers and broadcasts meet).
        Rank 0 holds output_dir from here to the end of ``shutdown`` (a build that fails lets it go)."""
        try:
            self._build()
        except BaseException:
            self.release_output_dir()
            raise

    def adopt_output_dir_hold(self, hold: IO[bytes]) -> None:
        """The hold on output_dir the command took before its first event (``__main__``): the build keeps it
        rather than opening the lock again (closing either file would drop this process's lock)."""
        self._dir_hold = hold

    def release_output_dir(self) -> None:
        """Lets another trainer use output_dir (the process's end does it too, however it ends)."""
        hold, self._dir_hold = self._dir_hold, None
        if hold is not None:
            hold.close()

    def _build(self) -> None:
        cfg = self.cfg
        if self.info.rank == 0:  # rank 0 resumes and writes checkpoints: it decides before anything loads
            if self._dir_hold is None:  # the command may have taken it already (adopt_output_dir_hold)
                self._dir_hold = hold_output_dir(self.output_dir)  # no second trainer in this output_dir meanwhile
            self.claim = claim(cfg, self.output_dir, should_stop=lambda: self._signalled)
            for line in self.claim.said:
                self.events.stage("checkpoint", line)
        configure_torch(cfg, self.events)
        tdevs, ddevs = devices_for(cfg, self.info)
        if self.info.launched:
            self.cross = self._start_distributed(tdevs, ddevs)
        set_recompile_limit(recompile_limit_for(cfg.ttt_steps, len(cfg.buckets), len(ddevs)))
        on_compile = compile_listener(self.events)
        attn_impl = attention_impl(cfg, ddevs)
        check_drafter_fp8(cfg, ddevs)
        tokenizer = load_tokenizer(cfg.target)
        self.targets = load_targets(cfg, tdevs, tokenizer, on_compile, self.events)
        self._stop_if_signalled("the target loaded")  # minutes for a large target: a stop then ends the run here
        self.source = self._load_data(tokenizer, self.targets[0].vocab_size)
        if self.info.rank == 0:  # the data file's hash is the data cache's, already computed
            self._data_plan = data_plan(cfg, data_identity(cfg, should_stop=lambda: self._signalled))
        resume = self._load_vocab(self.targets[0].vocab_size)
        self._ledgers = model_ledgers(cfg.drafter_mode, len(ddevs))
        drafters = self._build_drafters(ddevs)
        self.group = self._build_group(ddevs, gradient_shapes(cfg, drafters))
        models = {REPLICAS_CHECKPOINT} if cfg.drafter_mode == "replicas" else {f"drafter{r}" for r in range(len(ddevs))}
        self._rounds = CheckpointRounds(models, self._write_checkpoint)
        attention, step_fn = shared_step(cfg, ddevs, attn_impl, on_compile)
        layouts_fn = fp8_layouts(cfg, ddevs, on_compile)
        for rank, (dev, drafter) in enumerate(zip(ddevs, drafters, strict=True)):
            training = drafter_training(cfg, drafter, rank, dev, attention, step_fn, layouts_fn)
            worker = self._build_worker(rank, training)
            if resume.path is not None:
                self._restore(worker, resume)
            self.workers.append(worker)
        self.dispatcher = Dispatcher(self._ledgers, cfg.drafter_mode)
        routes = [Route(q, d) for q, d in zip(self.queues, ddevs, strict=True)]
        trained = max(ledger.trained for ledger in self._ledgers)
        assert self.vocab is not None
        rows_ttt = cfg.ttt_steps if cfg.head_positions == HEAD_POSITIONS_TRAINED else 0
        self.producers = build_producers(
            self.targets, self.source, routes, self.dispatcher, self.vocab, self.control, trained, rows_ttt
        )
        if cfg.cuda_streams == "per_device":
            share_streams(self.producers, self.workers)
        self._report_lost_steps()
        self._report_dropped_average(resume)
        self._stop_if_signalled("the drafters were built")  # before the FP8 check's forwards and the warm-up
        # before the evaluation, which may keep them
        check_fp8_targets(cfg, self.targets, self.vocab, self.source, self.events)
        self._install_evaluation()
        self._report_built(attn_impl)

    def _stop_if_signalled(self, while_: str) -> None:
        """A stop signal noted while the run was being built ends the build (LoadingStopped: exit 0, nothing trained
        and nothing to save), rather than after the compile warm-up that would come next. Not in a torchrun world:
        there the ranks agree on a stop at a step boundary (one rank leaving the build alone would hang the others)."""
        if self._signalled is not None and not self.info.launched:
            raise LoadingStopped(f"stopped ({self._signalled}) while {while_}")

    def stopped_while_building(self, exc: BaseException) -> str | None:
        """The reason to report when the build failed only because a peer rank left after a stop signal this rank
        was sent too (a torchrun-wide stop: the first rank on the node leaves its tokenizing at once while the
        others wait for its cache), so the run ends as stopped, not failed; None for any other failure."""
        if self._signalled is None or not isinstance(exc, PeerFailure):
            return None
        named = re.search(r"peer rank \d+ \([^)]*\)", str(exc))  # CrossRank.failure's way of naming the peer
        who = named.group(0) if named else "a peer rank"
        return f"stopped ({self._signalled}) while the run was built; {who} left first"

    def _start_distributed(self, tdevs: list[torch.device], ddevs: list[torch.device]) -> CrossRank:
        """Join the torchrun world; a ``distributed`` stage names this rank, its devices and its process."""
        t0 = time.perf_counter()
        cfg = self.cfg
        cross = start_distributed(self.info, [str(d) for d in ddevs], cfg.dist_timeout_s, cfg.dist_setup_timeout_s)
        detail = (
            f"rank {self.info.rank} of {self.info.world_size} (node {self.info.node}, local rank "
            f"{self.info.local_rank}) via {cross.backend} in {time.perf_counter() - t0:.1f} s; "
            f"drafters {[str(d) for d in ddevs]}, targets {[str(d) for d in tdevs]}"
        )
        # pid and local_rank let the agent map a rank to its process (torchrun starts each in its own session).
        self.events.emit(
            StageEvent(
                stage="distributed",
                detail=detail,
                pid=os.getpid(),
                local_rank=self.info.local_rank,
                local_world_size=self.info.local_world_size,
                backend=cross.backend,
            )
        )
        self.events.say(f"stage=distributed {detail}")
        return cross

    def _load_data(self, tokenizer: Any, target_vocab_size: int) -> BatchSource:
        """The training batches; the first rank of each node tokenizes (and caches) the data before the node's
        other ranks read the cache."""
        first_on_node = self.cross is None or self.info.local_rank == 0
        if not first_on_node and self.cross is not None:
            self.cross.barrier("waiting for the data cache of the node's first rank")
        source = data_source(
            self.cfg, tokenizer, target_vocab_size, self.output_dir, self.events, should_stop=lambda: self._signalled
        )
        if first_on_node and self.cross is not None:
            self.cross.barrier("the data cache of the node's first rank")
        return source

    def _load_vocab(self, target_vocab_size: int) -> ResumePoint:
        """The draft vocabulary (rank 0's: from the checkpoint resumed, or counted over the training set); then
        this rank's shard of the data. Returns what to resume from."""
        resume = self._resume_point(target_vocab_size)
        self.vocab = DraftVocab(resume.vocab)
        if resume.path is not None:
            self.resumed_from = resume.path
        if self.info.rank == 0:
            self._report_vocab(target_vocab_size, resume.path)
        if self.cross is not None:
            assert self.source is not None
            self.source = ShardedSource(self.source, self.info.rank, self.info.world_size)
        if self.cfg.vocab_sample_batches is not None:
            self.events.say(
                "warning: vocab_sample_batches is ignored: the draft vocabulary counts every training conversation"
            )
        return resume

    def _report_vocab(self, target_vocab_size: int, resumed: Path | None) -> None:
        """The draft vocabulary at stage ``data``: where it came from and, for conversations, the share of the
        trained tokens it holds (``vocab_coverage``), with a warning below VOCAB_COVERAGE_WARN."""
        assert self.vocab is not None and self.source is not None
        size = self.vocab.size
        where = (
            f"draft vocabulary: {size} token ids from {resumed.name}"
            if resumed is not None
            else f"draft vocabulary: the {size} most frequent token ids over the whole training set"
        )
        coverage = None
        if isinstance(self.source, ConversationSource):  # random tokens have no frequencies to cover
            coverage = self.vocab.coverage(self.source.token_counts(target_vocab_size))
        detail = where + (f"; it holds {coverage:.1%} of the trained tokens" if coverage is not None else "")
        self.events.emit(StageEvent(stage="data", detail=detail, vocab_coverage=coverage))
        self.events.say(f"stage=data {detail}")
        if coverage is not None and coverage < VOCAB_COVERAGE_WARN:
            self.events.say(
                f"warning: the draft vocabulary ({size} of the target's {target_vocab_size} ids) holds "
                f"{coverage:.1%} of the trained tokens, below {VOCAB_COVERAGE_WARN:.0%}: the drafter can never "
                "propose the rest (a larger draft_vocab_size holds more)"
            )

    def _build_drafters(self, ddevs: list[torch.device]) -> list[Drafter]:
        assert self.vocab is not None
        dcfg = DraftConfig.from_target(self.targets[0].config, self.vocab.size)
        return build_drafters(self.cfg, dcfg, ddevs, self.targets, self.vocab)

    def _build_group(self, ddevs: list[torch.device], shapes: list[list[torch.Size]]) -> ReplicaGroup | None:
        """Where the drafters' steps meet: None for one drafter training alone."""
        n = len(ddevs)
        if self.cross is not None:
            # In a torchrun world every step meets at the group (even one drafter), whose completing thread runs
            # the cross-rank all-reduce; independent drafters are each averaged with the same drafter elsewhere.
            return ReplicaGroup(
                list(range(n)),
                ddevs,
                lambda: self.control.stop_requested.is_set(),
                mode=self.cfg.drafter_mode,
                ledgers=dict(enumerate(self._ledgers)),
                cross=self.cross,
                shapes=shapes,
                after_round=self._after_round,
                failing=lambda: self.control.should_exit,
                on_wait=self._syncing,
            )
        if self.cfg.drafter_mode == "replicas" and n > 1:
            return ReplicaGroup(
                list(range(n)),
                ddevs,
                lambda: self.control.stop_requested.is_set(),
                self._ledgers[0],
                on_wait=self._syncing,
            )
        return None

    def _syncing(self, rank: int) -> None:
        """A drafter waiting for its peers at the gradient barrier (one may be evaluating, or a rank be slower):
        its heartbeat says so, so that only a thread that really stopped ages into a stall."""
        self.health.beat(f"drafter{rank}", state="syncing")

    def _build_worker(self, rank: int, training: DrafterTraining) -> DrafterWorker:
        """Drafter thread ``rank`` with its own bounded input queue."""
        cfg = self.cfg
        queue: BoundedQueue[DeviceBatch] = BoundedQueue(cfg.queue_size, name=f"queue{rank}")
        self.queues.append(queue)
        name = f"drafter{rank}"
        model = REPLICAS_CHECKPOINT if cfg.drafter_mode == "replicas" else name
        links = WorkerLinks(
            queue,
            self.control,
            self._ledgers[rank],
            self.group,
            # Rank 0 writes the world's checkpoints: the other ranks need not copy their states for it.
            submit_checkpoint=self._submit(model) if self.info.rank == 0 else None,
        )
        return DrafterWorker(name, rank, training, WorkerSettings.from_config(cfg), links)

    def _restore(self, worker: DrafterWorker, resume: ResumePoint) -> None:
        """Load a worker's model, optimizer, step and data position from the checkpoint resumed."""
        replicas = self.cfg.drafter_mode == "replicas"
        state_name = REPLICAS_CHECKPOINT if replicas else worker.name
        # A drafter that had died (policy continue) has no state: it starts afresh.
        state = resume.states.get(state_name)
        if state is None:
            return
        position = self._position_for(resume.meta, state_name, state)
        if resume.replan:
            position = self._epoch_start(resume.meta, state_name, state)
        if position is not None:
            state = {**state, "data_position": position}
        worker.restore_state(state)
        if replicas and "data_position" not in state:
            # Before the ledger, replica r trained indices r, r + n, ...: step s means all below s * n.
            worker.links.ledger.restore({"watermark": worker.step * len(self._ledgers)})

    def _report_dropped_average(self, resume: ResumePoint) -> None:
        """A checkpoint with a weight average resumed under ema_decay = 0: the average is not carried on (say so)."""
        if self.cfg.ema_decay > 0 or resume.path is None:
            return
        kept = [s[EMA_KEY] for s in resume.states.values() if isinstance(s.get(EMA_KEY), dict)]
        if kept:
            self.events.stage(
                "checkpoint",
                f"resumed from {resume.path.name}, which keeps a weight average (ema_decay {kept[0].get('decay')}); "
                "this run has ema_decay = 0: the average is dropped and export will serve the trained weights",
            )

    def _report_lost_steps(self) -> None:
        """A resumed run names the steps the previous run made after the checkpoint it resumes from."""
        if self.resumed_from is None:
            return
        ckpt_step, before = self.workers[0].step, self._last_step_before
        if before is not None and before > ckpt_step:
            self.events.stage(
                "checkpoint",
                f"resumed from {self.resumed_from.name}: lost {before - ckpt_step} step(s) since that checkpoint "
                f"(the previous run reached step {before})",
            )

    def _report_built(self, attn_impl: str) -> None:
        assert self.vocab is not None and self.source is not None
        cfg = self.cfg
        params_m = sum(p.numel() for p in self.workers[0].params) / 1e6
        latest = self.resumed_from
        resumed = f", resumed from {latest.name} at step {self.workers[0].step}" if latest is not None else ""
        self.events.say(
            f"engine: {len(self.targets)} target thread(s), "
            f"{len(self.workers)} drafter thread(s) ({cfg.drafter_mode}), drafter {params_m:.1f}M trainable params, "
            f"draft vocab {self.vocab.size}, attention {attn_impl}{' compiled' if cfg.compile else ''}"
            f"{f', drafter GEMMs FP8 {cfg.drafter_fp8}' if cfg.drafter_fp8 != DRAFTER_FP8_OFF else ''}, "
            f"data: {self.source.describe()}{resumed}"
        )

    def _install_evaluation(self) -> None:
        """eval_every > 0: acceptance length on held-out prompts every eval_every steps, per drafter (``eval``)."""
        from engine.trainer.serve.evaluate import EvalSubject, PeriodicEvaluation, heldout_prompts, rope_offset_of
        from engine.trainer.verifier.stops import target_stop_ids

        cfg = self.cfg
        if not cfg.eval_every:
            return
        target0 = self.targets[0]
        tok = target0.tokenizer
        prompts = heldout_prompts(tok, cfg.data, cfg.eval_holdout, cfg.seed, cfg.eval_conversations)
        workers = self.workers[:1] if cfg.drafter_mode == "replicas" else self.workers  # replicas: one drafter
        subjects = {
            w.name: EvalSubject(
                w.training.drafter,
                next((t for t in self.targets if t.device == w.training.device), target0),
                w.training.autocast_dtype,
                # ema_decay: the average is what export serves, so it is what is measured
                served=w.averaged_drafter if w.average is not None else None,
            )
            for w in workers
        }
        evaluation = PeriodicEvaluation(
            self.events,
            subjects,
            prompts,
            every=cfg.eval_every,
            k=cfg.eval_k,
            max_new_tokens=cfg.eval_max_new_tokens,
            eos_id=target_stop_ids(cfg.target, tok),
            rope_offset=rope_offset_of(cfg.to_dict()),
            beat=lambda name: self.health.beat(name, state="training"),
        )
        self.events.listeners.append(evaluation.on_event)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def _submit(self, name: str) -> Any:
        def submit(step: int, _thread: str, state: dict[str, Any]) -> None:
            self._rounds.submit(step, name, state)

        return submit

    def _resume_point(self, target_vocab_size: int) -> ResumePoint:
        """What rank 0 resumes from (the newest checkpoint in its output_dir: path, vocabulary, meta and drafter
        states) or, for a fresh run, its draft vocabulary; every rank gets rank 0's, so the ranks need no
        shared filesystem and agree on the vocabulary."""
        assert self.source is not None
        package: ResumePoint | None = None
        if self.info.rank == 0:
            latest = self.claim.checkpoint if self.claim is not None else None
            if latest is not None:
                meta = ckpt.read_meta(latest)
                states = {}
                for name in meta.get("drafters", []):
                    try:
                        states[name] = ckpt.load_drafter_state(latest, name)
                    except FileNotFoundError:
                        continue
                replan = self.claim is not None and self.claim.replan
                package = ResumePoint(ckpt.load_vocab(latest), latest, meta, states, replan=replan)
            else:
                draft_size = min(self.cfg.draft_vocab_size, target_vocab_size)
                vocab = build_draft_vocab(self.source, target_vocab_size, draft_size)
                package = ResumePoint(vocab.draft_to_target)
        if self.cross is not None:
            package = self.cross.broadcast(package, "the vocabulary and the checkpoint to resume from")
        assert package is not None
        return package

    @staticmethod
    def _known_positions(meta: dict[str, Any], name: str, state: dict[str, Any]) -> dict[int, dict[str, Any]]:
        """Model ``name``'s data position per rank of the world that wrote the checkpoint (those recorded)."""
        by_rank = meta.get("rank_positions")
        if by_rank:
            positions = {int(r): (p or {}).get(name) for r, p in by_rank.items()}
        else:
            positions = {0: state.get("data_position")}
        return {r: p for r, p in positions.items() if p is not None}

    def _epoch_start(self, meta: dict[str, Any], name: str, state: dict[str, Any]) -> dict[str, Any]:
        """replan_data: this rank's position at the start of the checkpoint's epoch under this run's data plan."""
        inner = getattr(self.source, "inner", self.source)  # a rank's ShardedSource wraps the whole data set
        bpe = getattr(inner, "batches_per_epoch", None)
        return epoch_start(
            self._known_positions(meta, name, state),
            int(meta.get("world_size") or 1),
            meta.get("batches_per_epoch"),
            bpe,
            self.info.rank,
            self.info.world_size,
        )

    def _position_for(self, meta: dict[str, Any], name: str, state: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's data position for model ``name`` from a checkpoint written by any number of ranks."""
        old_world = int(meta.get("world_size") or 1)
        known = self._known_positions(meta, name, state)
        if len(known) != old_world:
            return None  # an older checkpoint: the worker's own fallbacks apply
        if old_world == self.info.world_size:
            return known[self.info.rank]
        return reshard(known, old_world, self.info.rank, self.info.world_size)

    def _after_round(self, step: int, stop: bool) -> None:
        """After each cross-rank step: gather every rank's data position where rank 0 will write a checkpoint."""
        cfg = self.cfg
        if self.cross is None:
            return
        if stop or step >= cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0):
            self.cross.gather_positions(step, self._positions())

    def _positions(self) -> dict[str, Any]:
        if self.cfg.drafter_mode == "replicas":
            return {REPLICAS_CHECKPOINT: self._ledgers[0].state()}
        return {f"drafter{r}": ledger.state() for r, ledger in enumerate(self._ledgers)}

    def _write_checkpoint(self, step: int, states: dict[str, dict[str, Any]]) -> None:
        assert self.vocab is not None and self.source is not None
        if self.info.rank != 0:
            return  # rank 0 writes the world's checkpoints
        rank_positions: dict[int, Any] | None = None
        if self.cross is not None:
            rank_positions = self.cross.positions.get(step)
            if rank_positions is None:
                raise RuntimeError(f"no data positions were gathered from the ranks for step {step}")
        inner = getattr(self.source, "inner", self.source)
        meta = {
            "run_id": self.claim.run_id if self.claim is not None else None,
            "data_plan": self._data_plan,
            "batches_per_epoch": getattr(inner, "batches_per_epoch", None),
            "world_size": self.info.world_size,
            "rank_positions": rank_positions,
            "config": self.cfg.to_dict(),
            "mode": self.cfg.drafter_mode,
            "data": self.source.describe(),
            "data_position": {name: s.get("data_position") for name, s in states.items()},
            "draft_config": self.workers[0].training.drafter.cfg.to_dict(),
            # 0-based decoder layers whose output was captured = SGLang's eagle_aux_hidden_state_layer_ids;
            # vLLM's aux_hidden_state_layers are these + 1 (target.py).
            "target_layers": self.targets[0].layer_ids,
            "target_hf_config": self.targets[0].config.to_dict(),  # rope, max positions, architectures for export
        }
        with self._ckpt_lock:
            path = ckpt.save_checkpoint(
                self.output_dir,
                step,
                states,
                meta,
                self.vocab.draft_to_target,
                self.cfg.keep_checkpoints,
                run_id=self.claim.run_id if self.claim is not None else None,
            )
            self.last_checkpoint = path
        self.events.emit(CheckpointEvent(step=step, path=str(path)))
        self.events.say(f"checkpoint step={step} path={path}")

    # --- failures ---------------------------------------------------------------------------------------------
    def _on_failure(self, failure: ThreadFailure, continuing: bool) -> None:
        if not continuing:
            return
        if failure.role == "producer":
            # Its claimed batch went back to the dispatcher: the live producers take over its share.
            live = [p.name for p in self.producers if not p.failed and p.name != failure.thread]
            if not live:
                self.control.fail_run(f"every target thread failed (last: {failure.thread})")
            else:
                self.events.stage("training", f"degraded: {failure.thread} died; {len(live)} target thread(s) remain")
            return
        dead = next(w for w in self.workers if w.name == failure.thread)
        assert self.dispatcher is not None
        # Route nothing more to it, unblock producers waiting on its queue, and (replicas) give its batches back
        # so that a live replica trains them.
        self.dispatcher.retire(dead.rank)
        queue = self.queues[dead.rank]
        queue.close()
        left = queue.drain()
        if self.cfg.drafter_mode == "replicas":
            for batch in left:
                self.dispatcher.release(batch.index)
            for index in dead.held_indices():
                self.dispatcher.release(index)
        else:
            self._rounds.drop(failure.thread)
        alive = [w.name for w in self.workers if not w.failed and w.name != failure.thread]
        if not alive:
            self.control.fail_run(f"every drafter thread failed (last: {failure.thread})")
        else:
            self.events.stage("training", f"degraded: {failure.thread} died; {len(alive)} drafter(s) remain")

    # --- running ----------------------------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        self.events.say(f"stop requested ({reason}): stopping at the next step boundary")
        self.events.stage("stopping", reason)
        self.control.request_stop(reason)

    def install_signal_handlers(self) -> None:
        # The handlers only note the signal: they run on the main thread between two bytecodes, maybe while it holds
        # the event log's or an Event's lock (a second SIGTERM deadlocked there); the watch loop acts within 0.5 s.
        def on_signal(signum: int, _frame: FrameType | None) -> None:
            self._signalled = self._signalled or signal.Signals(signum).name

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        if self.info.launched:

            def on_parent_death(_signum: int, _frame: FrameType | None) -> None:
                self._parent_death_signalled = True

            signal.signal(AGENT_DEATH_SIGNAL, on_parent_death)

    _signalled: str | None = None  # the first stop signal's name, noted by its handler
    _parent_death_signalled = False

    def _take_signals(self) -> None:
        """Act on what the signal handlers noted (outside any handler, so taking locks is safe here)."""
        if self._signalled is not None and not self.control.stop_requested.is_set():
            self.request_stop(self._signalled)
        if self._parent_death_signalled:
            self._parent_death_signalled = False
            if self.cross is not None and self.cross.agent_gone():  # not a thread of the agent ending
                self._agent_lost()

    def _agent_lost(self) -> None:
        """This rank's torchrun agent died: fail at once, so that the peers' next step names this rank
        (rather than this rank agreeing to a stop that the peers' agents may be asking for meanwhile)."""
        who = f"rank {self.info.rank} (node {self.info.node})"
        self.control.fail_run(f"{who}: the torchrun agent that started it is gone")

    def start(self) -> None:
        for w in self.workers:
            w.start()
        for p in self.producers:
            p.start()

    def run(self) -> int:
        """Start the threads, watch them until the drafters are done, then stop, checkpoint and report."""
        self.start()
        interval = self.cfg.heartbeat_interval_s
        next_beat = 0.0
        while True:
            self._take_signals()
            live = [w for w in self.workers if not w.finished.is_set()]
            if not live or self.control.should_exit:
                break
            if self._stop_seen is None and self.control.stop_requested.is_set():
                self._stop_seen = time.monotonic()
            if self._stop_seen is not None and time.monotonic() - self._stop_seen > self.cfg.stop_grace_s:
                self.events.say(f"threads still busy {self.cfg.stop_grace_s:.0f} s after the stop request; stacks:")
                faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
                self.control.fail_run(f"threads did not reach a step boundary within {self.cfg.stop_grace_s:.0f} s")
                break
            if self.cross is not None and self.cross.agent_gone():
                self._agent_lost()
                break
            self.control.wake.wait(min(interval, 0.5))
            self.control.wake.clear()
            if self.training_started_at is None and all(w.warm.is_set() for w in self.workers):
                self.training_started_at = time.time()
                warm = ", ".join(f"{w.name} {w.warmup_s or 0:.1f}s" for w in self.workers)
                self.events.stage("training", f"all drafters warm ({warm})")
            now = time.monotonic()
            if now >= next_beat:
                for thread, flag in self.health.publish():
                    self.events.say(f"warning: thread {thread} is {flag}")
                next_beat = now + interval
        return self.shutdown()

    def shutdown(self) -> int:
        self.control.producers_stop.set()
        for q in self.queues:
            q.close()
        deadline = time.monotonic() + (5.0 if self.control.should_exit else JOIN_TIMEOUT_S)
        for t in [w.thread for w in self.workers] + [p.thread for p in self.producers]:
            if t.is_alive():
                t.join(max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in [w.thread for w in self.workers] + [p.thread for p in self.producers] if t.is_alive()]
        step = max((w.step for w in self.workers), default=0)
        ok = not self.control.should_exit and not stuck
        if ok:
            states = self._final_states()
            if states and self.info.rank == 0:
                self.events.stage("checkpoint", f"final checkpoint at step {step}")
                self._write_checkpoint(step, states)
        self.health.publish()
        reason = (
            self.control.abort_reason
            or (f"threads did not stop: {', '.join(stuck)}" if stuck else None)
            or self.control.stop_reason
            or "steps done"
        )
        degraded = [f.thread for f in self.control.failures]
        if ok:
            self._write_rank_record(step)
        if ok and self.cross is not None:
            self.finalize_unsafe = not self.cross.close()
        self.events.emit(RunEndEvent(ok=ok, reason=reason, step=step, degraded=degraded))
        self.events.stage("done", reason)
        self.exit_code = 0 if ok else 1
        if not stuck:  # a stuck thread may still write a checkpoint: the directory stays held until the process ends
            self.release_output_dir()
        return self.exit_code

    def _write_rank_record(self, step: int) -> None:
        """<output_dir>/ranks/rank<R>.json: this rank's step, a digest of each drafter's weights and its data
        position, so equal weights and disjoint data across ranks are checked, not assumed."""
        record = {
            "rank": self.info.rank,
            "world_size": self.info.world_size,
            "node": self.info.node,
            "step": step,
            "devices": [str(w.training.device) for w in self.workers],
            "weights_sha256": {
                w.name: weights_digest(w.training.drafter.state_dict()) for w in self.workers if not w.failed
            },
            "data_position": self._positions(),
        }
        path = self.output_dir / "ranks" / f"rank{self.info.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(record, indent=1), encoding="utf-8")
        os.replace(tmp, path)

    def _final_states(self) -> dict[str, dict[str, Any]]:
        good = [w for w in self.workers if not w.failed and w.final_state is not None]
        if not good:
            return {}
        if self.cfg.drafter_mode == "replicas":
            return {REPLICAS_CHECKPOINT: good[0].final_state or {}}
        return {w.name: w.final_state or {} for w in good}
