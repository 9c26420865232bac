"""The engine: builds target producers and drafter workers from a config, runs them, watches them, stops them.

All in one process: one producer thread per target device, one worker thread per drafter device, bounded
queues between them, heartbeats and step metrics to events.jsonl, checkpoints periodically and on SIGTERM.
"""

from __future__ import annotations

import faulthandler
import json
import math
import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import torch

from engine.trainer import checkpoint as ckpt
from engine.trainer.compile import GuardedFunction, recompile_limit_for, set_guard_enabled, set_recompile_limit
from engine.trainer.config import DATA_RANDOM, DATA_SHIPPED, EngineConfig
from engine.trainer.control import CheckpointRounds, RunControl, ThreadFailure
from engine.trainer.data import BatchSource, ConversationSource, RandomTokenSource, shipped_corpus_path
from engine.trainer.dispatch import Dispatcher, IndexLedger
from engine.trainer.distributed import (
    AGENT_DEATH_SIGNAL,
    CrossRank,
    ShardedSource,
    map_devices,
    reshard,
    weights_digest,
)
from engine.trainer.distributed import start as start_distributed
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.model import DraftConfig, Drafter, ttt_step
from engine.trainer.health import HealthBoard
from engine.trainer.launch import RankInfo, rank_from_env
from engine.trainer.loss import loss_function
from engine.trainer.metrics import EventLog, compile_listener, events_path_for
from engine.trainer.producer import DeviceBatch, Producer, Route
from engine.trainer.queue import BoundedQueue
from engine.trainer.target import Target, load_target, load_tokenizer
from engine.trainer.vocab import DraftVocab, build_draft_vocab
from engine.trainer.worker import DrafterWorker, ReplicaGroup

JOIN_TIMEOUT_S = 30.0
REPLICAS_CHECKPOINT = "replicas"


def lr_lambda(cfg: EngineConfig) -> Any:
    def fn(step: int) -> float:
        if cfg.warmup_steps and step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, cfg.steps - cfg.warmup_steps)
        frac = min(1.0, (step - cfg.warmup_steps) / span)
        if cfg.schedule == "linear":
            return max(0.0, 1.0 - frac)
        return 0.5 * (1.0 + math.cos(math.pi * frac))

    return fn


FP8_NOTE = " (FP8 linears)"  # the target_loaded stage names an FP8 target


class Engine:
    def __init__(self, cfg: EngineConfig, events: EventLog | None = None, rank: RankInfo | None = None) -> None:
        self.cfg = cfg.validate()
        # Who this process is in a torchrun world; a plain process (or distributed = "off") is rank 0 of 1.
        self.info = rank if rank is not None else (rank_from_env() if cfg.distributed == "auto" else RankInfo())
        self.cross: CrossRank | None = None
        self.output_dir = Path(cfg.output_dir).expanduser().resolve()
        self.events = events if events is not None else EventLog(events_path_for(cfg.output_dir))
        self.health = HealthBoard(self.events, stall_after_s=cfg.stall_after_s, starve_after_s=cfg.starve_after_s)
        self.control = RunControl(self.events, self.health, cfg.on_thread_error)
        self.control.on_failure.append(self._on_failure)
        self.targets: list[Target] = []
        self.producers: list[Producer] = []
        self.workers: list[DrafterWorker] = []
        self.queues: list[BoundedQueue[DeviceBatch]] = []
        self.group: ReplicaGroup | None = None
        self.dispatcher: Dispatcher | None = None
        self.vocab: DraftVocab | None = None
        self.source: BatchSource | None = None
        self.resumed_from: Path | None = None
        self.checkpoints: list[Path] = []
        self._ckpt_lock = threading.Lock()
        self.training_started_at: float | None = None
        self.exit_code: int | None = None
        self._stop_seen: float | None = None
        self.progress = ckpt.ProgressRecord(self.output_dir)
        self._last_step_before = self.progress.last_recorded_step()  # read before this run's steps overwrite it
        if self.info.rank == 0:  # the ranks of a node share output_dir: rank 0 keeps the record
            self.events.listeners.append(self.progress.on_event)

    # --- building ---------------------------------------------------------------------------------------------
    def _dtypes(self, device: torch.device) -> tuple[torch.dtype, torch.dtype | None]:
        """(target dtype, autocast dtype) for a device."""
        if self.cfg.dtype == "float32":
            return torch.float32, None
        if device.type == "cuda" or self.cfg.dtype == "bfloat16":
            return torch.bfloat16, torch.bfloat16
        return torch.float32, None

    def build(self) -> None:
        cfg = self.cfg
        if cfg.torch_threads:
            torch.set_num_threads(cfg.torch_threads)
        set_guard_enabled(cfg.compile_guard)
        if not cfg.compile_guard:
            self.events.say("warning: compile guard DISABLED (control experiment): threads may compile concurrently")
        tdevs = [torch.device(d) for d in map_devices(cfg.target_devices, self.info)]
        ddevs = [torch.device(d) for d in map_devices(cfg.drafter_devices, self.info)]
        if any(d.type == "cuda" for d in tdevs + ddevs) and not torch.cuda.is_available():
            raise RuntimeError("the config names CUDA devices but torch.cuda.is_available() is False")
        for d in tdevs + ddevs:
            if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
                raise RuntimeError(
                    f"rank {self.info.rank} (local rank {self.info.local_rank}) maps to {d}, but this node has "
                    f"{torch.cuda.device_count()} GPU(s): lower nproc_per_node or name fewer devices per rank"
                )
        if self.info.launched:
            t0 = time.perf_counter()
            self.cross = start_distributed(
                self.info, [str(d) for d in ddevs], cfg.dist_timeout_s, cfg.dist_setup_timeout_s
            )
            detail = (
                f"rank {self.info.rank} of {self.info.world_size} (node {self.info.node}, local rank "
                f"{self.info.local_rank}) via {self.cross.backend} in {time.perf_counter() - t0:.1f} s; "
                f"drafters {[str(d) for d in ddevs]}, targets {[str(d) for d in tdevs]}"
            )
            # pid and local_rank let the agent map a rank to its process (torchrun starts each in its own session).
            self.events.emit(
                "stage",
                stage="distributed",
                thread=None,
                detail=detail,
                pid=os.getpid(),
                local_rank=self.info.local_rank,
                local_world_size=self.info.local_world_size,
                backend=self.cross.backend,
            )
            self.events.say(f"stage=distributed {detail}")
        set_recompile_limit(recompile_limit_for(cfg.ttt_steps, len(cfg.buckets), len(ddevs)))
        on_compile = compile_listener(self.events)
        attn_impl = cfg.attention if cfg.attention != "auto" else ("flex" if ddevs[0].type == "cuda" else "sdpa")
        if attn_impl == "flex" and any(d.type == "cpu" for d in ddevs):
            raise RuntimeError("attention = 'flex' needs CUDA drafters (flex_attention has no CPU backward)")

        tokenizer = load_tokenizer(cfg.target)
        for i, dev in enumerate(tdevs):
            t0 = time.perf_counter()
            tdtype, _ = self._dtypes(dev)
            target = load_target(
                cfg.target,
                dev,
                tokenizer=tokenizer,
                layer_ids=cfg.target_layers,
                seed=cfg.seed,
                dtype=tdtype,
                tiny_hidden=cfg.tiny_hidden,
                tiny_layers=cfg.tiny_layers,
                fp8=cfg.target_fp8,
            )
            if cfg.compile and cfg.compile_target and dev.type == "cuda":
                target.compile()
            for fn in target.compiled_functions():
                fn.listeners.append(on_compile)
            self.targets.append(target)
            self.events.stage(
                "target_loaded",
                f"target{i} {cfg.target} on {dev}{FP8_NOTE if cfg.target_fp8 else ''} layers {target.layer_ids} "
                f"in {time.perf_counter() - t0:.1f} s",
            )
        target0 = self.targets[0]

        # The first rank of each node tokenizes (and caches) the data before the node's other ranks read the cache.
        first_on_node = self.cross is None or self.info.local_rank == 0
        if not first_on_node and self.cross is not None:
            self.cross.barrier("waiting for the data cache of the node's first rank")
        if cfg.data == DATA_RANDOM or tokenizer is None:
            self.source = RandomTokenSource(
                target0.vocab_size, buckets=cfg.buckets, batch_size=cfg.batch_size, seed=cfg.seed
            )
        else:
            path = shipped_corpus_path() if cfg.data == DATA_SHIPPED else Path(cfg.data).expanduser()
            cache_dir = Path(cfg.data_cache_dir).expanduser() if cfg.data_cache_dir else self.output_dir / "data_cache"
            source = ConversationSource(
                tokenizer,
                path,
                buckets=cfg.buckets,
                batch_size=cfg.batch_size,
                seed=cfg.seed,
                eval_holdout=cfg.eval_holdout,
                cache_dir=cache_dir,
                progress=lambda text: self.events.stage("data", text),
            )
            self.source = source
            self._report_data(source)
        if first_on_node and self.cross is not None:
            self.cross.barrier("the data cache of the node's first rank")

        resume = self._resume_package(target0.vocab_size)
        latest = Path(resume["path"]) if resume["path"] is not None else None
        self.vocab = DraftVocab(resume["vocab"])
        if latest is not None:
            self.resumed_from = latest
        elif self.info.rank == 0:
            self.events.stage(
                "data", f"draft vocabulary: the {self.vocab.size} most frequent token ids over the whole training set"
            )
        if self.cross is not None:
            self.source = ShardedSource(self.source, self.info.rank, self.info.world_size)
        if cfg.vocab_sample_batches is not None:
            self.events.say(
                "warning: vocab_sample_batches is ignored: the draft vocabulary counts every training conversation"
            )
        dcfg = DraftConfig.from_target(target0.config, self.vocab.size)

        n = len(ddevs)
        replicas = cfg.drafter_mode == "replicas"
        # The trained batch indices per model: replicas train one model (one ledger), independent drafters one each.
        shared = IndexLedger()
        ledgers = [shared] * n if replicas else [IndexLedger() for _ in range(n)]
        self._ledgers = ledgers
        shapes: list[list[torch.Size]] = []  # the gradients' shapes per model, filled as the drafters are built
        if self.cross is not None:
            # In a torchrun world every step meets at the group (even one drafter), whose completing thread runs
            # the cross-rank all-reduce; independent drafters are each averaged with the same drafter elsewhere.
            self.group = ReplicaGroup(
                list(range(n)),
                ddevs,
                lambda: self.control.stop_requested.is_set(),
                mode=cfg.drafter_mode,
                ledgers=dict(enumerate(ledgers)),
                cross=self.cross,
                shapes=shapes,
                after_round=self._after_round,
                failing=lambda: self.control.should_exit,
            )
        elif replicas and n > 1:
            self.group = ReplicaGroup(list(range(n)), ddevs, lambda: self.control.stop_requested.is_set(), shared)
        rounds = CheckpointRounds(
            {REPLICAS_CHECKPOINT} if replicas else {f"drafter{r}" for r in range(n)}, self._write_checkpoint
        )
        self._rounds = rounds
        first: Drafter | None = None
        # One compiled attention and loss for all workers: compiled once (under the guard), then shared.
        compiled = cfg.compile and ddevs[0].type == "cuda"
        attention = TTTAttention(attn_impl, compiled=compiled)
        step_fn = GuardedFunction(ttt_step, compiled=compiled, name="ttt_step")
        for fn in [step_fn, *attention.compiled_functions()]:
            fn.listeners.append(on_compile)
        writes = self.info.rank == 0
        for rank, dev in enumerate(ddevs):
            embed = next((t.embed_weight() for t in self.targets if t.device == dev), None)
            if embed is None:
                embed = target0.embed_weight().to(dev)
            seed = cfg.seed if replicas else cfg.seed + rank
            with torch.random.fork_rng(devices=[]), torch.device(dev):
                torch.manual_seed(seed + 7919)
                drafter = Drafter(
                    dcfg, embed, self.vocab.draft_to_target.to(dev), ttt_rope_offset=cfg.ttt_rope_offset
                )
            if replicas and first is not None:
                drafter.load_state_dict(first.state_dict())
            first = first or drafter
            if not replicas or rank == 0:
                shapes.append([p.shape for p in drafter.trainable_parameters()])
            params = drafter.trainable_parameters()
            optimizer = torch.optim.AdamW(
                params,
                lr=float(cfg.drafter_lrs[rank]) if cfg.drafter_lrs else cfg.lr,
                betas=(0.9, 0.95),
                weight_decay=cfg.weight_decay,
                **({"fused": True} if dev.type == "cuda" else {}),
            )
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg))
            queue: BoundedQueue[DeviceBatch] = BoundedQueue(cfg.queue_size, name=f"queue{rank}")
            self.queues.append(queue)
            tdtype, autocast = self._dtypes(dev)
            name = f"drafter{rank}"
            worker = DrafterWorker(
                name,
                rank,
                drafter,
                dev,
                queue,
                optimizer=optimizer,
                scheduler=scheduler,
                attention=attention,
                step_fn=step_fn,
                control=self.control,
                ttt_steps=cfg.ttt_steps,
                total_steps=cfg.steps,
                buckets=cfg.buckets,
                batch_size=cfg.batch_size,
                hidden_dtype=tdtype,
                autocast_dtype=autocast,
                compile_step=compiled,
                grad_checkpointing=cfg.grad_checkpointing,
                max_grad_norm=cfg.max_grad_norm,
                log_every=cfg.log_every,
                checkpoint_every=cfg.checkpoint_every,
                group=self.group,
                ledger=ledgers[rank],
                # Rank 0 writes the world's checkpoints: the other ranks need not copy their states for it.
                submit_checkpoint=self._submit(REPLICAS_CHECKPOINT if replicas else name) if writes else None,
                step_delay_s=cfg.step_delay_s,
                loss_fn=loss_function(cfg.loss_mean),
            )
            if latest is not None:
                state_name = REPLICAS_CHECKPOINT if replicas else name
                # A drafter that had died (policy continue) has no state: it starts afresh.
                state: dict[str, Any] | None = resume["states"].get(state_name)
                if state is not None:
                    position = self._position_for(resume["meta"], state_name, state)
                    if position is not None:
                        state = {**state, "data_position": position}
                    worker.restore_state(state)
                    if replicas and "data_position" not in state:
                        # Before the ledger, replica r trained indices r, r + n, ...: step s means all below s * n.
                        worker.ledger.restore({"watermark": worker.step * n})
            self.workers.append(worker)

        self.dispatcher = Dispatcher(ledgers, cfg.drafter_mode)
        routes = [Route(q, d) for q, d in zip(self.queues, ddevs, strict=True)]
        trained = max(ledger.trained for ledger in ledgers)
        n_targets = len(self.targets)
        for p, target in enumerate(self.targets):
            _, autocast = self._dtypes(target.device)
            self.producers.append(
                Producer(
                    f"target{p}",
                    target,
                    self.source,
                    routes,
                    self.dispatcher,
                    # The batches this producer would have made so far had the run not stopped.
                    start_batches=trained // n_targets + (1 if p < trained % n_targets else 0),
                    draft_ids=self.vocab.draft_to_target,
                    t2d=self.vocab.t2d(target.vocab_size),
                    control=self.control,
                    autocast_dtype=None,
                )
            )
        if cfg.cuda_streams == "per_device":
            streams: dict[str, Any] = {}
            for thread_dev, obj in [(p.target.device, p) for p in self.producers] + [
                (w.device, w) for w in self.workers
            ]:
                if thread_dev.type == "cuda":
                    obj.stream = streams.setdefault(str(thread_dev), torch.cuda.Stream(thread_dev))
        params_m = sum(p.numel() for p in self.workers[0].params) / 1e6
        resumed = f", resumed from {latest.name} at step {self.workers[0].step}" if latest is not None else ""
        if latest is not None:
            ckpt_step, before = self.workers[0].step, self._last_step_before
            if before is not None and before > ckpt_step:
                self.events.stage(
                    "checkpoint",
                    f"resumed from {latest.name}: lost {before - ckpt_step} step(s) since that checkpoint "
                    f"(the previous run reached step {before})",
                )
        self._install_evaluation()
        self.events.say(
            f"engine: {len(self.targets)} target thread(s), {n} drafter thread(s) ({cfg.drafter_mode}), "
            f"drafter {params_m:.1f}M trainable params, draft vocab {self.vocab.size}, attention {attn_impl}"
            f"{' compiled' if cfg.compile else ''}, data: {self.source.describe()}{resumed}"
        )

    def _report_data(self, source: ConversationSource) -> None:
        """Every conversation not trained on is counted, with its reason: an event and a log line."""
        skipped = dict(sorted(source.skipped.items()))
        total = sum(skipped.values())
        detail = (
            f"{source.examples} conversations to train on, {len(source.heldout_indices)} held out, "
            f"{total} skipped" + (f" ({', '.join(f'{k}: {v}' for k, v in skipped.items())})" if total else "")
            + (f", {source.corpus.truncated} cut to {source.buckets[-1]} tokens" if source.corpus.truncated else "")
        )
        self.events.emit(
            "stage",
            stage="data",
            thread=None,
            detail=detail,
            skipped=skipped,
            heldout=len(source.heldout_indices),
            truncated=source.corpus.truncated,
            cached=source.cache_hit,
        )
        self.events.say(f"stage=data {detail}")

    def _install_evaluation(self) -> None:
        """eval_every > 0: acceptance length on held-out prompts every eval_every steps, per drafter (``eval``)."""
        from engine.trainer.evaluate import EvalSubject, PeriodicEvaluation, heldout_prompts, rope_offset_of

        cfg = self.cfg
        if not cfg.eval_every:
            return
        target0 = self.targets[0]
        tok = target0.tokenizer
        prompts = heldout_prompts(tok, cfg.data, cfg.eval_holdout, cfg.seed, cfg.eval_conversations)
        workers = self.workers[:1] if cfg.drafter_mode == "replicas" else self.workers  # replicas: one drafter
        subjects = {
            w.name: EvalSubject(
                w.drafter, next((t for t in self.targets if t.device == w.device), target0), w.autocast_dtype
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
            eos_id=getattr(tok, "eos_token_id", None),
            rope_offset=rope_offset_of(cfg.to_dict()),
            beat=lambda name: self.health.beat(name, state="training"),
        )
        self.events.listeners.append(evaluation.on_event)

    # --- checkpoints ------------------------------------------------------------------------------------------
    def _submit(self, name: str) -> Any:
        def submit(step: int, _thread: str, state: dict[str, Any]) -> None:
            self._rounds.submit(step, name, state)

        return submit

    def _resume_package(self, target_vocab_size: int) -> dict[str, Any]:
        """What rank 0 resumes from (the newest checkpoint in its output_dir: path, vocabulary, meta and drafter
        states) or, for a fresh run, its draft vocabulary; every rank gets rank 0's, so the ranks need no
        shared filesystem and agree on the vocabulary."""
        assert self.source is not None
        package: dict[str, Any] | None = None
        if self.info.rank == 0:
            latest = ckpt.latest_checkpoint(self.output_dir) if self.cfg.resume else None
            if latest is not None:
                meta = ckpt.read_meta(latest)
                states = {}
                for name in meta.get("drafters", []):
                    try:
                        states[name] = ckpt.load_drafter_state(latest, name)
                    except FileNotFoundError:
                        continue
                package = {"path": str(latest), "vocab": ckpt.load_vocab(latest), "meta": meta, "states": states}
            else:
                draft_size = min(self.cfg.draft_vocab_size, target_vocab_size)
                vocab = build_draft_vocab(self.source, target_vocab_size, draft_size)
                package = {"path": None, "vocab": vocab.draft_to_target, "meta": {}, "states": {}}
        if self.cross is not None:
            package = self.cross.broadcast(package, "the vocabulary and the checkpoint to resume from")
        assert package is not None
        return package

    def _position_for(self, meta: dict[str, Any], name: str, state: dict[str, Any]) -> dict[str, Any] | None:
        """This rank's data position for model ``name`` from a checkpoint written by any number of ranks."""
        old_world = int(meta.get("world_size") or 1)
        by_rank = meta.get("rank_positions")
        if by_rank:
            positions = {int(r): (p or {}).get(name) for r, p in by_rank.items()}
        else:
            positions = {0: state.get("data_position")}
        known = {r: p for r, p in positions.items() if p is not None}
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
        meta = {
            "world_size": self.info.world_size,
            "rank_positions": rank_positions,
            "config": self.cfg.to_dict(),
            "mode": self.cfg.drafter_mode,
            "data": self.source.describe(),
            "data_position": {name: s.get("data_position") for name, s in states.items()},
            "draft_config": self.workers[0].drafter.cfg.to_dict(),
            # 0-based decoder layers whose output was captured = SGLang's eagle_aux_hidden_state_layer_ids;
            # vLLM's aux_hidden_state_layers are these + 1 (target.py).
            "target_layers": self.targets[0].layer_ids,
            "target_hf_config": self.targets[0].config.to_dict(),  # rope, max positions, architectures for export
        }
        with self._ckpt_lock:
            path = ckpt.save_checkpoint(
                self.output_dir, step, states, meta, self.vocab.draft_to_target, self.cfg.keep_checkpoints
            )
            self.checkpoints.append(path)
        self.events.emit("checkpoint", step=step, path=str(path))
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
            if dead.current_index is not None:
                self.dispatcher.release(dead.current_index)
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
            self.cross.close()
        self.events.emit("run_end", ok=ok, reason=reason, step=step, degraded=degraded)
        self.events.stage("done", reason)
        self.exit_code = 0 if ok else 1
        return self.exit_code

    def _write_rank_record(self, step: int) -> None:
        """<output_dir>/ranks/rank<R>.json: this rank's step, a digest of each drafter's weights and its data
        position, so equal weights and disjoint data across ranks are checked, not assumed."""
        record = {
            "rank": self.info.rank,
            "world_size": self.info.world_size,
            "node": self.info.node,
            "step": step,
            "devices": [str(w.device) for w in self.workers],
            "weights_sha256": {w.name: weights_digest(w.drafter.state_dict()) for w in self.workers if not w.failed},
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
