"""Training data: ShareGPT-style conversations tokenized with the target's chat template, or random tokens.

A batch is a pure function of its index (epoch permutation seeded by ``seed + epoch``), so a checkpoint's data
position is the set of indices trained (dispatch.IndexLedger) and a resumed run reads exactly the batches it had
not trained. Nothing is dropped silently: every conversation not trained on is counted with its reason.
With ``packing`` a row of a bucket holds several conversations (data/packing.py) instead of one and padding.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from engine.trainer.config import ConfigError
from engine.trainer.data.cache import TokenizedCorpus, load_or_build
from engine.trainer.data.holdout import heldout_indices
from engine.trainer.data.packing import PackingPlan, pack_rows
from engine.trainer.data.rows import SKIP_NOT_JSON as SKIP_NOT_JSON  # where the data tests and readers look
from engine.trainer.data.rows import BadRow, LoadingStopped, check_turns, parse_row, read_rows

ROLE_ALIASES: dict[str, str] = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "model": "assistant",
    "system": "system",
}


def shipped_corpus_path() -> Path:
    return Path(__file__).parent / "corpus" / "corpus.jsonl"


@dataclass
class HostBatch:
    """One batch on the host: token ids and the loss mask (1 on assistant tokens), padded to a bucket."""

    index: int
    input_ids: torch.Tensor  # (B, T) long
    loss_mask: torch.Tensor  # (B, T) float32
    bucket: int
    # (B, T) int64, packed rows only: each row's conversations numbered from 0, the padding after them one more
    documents: torch.Tensor | None = None
    conversation_tokens: int | None = None  # tokens inside conversations (None: every token is)

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def useful_tokens(self) -> int:
        """Tokens inside conversations, padding left out."""
        return self.tokens if self.conversation_tokens is None else self.conversation_tokens


class BatchSource(Protocol):
    buckets: list[int]
    batch_size: int

    def batch(self, index: int) -> HostBatch: ...

    def describe(self) -> str: ...

    def token_counts(self, vocab_size: int) -> torch.Tensor: ...


SKIP_NO_ASSISTANT = "no assistant turn"
SKIP_NOT_CONVERSATION = "not a conversation object"
CONVERSATION_SHAPE = "conversations or messages: a list of turns"
BAD_LINES_SHOWN = 5  # file:line of the first malformed lines, kept to show; the rest are only counted
SKIP_TEMPLATE_ERROR = "chat template error"
SKIP_EMPTY_MASK = "no assistant tokens after templating"
SKIP_TOO_LONG = "assistant tokens beyond the longest bucket"
# Tokenizing is chunked so that progress can be reported; at most this many conversations per chunk.
TOKENIZE_CHUNK = 512
PROGRESS_EVERY_PCT = 10
_PROBE_REPLY = "specdec-probe-reply"


class DataError(ConfigError):
    """A malformed data line under ``strict_data = true``: the run stops (exit 2) naming the file and line."""


def _turns(row: Any) -> list[Any] | None:
    """The turn list of one row, or None when the row is no conversation object."""
    if not isinstance(row, dict):
        return None
    turns = row.get("conversations") or row.get("messages") or []
    if not isinstance(turns, list) or not all(isinstance(t, dict) for t in turns):
        return None
    return turns


def load_conversations(
    path: str | Path,
    skipped: Counter[str] | None = None,
    *,
    strict: bool = False,
    bad_lines: list[str] | None = None,
    should_stop: Callable[[], str | None] | None = None,
) -> list[list[dict[str, str]]]:
    """ShareGPT (``conversations: [{from, value}]``) or chat (``messages: [{role, content}]``) JSON lines.

    Rows without an assistant turn are left out (counted in ``skipped``); so are the rows that cannot be read
    (longer than ``rows.MAX_ROW_BYTES``, not UTF-8, not JSON, nested too deeply, a number too long, more than
    ``rows.MAX_ROW_TURNS`` turns, not a conversation object), whose first few ``file:line: reason`` go to
    ``bad_lines``; ``strict`` raises DataError at the first one instead. A long row is never held in memory
    (data/rows.py). The held-out split indexes the list this returns."""
    convs: list[list[dict[str, str]]] = []
    for row in read_rows(path, should_stop=should_stop):
        try:
            turns = _turns(parse_row(row))
            if turns is None:
                raise BadRow(SKIP_NOT_CONVERSATION, f"{SKIP_NOT_CONVERSATION} ({CONVERSATION_SHAPE})")
            check_turns(turns)
        except BadRow as bad:
            where = f"{path}:{row.lineno}: {bad.detail}"
            if strict:
                raise DataError(f"strict_data: {where}") from None
            if skipped is not None:
                skipped[bad.reason] += 1
            if bad_lines is not None and len(bad_lines) < BAD_LINES_SHOWN:
                bad_lines.append(where)
            continue
        msgs: list[dict[str, str]] = []
        for turn in turns:
            role = ROLE_ALIASES.get(str(turn.get("from", turn.get("role", ""))).lower())
            content = turn.get("value", turn.get("content"))
            if role is None or not isinstance(content, str):
                continue
            msgs.append({"role": role, "content": content})
        if any(m["role"] == "assistant" for m in msgs):
            convs.append(msgs)
        elif skipped is not None:
            skipped[SKIP_NO_ASSISTANT] += 1
    if not convs:
        why = ", ".join(f"{n} {reason}" for reason, n in sorted((skipped or {}).items()))
        because = f" (skipped: {why})" if why else ""
        raise ConfigError(f"data: {path}: no conversation with an assistant turn{because}")
    return convs


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    text: str = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return text


def end_of_turn_marker(tokenizer: Any) -> str:
    """What the chat template writes after an assistant reply (``<|eot_id|>``, ``<|im_end|>\\n``, ...)."""
    probe = [{"role": "user", "content": "specdec-probe"}, {"role": "assistant", "content": _PROBE_REPLY}]
    text = _render(tokenizer, probe)
    at = text.rfind(_PROBE_REPLY)
    return text[at + len(_PROBE_REPLY) :] if at >= 0 else ""


def _reply_variants(content: str) -> list[str]:
    """The forms a template may render a reply in: as given, trimmed, without a leading reasoning block."""
    after_think = content.split("</think>")[-1].lstrip("\n")
    out: list[str] = []
    for v in (content, content.strip(), after_think, after_think.strip()):
        if v and v not in out:
            out.append(v)
    return out


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _safe_render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> str | None:
    """The rendering of a conversation prefix, or None where the template refuses it (e.g. no user turn yet)."""
    from jinja2 import TemplateError

    try:
        return _render(tokenizer, messages, generation_prompt)
    except TemplateError:
        return None


def assistant_spans(
    tokenizer: Any, messages: list[dict[str, str]], end_of_turn: str
) -> tuple[str, list[tuple[int, int]]]:
    """The chat-templated text and the character spans the model generates: each assistant turn from the end of
    the generation prompt through the end-of-turn marker.

    Templates trim replies (Llama 3.1: ``content | trim``) and rewrite them (Qwen3 drops earlier turns' reasoning
    and adds an empty ``<think>`` block to the last one), so a turn is found from the renderings of the
    conversation's prefixes, not by searching its content: it starts where ``messages[:k]`` plus the generation
    prompt stops matching the full text and ends where ``messages[:k + 1]`` ends (or, where later turns change
    how it is rendered, at its end-of-turn marker). The reply's own text is searched only as a last resort.
    """
    full = _render(tokenizer, messages)
    spans: list[tuple[int, int]] = []
    cursor = 0
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        start: int | None = None
        before = _safe_render(tokenizer, messages[:k]) if k else ""
        prompt = _safe_render(tokenizer, messages[:k], generation_prompt=True) if k else None
        if before is not None and full.startswith(before) and len(before) >= cursor and prompt is not None:
            start = max(len(before), _common_prefix_len(prompt, full))
        if start is None or start >= len(full):
            start = None
            for variant in _reply_variants(msg["content"]):
                at = full.find(variant, cursor)
                if at >= 0:
                    start = at
                    break
        if start is None:
            continue
        end: int | None = None
        upto = _safe_render(tokenizer, messages[: k + 1])
        if upto is not None and full.startswith(upto) and len(upto) > start:
            end = len(upto)
        elif end_of_turn:
            at = full.find(end_of_turn, start)
            if at >= 0:
                end = at + len(end_of_turn)
        if end is None:
            for variant in _reply_variants(msg["content"]):
                at = full.find(variant, start)
                if at >= 0:
                    end = at + len(variant)
                    break
        if end is None or end <= start:
            continue
        spans.append((start, end))
        cursor = end
    return full, spans


def _mask_from_offsets(offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> list[int]:
    mask = [0] * len(offsets)
    si = 0
    for i, (a, _b) in enumerate(offsets):
        while si < len(spans) and a >= spans[si][1]:
            si += 1
        if si < len(spans) and spans[si][0] <= a < spans[si][1]:
            mask[i] = 1
    return mask


def tokenize_conversations(
    tokenizer: Any, conversations: list[list[dict[str, str]]], end_of_turn: str | None = None
) -> list[tuple[list[int], list[int]] | str]:
    """Per conversation: its token ids and a mask that is 1 on the tokens the model generates (assistant turns),
    or the reason it cannot be trained on (a template error)."""
    from jinja2 import TemplateError

    eot = end_of_turn_marker(tokenizer) if end_of_turn is None else end_of_turn
    rendered: list[tuple[str, list[tuple[int, int]]] | str] = []
    for msgs in conversations:
        try:
            rendered.append(assistant_spans(tokenizer, msgs, eot))
        except TemplateError:
            rendered.append(SKIP_TEMPLATE_ERROR)
    texts = [r[0] for r in rendered if not isinstance(r, str)]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True) if texts else None
    out: list[tuple[list[int], list[int]] | str] = []
    j = 0
    for r in rendered:
        if isinstance(r, str):
            out.append(r)
            continue
        assert enc is not None
        ids, offsets = enc["input_ids"][j], enc["offset_mapping"][j]
        j += 1
        out.append((list(ids), _mask_from_offsets(list(offsets), r[1])))
    return out


def pick_bucket(length: int, buckets: list[int]) -> int:
    for b in buckets:
        if length <= b:
            return b
    return buckets[-1]


def build_corpus(
    tokenizer: Any,
    path: str | Path,
    *,
    max_tokens: int,
    eval_holdout: int,
    seed: int,
    progress: Callable[[str], None] | None = None,
    strict: bool = False,
    should_stop: Callable[[], str | None] | None = None,
) -> TokenizedCorpus:
    """Tokenize every conversation of ``path`` except the held-out ones, counting what is skipped and why, and
    the trained token frequencies (the draft vocabulary's input), with a progress line every 10 %. ``should_stop``
    (a stop signal's name, or None) is asked between rows and between chunks: LoadingStopped."""
    skipped: Counter[str] = Counter()
    bad_lines: list[str] = []
    convs = load_conversations(path, skipped, strict=strict, bad_lines=bad_lines, should_stop=should_stop)
    heldout = heldout_indices(len(convs), eval_holdout, seed)
    train = [c for i, c in enumerate(convs) if i not in heldout]
    eot = end_of_turn_marker(tokenizer)
    ids_parts: list[torch.Tensor] = []
    mask_parts: list[torch.Tensor] = []
    lengths: list[int] = []
    truncated = 0
    next_pct = PROGRESS_EVERY_PCT
    chunk = max(1, min(TOKENIZE_CHUNK, -(-len(train) // (100 // PROGRESS_EVERY_PCT))))
    for lo in range(0, len(train), chunk):
        if should_stop is not None and (signal_name := should_stop()):
            raise LoadingStopped(f"stopped ({signal_name}) while tokenizing {path}")
        for got in tokenize_conversations(tokenizer, train[lo : lo + chunk], eot):
            if isinstance(got, str):
                skipped[got] += 1
                continue
            ids, mask = got
            if sum(mask) == 0:
                skipped[SKIP_EMPTY_MASK] += 1
                continue
            if len(ids) > max_tokens:
                if sum(mask[:max_tokens]) == 0:
                    skipped[SKIP_TOO_LONG] += 1
                    continue
                truncated += 1
                ids, mask = ids[:max_tokens], mask[:max_tokens]
            ids_parts.append(torch.tensor(ids, dtype=torch.int32))
            mask_parts.append(torch.tensor(mask, dtype=torch.bool))
            lengths.append(len(ids))
        done = min(lo + chunk, len(train))
        pct = 100 * done // max(1, len(train))
        if progress is not None and (pct >= next_pct or done == len(train)):
            progress(f"tokenized {pct}% ({done}/{len(train)} conversations)")
            next_pct = (pct // PROGRESS_EVERY_PCT + 1) * PROGRESS_EVERY_PCT
    flat_ids = torch.cat(ids_parts) if ids_parts else torch.zeros(0, dtype=torch.int32)
    flat_mask = torch.cat(mask_parts) if mask_parts else torch.zeros(0, dtype=torch.bool)
    offsets = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    if lengths:
        offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    vocab = max(len(tokenizer), int(flat_ids.max()) + 1 if flat_ids.numel() else 0)
    counts = torch.bincount(flat_ids[flat_mask].long(), minlength=vocab)
    return TokenizedCorpus(
        ids=flat_ids,
        mask=flat_mask,
        offsets=offsets,
        token_counts=counts,
        conversations=len(convs),
        heldout=sorted(heldout),
        skipped=dict(skipped),
        truncated=truncated,
        bad_lines=bad_lines,
    )


class ConversationSource:
    """Tokenized conversations, batched by a seeded per-epoch permutation, padded to fixed length buckets.

    The ``eval_holdout`` conversations chosen by ``holdout.heldout_indices`` are never trained on;
    ``heldout_conversations()`` returns them for measuring acceptance. With a ``cache_dir`` the tokenized
    corpus (and its token counts) is kept on disk, keyed by everything it depends on, so a restart does not
    tokenize again. ``packing``: rows of the longest bucket filled with several conversations (``PackingPlan``),
    each batch in the smallest bucket its fullest row fits.
    """

    def __init__(
        self,
        tokenizer: Any,
        path: str | Path,
        *,
        buckets: list[int],
        batch_size: int,
        seed: int,
        pad_id: int | None = None,
        eval_holdout: int = 0,
        cache_dir: str | Path | None = None,
        progress: Callable[[str], None] | None = None,
        strict: bool = False,
        packing: bool = False,
        should_stop: Callable[[], str | None] | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.batch_size = batch_size
        self.packing = packing
        self.seed = seed
        self.path = Path(path)
        self.eval_holdout = eval_holdout
        pid = pad_id if pad_id is not None else getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pid) if pid is not None else 0

        def build() -> TokenizedCorpus:
            return build_corpus(
                tokenizer,
                path,
                max_tokens=self.buckets[-1],
                eval_holdout=eval_holdout,
                seed=seed,
                progress=progress,
                strict=strict,
                should_stop=should_stop,
            )

        self.cache_hit = False
        self.cache_path: Path | None = None
        if cache_dir is not None:
            self.corpus, self.cache_path, self.cache_hit = load_or_build(
                Path(cache_dir),
                tokenizer,
                self.path,
                max_tokens=self.buckets[-1],
                eval_holdout=eval_holdout,
                seed=seed,
                build=build,
                say=progress,
                should_stop=should_stop,
            )
        else:
            self.corpus = build()
        self.skipped = dict(self.corpus.skipped)
        self.bad_lines = list(self.corpus.bad_lines)
        if strict and self.bad_lines:  # a cache built without strict_data kept the file's malformed lines
            raise DataError(f"strict_data: {self.bad_lines[0]}")
        self.heldout_indices = list(self.corpus.heldout)
        n = self.corpus.examples
        if n < batch_size:
            raise ConfigError(f"batch_size: {path} has {n} usable conversations, fewer than batch_size {batch_size}")
        self.batches_per_epoch = n // batch_size
        self.plan: PackingPlan | None = None
        if packing:
            self.plan = PackingPlan.build(
                self.corpus.lengths(), capacity=self.buckets[-1], batch_size=batch_size, seed=seed
            )
            self.batches_per_epoch = self.plan.batches_per_epoch
        self._perm_lock = threading.Lock()
        self._perms: dict[int, list[int]] = {}

    @property
    def examples(self) -> int:
        return self.corpus.examples

    def heldout_conversations(self) -> list[list[dict[str, str]]]:
        """The held-out conversations (file order), as ``load_conversations`` returns them."""
        convs = load_conversations(self.path)
        return [convs[i] for i in self.heldout_indices]

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """How often each token id is trained on over the whole training set, ``(vocab_size,)`` int64."""
        counts = self.corpus.token_counts
        out = torch.zeros(vocab_size, dtype=torch.long)
        n = min(vocab_size, counts.numel())
        out[:n] = counts[:n]
        return out

    def _perm(self, epoch: int) -> list[int]:
        with self._perm_lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = list(range(self.corpus.examples))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
                self._perms = {epoch: perm}  # keep only the current epoch's
            return perm

    def example(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        lo, hi = int(self.corpus.offsets[i]), int(self.corpus.offsets[i + 1])
        return self.corpus.ids[lo:hi], self.corpus.mask[lo:hi]

    def batch(self, index: int) -> HostBatch:
        if self.plan is not None:
            return self.packed_batch(index)
        epoch, offset = divmod(index, self.batches_per_epoch)
        perm = self._perm(epoch)
        rows = [self.example(perm[offset * self.batch_size + j]) for j in range(self.batch_size)]
        bucket = pick_bucket(max(int(ids.numel()) for ids, _ in rows), self.buckets)
        ids_t = torch.full((self.batch_size, bucket), self.pad_id, dtype=torch.long)
        mask_t = torch.zeros((self.batch_size, bucket), dtype=torch.float32)
        for j, (ids, mask) in enumerate(rows):
            n = min(int(ids.numel()), bucket)
            ids_t[j, :n] = ids[:n].long()
            mask_t[j, :n] = mask[:n].float()
        useful = sum(min(int(ids.numel()), bucket) for ids, _ in rows)
        return HostBatch(index=index, input_ids=ids_t, loss_mask=mask_t, bucket=bucket, conversation_tokens=useful)

    def packed_batch(self, index: int) -> HostBatch:
        """Batch ``index`` of the packing plan: ``batch_size`` rows, each several whole conversations."""
        assert self.plan is not None
        rows = [[self.example(i) for i in row] for row in self.plan.batch_rows(index)]
        filled = [sum(int(ids.numel()) for ids, _ in row) for row in rows]
        bucket = pick_bucket(max(filled), self.buckets)
        ids_t, mask_t, docs_t = pack_rows(rows, bucket, self.pad_id)
        return HostBatch(
            index=index,
            input_ids=ids_t,
            loss_mask=mask_t,
            bucket=bucket,
            documents=docs_t,
            conversation_tokens=sum(filled),
        )

    def describe(self) -> str:
        held = f", {len(self.heldout_indices)} held out" if self.heldout_indices else ""
        packed = ""
        if self.plan is not None:
            packed = f", packed {self.corpus.examples / max(1, len(self.plan.rows)):.1f} a row"
        return (
            f"{self.corpus.examples} conversations from {self.path}{held} "
            f"({self.batches_per_epoch} batches/epoch{packed})"
        )


class RandomTokenSource:
    """Random token ids at the largest bucket, every position trained: for throughput work without data."""

    def __init__(self, vocab_size: int, *, buckets: list[int], batch_size: int, seed: int) -> None:
        self.buckets = list(buckets)
        self.batch_size = batch_size
        self.vocab_size = vocab_size
        self.seed = seed

    def batch(self, index: int) -> HostBatch:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        t = self.buckets[-1]
        ids = torch.randint(0, self.vocab_size, (self.batch_size, t), generator=g)
        return HostBatch(index=index, input_ids=ids, loss_mask=torch.ones(self.batch_size, t), bucket=t)

    def token_counts(self, vocab_size: int) -> torch.Tensor:
        """Random ids are uniform: every id has the same expected count (the draft vocabulary is the lowest ids)."""
        return torch.ones(vocab_size, dtype=torch.long)

    def describe(self) -> str:
        return f"random tokens (vocab {self.vocab_size}, {self.batch_size}x{self.buckets[-1]})"
