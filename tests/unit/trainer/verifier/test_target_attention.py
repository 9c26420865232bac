"""The target's attention: a plain causal forward makes no mask, compiled too, and gives what SDPA gives.

Hugging Face's ``sdpa`` materialises a (B, 1, T, T) mask under torch.compile, and SDPA then runs the masked
kernel over every pair (32 of the target's 227 ms a step on an H200 at the 8B shape). ``specdec_causal_sdpa``
hands SDPA ``is_causal`` instead; these tests pin the traced call and the numbers (fp32, CPU: equal to 1e-6).
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from engine.trainer.data.packing import document_causal_mask, document_positions
from engine.trainer.verifier.model import CAUSAL_SDPA, FrozenTarget, load_target, use_causal_fast_path
from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    return load_target(
        "tiny", torch.device("cpu"), tokenizer=build_tiny_tokenizer(), layer_ids=None, seed=0, dtype=torch.float32
    )


def _sdpa_calls(model: Any, **inputs: Any) -> list[str]:
    """The scaled_dot_product_attention calls of the graph dynamo traces for ``model(**inputs)``."""
    graphs: list[Any] = []

    def backend(gm: Any, _example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(**inputs, use_cache=False)
    code = "\n".join(g.code for g in graphs)
    return re.findall(r"scaled_dot_product_attention\([^\n]*", code)


@pytest.fixture
def with_hf_sdpa(target: FrozenTarget) -> Any:
    """Runs the body with Hugging Face's own sdpa, then switches back."""
    target.model.set_attn_implementation("sdpa")
    try:
        yield target
    finally:
        assert use_causal_fast_path(target.model)


def test_the_target_runs_the_causal_fast_path(target: FrozenTarget) -> None:
    assert target.model.config._attn_implementation == CAUSAL_SDPA


def test_compiled_plain_forward_calls_sdpa_causal_without_a_mask(target: FrozenTarget) -> None:
    ids = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))
    calls = _sdpa_calls(target.model, input_ids=ids)
    layers = target.config.num_hidden_layers
    assert len(calls) == layers
    assert all("attn_mask = None" in c and "is_causal = True" in c for c in calls), calls[0]


def test_hf_sdpa_compiled_materialises_a_mask(with_hf_sdpa: FrozenTarget) -> None:
    """What the fast path replaces (if Hugging Face stops doing this, the fast path is no longer needed)."""
    ids = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(0))
    calls = _sdpa_calls(with_hf_sdpa.model, input_ids=ids)
    assert calls and all("is_causal = False" in c and "attn_mask = None" not in c for c in calls), calls[0]


def test_packed_rows_keep_their_document_mask_compiled(target: FrozenTarget) -> None:
    ids = torch.randint(0, 200, (2, 64), generator=torch.Generator().manual_seed(1))
    docs = (torch.arange(64) >= 20).long().expand(2, 64).contiguous()
    mask, positions = document_causal_mask(docs), document_positions(docs)
    calls = _sdpa_calls(target.model, input_ids=ids, attention_mask=mask, position_ids=positions)
    assert calls and all("is_causal = False" in c and "attn_mask = None" not in c for c in calls), calls[0]


def test_numbers_equal_hf_sdpa_plain_packed_and_left_padded(target: FrozenTarget) -> None:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 200, (2, 64), generator=g)
    docs = (torch.arange(64) >= 20).long().expand(2, 64).contiguous()
    pad = torch.ones(2, 64, dtype=torch.long)
    pad[1, :9] = 0  # left padding, as generation batches it

    def forwards() -> list[torch.Tensor]:
        with torch.no_grad():
            plain, plain_h = target.logits_and_hidden3(ids, eager=True)
            packed, packed_h = target.logits_and_hidden3(ids, eager=True, documents=docs)
            padded = target.model(input_ids=ids, attention_mask=pad, use_cache=False).logits
        return [plain, plain_h, packed, packed_h, padded[:, 9:]]

    ours = forwards()
    target.model.set_attn_implementation("sdpa")
    try:
        theirs = forwards()
    finally:
        assert use_causal_fast_path(target.model)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


def test_sliding_window_models_are_left_alone() -> None:
    from transformers import MistralConfig, MistralForCausalLM

    cfg = MistralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16, attn_implementation="sdpa",
    )  # fmt: skip
    model = MistralForCausalLM(cfg)
    assert not use_causal_fast_path(model)
    assert model.config._attn_implementation == "sdpa"


def test_packed_flex_block_mask_gives_what_the_dense_document_mask_gives(target: FrozenTarget) -> None:
    """The compiled CUDA forward's packed mask (a flex BlockMask), here eager on the CPU: the same numbers."""
    from engine.trainer.verifier.model import document_block_mask

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 200, (2, 256), generator=g)
    docs = torch.zeros(2, 256, dtype=torch.long)
    docs[0, 100:] = 1
    docs[0, 230:] = 2
    docs[1, 17:] = 1  # a boundary inside the first tile
    positions = document_positions(docs)
    with torch.no_grad():
        dense = target.model(input_ids=ids, attention_mask=document_causal_mask(docs), position_ids=positions)
        flex = target.model(input_ids=ids, attention_mask=document_block_mask(docs), position_ids=positions)
    torch.testing.assert_close(flex.logits, dense.logits, atol=1e-5, rtol=1e-5)


def test_compiled_target_takes_packed_block_masks_without_a_graph_per_batch(target: FrozenTarget) -> None:
    """The compiled CUDA forward's packed path, traced by dynamo on the CPU: flex in the graph, the numbers of
    the dense mask, and no graph for a batch whose conversations split differently.

    The first call makes one graph (no graph break). A second call may make one more whatever the batch: with
    transformers 5.25 the ``kernels`` package's context variable is None before the first call and set after it
    (a guard dynamo checks), so the count is taken from the second call on."""
    from engine.trainer.verifier.model import document_block_mask

    graphs: list[Any] = []

    def backend(gm: Any, _example: Any) -> Any:
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(target.model, backend=backend, dynamic=False)
    g = torch.Generator().manual_seed(4)
    counts = []
    for cut in (60, 60, 170):
        ids = torch.randint(0, 200, (2, 256), generator=g)
        docs = (torch.arange(256) >= cut).long().expand(2, 256).contiguous()
        positions = document_positions(docs)
        with torch.no_grad():
            mask = document_block_mask(docs)
            target._captured.clear()  # as FrozenTarget.logits_and_hidden3 calls it (dynamo guards on the hooks' dict)
            flex = compiled(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False)
            dense = target.model(
                input_ids=ids, attention_mask=document_causal_mask(docs), position_ids=positions, use_cache=False
            )
        torch.testing.assert_close(flex.logits, dense.logits, atol=1e-5, rtol=1e-5)
        counts.append(len(graphs))
    assert counts[0] == 1  # no graph break: flex stays in the target's graph
    assert counts[2] == counts[1] <= 2  # the other split of conversations compiled nothing
    assert all("flex_attention" in gm.code for gm in graphs)


def test_a_transformers_with_the_old_mask_api_keeps_hf_sdpa(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers 4.53 to 5.5 call mask functions with ``cache_position`` and no ``q_length``: the fast path's mask
    function would raise on every forward there, so it is not installed."""
    import transformers.masking_utils as masking

    def old_sdpa_mask(batch_size: int, cache_position: torch.Tensor, kv_length: int, **kwargs: Any) -> None:
        return None

    monkeypatch.setattr(masking, "sdpa_mask", old_sdpa_mask)
    model = load_target(
        "tiny", torch.device("cpu"), tokenizer=build_tiny_tokenizer(), layer_ids=None, seed=0, dtype=torch.float32
    ).model
    assert model.config._attn_implementation == "sdpa"


def test_chunked_attention_models_are_left_alone() -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_implementation="sdpa",
    )  # fmt: skip
    cfg.attention_chunk_size = 8  # Llama 4's chunked attention: more than causal
    assert not use_causal_fast_path(LlamaForCausalLM(cfg))
