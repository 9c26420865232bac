"""The tokenized training data (``TokenizedCorpus``, built by data.sources) kept on disk, so a restart does not
tokenize (or count tokens) again.

One file per key under the cache directory, named by the key's hash. The key holds everything the tokenized
corpus depends on: the tokenizer (a hash of its vocabulary, merges, normalizers and special tokens), the chat
template, the data file's sha256, the longest bucket (examples are cut to it) and the held-out split. A file
that cannot be read or whose key does not match is rebuilt, and the rebuild is said.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from engine.trainer.data.rows import LoadingStopped, open_regular

# Bump when TokenizedCorpus, the mask rule or the rows read change: older files are then rebuilt. 2: rows past
# data/rows.py's limits (size, turns) and rows that are not UTF-8 are skipped, no longer tokenized or replaced.
CACHE_FORMAT = 2
READ_CHUNK_BYTES = 1 << 20


@dataclass
class TokenizedCorpus:
    """The training conversations tokenized and cut to the longest bucket, flattened: example ``i`` is
    ``ids[offsets[i]:offsets[i + 1]]`` (and the same slice of ``mask``)."""

    ids: torch.Tensor  # (N,) int32
    mask: torch.Tensor  # (N,) bool: the tokens the model generates
    offsets: torch.Tensor  # (E + 1,) int64
    token_counts: torch.Tensor  # (V,) int64: how often each token id is trained on, over every example
    conversations: int  # conversations in the file (with an assistant turn), held-out ones included
    heldout: list[int]  # conversation indices (file order) kept out of training
    skipped: dict[str, int]  # conversations not trained on, by reason
    truncated: int  # conversations cut to the longest bucket (still trained on)
    bad_lines: list[str] = field(default_factory=list)  # "file:line: reason" of the first malformed lines

    @property
    def examples(self) -> int:
        return int(self.offsets.numel()) - 1

    def lengths(self) -> list[int]:
        """Each example's token count."""
        return (self.offsets[1:] - self.offsets[:-1]).tolist()


# sha256 per (device, inode, size, mtime): a run's start hashes its data twice (the data plan, the cache key).
_SHA256_SEEN: dict[tuple[int, int, int, int], str] = {}


def file_sha256(path: Path, should_stop: Callable[[], str | None] | None = None) -> str:
    """The sha256 of a regular file (data/rows.py's checks), remembered while the file is unchanged;
    ``should_stop`` (a stop signal's name, or None) is asked every chunk: LoadingStopped."""
    with open_regular(path) as f:
        st = os.fstat(f.fileno())
        seen = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if seen in _SHA256_SEEN:
            return _SHA256_SEEN[seen]
        h = hashlib.sha256()
        while chunk := f.read(READ_CHUNK_BYTES):
            if should_stop is not None and (signal_name := should_stop()):
                raise LoadingStopped(f"stopped ({signal_name}) while reading {path}")
            h.update(chunk)
    _SHA256_SEEN[seen] = h.hexdigest()
    return _SHA256_SEEN[seen]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """A hash of what makes the tokenizer's ids: its full definition where it has one (fast tokenizers), else
    its vocabulary, plus its special tokens."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(getattr(tokenizer, "special_tokens_map", {}), sort_keys=True, default=str).encode())
    return h.hexdigest()


def cache_key(
    tokenizer: Any,
    data: Path,
    *,
    max_tokens: int,
    eval_holdout: int,
    seed: int,
    should_stop: Callable[[], str | None] | None = None,
) -> dict[str, Any]:
    return {
        "format": CACHE_FORMAT,
        "tokenizer": str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__),
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "chat_template_sha256": hashlib.sha256(str(tokenizer.chat_template or "").encode()).hexdigest(),
        "data_sha256": file_sha256(data, should_stop),
        "max_tokens": max_tokens,
        "eval_holdout": eval_holdout,
        "holdout_seed": seed,
    }


def _key_hash(key: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _to_file(key: dict[str, Any], corpus: TokenizedCorpus) -> dict[str, Any]:
    return {
        "key": key,
        "ids": corpus.ids,
        "mask": corpus.mask,
        "offsets": corpus.offsets,
        "token_counts": corpus.token_counts,
        "conversations": corpus.conversations,
        "heldout": corpus.heldout,
        "skipped": corpus.skipped,
        "truncated": corpus.truncated,
        "bad_lines": corpus.bad_lines,
    }


class CacheUnusable(Exception):
    """The cache file exists but cannot be used (unreadable, another key, inconsistent)."""


def _from_file(blob: Any, key: dict[str, Any]) -> TokenizedCorpus:
    if not isinstance(blob, dict):
        raise CacheUnusable("not a cache file")
    if blob.get("key") != key:
        raise CacheUnusable("its key does not match")
    try:
        corpus = TokenizedCorpus(
            ids=blob["ids"],
            mask=blob["mask"],
            offsets=blob["offsets"],
            token_counts=blob["token_counts"],
            conversations=int(blob["conversations"]),
            heldout=[int(i) for i in blob["heldout"]],
            skipped={str(k): int(v) for k, v in blob["skipped"].items()},
            truncated=int(blob["truncated"]),
            bad_lines=[str(w) for w in blob.get("bad_lines", [])],
        )
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CacheUnusable(f"missing or malformed field ({type(exc).__name__}: {exc})") from None
    tensors = (corpus.ids, corpus.mask, corpus.offsets, corpus.token_counts)
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise CacheUnusable("a field is not a tensor")
    n = corpus.ids.numel()
    if corpus.mask.numel() != n or corpus.offsets.numel() < 1 or int(corpus.offsets[-1]) != n:
        raise CacheUnusable("inconsistent sizes")
    return corpus


def load_or_build(
    cache_dir: Path,
    tokenizer: Any,
    data: Path,
    *,
    max_tokens: int,
    eval_holdout: int,
    seed: int,
    build: Callable[[], TokenizedCorpus],
    say: Callable[[str], None] | None = None,
    should_stop: Callable[[], str | None] | None = None,
) -> tuple[TokenizedCorpus, Path, bool]:
    """The cached corpus for this key, or ``build()`` written to the cache; returns (corpus, file, hit)."""
    key = cache_key(
        tokenizer, data, max_tokens=max_tokens, eval_holdout=eval_holdout, seed=seed, should_stop=should_stop
    )
    path = cache_dir / f"tokenized-{_key_hash(key)}.pt"
    if path.exists():
        try:
            blob = torch.load(path, map_location="cpu", weights_only=True)
            corpus = _from_file(blob, key)
        except (OSError, RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, CacheUnusable) as exc:
            if say is not None:
                say(f"data cache {path} unusable ({type(exc).__name__}: {exc}): tokenizing again")
        else:
            if say is not None:
                say(f"data cache hit: {path} ({corpus.examples} conversations, not tokenized again)")
            return corpus, path, True
    corpus = build()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    torch.save(_to_file(key, corpus), tmp)
    os.replace(tmp, path)
    if say is not None:
        say(f"data cache written: {path}")
    return corpus, path, False
