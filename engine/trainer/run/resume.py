"""Who may use an output directory, and what a resume may take from a checkpoint (rank 0 decides, at the start).

While a trainer runs, its output_dir is held (``dir_hold.hold_output_dir``): a second trainer started there, at the same
moment or later, is refused in one line instead of claiming or resuming what the first is still writing.

An output_dir belongs to one run: its ``run.json`` (checkpoint.py) holds the run's id and identity, the keys that
make a drafter another model (``IDENTITY_KEYS``). ``claim`` decides:

- no checkpoint there: a new run, with a new id;
- checkpoints of a run with this identity, and ``resume = true``: that run goes on from its newest (a restart);
- checkpoints of a run with another identity, or any checkpoint under ``resume = false``: refused in one line.
  Before, the other run was resumed (and exported), or the new run's checkpoints were pruned against the other
  run's higher step numbers as soon as they were written;
- ``resume_from``: that checkpoint (or an output directory's newest) is taken on purpose, another run's too,
  into an output_dir that holds nothing newer; once this run has checkpoints of its own, a restart resumes them.

A resume compares the data plan (``data_plan``: the data file's sha256, packing, batch_size, seed, buckets, the
held-out split) with the checkpoint's: batch indices mean other conversations under another plan, so some would
be trained twice in the epoch and others not at all. It is refused naming the keys that differ, or with
``replan_data = true`` the run starts the checkpoint's epoch over under the new plan (``epoch_start``).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.trainer import checkpoint as ckpt
from engine.trainer.config import DATA_RANDOM, DATA_SHIPPED, TOKENIZERLESS_TARGETS, ConfigError, TrainerConfig
from engine.trainer.data.cache import file_sha256
from engine.trainer.data.sources import shipped_corpus_path

# A checkpoint trained under other values of these is another model: resuming it would be resuming another run.
IDENTITY_KEYS = ("target", "target_layers", "drafter_mode", "draft_vocab_size")
TINY_KEYS = ("tiny_hidden", "tiny_layers")  # the built-in random target's shape
# What a resume_from taken on purpose must share (the rest may change on purpose: fine-tuning for another target):
# other drafter states or another draft vocabulary cannot be loaded at all.
LOADABLE_KEYS = ("drafter_mode", "draft_vocab_size")
PLAN_KEYS = ("packing", "batch_size", "seed", "buckets", "eval_holdout")


def run_identity(config: dict[str, Any]) -> dict[str, Any]:
    """The identity keys of a config (a TrainerConfig's to_dict, or a checkpoint meta's ``config``)."""
    keys = IDENTITY_KEYS + (TINY_KEYS if config.get("target") == "tiny" else ())
    return {k: config.get(k) for k in keys}


def data_identity(cfg: TrainerConfig, should_stop: Callable[[], str | None] | None = None) -> str:
    """What the batches are made from: "random", or the conversation file's sha256 (where it lives may change)."""
    if cfg.data == DATA_RANDOM or cfg.target in TOKENIZERLESS_TARGETS:
        return DATA_RANDOM
    path = shipped_corpus_path() if cfg.data == DATA_SHIPPED else Path(cfg.data).expanduser()
    return "sha256:" + file_sha256(path, should_stop)


def data_plan(cfg: TrainerConfig, data: str) -> dict[str, Any]:
    """What decides which conversations batch index i holds (the checkpoint's data position counts indices)."""
    return {"data": data, **{k: getattr(cfg, k) for k in PLAN_KEYS}}


def plan_of(meta: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's data plan; for a checkpoint older than the record, what its config says of it."""
    plan = meta.get("data_plan")
    if isinstance(plan, dict):
        return plan
    config = config_of(meta)
    return {k: config[k] for k in PLAN_KEYS if k in config}


def config_of(meta: dict[str, Any]) -> dict[str, Any]:
    """The config a checkpoint was trained with (empty where its meta has none)."""
    config = meta.get("config")
    return config if isinstance(config, dict) else {}


def _shown(value: Any) -> str:
    text = json.dumps(value) if not isinstance(value, str) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def differences(there: dict[str, Any], here: dict[str, Any], keys: tuple[str, ...] | None = None) -> list[str]:
    """``key: <there> there, <here> here`` for each key both hold with different values."""
    return [
        f"{k}: {_shown(there[k])} there, {_shown(here[k])} here"
        for k in (keys if keys is not None else tuple(here))
        if k in there and k in here and there[k] != here[k]
    ]


@dataclass
class Claim:
    """Rank 0's decision for this run: its id, the checkpoint it resumes (None: it starts afresh), whether that
    checkpoint's data position is re-planned, and lines to say."""

    run_id: str
    checkpoint: Path | None = None
    replan: bool = False
    said: list[str] = field(default_factory=list)
    adopted_unmarked: bool = False  # the checkpoints there without a run id (an older version's) are this run's


def _step(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


def claim(cfg: TrainerConfig, output_dir: Path, should_stop: Callable[[], str | None] | None = None) -> Claim:
    """Who this run is in ``output_dir`` and what it resumes (see the module's words); writes run.json.
    ConfigError in one line when it may not use the directory as asked."""
    identity = run_identity(cfg.to_dict())
    found = ckpt.complete_checkpoints(output_dir)
    marker = ckpt.read_marker(output_dir)
    if marker is None and found:  # checkpoints without run.json: their newest says whose they are
        newest = found[-1][1]
        owner_id = newest.get("run_id")
        identity_there = run_identity(config_of(newest))
        marker = {"run_id": owner_id or "", "identity": identity_there, "adopted_unmarked": owner_id is None}
    if cfg.resume_from:
        got = _take(cfg, output_dir, identity, found, marker)
    elif not found:
        got = Claim(uuid.uuid4().hex[:16])
    else:
        got = _resume_own(cfg, output_dir, identity, found, marker)
    if got.checkpoint is not None:
        _compare_plans(cfg, got, should_stop)
    written = marker if marker is not None and marker.get("run_id") == got.run_id else {}
    ckpt.write_marker(
        output_dir,
        {
            "run_id": got.run_id,
            "identity": identity,
            "created": written.get("created", time.time()),
            "adopted_unmarked": got.adopted_unmarked or bool(written.get("adopted_unmarked")),
            **({"taken_from": _resolved(cfg.resume_from)} if cfg.resume_from else {}),
        },
    )
    return got


def _resolved(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _run_words(marker: dict[str, Any] | None, newest: Path) -> str:
    run = f"run {marker['run_id']}, " if marker and marker.get("run_id") else ""
    return f"{run}up to {newest.name}"


def _resume_own(
    cfg: TrainerConfig,
    output_dir: Path,
    identity: dict[str, Any],
    found: list[tuple[Path, dict[str, Any]]],
    marker: dict[str, Any] | None,
) -> Claim:
    assert marker is not None
    own = [p for p, meta in found if ckpt.belongs(meta, marker)]
    newest = found[-1][0]
    if not cfg.resume:
        raise ConfigError(
            f"output_dir: {output_dir} holds the checkpoints of a run ({_run_words(marker, newest)}), and resume = "
            "false starts a new one whose checkpoints would be pruned against them: choose another output_dir, "
            "or resume = true to continue that run"
        )
    differ = differences(marker.get("identity") or {}, identity)
    if differ or not own:
        what = "; ".join(differ) if differ else "not this run's"
        raise ConfigError(
            f"output_dir: {output_dir} holds another run's checkpoints ({_run_words(marker, newest)}; {what}): "
            f"choose another output_dir (resume_from = '{output_dir}' there takes them on purpose)"
        )
    run_id = marker["run_id"] or uuid.uuid4().hex[:16]
    if not marker["run_id"]:  # checkpoints of a version without run ids, this config's model: adopted
        marker.update(run_id=run_id, adopted_unmarked=True)
    return Claim(run_id, own[-1])


def _take(
    cfg: TrainerConfig,
    output_dir: Path,
    identity: dict[str, Any],
    found: list[tuple[Path, dict[str, Any]]],
    marker: dict[str, Any] | None,
) -> Claim:
    own = [p for p, meta in found if marker is not None and ckpt.belongs(meta, marker)]
    if (
        marker is not None
        and own
        and cfg.resume
        and marker.get("taken_from") == _resolved(cfg.resume_from)
        and not differences(marker.get("identity") or {}, identity)
    ):  # a restart of the run that took it: its own checkpoints go on
        return Claim(marker["run_id"], own[-1], said=[f"resume_from {cfg.resume_from} was taken before: resuming"])
    try:
        source, _how = ckpt.resolve_checkpoint(cfg.resume_from)
    except ckpt.CheckpointNotFound as exc:
        raise ConfigError(f"resume_from: {exc}") from None
    meta = ckpt.read_meta(source)
    differ = differences(config_of(meta), cfg.to_dict(), LOADABLE_KEYS)
    if differ:
        raise ConfigError(f"resume_from: {source} cannot be loaded by this config ({'; '.join(differ)})")
    inside = source.parent.parent.resolve() == output_dir.resolve()
    newer = [p for p, _ in found if _step(p) > _step(source)]
    if inside and newer:
        raise ConfigError(
            f"resume_from: {source.name}, but {output_dir} holds newer checkpoints (up to {newer[-1].name}) whose "
            "steps this run would repeat: name the newest, or choose another output_dir"
        )
    if not inside and found:
        raise ConfigError(
            f"output_dir: {output_dir} holds the checkpoints of a run ({_run_words(marker, found[-1][0])}); "
            f"resume_from takes {source} into an output_dir of its own: choose an empty one"
        )
    # Taken inside output_dir, the run goes on as the run that wrote it (its older checkpoints are pruned in turn).
    run_id = meta.get("run_id") if inside and isinstance(meta.get("run_id"), str) else None
    said = [f"resume_from: taking {source} on purpose"]
    return Claim(run_id or uuid.uuid4().hex[:16], source, said=said, adopted_unmarked=inside and run_id is None)


def _compare_plans(cfg: TrainerConfig, got: Claim, should_stop: Callable[[], str | None] | None) -> None:
    assert got.checkpoint is not None
    there = plan_of(ckpt.read_meta(got.checkpoint))
    here = data_plan(cfg, data_identity(cfg, should_stop) if "data" in there else "")
    differ = differences(there, here)
    if not differ:
        return
    if not cfg.replan_data:
        raise ConfigError(
            f"data plan: {got.checkpoint.name} was trained under another data plan ({'; '.join(differ)}), so its "
            "data position means other conversations here: set replan_data = true to start its epoch over under "
            "this plan, or put the values back"
        )
    got.replan = True
    got.said.append(f"data plan changed ({'; '.join(differ)}): re-planned from the start of the checkpoint's epoch")


def epoch_start(
    positions: dict[int, dict[str, Any]],
    old_world: int,
    old_batches_per_epoch: int | None,
    new_batches_per_epoch: int | None,
    rank: int,
    world_size: int,
) -> dict[str, Any]:
    """Rank ``rank``'s ledger state that starts over the epoch of the checkpoint's first untrained batch (global
    indices: local * world + rank) under a plan of ``new_batches_per_epoch`` batches an epoch. Random data (no
    epochs) goes on from that batch."""
    lowest = min((int(p.get("watermark", 0)) * old_world + r for r, p in positions.items()), default=0)
    start = lowest
    if old_batches_per_epoch and new_batches_per_epoch:
        start = (lowest // old_batches_per_epoch) * new_batches_per_epoch
    return {"watermark": max(0, -(-(start - rank) // world_size)), "done": []}
