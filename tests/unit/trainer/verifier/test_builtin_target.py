"""The built-in trained target: trained once per recipe, cached, reproducible, loadable as ``tiny-trained``."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from engine.trainer.config import BUILTIN_TARGET_LAYERS, from_dict
from engine.trainer.data.sources import shipped_corpus_path
from engine.trainer.verifier import builtin as builtin_target
from engine.trainer.verifier.builtin import RECIPE_FILE, Recipe, ensure_built, read_metrics, split_corpus
from engine.trainer.verifier.model import load_target, load_tokenizer

SMALL = Recipe(hidden=32, layers=8, head_dim=32, steps=6, batch_size=4, seq_len=32)  # default depth, few steps


@pytest.fixture(scope="module")
def small_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("targets")
    ensure_built(SMALL, root=root, progress=lambda _line: None)
    return root


def test_a_built_target_is_cached_and_not_trained_again(small_root: Path) -> None:
    said: list[str] = []
    path = ensure_built(SMALL, root=small_root, progress=said.append)
    assert said == []
    assert (path / RECIPE_FILE).is_file() and (path / "config.json").is_file()
    metrics = read_metrics(path)
    assert 0.0 <= metrics["heldout_accuracy"] <= 1.0
    assert metrics["uniform_entropy_bits"] == pytest.approx(8.03, abs=0.01)  # 262 byte-level tokens


def test_concurrent_first_uses_train_it_once(tmp_path: Path) -> None:
    said: list[str] = []
    paths: list[Path] = []

    def build() -> None:
        paths.append(ensure_built(SMALL, root=tmp_path, progress=said.append))

    threads = [threading.Thread(target=build) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(paths) == 2 and paths[0] == paths[1]
    assert sum("first use" in line for line in said) == 1


def test_the_same_recipe_gives_the_same_weights(small_root: Path, tmp_path: Path) -> None:
    again = ensure_built(SMALL, root=tmp_path, progress=lambda _line: None)
    first = ensure_built(SMALL, root=small_root)
    assert (again / "model.safetensors").read_bytes() == (first / "model.safetensors").read_bytes()


def test_the_held_out_conversations_are_not_trained_on() -> None:
    train, held = split_corpus(shipped_corpus_path(), SMALL)
    assert len(held) == SMALL.holdout
    assert not {repr(c) for c in held} & {repr(c) for c in train}


def test_tiny_trained_is_a_target_name_the_engine_loads(small_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builtin_target, "DEFAULT_RECIPE", SMALL)
    monkeypatch.setattr(builtin_target, "cache_root", lambda: small_root)
    assert from_dict({"target": "tiny-trained"}).target == "tiny-trained"
    assert BUILTIN_TARGET_LAYERS["tiny-trained"] == builtin_target.Recipe().layers  # config knows its depth
    tok = load_tokenizer("tiny-trained")
    target = load_target(
        "tiny-trained", torch.device("cpu"), tokenizer=tok, layer_ids=[1, 3, 4], seed=0, dtype=torch.float32
    )
    assert target.config.num_hidden_layers == 8 and target.layer_ids == [1, 3, 4]
    logits, hidden3 = target.logits_and_hidden3(torch.tensor([tok("<|bos|>hi")["input_ids"]]))
    assert logits.shape[-1] == target.vocab_size and hidden3.shape[-1] == 3 * SMALL.hidden


def test_the_saved_directory_serves_as_it_is(small_root: Path) -> None:
    """A server given only the directory must stop at <|end|> (not at LlamaConfig's eos 2, the byte '#') and find
    the tokenizer and its chat template there; vLLM's CPU attention has no 16-wide heads."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    path = ensure_built(SMALL, root=small_root, progress=lambda _line: None)
    tok = AutoTokenizer.from_pretrained(str(path))
    config, generation = AutoConfig.from_pretrained(str(path)), GenerationConfig.from_pretrained(str(path))
    names = {"bos": "<|bos|>", "eos": "<|end|>", "pad": "<|pad|>"}
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in names.items()}
    for cfg in (config, generation):
        assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (ids["bos"], ids["eos"], ids["pad"])
    assert tok.decode([2]) == "#" and ids["eos"] != 2
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == (
        "<|bos|><|user|>\nhi<|end|>\n<|assistant|>\n"
    )
    assert builtin_target.Recipe().head_dim == 64 and config.head_dim == SMALL.head_dim
