"""``specdec-train regenerate``: a dataset's assistant turns rewritten with the target's own replies.

A drafter learns to predict what it is trained on. Trained on the corpus text, it predicts the corpus, yet a
server asks it to predict the target, whose replies differ (the ``tiny-trained`` drafter's first proposal matches
0.75 of held-out corpus tokens and 0.37 of the target's own greedy replies). EAGLE, SpecForge and speculators
therefore regenerate the assistant turns with the target before training; this is that step.

    specdec-train regenerate --target tiny-trained --out regen.jsonl [--data shipped|FILE]
        [--temperature 0] [--seed 0] [--batch-size 32] [--max-new-tokens 2048] [--max-length 4096] [--device cpu]

Each conversation keeps its system and user turns word for word and its turn structure; every assistant turn is
replaced, in order, by the target's reply to the conversation so far (earlier turns already regenerated, as the
target would have had them). Greedy at ``--temperature 0``, else sampled at that temperature (seeded per batch, so
a resumed run draws what an uninterrupted one would) and nothing else: the target's shipped sampling settings
(a repetition penalty, top-p, top-k) are not inherited. A reply ends at the target's first stop token (the
tokenizer's eos and the generation config's eos ids, verifier/stops.py), where a server ends it. The settings given
to generate() are in the log and in ``<out>.progress.json``. A target with the harmony chat format (gpt-oss:
channels in each reply) is refused (exit 2). Batched across conversations, one turn at a time.

The output is chat JSON lines (``{"messages": [{role, content}], "source_line": N}``) in input order, which any
run takes as ``data = "/path/regen.jsonl"``. Progress goes to stderr. It is resumable: ``<out>.progress.json``
records the rows done and the output's length after every batch (the output is on disk before the progress file
says so), and a second run with the same settings goes on from there (other settings, the batch size and the
source file's sha256 included: an error naming the key, unless ``--restart``); a progress file that does
not agree with the source and the output (a row written twice, an offset past the output's end) is refused naming
the key. ``--out`` is never the ``--data`` file (nor a link to it), nor a file regenerate did not write, unless
``--restart``. Rows that cannot be regenerated are left out and counted by reason (longer than 1 MiB, more than
1024 turns, not UTF-8, not JSON, no user turn before an assistant turn, no assistant turn, a chat template error
or a prompt too long for ``--max-length`` at the first turn); a conversation whose prompt is too long (or refused
by the template) at a later turn keeps the turns before it, regenerated. A reply that reaches ``--max-new-tokens``
(by default the longest training bucket) is kept, cut, and counted.
Exit codes: 0 done, 2 bad arguments, a data path that is no regular file, or a progress file or settings that
differ from the run being resumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.trainer.config import PRESETS, TrainerConfig, data_file_problem, file_kind, target_problem
from engine.trainer.data.cache import file_sha256
from engine.trainer.data.rows import SKIP_NOT_JSON as SKIP_NOT_JSON  # a reason rows are counted under
from engine.trainer.data.rows import BadRow, Row, check_turns, read_rows
from engine.trainer.data.rows import parse_row as parse_json_row
from engine.trainer.data.sources import ROLE_ALIASES, SKIP_TEMPLATE_ERROR, shipped_corpus_path
from engine.trainer.verifier.stops import first_stop, target_directory, target_stop_ids

SKIP_NO_USER = "no user turn before an assistant turn"
SKIP_NO_ASSISTANT = "no assistant turn"
SKIP_TOO_LONG = "prompt too long for --max-length"
NOTE_CUT = "replies cut at --max-new-tokens"
NOTE_EMPTY = "empty replies"
NOTE_KEPT_BEFORE_LONG = "conversations kept up to a turn whose prompt was too long"
NOTE_KEPT_BEFORE_TEMPLATE = "conversations kept up to a turn the chat template refused"
PROGRESS_SUFFIX = ".progress.json"
# A reply may be as long as the longest training bucket (a preset's or the default config's): what training sees of
# a reply is never cut here first. A prompt may be as long again: a longer one would be cut by training anyway.
LONGEST_BUCKET = max(max(TrainerConfig().buckets), *(max(p.get("buckets", [0])) for p in PRESETS.values()))
DEFAULT_MAX_NEW_TOKENS = LONGEST_BUCKET

Message = dict[str, str]
Say = Callable[[str], None]


@dataclass(frozen=True)
class Settings:
    """What decides the output; a resumed run must have the same."""

    source: str
    target: str
    temperature: float
    seed: int
    max_new_tokens: int
    max_length: int
    # What generate() is given (Replier.generation): filled by the Replier from the target, recorded in the progress
    generation: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "target": self.target,
            "temperature": self.temperature,
            "seed": self.seed,
            "max_new_tokens": self.max_new_tokens,
            "max_length": self.max_length,
            **({"generation": dict(self.generation)} if self.generation else {}),
        }


@dataclass
class Progress:
    """Rows of the source consumed, the output's byte length after them, and the counts so far."""

    settings: dict[str, Any]
    rows_done: int = 0
    output_bytes: int = 0
    written: int = 0
    replies: int = 0
    reply_tokens: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    notes: Counter[str] = field(default_factory=Counter)

    def to_dict(self) -> dict[str, Any]:
        return {
            "settings": self.settings,
            "rows_done": self.rows_done,
            "output_bytes": self.output_bytes,
            "written": self.written,
            "replies": self.replies,
            "reply_tokens": self.reply_tokens,
            "skipped": dict(self.skipped),
            "notes": dict(self.notes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Progress:
        return cls(
            settings=dict(data["settings"]),
            rows_done=int(data["rows_done"]),
            output_bytes=int(data["output_bytes"]),
            written=int(data.get("written", 0)),
            replies=int(data.get("replies", 0)),
            reply_tokens=int(data.get("reply_tokens", 0)),
            skipped=Counter({str(k): int(v) for k, v in dict(data.get("skipped", {})).items()}),
            notes=Counter({str(k): int(v) for k, v in dict(data.get("notes", {})).items()}),
        )


def parse_row(row: Row) -> list[Message] | str:
    """The conversation of one row (ShareGPT or chat, roles normalised), or the reason it cannot be used: a row
    past data/rows.py's limits, not UTF-8, not JSON (or too deep, or a number too long), no turns to use."""
    try:
        data = parse_json_row(row)
        turns = (data.get("conversations") or data.get("messages") or []) if isinstance(data, dict) else []
        check_turns(turns if isinstance(turns, list) else [])
    except BadRow as bad:
        return bad.reason
    msgs: list[Message] = []
    for turn in turns if isinstance(turns, list) else []:
        if not isinstance(turn, dict):
            continue
        role = ROLE_ALIASES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is not None and isinstance(content, str):
            msgs.append({"role": role, "content": content})
    first_reply = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), None)
    if first_reply is None:
        return SKIP_NO_ASSISTANT
    if not any(m["role"] == "user" for m in msgs[:first_reply]):
        return SKIP_NO_USER
    return msgs


def source_rows(path: Path, start: int) -> Iterator[tuple[int, Row]]:
    """(row number, row) of the non-blank lines from row ``start`` on; no row is held past data/rows.py's limit."""
    for number, row in enumerate(read_rows(path)):
        if number >= start:
            yield number, row


def batched(rows: Iterator[tuple[int, Row]], size: int) -> Iterator[list[tuple[int, Row]]]:
    batch: list[tuple[int, Row]] = []
    for row in rows:
        batch.append(row)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Replier:
    """The target answering a batch of conversations, left-padded, with its KV cache (transformers' generate).

    It generates with a generation config of its own: greedy, or sampled at ``temperature`` with nothing else (no
    top-k, top-p or penalty), stopping at the target's stop ids (verifier/stops.py). The model's shipped generation
    config (Qwen2.5-Instruct's ``repetition_penalty`` 1.05, ``top_p`` 0.8, ...) is replaced, not merged:
    transformers fills every setting a given config leaves unset from the model's own."""

    def __init__(self, model: Any, tokenizer: Any, device: torch.device, settings: Settings) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.device = device
        self.stop_ids = sorted(target_stop_ids(settings.target, tokenizer))
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else int(tokenizer.eos_token_id)
        self.generation = fresh_generation(settings.temperature, settings.max_new_tokens, self.stop_ids, self.pad_id)
        self.dropped = shipped_sampling(model)
        self.settings = dataclasses.replace(settings, generation=self.generation)
        model.generation_config = generation_config(self.generation)

    def describe(self) -> str:
        """The generation settings in words, for the log."""
        g = self.generation
        how = f"sampled at temperature {g['temperature']:g}, no top-k, top-p or penalty" if g["do_sample"] else "greedy"
        names = [self.tokenizer.convert_ids_to_tokens(i) for i in g["eos_token_id"]]
        stops = ", ".join(f"{i} {n}" for i, n in zip(g["eos_token_id"], names, strict=True))
        dropped = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items()))
        line = f"generation: {how}, up to {g['max_new_tokens']} tokens, stopping at ids [{stops}]"
        return line + (f"; not inherited from the target's generation_config: {dropped}" if dropped else "")

    def prompt(self, messages: list[Message]) -> list[int]:
        text: str = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @torch.no_grad()
    def replies(self, prompts: list[list[int]], seed: int) -> list[tuple[list[int], bool]]:
        """(reply token ids without the stop token, whether it was cut at max_new_tokens) per prompt."""
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                generation_config=generation_config(self.generation),
            )
        result = []
        for row in out[:, width:].tolist():
            at = first_stop(row, self.stop_ids)
            result.append((row, True) if at is None else (row[:at], False))
        return result

    def text(self, reply: list[int]) -> str:
        decoded: str = self.tokenizer.decode(reply, skip_special_tokens=True)
        return decoded


def fresh_generation(temperature: float, max_new_tokens: int, stops: list[int], pad_id: int) -> dict[str, Any]:
    """Every setting generate() is given: greedy, or sampled at ``temperature`` alone; the stop ids; the length."""
    sampled = temperature > 0
    plain: dict[str, Any] = {"do_sample": sampled, "num_beams": 1, "repetition_penalty": 1.0}
    if sampled:
        plain.update(temperature=temperature, top_k=0, top_p=1.0, min_p=None, typical_p=1.0)
    return {**plain, "max_new_tokens": max_new_tokens, "eos_token_id": list(stops), "pad_token_id": pad_id}


def generation_config(settings: dict[str, Any]) -> Any:
    from transformers import GenerationConfig

    return GenerationConfig(**settings)


# Shipped generation settings that change which token comes next; reported when replaced.
SAMPLING_KEYS = (
    "do_sample", "temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff",
    "repetition_penalty", "no_repeat_ngram_size", "bad_words_ids", "suppress_tokens", "begin_suppress_tokens",
    "sequence_bias", "min_new_tokens", "min_length", "num_beams", "exponential_decay_length_penalty",
)  # fmt: skip


def shipped_sampling(model: Any) -> dict[str, Any]:
    """The target's own generation settings that a default generate() would have applied."""
    shipped = getattr(model, "generation_config", None)
    if shipped is None:
        return {}
    own = shipped.to_diff_dict() if hasattr(shipped, "to_diff_dict") else {}
    return {k: v for k, v in own.items() if k in SAMPLING_KEYS and v is not None}


def harmony_template(tokenizer: Any) -> bool:
    """gpt-oss's harmony chat format: a reply is channels (analysis, final) in ``<|channel|>`` markers."""
    return "<|channel|>" in str(getattr(tokenizer, "chat_template", "") or "")


def regenerate_batch(replier: Replier, convs: list[list[Message]], seed: int, progress: Progress) -> list[str | None]:
    """Rewrites the assistant turns of ``convs`` in place, turn by turn across the batch. A conversation whose
    prompt at turn k outgrows ``max_length`` (or that the chat template refuses there) keeps its first k turns,
    already regenerated, and ends with the last of them; at turn 0 it is left out. Per conversation: None (kept),
    or the reason it is left out."""
    from jinja2 import TemplateError

    settings = replier.settings
    left_out: list[str | None] = [None] * len(convs)
    ended = [False] * len(convs)
    turn = 0
    while True:
        todo: list[tuple[int, int, list[int]]] = []  # (conversation, message index, prompt ids)
        for c, conv in enumerate(convs):
            at = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
            if ended[c] or turn >= len(at):
                continue
            try:
                ids = replier.prompt(conv[: at[turn]])
            except TemplateError:
                ids, why, note = None, SKIP_TEMPLATE_ERROR, NOTE_KEPT_BEFORE_TEMPLATE
            else:
                why, note = SKIP_TOO_LONG, NOTE_KEPT_BEFORE_LONG
            if ids is None or len(ids) + settings.max_new_tokens > settings.max_length:
                ended[c] = True
                if turn == 0:
                    left_out[c] = why
                else:
                    del conv[at[turn - 1] + 1 :]  # ends with the last reply regenerated
                    progress.notes[note] += 1
                continue
            todo.append((c, at[turn], ids))
        if not todo:
            return left_out
        replies = replier.replies([ids for _, _, ids in todo], seed * 1_000_003 + turn)
        for (c, i, _), (reply, cut) in zip(todo, replies, strict=True):
            convs[c][i] = {"role": "assistant", "content": replier.text(reply)}
            progress.replies += 1
            progress.reply_tokens += len(reply)
            progress.notes[NOTE_CUT] += int(cut)
            progress.notes[NOTE_EMPTY] += int(not reply)
        turn += 1


class ProgressError(ValueError):
    """``<out>.progress.json`` (or ``--out``) cannot be resumed from; the message names the file and the key."""


PROGRESS_FILE_MAX_BYTES = 1 << 20  # a progress file holds counts: anything larger is not one
PROGRESS_COUNTS = ("rows_done", "output_bytes", "written", "replies", "reply_tokens")
OUTPUT_ROW_MAX_BYTES = 64 << 20  # the last output row is read back to check its source_line, up to this long


def _count(value: Any) -> bool:
    return type(value) is int and 0 <= value < 2**63


def read_progress(marker: Path) -> Progress:
    """The progress file with every key checked (counts: integers >= 0; ``settings``: a table; ``skipped`` and
    ``notes``: counts by reason); ProgressError naming the key."""

    def wrong(key: str, why: str) -> ProgressError:
        return ProgressError(f"{marker}: {key}: {why}; --restart to start over")

    size = marker.stat().st_size
    if size > PROGRESS_FILE_MAX_BYTES:
        raise ProgressError(f"{marker}: not a progress file ({size} bytes); --restart to start over")
    try:
        data = json.loads(marker.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise ProgressError(f"{marker}: not a progress file ({type(exc).__name__}); --restart to start over") from None
    if not isinstance(data, dict):
        raise ProgressError(f"{marker}: not a progress file (not a JSON object); --restart to start over")
    if not isinstance(data.get("settings"), dict):
        raise wrong("settings", "missing, or not a table of settings")
    for key in PROGRESS_COUNTS:
        value = data.get(key, None if key in ("rows_done", "output_bytes") else 0)
        if not _count(value):
            raise wrong(key, f"expected an integer >= 0, got {json.dumps(value)[:40]}")
    for key in ("skipped", "notes"):
        value = data.get(key, {})
        if not isinstance(value, dict) or not all(_count(n) for n in value.values()):
            raise wrong(key, "expected counts by reason (integers >= 0)")
    return Progress.from_dict(data)


def output_rows(out: Path, end: int) -> tuple[int, int | None]:
    """(rows, the last row's source_line or None) of ``out``'s first ``end`` bytes, which must end a row; read in
    chunks. ProgressError when ``end`` is not at the end of a row."""
    rows, last_start = 0, 0
    with out.open("rb") as f:
        at = 0
        while at < end:
            chunk = f.read(min(1 << 20, end - at))
            if not chunk:
                break
            rows += chunk.count(b"\n")
            newline = chunk.rfind(b"\n", 0, len(chunk) - 1 if at + len(chunk) == end else len(chunk))
            if newline >= 0:
                last_start = at + newline + 1
            at += len(chunk)
        if end and (f.seek(end - 1) < 0 or f.read(1) != b"\n"):
            raise ProgressError(f"output_bytes: {end} is not at the end of a row of {out}; --restart to start over")
        if not end or end - last_start > OUTPUT_ROW_MAX_BYTES:
            return rows, None
        f.seek(last_start)
        try:
            line = json.loads(f.read(end - last_start))
        except (ValueError, RecursionError):
            return rows, None
    source_line = line.get("source_line") if isinstance(line, dict) else None
    return rows, source_line if _count(source_line) else None


def check_resume_point(progress: Progress, out: Path, marker: Path, total: int) -> None:
    """The recorded position agrees with the source and the output, so a resume neither writes a row twice nor
    pads the output (a tampered or foreign progress file); ProgressError naming the key."""

    def wrong(key: str, why: str) -> ProgressError:
        return ProgressError(f"{marker}: {key}: {why}; --restart to start over")

    size = out.stat().st_size if out.is_file() else None
    if size is None:
        raise wrong("output_bytes", f"{progress.output_bytes}, but {out} is not there")
    if progress.output_bytes > size:
        raise wrong("output_bytes", f"{progress.output_bytes}, but {out} holds {size} bytes")
    if progress.rows_done > total:
        raise wrong("rows_done", f"{progress.rows_done}, but the source has {total} rows")
    accounted = progress.written + sum(progress.skipped.values())
    if accounted != progress.rows_done:
        raise wrong(
            "rows_done",
            f"{progress.rows_done}, but {progress.written} written and {accounted - progress.written} skipped "
            f"make {accounted}",
        )
    try:
        rows, last_line = output_rows(out, progress.output_bytes)
    except ProgressError as exc:
        raise ProgressError(f"{marker}: {exc}") from None
    if rows != progress.written:
        raise wrong("written", f"{progress.written}, but the first {progress.output_bytes} bytes of {out} hold {rows}")
    if last_line is not None and last_line > progress.rows_done:
        raise wrong("rows_done", f"{progress.rows_done}, but {out} already holds row {last_line}")


def load_progress(
    out: Path, settings: Settings, restart: bool, *, batch_size: int = 0, total: int = 0, source_sha256: str = ""
) -> Progress:
    """Where a previous run stopped (the output cut back to its last complete batch, every recorded key checked
    against the settings, the source's ``total`` rows and the output), or a fresh start. The batch size is a
    setting: the batches' boundaries decide their sampling seeds. So is the source file's sha256: another file at
    the same path would mix two datasets in one output."""
    marker = out.with_name(out.name + PROGRESS_SUFFIX)
    expected = {**settings.as_dict(), "batch_size": batch_size, "source_sha256": source_sha256}
    if restart or not marker.is_file():
        if not restart and out.is_file() and out.stat().st_size:
            raise ProgressError(
                f"{out} holds {out.stat().st_size} bytes and has no {marker.name}: not an output of regenerate to "
                "resume; --restart writes over it, or name a new --out"
            )
        out.write_bytes(b"")
        return Progress(settings=expected)
    progress = read_progress(marker)
    if progress.settings != expected:
        differ = sorted(k for k, v in expected.items() if progress.settings.get(k) != v)
        differ += sorted(k for k in progress.settings if k not in expected)
        raise ValueError(f"{out} was started with other settings ({', '.join(differ)}); --restart to start over")
    check_resume_point(progress, out, marker, total)
    with out.open("r+b") as f:  # a batch written after the last marker update is dropped and done again
        f.truncate(progress.output_bytes)
    return progress


def check_out(source: Path, out: Path) -> None:
    """``--out`` must not be the ``--data`` file (nor a link to it, nor another name of it): regenerating writes
    the output from its first byte while it reads the source. Nor a FIFO, device or directory."""
    same = out.resolve() == source.resolve() or (out.exists() and os.path.samefile(out, source))
    if same:
        raise ValueError(f"--out {out} is the --data file {source.resolve()}: it would write over its input")
    if out.exists() and not out.is_file():
        raise ValueError(f"--out {out} is {file_kind(out.stat().st_mode)}, not a regular file")


def save_progress(out: Path, progress: Progress) -> None:
    marker = out.with_name(out.name + PROGRESS_SUFFIX)
    tmp = marker.with_name(marker.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(progress.to_dict(), indent=1), encoding="utf-8")
    os.replace(tmp, marker)


def regenerate(replier: Replier, source: Path, out: Path, *, batch_size: int, restart: bool, say: Say) -> Progress:
    check_out(source, out)
    total = sum(1 for _ in source_rows(source, 0))
    identity = file_sha256(source)  # as training's data plan names its data
    progress = load_progress(out, replier.settings, restart, batch_size=batch_size, total=total, source_sha256=identity)
    if progress.rows_done:
        say(f"resuming at row {progress.rows_done}/{total} ({progress.written} conversations written)")
    t0 = time.perf_counter()
    tokens0 = progress.reply_tokens
    with out.open("ab") as f:
        for batch in batched(source_rows(source, progress.rows_done), batch_size):
            usable: list[tuple[int, list[Message]]] = []
            for number, line in batch:
                parsed = parse_row(line)
                if isinstance(parsed, str):
                    progress.skipped[parsed] += 1
                else:
                    usable.append((number, parsed))
            convs = [conv for _, conv in usable]
            left_out = regenerate_batch(replier, convs, replier.settings.seed + batch[0][0], progress) if convs else []
            for (row, _), conv, why in zip(usable, convs, left_out, strict=True):
                if why is not None:
                    progress.skipped[why] += 1
                    continue
                f.write((json.dumps({"messages": conv, "source_line": row + 1}) + "\n").encode())
                progress.written += 1
            f.flush()
            os.fsync(f.fileno())  # on disk before the progress file claims it (a power loss keeps them in step)
            progress.rows_done = batch[-1][0] + 1
            progress.output_bytes = f.tell()
            save_progress(out, progress)
            rate = (progress.reply_tokens - tokens0) / max(time.perf_counter() - t0, 1e-9)
            say(
                f"{progress.rows_done}/{total} rows, {progress.written} written, {progress.replies} replies, "
                f"{rate:.0f} reply tokens/s"
            )
    return progress


def load_model(spec: str, device: torch.device) -> tuple[Any, Any]:
    """The target's model and tokenizer: ``tiny-trained`` or a Hugging Face directory (not a random preset), loaded
    as training loads it (SDPA attention, or eager where the model has none: gpt-oss)."""
    from transformers import AutoModelForCausalLM

    from engine.trainer.verifier.model import load_pretrained, load_tokenizer

    path = target_directory(spec)
    if path is None:
        raise ValueError(f"target {spec!r} has random weights: its replies would teach the drafter nothing")
    tokenizer = load_tokenizer(spec)
    if tokenizer is None or tokenizer.eos_token_id is None:
        raise ValueError(f"target {spec!r} has no tokenizer with an eos token: replies would never end")
    if harmony_template(tokenizer):
        raise ValueError(
            f"target {spec!r} writes its replies in the harmony format (analysis and final channels, gpt-oss); "
            "regenerate would flatten the channels into one reply, so it refuses"
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model: Any = load_pretrained(AutoModelForCausalLM, str(path), dtype)
    return model.to(device).eval(), tokenizer


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="specdec-train regenerate",
        allow_abbrev=False,
        description="Rewrite a dataset's assistant turns with the target's own replies (for drafter training)",
        epilog="Exit codes: 0 done; 2 bad arguments, a missing file, or settings that differ from the run being "
        "resumed.",
    )
    ap.add_argument("--target", required=True, help="tiny-trained or a Hugging Face model directory")
    ap.add_argument("--data", default="shipped", help="shipped (the corpus the project ships) or a JSONL file")
    ap.add_argument("--out", required=True, type=Path, help="the regenerated JSONL (resumed when it exists)")
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default); > 0: sampled at it")
    ap.add_argument("--seed", type=int, default=0, help="the sampling seed")
    ap.add_argument("--batch-size", type=int, default=32, help="conversations answered together")
    ap.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"the longest reply, in tokens (default {DEFAULT_MAX_NEW_TOKENS}: the longest training bucket)",
    )
    ap.add_argument(
        "--max-length",
        type=int,
        help=f"prompt + reply tokens at most (default: --max-new-tokens + {LONGEST_BUCKET}); a conversation is kept "
        "up to the last turn that fits",
    )
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--restart", action="store_true", help="start over, whatever was done before")
    ap.add_argument("--json", action="store_true", help="the final counts as one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.max_length is None:
        args.max_length = args.max_new_tokens + LONGEST_BUCKET
    if not 0 <= args.temperature < math.inf:  # NaN too: it compares false, and sampled as if greedy
        ap.error("--temperature must be a number >= 0")
    from engine.trainer.verifier.model import device_refusal

    reason = device_refusal(args.device)
    if reason is not None:
        ap.error(f"--device {args.device}: {reason}")
    reason = target_problem(args.target)
    if reason is not None:
        ap.error(f"--target {reason}")
    for key in ("batch_size", "max_new_tokens", "max_length"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    def say(line: str) -> None:
        print(f"regenerate: {line}", file=sys.stderr, flush=True)

    source = shipped_corpus_path() if args.data == "shipped" else Path(args.data).expanduser()
    try:
        problem = data_file_problem(source)
        if problem is not None:
            raise ValueError(f"--data {source} {problem}")
        check_out(source, args.out)
    except (ValueError, OSError) as exc:
        print(f"specdec-train regenerate: {exc}", file=sys.stderr)
        return 2
    settings = Settings(
        source=str(source.resolve()),
        target=args.target,
        temperature=args.temperature,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
    )
    device = torch.device(args.device)
    try:
        model, tokenizer = load_model(args.target, device)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        replier = Replier(model, tokenizer, device, settings)
        say(replier.describe())
        progress = regenerate(
            replier,
            source,
            args.out,
            batch_size=args.batch_size,
            restart=args.restart,
            say=say,
        )
    except (ValueError, OSError) as exc:
        print(f"specdec-train regenerate: {exc}", file=sys.stderr)
        return 2
    how = "greedy" if args.temperature == 0 else f"sampled at temperature {args.temperature:g}"
    skipped = ", ".join(f"{n} {why}" for why, n in sorted(progress.skipped.items())) or "none"
    notes = ", ".join(f"{n} {what}" for what, n in sorted(progress.notes.items()) if n) or "none"
    say(
        f"done: {progress.written} conversations ({progress.replies} replies, {progress.reply_tokens} tokens, "
        f"{how}) in {args.out}; skipped: {skipped}; notes: {notes}"
    )
    if args.json:
        print(json.dumps({**progress.to_dict(), "out": str(args.out)}))
    return 0
