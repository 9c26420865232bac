"""``specdec-train regenerate``: a dataset's assistant turns rewritten with the target's own replies.

A drafter learns to predict what it is trained on. Trained on the corpus text, it predicts the corpus, yet a
server asks it to predict the target, whose replies differ (the ``tiny-trained`` drafter's first proposal matches
0.75 of held-out corpus tokens and 0.37 of the target's own greedy replies). EAGLE, SpecForge and speculators
therefore regenerate the assistant turns with the target before training; this is that step.

    specdec-train regenerate --target tiny-trained --out regen.jsonl [--data shipped|FILE]
        [--temperature 0] [--seed 0] [--batch-size 32] [--max-new-tokens 256] [--max-length 2048] [--device cpu]

Each conversation keeps its system and user turns word for word and its turn structure; every assistant turn is
replaced, in order, by the target's reply to the conversation so far (earlier turns already regenerated, as the
target would have had them). Greedy at ``--temperature 0``, else sampled at that temperature (seeded per batch, so
a resumed run draws what an uninterrupted one would) and nothing else: the target's shipped sampling settings
(a repetition penalty, top-p, top-k) are not inherited. A reply ends at the target's first stop token (the
tokenizer's eos and the generation config's eos ids, target/stops.py), where a server ends it. The settings given
to generate() are in the log and in ``<out>.progress.json``. A target with the harmony chat format (gpt-oss:
channels in each reply) is refused (exit 2). Batched across conversations, one turn at a time.

The output is chat JSON lines (``{"messages": [{role, content}], "source_line": N}``) in input order, which any
run takes as ``data = "/path/regen.jsonl"``. Progress goes to stderr. It is resumable: ``<out>.progress.json``
records the rows done and the output's length after every batch, and a second run with the same settings goes on
from there (other settings: an error, unless ``--restart``). Rows that cannot be regenerated are left out and
counted by reason (not JSON, no user turn before an assistant turn, no assistant turn, prompt too long for
``--max-length``); a reply that reaches ``--max-new-tokens`` is kept, cut, and counted.
Exit codes: 0 done, 2 bad arguments or settings that differ from the run being resumed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.trainer.data.sources import ROLE_ALIASES, shipped_corpus_path
from engine.trainer.target.stops import first_stop, target_stop_ids

SKIP_NOT_JSON = "not JSON"
SKIP_NO_USER = "no user turn before an assistant turn"
SKIP_NO_ASSISTANT = "no assistant turn"
SKIP_TOO_LONG = "prompt too long for --max-length"
NOTE_CUT = "replies cut at --max-new-tokens"
NOTE_EMPTY = "empty replies"
PROGRESS_SUFFIX = ".progress.json"

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


def parse_row(line: str) -> list[Message] | str:
    """The conversation of one JSON line (ShareGPT or chat, roles normalised), or the reason it cannot be used."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError:
        return SKIP_NOT_JSON
    turns = (row.get("conversations") or row.get("messages") or []) if isinstance(row, dict) else []
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


def source_rows(path: Path, start: int) -> Iterator[tuple[int, str]]:
    """(row number, line) of the non-blank lines from row ``start`` on."""
    with path.open(encoding="utf-8") as f:
        row = 0
        for line in f:
            if not line.strip():
                continue
            if row >= start:
                yield row, line
            row += 1


def batched(rows: Iterator[tuple[int, str]], size: int) -> Iterator[list[tuple[int, str]]]:
    batch: list[tuple[int, str]] = []
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
    top-k, top-p or penalty), stopping at the target's stop ids (target/stops.py). The model's shipped generation
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


def regenerate_batch(replier: Replier, convs: list[list[Message]], seed: int, progress: Progress) -> list[bool]:
    """Rewrites the assistant turns of ``convs`` in place, turn by turn across the batch; False for a
    conversation whose prompt outgrew ``max_length`` (it is left out)."""
    settings = replier.settings
    alive = [True] * len(convs)
    turn = 0
    while True:
        todo: list[tuple[int, int, list[int]]] = []  # (conversation, message index, prompt ids)
        for c, conv in enumerate(convs):
            at = [i for i, m in enumerate(conv) if m["role"] == "assistant"]
            if not alive[c] or turn >= len(at):
                continue
            ids = replier.prompt(conv[: at[turn]])
            if len(ids) + settings.max_new_tokens > settings.max_length:
                alive[c] = False
                continue
            todo.append((c, at[turn], ids))
        if not todo:
            return alive
        replies = replier.replies([ids for _, _, ids in todo], seed * 1_000_003 + turn)
        for (c, i, _), (reply, cut) in zip(todo, replies, strict=True):
            convs[c][i] = {"role": "assistant", "content": replier.text(reply)}
            progress.replies += 1
            progress.reply_tokens += len(reply)
            progress.notes[NOTE_CUT] += int(cut)
            progress.notes[NOTE_EMPTY] += int(not reply)
        turn += 1


def load_progress(out: Path, settings: Settings, restart: bool) -> Progress:
    """Where a previous run stopped (the output cut back to its last complete batch), or a fresh start."""
    marker = out.with_name(out.name + PROGRESS_SUFFIX)
    if restart or not marker.is_file():
        out.write_bytes(b"")
        return Progress(settings=settings.as_dict())
    progress = Progress.from_dict(json.loads(marker.read_text(encoding="utf-8")))
    if progress.settings != settings.as_dict():
        differ = sorted(k for k, v in settings.as_dict().items() if progress.settings.get(k) != v)
        raise ValueError(f"{out} was started with other settings ({', '.join(differ)}); --restart to start over")
    with out.open("r+b") as f:  # a batch written after the last marker update is dropped and done again
        f.truncate(progress.output_bytes)
    return progress


def save_progress(out: Path, progress: Progress) -> None:
    marker = out.with_name(out.name + PROGRESS_SUFFIX)
    tmp = marker.with_name(marker.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(progress.to_dict(), indent=1), encoding="utf-8")
    os.replace(tmp, marker)


def regenerate(replier: Replier, source: Path, out: Path, *, batch_size: int, restart: bool, say: Say) -> Progress:
    progress = load_progress(out, replier.settings, restart)
    total = sum(1 for _ in source_rows(source, 0))
    if progress.rows_done:
        say(f"resuming at row {progress.rows_done}/{total} ({progress.written} conversations written)")
    t0 = time.perf_counter()
    tokens0 = progress.reply_tokens
    with out.open("ab") as f:
        for batch in batched(source_rows(source, progress.rows_done), batch_size):
            usable: list[tuple[int, list[Message]]] = []
            for row, line in batch:
                parsed = parse_row(line)
                if isinstance(parsed, str):
                    progress.skipped[parsed] += 1
                else:
                    usable.append((row, parsed))
            convs = [conv for _, conv in usable]
            kept = regenerate_batch(replier, convs, replier.settings.seed + batch[0][0], progress) if convs else []
            for (row, _), conv, ok in zip(usable, convs, kept, strict=True):
                if not ok:
                    progress.skipped[SKIP_TOO_LONG] += 1
                    continue
                f.write((json.dumps({"messages": conv, "source_line": row + 1}) + "\n").encode())
                progress.written += 1
            f.flush()
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
    """The target's model and tokenizer: ``tiny-trained`` or a Hugging Face directory (not a random preset)."""
    from transformers import AutoModelForCausalLM

    from engine.trainer.target.model import load_tokenizer

    if spec in ("tiny", "llama3-8b-shape"):
        raise ValueError(f"target {spec!r} has random weights: its replies would teach the drafter nothing")
    path = spec
    if spec == "tiny-trained":
        from engine.trainer.target.builtin import ensure_built

        path = str(ensure_built())
    tokenizer = load_tokenizer(spec)
    if tokenizer is None or tokenizer.eos_token_id is None:
        raise ValueError(f"target {spec!r} has no tokenizer with an eos token: replies would never end")
    if harmony_template(tokenizer):
        raise ValueError(
            f"target {spec!r} writes its replies in the harmony format (analysis and final channels, gpt-oss); "
            "regenerate would flatten the channels into one reply, so it refuses"
        )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model: Any = AutoModelForCausalLM.from_pretrained(str(Path(path).expanduser()), dtype=dtype)
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
    ap.add_argument("--max-new-tokens", type=int, default=256, help="the longest reply, in tokens")
    ap.add_argument("--max-length", type=int, default=2048, help="prompt + reply tokens at most; longer: skipped")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--restart", action="store_true", help="start over, whatever was done before")
    ap.add_argument("--json", action="store_true", help="the final counts as one JSON object on stdout")
    args = ap.parse_args(argv)
    if args.temperature < 0:
        ap.error("--temperature must be >= 0")
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
    if not source.is_file():
        print(f"specdec-train regenerate: {source}: no such file", file=sys.stderr)
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
