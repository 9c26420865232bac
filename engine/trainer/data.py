"""Training data: ShareGPT-style conversations tokenized with the target's chat template, or random tokens.

A batch is a pure function of its index (epoch permutation seeded by ``seed + epoch``), so the data
position of a checkpoint is one integer and a resumed run reads exactly the batches it would have read.
"""

from __future__ import annotations

import json
import random
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

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

    @property
    def tokens(self) -> int:
        return int(self.input_ids.numel())


class BatchSource(Protocol):
    buckets: list[int]
    batch_size: int

    def batch(self, index: int) -> HostBatch: ...

    def describe(self) -> str: ...


def load_conversations(path: str | Path) -> list[list[dict[str, str]]]:
    """ShareGPT (``conversations: [{from, value}]``) or chat (``messages: [{role, content}]``) JSON lines."""
    convs: list[list[dict[str, str]]] = []
    with Path(path).open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{lineno}: not JSON: {exc}") from exc
            turns = row.get("conversations") or row.get("messages") or []
            msgs: list[dict[str, str]] = []
            for turn in turns:
                role = ROLE_ALIASES.get(str(turn.get("from", turn.get("role", ""))).lower())
                content = turn.get("value", turn.get("content"))
                if role is None or not isinstance(content, str):
                    continue
                msgs.append({"role": role, "content": content})
            if any(m["role"] == "assistant" for m in msgs):
                convs.append(msgs)
    if not convs:
        raise ValueError(f"{path}: no conversation with an assistant turn")
    return convs


def _assistant_spans(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, list[tuple[int, int]]]:
    """The chat-templated text and the character spans of assistant content (through the end-of-turn marker)."""
    full: str = tokenizer.apply_chat_template(messages, tokenize=False)
    spans: list[tuple[int, int]] = []
    search_from = 0
    for k, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        upto: str = tokenizer.apply_chat_template(messages[: k + 1], tokenize=False)
        end = len(upto) if full.startswith(upto) else -1
        start = full.find(msg["content"], search_from)
        if start < 0:
            continue
        end = max(end, start + len(msg["content"]))
        spans.append((start, end))
        search_from = end
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
    tokenizer: Any, conversations: list[list[dict[str, str]]]
) -> list[tuple[list[int], list[int]]]:
    """Token ids of each chat-templated conversation and a mask that is 1 on assistant content tokens."""
    rendered = [_assistant_spans(tokenizer, msgs) for msgs in conversations]
    enc = tokenizer([text for text, _ in rendered], add_special_tokens=False, return_offsets_mapping=True)
    return [
        (list(ids), _mask_from_offsets(list(offsets), spans))
        for ids, offsets, (_, spans) in zip(enc["input_ids"], enc["offset_mapping"], rendered, strict=True)
    ]


def tokenize_conversation(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    return tokenize_conversations(tokenizer, [messages])[0]


def pick_bucket(length: int, buckets: list[int]) -> int:
    for b in buckets:
        if length <= b:
            return b
    return buckets[-1]


class ConversationSource:
    """Tokenized conversations, batched by a seeded per-epoch permutation, padded to fixed length buckets."""

    def __init__(
        self,
        tokenizer: Any,
        path: str | Path,
        *,
        buckets: list[int],
        batch_size: int,
        seed: int,
        pad_id: int | None = None,
    ) -> None:
        self.buckets = list(buckets)
        self.batch_size = batch_size
        self.seed = seed
        self.path = Path(path)
        pid = pad_id if pad_id is not None else getattr(tokenizer, "pad_token_id", None)
        self.pad_id = int(pid) if pid is not None else 0
        self.examples: list[tuple[list[int], list[int]]] = []
        for ids, mask in tokenize_conversations(tokenizer, load_conversations(path)):
            if sum(mask) == 0:
                continue
            self.examples.append((ids[: self.buckets[-1]], mask[: self.buckets[-1]]))
        if len(self.examples) < batch_size:
            raise ValueError(f"{path}: {len(self.examples)} usable conversations, fewer than batch_size {batch_size}")
        self.batches_per_epoch = len(self.examples) // batch_size
        self._perm_lock = threading.Lock()
        self._perms: dict[int, list[int]] = {}

    def _perm(self, epoch: int) -> list[int]:
        with self._perm_lock:
            perm = self._perms.get(epoch)
            if perm is None:
                perm = list(range(len(self.examples)))
                random.Random(self.seed * 1_000_003 + epoch).shuffle(perm)
                self._perms = {epoch: perm}  # keep only the current epoch's
            return perm

    def batch(self, index: int) -> HostBatch:
        epoch, offset = divmod(index, self.batches_per_epoch)
        perm = self._perm(epoch)
        rows = [self.examples[perm[offset * self.batch_size + j]] for j in range(self.batch_size)]
        bucket = pick_bucket(max(len(ids) for ids, _ in rows), self.buckets)
        ids_t = torch.full((self.batch_size, bucket), self.pad_id, dtype=torch.long)
        mask_t = torch.zeros((self.batch_size, bucket), dtype=torch.float32)
        for j, (ids, mask) in enumerate(rows):
            n = min(len(ids), bucket)
            ids_t[j, :n] = torch.tensor(ids[:n], dtype=torch.long)
            mask_t[j, :n] = torch.tensor(mask[:n], dtype=torch.float32)
        return HostBatch(index=index, input_ids=ids_t, loss_mask=mask_t, bucket=bucket)

    def describe(self) -> str:
        return f"{len(self.examples)} conversations from {self.path} ({self.batches_per_epoch} batches/epoch)"


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

    def describe(self) -> str:
        return f"random tokens (vocab {self.vocab_size}, {self.batch_size}x{self.buckets[-1]})"
