"""Sequence packing: a packed row trains exactly what its conversations train unpacked (CPU, fp32).

Tolerances: the target's hidden states and distributions of a packed conversation equal its unpacked ones to
1e-5 (absolute, fp32), for causal targets and for sliding-window ones (Mistral, Qwen2's window layers); the
drafter's per-TTT-step summed losses to 1e-5 relative, the counts exactly, the gradients to 1e-4 relative (sums
over differently shaped batches reduce in another order).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from support.packed_drafter import drafter_losses as packed_drafter_losses
from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

from engine.trainer.config import ConfigError, from_dict
from engine.trainer.data.packing import (
    PackingPlan,
    best_fit_decreasing,
    document_causal_mask,
    document_positions,
    pack_rows,
    same_document_after,
)
from engine.trainer.data.sources import ConversationSource
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.loss import soft_cross_entropy
from engine.trainer.draft.masks import dense_document_ttt_mask, document_ttt_mask_mod
from engine.trainer.draft.model import DraftConfig, Drafter, ttt_step
from engine.trainer.run.loop import TrainingRun
from engine.trainer.threads.compile import GuardedFunction, _signature, apply_dynamo_config, compile_guard
from engine.trainer.threads.metrics import EventLog
from engine.trainer.verifier.model import FrozenTarget, load_target
from engine.trainer.verifier.packed import packing_refusal
from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

TTT_STEPS = 4
ROW = 64
LENGTHS = [37, 20, 50, 13]  # packed two a row: [37, 20] and [50, 13]
DRAFT_VOCAB = 64


def conversations(seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random ids with a loss mask on most tokens, a conversation's first ones included (a shifted target that
    crossed into the next conversation would be counted)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in LENGTHS:
        mask = (torch.arange(n) % 4 != 1).float()
        out.append((torch.randint(3, 250, (n,), generator=g), mask))
    return out


@pytest.fixture(scope="module")
def target() -> FrozenTarget:
    tok = build_tiny_tokenizer()
    return load_target("tiny", torch.device("cpu"), tokenizer=tok, layer_ids=None, seed=0, dtype=torch.float32)


def unpacked_and_packed() -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    convs = conversations()
    unpacked = pack_rows([[c] for c in convs], ROW, 0)
    packed = pack_rows([[convs[0], convs[1]], [convs[2], convs[3]]], ROW, 0)
    return unpacked, packed


# (unpacked row, packed row, offset in the packed row) of each conversation
PLACES = [(0, 0, 0), (1, 0, 37), (2, 1, 0), (3, 1, 50)]


def reference_document_mask(documents: torch.Tensor, step: int) -> torch.Tensor:
    """Written out pair by pair: causal over block 0 inside the query's document, the diagonals of later blocks."""
    b, t = documents.shape
    ref = torch.zeros(b, t, (step + 1) * t, dtype=torch.bool)
    for r in range(b):
        for q in range(t):
            for kv in range(q + 1):
                ref[r, q, kv] = bool(documents[r, kv] == documents[r, q])
            for block in range(1, step + 1):
                ref[r, q, block * t + q] = True
    return ref


def test_positions_restart_at_every_document() -> None:
    docs = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 2, 2]])
    assert document_positions(docs).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 1]]


def test_pack_rows_numbers_documents_and_gives_padding_its_own() -> None:
    _, (ids, mask, docs) = unpacked_and_packed()
    assert docs[0, :37].eq(0).all() and docs[0, 37:57].eq(1).all() and docs[0, 57:].eq(2).all()
    assert docs[1, :50].eq(0).all() and docs[1, 50:63].eq(1).all() and docs[1, 63:].eq(2).all()
    assert mask[0, 57:].eq(0).all() and ids[1, 63] == 0


@pytest.mark.parametrize("step", [0, 1, 3])
def test_no_token_attends_across_documents_in_the_ttt_mask(step: int) -> None:
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    ref = reference_document_mask(docs, step)
    dense = dense_document_ttt_mask(docs, step)
    assert dense.shape == (2, 1, 16, (step + 1) * 16)
    assert torch.equal(dense[:, 0], ref)
    flex = create_mask(document_ttt_mask_mod(docs), 2, None, 16, (step + 1) * 16, device="cpu")
    assert torch.equal(flex[:, 0], ref)
    # Block 0: any allowed pair is inside one document.
    block0 = dense[:, 0, :, :16]
    same = docs[:, :, None] == docs[:, None, :]
    assert not (block0 & ~same).any()


def test_flex_document_mask_forward_equals_sdpa_path() -> None:
    torch.manual_seed(0)
    step, b, t, d = 2, 2, 128, 16
    docs = torch.tensor([[0] * 40 + [1] * 60 + [2] * 28, [0] * 100 + [1] * 28])
    q = torch.randn(b, 4, t, d)
    k = torch.randn(b, 2, (step + 1) * t, d)
    v = torch.randn(b, 2, (step + 1) * t, d)
    sdpa = TTTAttention("sdpa")
    flex = TTTAttention("flex", compiled=False)
    out_sdpa = sdpa.apply(q, k, v, sdpa.prepare(q.device, t, step, docs))
    out_flex = flex.apply(q, k, v, flex.prepare(q.device, t, step, docs))
    torch.testing.assert_close(out_flex, out_sdpa, rtol=1e-5, atol=1e-5)
    bm = create_block_mask(document_ttt_mask_mod(docs), b, None, t, (step + 1) * t, device="cpu")
    direct = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    torch.testing.assert_close(out_flex, direct[0] if isinstance(direct, tuple) else direct)


@pytest.mark.parametrize("step", [0, 1, 3])
def test_extended_block_mask_equals_the_block_mask_of_the_whole_step(step: int) -> None:
    t = 256
    docs = torch.tensor([[0] * 100 + [1] * 60 + [2] * 96, [0] * 200 + [1] * 56])
    whole = create_block_mask(document_ttt_mask_mod(docs), 2, None, t, (step + 1) * t, device="cpu")
    made = TTTAttention("flex", compiled=False).prepare(docs.device, t, step, docs)
    assert torch.equal(made.to_dense(), whole.to_dense())
    torch.manual_seed(step)
    q, k, v = torch.randn(2, 2, t, 16), torch.randn(2, 2, (step + 1) * t, 16), torch.randn(2, 2, (step + 1) * t, 16)
    torch.testing.assert_close(flex_attention(q, k, v, block_mask=made), flex_attention(q, k, v, block_mask=whole))


def test_masks_of_two_packed_batches_share_one_compile_signature() -> None:
    """A compiled TTT step sees a new mask every packed batch; the guard lets them share the step's graphs."""
    t = 256
    attention = TTTAttention("flex", compiled=False)
    one = attention.prepare(torch.device("cpu"), t, 2, torch.tensor([[0] * 100 + [1] * 156]))
    two = attention.prepare(torch.device("cpu"), t, 2, torch.tensor([[0] * 30 + [1] * 200 + [2] * 26]))
    assert one is not two
    assert _signature(one) == _signature(two)
    assert _signature(one) != _signature(attention.prepare(torch.device("cpu"), t, 1, torch.zeros(1, t).long()))


def test_target_mask_is_causal_inside_documents() -> None:
    docs = torch.tensor([[0, 0, 1, 1, 1]])
    m = document_causal_mask(docs)[0, 0].int().tolist()
    assert m == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 1, 1, 1]]


def test_packed_target_states_equal_unpacked(target: FrozenTarget) -> None:
    (ids_u, _, _), (ids_p, _, docs_p) = unpacked_and_packed()
    logits_u, hidden_u = target.logits_and_hidden3(ids_u)
    logits_p, hidden_p = target.logits_and_hidden3(ids_p, documents=docs_p)
    for (ru, rp, at), n in zip(PLACES, LENGTHS, strict=True):
        torch.testing.assert_close(hidden_p[rp, at : at + n], hidden_u[ru, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits_p[rp, at : at + n], logits_u[ru, :n], rtol=0, atol=1e-5)
    # Without the documents the second conversation of a row reads the first: the states differ.
    _, hidden_cross = target.logits_and_hidden3(ids_p)
    assert (hidden_cross[0, 37:57] - hidden_u[1, :20]).abs().max() > 1e-2


WINDOW = 8  # shorter than every conversation of LENGTHS: the window decides most of their attention


def windowed_model(kind: str) -> Any:
    """A tiny random Mistral (one window on every layer) or Qwen2 with ``use_sliding_window`` (its first two layers
    full, the rest sliding: a per-layer-type mask), float32."""
    from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sizes: dict[str, Any] = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 6,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "initializer_range": 0.1,
    }
    torch.manual_seed(0)
    if kind == "mistral":
        return MistralForCausalLM(MistralConfig(**sizes, sliding_window=WINDOW))
    config = Qwen2Config(**sizes, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2)
    assert len(set(config.layer_types)) == 2  # full and sliding layers: the forward takes a mapping of masks
    return Qwen2ForCausalLM(config)


@pytest.fixture(scope="module", params=["mistral", "qwen2"])
def windowed_target(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> FrozenTarget:
    """Saved and loaded back through load_target, as a run loads a local target directory."""
    directory = tmp_path_factory.mktemp(f"windowed-{request.param}")
    with torch.random.fork_rng(devices=[]):
        windowed_model(request.param).save_pretrained(directory)
    return load_target(str(directory), torch.device("cpu"), tokenizer=None, layer_ids=None, seed=0, dtype=torch.float32)


def test_packed_states_of_a_sliding_window_target_equal_unpacked(windowed_target: FrozenTarget) -> None:
    """Every position of every packed conversation, the window reaching back past the conversation's start or
    not: the hidden states and logits are those of the conversation alone (1e-5, fp32)."""
    (ids_u, _, _), (ids_p, _, docs_p) = unpacked_and_packed()
    logits_u, hidden_u = windowed_target.logits_and_hidden3(ids_u)
    logits_p, hidden_p = windowed_target.logits_and_hidden3(ids_p, documents=docs_p)
    for (ru, rp, at), n in zip(PLACES, LENGTHS, strict=True):
        torch.testing.assert_close(hidden_p[rp, at : at + n], hidden_u[ru, :n], rtol=0, atol=1e-5)
        torch.testing.assert_close(logits_p[rp, at : at + n], logits_u[ru, :n], rtol=0, atol=1e-5)
    # A document mask without the window (what packed rows got before) lets positions >= WINDOW see too far back.
    model: Any = windowed_target.model
    plain = model(input_ids=ids_p, attention_mask=document_causal_mask(docs_p), position_ids=document_positions(docs_p))
    drift = (plain.logits[0, :37] - logits_u[0, :37]).abs().amax(dim=-1)
    assert drift[:WINDOW].max() < 1e-5 < drift[WINDOW:].max()


def test_packing_a_linear_attention_target_is_refused_in_one_line_naming_the_kind() -> None:
    from transformers import Qwen3NextConfig

    config = Qwen3NextConfig(num_hidden_layers=4, layer_types=["linear_attention"] * 3 + ["full_attention"])
    assert packing_refusal(config, 256) == (
        "packing: target qwen3_next has linear_attention layers (3 of 4 layers), whose recurrent state would run "
        "from one packed conversation into the next; set packing = false"
    )


def test_packing_llama4_is_refused_once_a_row_reaches_its_temperature_tuning_floor() -> None:
    from transformers import Llama4TextConfig

    config = Llama4TextConfig(num_hidden_layers=4, floor_scale=8192, attn_temperature_tuning=True)
    assert packing_refusal(config, 4096) is None
    refusal = packing_refusal(config, 8192)
    assert refusal is not None and "\n" not in refusal and "floor_scale 8192" in refusal


def make_drafter(target: FrozenTarget) -> Drafter:
    cfg = DraftConfig.from_target(target.config, DRAFT_VOCAB)
    torch.manual_seed(1)
    return Drafter(cfg, target.embed_weight(), torch.arange(DRAFT_VOCAB))


def drafter_losses(
    target: FrozenTarget, drafter: Drafter, batch: tuple[torch.Tensor, ...], packed: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    return packed_drafter_losses(target, drafter, batch, packed, ttt_steps=TTT_STEPS, draft_vocab=DRAFT_VOCAB)


def test_packed_loss_equals_unpacked_loss_on_the_same_conversations(target: FrozenTarget) -> None:
    unpacked, packed = unpacked_and_packed()
    drafter = make_drafter(target)
    loss_u, correct_u, counts_u, grads_u = drafter_losses(target, drafter, unpacked, packed=False)
    loss_p, correct_p, counts_p, grads_p = drafter_losses(target, drafter, packed, packed=True)
    assert counts_u.tolist() == counts_p.tolist() and counts_u.min() > 0
    assert correct_u.tolist() == correct_p.tolist()
    torch.testing.assert_close(loss_p, loss_u, rtol=1e-5, atol=0)
    for gu, gp in zip(grads_u, grads_p, strict=True):
        torch.testing.assert_close(gp, gu, rtol=1e-4, atol=1e-7)
    # Without the documents the same packed rows train other targets: the loss differs.
    loss_x, _, counts_x, _ = drafter_losses(target, drafter, (packed[0], packed[1], torch.zeros_like(packed[2])), True)
    assert counts_x.tolist() != counts_u.tolist() or not torch.allclose(loss_x, loss_u, rtol=1e-3)


def test_ttt_targets_never_cross_a_document_boundary(target: FrozenTarget) -> None:
    """Every token trained: step i counts n - 1 - i positions per document, none reaching into the next one."""
    ids, _, docs = pack_rows([[(torch.arange(3, 3 + n), torch.ones(n)) for n in (10, 6, 30)]], ROW, 0)
    mask = (docs < 3).float()  # the padding (document 3) is not trained
    _, _, counts, _ = drafter_losses(target, make_drafter(target), (ids, mask, docs), packed=True)
    assert counts.tolist() == [sum(max(0, n - 1 - i) for n in (10, 6, 30)) for i in range(TTT_STEPS)]
    for shift in range(1, TTT_STEPS + 1):
        inside = same_document_after(docs, shift)[0]
        assert not inside[10 - shift : 10].any() and inside[: 10 - shift].all()


def test_best_fit_fills_rows_without_exceeding_them() -> None:
    lengths = [900, 700, 500, 400, 300, 200, 1200, 100, 64, 2048]
    rows = best_fit_decreasing(list(range(len(lengths))), lengths, 2048)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 2048 for row in rows)
    assert len(rows) == -(-sum(lengths) // 2048)  # 6412 tokens: the minimum of 4 rows


def test_packing_plan_trains_every_conversation_once_an_epoch() -> None:
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(16, 200, (301,), generator=g).tolist()
    plan = PackingPlan.build(lengths, capacity=256, batch_size=4, seed=3)
    for epoch in range(2):
        seen: list[int] = []
        for offset in range(plan.batches_per_epoch):
            rows = plan.batch_rows(epoch * plan.batches_per_epoch + offset)
            assert len(rows) == 4
            seen.extend(i for row in rows for i in row)
        assert sorted(seen) == list(range(301))
    assert plan.batch_rows(5) == plan.batch_rows(5)  # a pure function of the index
    fill = sum(lengths) / (len(plan.rows) * 256)
    assert fill > 0.95


def test_a_packed_run_trains_packed_batches_end_to_end(tmp_path: Path, corpus_head: Callable[[int], Path]) -> None:
    cfg = from_dict(
        {
            "target": "tiny",
            "data": str(corpus_head(64)),
            "buckets": [128, 256],
            "batch_size": 2,
            "ttt_steps": 2,
            "draft_vocab_size": 96,
            "steps": 3,
            "eval_holdout": 0,
            "packing": True,
            "output_dir": str(tmp_path),
            "torch_threads": 1,
        }
    )
    events = EventLog(tmp_path / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    steps: list[dict[str, Any]] = []
    events.listeners.append(lambda ev: steps.append(ev) if ev["kind"] == "step" else None)
    run = TrainingRun(cfg, events)
    run.build()
    assert isinstance(run.source, ConversationSource) and run.source.plan is not None
    batch = run.source.batch(0)
    assert batch.documents is not None and int(batch.documents.max()) >= 2  # two conversations and padding
    assert batch.useful_tokens > 0.9 * batch.tokens
    assert run.run() == 0
    assert [e["step"] for e in steps] == [1, 2, 3]
    assert all(math.isfinite(v) for e in steps for v in e["loss"])
    # Rows with padding after their conversations: the step says the rate of tokens inside them too.
    rated = [e for e in steps if e["tok_s"] > 0 and e.get("useful_tok_s") is not None]
    assert rated, steps
    assert all(0.5 * e["tok_s"] < e["useful_tok_s"] < e["tok_s"] for e in rated)


def test_packing_random_tokens_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="packing"):
        from_dict({"data": "random", "packing": True})
    with pytest.raises(ConfigError, match="no tokenizer"):  # found before an 8B target is loaded
        from_dict({"target": "llama3-8b-shape", "packing": True})


@pytest.mark.usefixtures("fresh_dynamo")
def test_a_compiled_ttt_step_compiles_nothing_new_for_later_packed_batches(target: FrozenTarget) -> None:
    """Dynamo (eager backend, flex forward on the CPU) keeps one graph per TTT step across packed batches, each
    with its own documents, BlockMasks and rotary tables: packing does not recompile per batch."""
    apply_dynamo_config()
    drafter = make_drafter(target)
    step_fn = GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="eager")
    compiles: list[Any] = []
    step_fn.listeners.append(compiles.append)
    attention = TTTAttention("flex", compiled=False)
    t, steps = 256, 2

    def forward(documents: list[list[int]]) -> torch.Tensor:
        g = torch.Generator().manual_seed(len(compiles))
        docs = torch.tensor(documents)
        ids = torch.randint(3, 250, (2, t), generator=g)
        out = target.run(ids, torch.ones(2, t), torch.arange(DRAFT_VOCAB), drafter.t2d, documents=docs)
        losses, _, _ = drafter(
            out.hidden3,
            ids,
            out.target_logits,
            out.target_lse,
            out.position_mask,
            ttt_steps=steps,
            attention=attention,
            loss_fn=soft_cross_entropy,
            step_fn=step_fn,
            loss_mask=out.loss_mask,
            documents=docs,
        )
        return losses

    with torch.no_grad():
        with compile_guard():
            forward([[0] * 128 + [1] * 128, [0] * 256])
        step_fn.mark_warm()
        graphs = step_fn.graph_count()
        assert graphs is not None and graphs >= steps
        forward([[0] * 30 + [1] * 200 + [2] * 26, [0] * 7 + [1] * 249])
        losses = forward([[0] * 5 + [1] * 5 + [2] * 246, [0] * 255 + [1]])
    assert torch.isfinite(losses).all()
    assert compiles == [] and step_fn.graph_count() == graphs
