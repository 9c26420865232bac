"""Checkpoints: per-drafter model, optimizer, scheduler, step, data position and RNG state, plus the vocab.

Layout: ``<output_dir>/checkpoints/step_<N>/`` with ``meta.json``, ``vocab.pt`` and one ``<drafter>.pt`` per
drafter; written into a temporary directory and renamed, so a directory with ``meta.json`` is complete.

An output directory belongs to one run: ``<output_dir>/run.json`` names it (its ``run_id`` and identity,
run/resume.py decides who may use the directory) and every checkpoint's meta carries the ``run_id`` that wrote
it. The newest checkpoint of a directory (resume, export, eval) is its owner's newest, and pruning removes only
the writing run's own older checkpoints: another run's are never deleted. Checkpoints of a version without
run ids (no run_id in their meta) belong to the run that adopted them (``adopted_unmarked`` in run.json).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

META = "meta.json"
RUN_MARKER = "run.json"
STEP_DIR = re.compile(r"step_\d+")  # a checkpoint's directory; complete once meta.json is in it
TMP_STEP_DIR = re.compile(r"\.tmp-step_\d+.*")  # one being written (renamed to step_<N> when complete)


class CheckpointNotFound(Exception):
    """A path that names no complete checkpoint; the message is one line a person can act on."""


def to_cpu(obj: Any) -> Any:
    """A deep copy with every tensor moved to (or copied on) the CPU: safe to keep while training goes on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_cpu(v) for v in obj]
    if isinstance(obj, tuple):
        return tuple(to_cpu(v) for v in obj)
    return obj


def rng_state(device: torch.device) -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def set_rng_state(state: dict[str, Any], device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def checkpoints_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def read_marker(output_dir: str | Path) -> dict[str, Any] | None:
    """``<output_dir>/run.json``, or None where there is none or it cannot be read as one."""
    try:
        data = json.loads((Path(output_dir) / RUN_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) and isinstance(data.get("run_id"), str) else None


def write_marker(output_dir: str | Path, marker: dict[str, Any]) -> None:
    """``<output_dir>/run.json`` written whole (tmp + rename)."""
    path = Path(output_dir) / RUN_MARKER
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{RUN_MARKER}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(marker, indent=1), encoding="utf-8")
    os.replace(tmp, path)


def belongs(meta: dict[str, Any], marker: dict[str, Any]) -> bool:
    """Whether the checkpoint with ``meta`` is the marker's run's."""
    run_id = meta.get("run_id")
    return run_id == marker.get("run_id") or (run_id is None and bool(marker.get("adopted_unmarked")))


def complete_checkpoints(output_dir: str | Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every complete checkpoint in ``output_dir`` with its meta (an unreadable meta: an empty one), oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in sorted(p for p in root.glob("step_*") if STEP_DIR.fullmatch(p.name) and (p / META).is_file()):
        try:
            meta = read_meta(path)
        except (OSError, ValueError, RecursionError):
            meta = {}
        found.append((path, meta if isinstance(meta, dict) else {}))
    return found


def owned_checkpoints(output_dir: str | Path) -> list[Path]:
    """The complete checkpoints of the run that owns ``output_dir`` (all of them where no run.json names one),
    oldest first."""
    marker = read_marker(output_dir)
    return [p for p, meta in complete_checkpoints(output_dir) if marker is None or belongs(meta, marker)]


def save_checkpoint(
    output_dir: str | Path,
    step: int,
    drafter_states: dict[str, dict[str, Any]],
    meta: dict[str, Any],
    draft_to_target: torch.Tensor,
    keep: int,
    run_id: str | None = None,
) -> Path:
    """Write checkpoint ``step`` (tagged with ``run_id``) and prune this run's older ones to the newest ``keep``;
    another run's checkpoint is never written over nor pruned. Without ``run_id``: every checkpoint there is this
    run's (a directory no run.json claims)."""
    root = checkpoints_dir(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{step:08d}"
    tmp = root / f".tmp-step_{step:08d}-{os.getpid()}-{time.monotonic_ns()}"
    tmp.mkdir()
    for name, state in drafter_states.items():
        torch.save(state, tmp / f"{name}.pt")
    torch.save({"draft_to_target": draft_to_target.cpu()}, tmp / "vocab.pt")
    body = {**meta, "step": step, "drafters": sorted(drafter_states), "saved_at": time.time()}
    if run_id is not None:
        body["run_id"] = run_id
    (tmp / META).write_text(json.dumps(body, indent=1, default=str), encoding="utf-8")
    marker: dict[str, Any] | None = None
    if run_id is not None:
        disk = read_marker(output_dir) or {}
        adopted = disk.get("run_id") == run_id and bool(disk.get("adopted_unmarked"))
        marker = {"run_id": run_id, "adopted_unmarked": adopted}
    if final.exists():
        previous = read_meta(final) if (final / META).is_file() else {}
        if marker is not None and previous and not belongs(previous, marker):
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(f"{final} is another run's checkpoint (run {previous.get('run_id')}): not written over")
        shutil.rmtree(final)
    os.replace(tmp, final)
    ours = [p for p, m in complete_checkpoints(output_dir) if marker is None or belongs(m, marker)]
    for old in ours[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def latest_checkpoint(output_dir: str | Path) -> Path | None:
    """The newest complete checkpoint of the run that owns ``output_dir`` (see owned_checkpoints)."""
    owned = owned_checkpoints(output_dir)
    return owned[-1] if owned else None


def resolve_checkpoint(source: str | Path) -> tuple[Path, str | None]:
    """The complete checkpoint ``source`` names (itself, or an output directory's latest) and how it was picked
    (None: ``source`` is the checkpoint); raises CheckpointNotFound saying why there is none."""
    source = Path(source).expanduser()
    if not source.exists():
        raise CheckpointNotFound(f"{source} does not exist")
    if not source.is_dir():
        raise CheckpointNotFound(f"{source} is not a directory (expected a checkpoint or a run output directory)")
    if (source / META).is_file():
        return source, None
    if TMP_STEP_DIR.fullmatch(source.name):
        raise CheckpointNotFound(f"{source} is a checkpoint still being written (no {META} yet); wait for it to finish")
    if STEP_DIR.fullmatch(source.name):
        raise CheckpointNotFound(f"{source} is an incomplete checkpoint: no {META}")
    root = checkpoints_dir(source)
    if not root.is_dir():
        raise CheckpointNotFound(
            f"{source} is neither a checkpoint (no {META}) nor an output directory (no checkpoints/)"
        )
    latest = latest_checkpoint(source)
    if latest is None:
        if any(TMP_STEP_DIR.fullmatch(p.name) for p in root.iterdir()):
            raise CheckpointNotFound(f"{root} has no complete checkpoint yet: one is still being written")
        raise CheckpointNotFound(f"{root} has no checkpoint")
    return latest, f"latest of {len(owned_checkpoints(source))} in {root}"


def read_meta(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path / META).read_text(encoding="utf-8"))
    return data


def load_vocab(path: Path) -> torch.Tensor:
    t: torch.Tensor = torch.load(path / "vocab.pt", map_location="cpu", weights_only=True)["draft_to_target"]
    return t


def load_drafter_state(path: Path, name: str) -> dict[str, Any]:
    # weights_only: export and eval load paths the user names; a crafted pickle must not run code here.
    state: dict[str, Any] = torch.load(path / f"{name}.pt", map_location="cpu", weights_only=True)
    return state


PROGRESS = "progress.json"


class ProgressRecord:
    """The last step any drafter finished, kept in <output_dir>/progress.json (tmp + rename per step),
    so a run resumed after SIGKILL can say how many steps the crash lost since its last checkpoint."""

    def __init__(self, output_dir: str | Path) -> None:
        self.path = Path(output_dir) / PROGRESS
        self._lock = threading.Lock()
        self._last = -1

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") != "step":
            return
        step = int(event.get("step", -1))
        with self._lock:
            if step <= self._last:
                return
            self._last = step
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_name(f".{PROGRESS}.tmp")
            tmp.write_text(json.dumps({"step": step, "t": event.get("t")}), encoding="utf-8")
            os.replace(tmp, self.path)

    def last_recorded_step(self) -> int | None:
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        step = data.get("step") if isinstance(data, dict) else None
        return step if isinstance(step, int) else None
