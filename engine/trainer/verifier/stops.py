"""The stop-token ids of a target: where its replies end, as a server ends them.

vLLM ends a request at the tokenizer's eos and at every ``eos_token_id`` of the model's generation config, and
transformers' ``generate`` at the latter; both read ``generation_config.json`` (an int or a list), or ``config.json``
where there is none. Chat models end a turn with tokens the tokenizer's eos is not: Gemma ``<end_of_turn>``
(generation config eos ``[1, 106]``), Llama-3.1 ``<|eot_id|>`` and ``<|eom_id|>``, gpt-oss ``<|return|>`` and
``<|call|>``. The stop set is the union, and regenerate, eval, training-time τ and serve-check all stop at it.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import Any

from engine.trainer.config import RANDOM_TARGETS

GENERATION_CONFIG = "generation_config.json"

StopIds = int | Collection[int] | None  # one id, several, or none (decode through every token)


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def generation_eos_ids(directory: Path) -> list[int]:
    """``eos_token_id`` of the directory's generation config: its ``generation_config.json``, or where there is none
    its ``config.json`` (or that file's ``text_config``), as transformers and vLLM fall back."""
    gen = directory / GENERATION_CONFIG
    if gen.is_file():
        return _as_ids(_read_json(gen).get("eos_token_id"))
    config = directory / "config.json"
    if not config.is_file():
        return []
    data = _read_json(config)
    if "eos_token_id" not in data and isinstance(data.get("text_config"), dict):
        data = data["text_config"]
    return _as_ids(data.get("eos_token_id"))


def stop_ids(tokenizer: Any, directory: Path | None) -> frozenset[int]:
    """The tokenizer's eos ∪ the generation config's eos ids of the target in ``directory`` (None: a random preset,
    the tokenizer's alone)."""
    ids = set(generation_eos_ids(directory)) if directory is not None else set()
    ids.update(_as_ids(getattr(tokenizer, "eos_token_id", None)))
    return frozenset(ids)


def target_directory(spec: str) -> Path | None:
    """The directory a target spec loads from: None for the random presets (their stop set is the tokenizer's eos
    alone, or none), the built one for ``tiny-trained``, else the spec as a path."""
    if spec in RANDOM_TARGETS:
        return None
    if spec == "tiny-trained":
        from engine.trainer.verifier.builtin import ensure_built

        return ensure_built()
    return Path(spec).expanduser()


def target_stop_ids(spec: str, tokenizer: Any) -> frozenset[int]:
    """``stop_ids`` of the target a config's ``target`` names."""
    return stop_ids(tokenizer, target_directory(spec))


def stop_set(stops: StopIds) -> frozenset[int]:
    if stops is None:
        return frozenset()
    if isinstance(stops, int):
        return frozenset((stops,))
    return frozenset(stops)


def first_stop(ids: Sequence[int], stops: Collection[int]) -> int | None:
    """The index of the first stop token in ``ids``, or None."""
    return next((i for i, t in enumerate(ids) if t in stops), None)


def cut_at_stop(ids: list[int], stops: Collection[int]) -> list[int]:
    """``ids`` up to (without) the first stop token."""
    at = first_stop(ids, stops)
    return ids if at is None else ids[:at]
