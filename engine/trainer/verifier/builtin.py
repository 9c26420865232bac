"""``tiny-trained``: a small Llama the project trains itself on the shipped corpus, so that τ means something.

A random target's next-token distribution is close to uniform: any drafter matches its greedy token by luck
only, and τ says nothing. This target is trained (seeded, next-token cross-entropy on the shipped chats minus
the held-out ones) until its predictions are sharp, then cached: built on first use under
``<cache>/targets/<recipe hash>/`` (``$SPECDEC_CACHE_DIR``, else ``$XDG_CACHE_HOME/specdec-tui``, else
``~/.cache/specdec-tui``), with a file lock so that concurrent first uses build it once. The directory is a
Hugging Face model directory plus ``recipe.json`` and ``metrics.json`` (held-out accuracy and entropy).

Eight layers, so the serve-time aux layers (outputs of 1, L/2-1, L-4) and the older ids (2, L/2, L-3) are all
distinct; the byte-level tokenizer of ``tiny`` (engine/trainer/verifier/tiny_tokenizer.py).

Servable as it is (``vllm serve DIR``, or DIR as the target of an EAGLE-3 speculative config): its heads are 64
wide (vLLM's CPU attention has kernels for head_dim 32, 64, 80, ... and none for 16), its config carries the
tokenizer's own special ids (LlamaConfig's defaults, bos 1 and eos 2, are the bytes ``"`` and ``#`` here, so a
server would stop at every ``#``), and the tokenizer files with the chat template are saved beside the weights.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import hashlib
import json
import math
import os
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from engine.trainer.data.holdout import heldout_indices
from engine.trainer.data.sources import load_conversations, shipped_corpus_path, tokenize_conversations

NAME = "tiny-trained"
RECIPE_FILE = "recipe.json"
METRICS_FILE = "metrics.json"
FORMAT_VERSION = 2  # bump when the training code changes what a recipe produces

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Recipe:
    """Everything that decides the trained weights; its hash names the cache directory."""

    hidden: int = 128
    layers: int = 8
    head_dim: int = 64  # two heads; vLLM's CPU attention runs 64-wide heads (not the tiny preset's 16)
    steps: int = 250
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 5e-3
    warmup_steps: int = 20
    seed: int = 0
    # The held-out conversations (holdout.heldout_indices of the corpus): never trained on. The engine's
    # defaults (eval_holdout = 32, seed = 0) pick the same ones, so its evaluation reads text this target never saw.
    holdout: int = 32
    holdout_seed: int = 0
    # CPU reductions can depend on the thread count; fixing it makes a recipe's weights repeatable on one machine.
    torch_threads: int = 1

    def key(self, corpus_digest: str) -> str:
        body = {"format": FORMAT_VERSION, "recipe": dataclasses.asdict(self), "corpus": corpus_digest}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]


DEFAULT_RECIPE = Recipe()


def cache_root() -> Path:
    env = os.environ.get("SPECDEC_CACHE_DIR")
    if env:
        return Path(env).expanduser() / "targets"
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "specdec-tui" / "targets"


def file_digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stderr_progress(line: str) -> None:
    import sys

    print(f"{NAME}: {line}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def _exclusive(lock_path: Path) -> Iterator[None]:
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def ensure_built(recipe: Recipe | None = None, *, root: Path | None = None, progress: Progress | None = None) -> Path:
    """The directory of the trained target for ``recipe`` (default: ``DEFAULT_RECIPE``), training it if absent."""
    recipe = recipe if recipe is not None else DEFAULT_RECIPE
    say = progress if progress is not None else _stderr_progress
    corpus = shipped_corpus_path()
    root = root if root is not None else cache_root()
    final = root / recipe.key(file_digest(corpus))
    if (final / RECIPE_FILE).is_file():
        return final
    with _exclusive(root / f"{final.name}.lock"):
        if (final / RECIPE_FILE).is_file():  # another process built it while this one waited
            return final
        say(f"first use: training it on the shipped corpus (cached in {final})")
        t0 = time.perf_counter()
        model, metrics = train(recipe, corpus, say)
        metrics["build_s"] = round(time.perf_counter() - t0, 1)
        tmp = root / f".tmp-{final.name}-{os.getpid()}"
        if tmp.exists():
            shutil.rmtree(tmp)
        save_servable(model, str(tmp))
        (tmp / METRICS_FILE).write_text(json.dumps(metrics, indent=1), encoding="utf-8")
        (tmp / RECIPE_FILE).write_text(json.dumps(dataclasses.asdict(recipe), indent=1), encoding="utf-8")
        if final.exists():  # an incomplete leftover (no recipe.json)
            shutil.rmtree(final)
        os.replace(tmp, final)
        say(
            f"built in {metrics['build_s']:.0f} s: held-out accuracy {metrics['heldout_accuracy']:.3f}, "
            f"entropy {metrics['heldout_entropy_bits']:.2f} bits (uniform: {metrics['uniform_entropy_bits']:.2f})"
        )
    return final


def save_servable(model: Any, directory: str) -> None:
    """The weights with the tokenizer's special ids in config.json and generation_config.json, and the tokenizer
    files (chat template included), so a server given only this directory tokenizes and stops as we do."""
    from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    special = {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    for config in (model.config, model.generation_config):
        for key, value in special.items():
            setattr(config, key, value)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def read_metrics(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((path / METRICS_FILE).read_text(encoding="utf-8"))
    return data


def split_corpus(corpus: Path, recipe: Recipe) -> tuple[list[list[dict[str, str]]], list[list[dict[str, str]]]]:
    """(training conversations, held-out conversations), file order kept."""
    convs = load_conversations(corpus)
    held = heldout_indices(len(convs), recipe.holdout, recipe.holdout_seed)
    return [c for i, c in enumerate(convs) if i not in held], [c for i, c in enumerate(convs) if i in held]


def tokenized(tokenizer: Any, conversations: list[list[dict[str, str]]]) -> list[tuple[list[int], list[int]]]:
    """(ids, assistant mask) of each conversation the chat template renders (the byte-level one renders all)."""
    return [x for x in tokenize_conversations(tokenizer, conversations) if not isinstance(x, str)]


def build_model(recipe: Recipe, vocab_size: int) -> Any:
    from transformers import LlamaForCausalLM

    from engine.trainer.verifier.model_configs import tiny_config

    cfg = tiny_config(vocab_size, recipe.hidden, recipe.layers, recipe.head_dim)
    cfg.initializer_range = 0.02  # tiny_config's 0.1 suits a random target, not one that is trained
    return LlamaForCausalLM(cfg)


def train(recipe: Recipe, corpus: Path, say: Progress) -> tuple[Any, dict[str, Any]]:
    """Next-token cross-entropy on windows of the training conversations laid end to end (seeded)."""
    from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    vocab = ((len(tokenizer) + 7) // 8) * 8
    train_convs, held_convs = split_corpus(corpus, recipe)
    stream = torch.tensor([t for ids, _ in tokenized(tokenizer, train_convs) for t in ids])
    old_threads = torch.get_num_threads()
    torch.set_num_threads(recipe.torch_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(recipe.seed)
            random.seed(recipe.seed)
            model = build_model(recipe, vocab)
            model.train()
            opt = torch.optim.AdamW(model.parameters(), lr=recipe.lr, betas=(0.9, 0.95), weight_decay=0.0)
            gen = torch.Generator().manual_seed(recipe.seed)
            window = recipe.seq_len + 1
            every = max(1, recipe.steps // 10)
            for step in range(recipe.steps):
                lr = recipe.lr * min(1.0, (step + 1) / max(1, recipe.warmup_steps))
                lr *= 0.5 * (1.0 + math.cos(math.pi * step / recipe.steps))
                for group in opt.param_groups:
                    group["lr"] = lr
                starts = torch.randint(0, stream.numel() - window, (recipe.batch_size,), generator=gen)
                rows = torch.stack([stream[s : s + window] for s in starts.tolist()])
                logits = model(input_ids=rows[:, :-1], use_cache=False).logits
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), rows[:, 1:].reshape(-1))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                if (step + 1) % every == 0 or step == 0:
                    say(f"step {step + 1}/{recipe.steps} loss {loss.item():.3f}")
            model.eval()
            metrics = heldout_metrics(model, tokenizer, held_convs, vocab_size=len(tokenizer))
    finally:
        torch.set_num_threads(old_threads)
    metrics.update({"train_conversations": len(train_convs), "train_tokens": int(stream.numel())})
    return model, metrics


@torch.no_grad()
def heldout_metrics(
    model: Any, tokenizer: Any, conversations: list[list[dict[str, str]]], *, vocab_size: int
) -> dict[str, Any]:
    """Next-token accuracy and predictive entropy on the assistant tokens of held-out conversations.

    "Far from uniform" as numbers: the entropy against log2 of the tokenizer's vocabulary.
    """
    correct = 0
    count = 0
    entropy_bits = 0.0
    nll = 0.0
    for ids, mask in tokenized(tokenizer, conversations):
        x = torch.tensor([ids])
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        labels = x[0, 1:]
        keep = torch.tensor(mask[1:], dtype=torch.bool)
        if not bool(keep.any()):
            continue
        logp = torch.log_softmax(logits[keep], dim=-1)
        correct += int((logp.argmax(-1) == labels[keep]).sum())
        count += int(keep.sum())
        entropy_bits += float(-(logp.exp() * logp).sum(-1).sum()) / math.log(2)
        nll += float(-logp.gather(-1, labels[keep][:, None]).sum())
    n = max(1, count)
    return {
        "heldout_conversations": len(conversations),
        "heldout_tokens": count,
        "heldout_accuracy": correct / n,
        "heldout_entropy_bits": entropy_bits / n,
        "heldout_nll_bits": nll / n / math.log(2),
        "uniform_entropy_bits": math.log2(vocab_size),
    }
