"""The FP8 target (target_fp8): row-wise e4m3 matmuls close to the exact Linear, lm_head and MoE routers kept
exact, and the exact weights kept for an exact forward (the evaluation's) until released."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.trainer.config import ConfigError, from_dict, preset
from engine.trainer.verifier.fp8 import (
    E4M3_MAX,
    Fp8Linear,
    exact_bytes,
    exact_linears,
    fp8_linears,
    fp8_unsupported_reason,
    quantize_linears,
    release_exact,
)
from engine.trainer.verifier.model import FrozenTarget, decoder_layers, load_target, load_tokenizer


def test_fp8_linear_matches_the_linear_within_e4m3_rounding() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(128, 64, bias=True)
    x = torch.randn(3, 5, 128)
    exact = linear(x)
    got = Fp8Linear(linear)(x)
    assert got.shape == exact.shape
    rel = ((got - exact).norm() / exact.norm()).item()
    # e4m3 keeps 3 mantissa bits (relative step 1/16) on both operands; summed over 128 terms the errors average out.
    assert 1e-4 < rel < 0.06, rel


def test_fp8_linear_scales_each_row_and_token_separately() -> None:
    linear = nn.Linear(32, 16, bias=False)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(16, 32) * torch.logspace(-3, 3, 16).unsqueeze(1))
    x = torch.zeros(2, 32)
    x[0, :16] = 1e-4  # a tiny token next to a huge one: a per-tensor scale would flush it to zero
    x[1, :16] = 1e4
    got = Fp8Linear(linear)(x)
    exact = linear(x)
    assert torch.allclose(got, exact, rtol=0.07, atol=0.0)
    assert float(Fp8Linear(linear).weight_scale.max()) == pytest.approx(1e3 / E4M3_MAX, rel=1e-3)


def test_quantize_linears_replaces_the_decoder_and_keeps_lm_head_exact() -> None:
    tok = load_tokenizer("tiny")
    ref = load_target("tiny", torch.device("cpu"), tokenizer=tok, layer_ids=None, seed=0, dtype=torch.float32)
    fp8 = load_target("tiny", torch.device("cpu"), tokenizer=tok, layer_ids=None, seed=0, dtype=torch.float32, fp8=True)
    assert isinstance(fp8.model.lm_head, nn.Linear)
    kinds = [type(m) for m in fp8.model.model.layers.modules()]
    assert nn.Linear not in kinds and kinds.count(Fp8Linear) == 7 * len(fp8.model.model.layers)
    ids = torch.randint(0, ref.vocab_size, (2, 48), generator=torch.Generator().manual_seed(1))
    (la, ha), (lb, hb) = ref.logits_and_hidden3(ids), fp8.logits_and_hidden3(ids)
    # A random 8-layer model compounds the rounding (measured 0.16, and 0.03 on the trained tiny-trained target);
    # a wrong scale or transpose gives errors near 1.
    assert ((hb - ha).norm() / ha.norm()).item() < 0.3
    assert (la.argmax(-1) == lb.argmax(-1)).float().mean().item() > 0.7


def test_fp8_on_a_device_without_fp8_tensor_cores_is_a_named_error() -> None:
    assert fp8_unsupported_reason(torch.device("cpu")) is None
    reason = fp8_unsupported_reason(torch.device("meta"))
    assert reason is not None and "CUDA or CPU" in reason
    with pytest.raises(RuntimeError, match="target_fp8 needs"):
        load_target(
            "tiny",
            torch.device("meta"),
            tokenizer=load_tokenizer("tiny"),
            layer_ids=None,
            seed=0,
            dtype=torch.float32,
            fp8=True,
        )


def test_fp8_linear_rejects_sizes_the_fp8_matmul_cannot_take() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear(nn.Linear(30, 16))


def test_target_fp8_is_a_config_key_of_type_bool() -> None:
    cfg = from_dict({"target_fp8": True}, preset("cpu-demo"))
    assert cfg.target_fp8 is True
    with pytest.raises(ConfigError):
        from_dict({"target_fp8": "yes"}, preset("cpu-demo"))


@pytest.mark.parametrize(
    ("key", "value"),
    [("fp8_min_top1", 1.5), ("fp8_min_top1", -0.1), ("fp8_check_batches", -1), ("fp8_check_batches", 0.5)],
)
def test_the_fp8_check_keys_refuse_values_out_of_range(key: str, value: float) -> None:
    with pytest.raises(ConfigError, match=key):
        from_dict({"target_fp8": True, key: value}, preset("cpu-demo"))
    assert from_dict({"fp8_min_top1": 1, "fp8_check_batches": 0}, preset("cpu-demo")).fp8_min_top1 == 1.0


def tiny_pair(*, keep_exact: bool = True) -> tuple[FrozenTarget, FrozenTarget]:
    """The tiny target exact, and the same seeded weights loaded as an FP8 target."""
    tok = load_tokenizer("tiny")
    cpu = torch.device("cpu")
    ref = load_target("tiny", cpu, tokenizer=tok, layer_ids=None, seed=0, dtype=torch.float32)
    fp8 = load_target(
        "tiny", cpu, tokenizer=tok, layer_ids=None, seed=0, dtype=torch.float32, fp8=True, keep_exact=keep_exact
    )
    return ref, fp8


def test_an_fp8_target_with_exact_weights_kept_runs_the_unquantised_model_when_asked() -> None:
    ref, fp8 = tiny_pair()
    ids = torch.randint(0, ref.vocab_size, (2, 40), generator=torch.Generator().manual_seed(3))
    exact_logits, exact_hidden = ref.logits_and_hidden3(ids)
    kept_logits, kept_hidden = fp8.logits_and_hidden3(ids, exact=True)
    fp8_logits, _ = fp8.logits_and_hidden3(ids)
    assert torch.equal(kept_logits, exact_logits) and torch.equal(kept_hidden, exact_hidden)
    assert not torch.allclose(fp8_logits, exact_logits, atol=1e-3)  # and the FP8 forward is still FP8 afterwards
    assert all(not m.exact for m in fp8_linears(fp8.model))


def test_the_kept_exact_weights_share_the_models_storage_and_release_frees_them() -> None:
    torch.manual_seed(0)
    linear = nn.Linear(64, 32, bias=False)
    kept = Fp8Linear(linear, keep_exact=True)
    assert kept.exact_weight is not None and kept.exact_weight.data_ptr() == linear.weight.data_ptr()
    assert "exact_weight" not in kept.state_dict()  # a state_dict holds the e4m3 weights only
    ref, fp8 = tiny_pair()
    decoder_linears = [m for m in ref.model.model.layers.modules() if isinstance(m, nn.Linear)]
    decoder_bytes = sum(m.weight.numel() * m.weight.element_size() for m in decoder_linears)
    assert decoder_bytes > 0 and exact_bytes(fp8.model) == decoder_bytes  # float32 here: 4 bytes a parameter
    assert release_exact(fp8.model) == decoder_bytes and exact_bytes(fp8.model) == 0
    with pytest.raises(RuntimeError, match="the exact target is gone"):
        fp8.logits_and_hidden3(torch.zeros(1, 8, dtype=torch.long), exact=True)


def test_an_fp8_target_quantised_without_keeping_exact_weights_refuses_an_exact_forward() -> None:
    _ref, fp8 = tiny_pair(keep_exact=False)
    assert exact_bytes(fp8.model) == 0
    with pytest.raises(RuntimeError, match="keep no exact weight"):
        fp8.logits_and_hidden3(torch.zeros(1, 8, dtype=torch.long), exact=True)


class Expert(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(hidden, 32), nn.Linear(32, hidden), nn.Linear(hidden, 32)


class MixtralMoe(nn.Module):
    """transformers 4.x's MixtralSparseMoeBlock: ``block_sparse_moe.gate`` is the router, an nn.Linear."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(Expert(hidden) for _ in range(experts))


class QwenMlp(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, 32), nn.Linear(hidden, 32)
        self.down_proj = nn.Linear(32, hidden)


class QwenMoe(nn.Module):
    """Qwen2-MoE's block: ``mlp.gate`` routes, ``mlp.shared_expert_gate`` (one output) weighs the shared expert."""

    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(QwenMlp(hidden) for _ in range(experts))
        self.shared_expert = QwenMlp(hidden)
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)


class Llama4Moe(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.shared_expert = QwenMlp(hidden)


def test_a_multimodal_wrapper_gets_fp8_in_its_text_decoder_only(family_dir: Callable[[str], Path]) -> None:
    """Gemma-3 as released: the text decoder inside a vision wrapper. The vision tower never runs on text, so its
    Linears stay as loaded (quantising them only cost memory and time, and a vision size off the 16 grid would have
    stopped the target's load); every Linear of the decoder's layers is FP8."""
    path = str(family_dir("gemma-3"))
    target = load_target(path, torch.device("cpu"), tokenizer=load_tokenizer(path), layer_ids=None, seed=0,
                         dtype=torch.float32, fp8=True)  # fmt: skip
    layers = decoder_layers(target.model)
    inside = {id(m) for m in layers.modules()}
    fp8 = [n for n, m in target.model.named_modules() if isinstance(m, Fp8Linear)]
    assert fp8 and all(id(target.model.get_submodule(n)) in inside for n in fp8), fp8
    assert not any(isinstance(m, nn.Linear) for m in layers.modules())
    vision = [n for n, m in target.model.named_modules() if isinstance(m, nn.Linear) and "vision" in n]
    assert vision, "the family's vision tower was expected in the loaded wrapper"


def test_quantize_linears_leaves_moe_routers_exact_and_quantises_experts_and_dense_gate_proj() -> None:
    hidden = 64
    tree = nn.ModuleDict(
        {
            "block_sparse_moe": MixtralMoe(hidden, experts=16),  # 16 experts: an FP8 matmul could take it
            "mlp": QwenMoe(hidden, experts=16),
            "feed_forward": Llama4Moe(hidden, experts=16),
            "dense": QwenMlp(hidden),
            "lm_head": nn.Linear(hidden, 128, bias=False),
        }
    )
    replaced = quantize_linears(tree)
    kept = sorted(name for name, m in tree.named_modules() if isinstance(m, nn.Linear))
    assert kept == [
        "block_sparse_moe.gate",
        "feed_forward.router",
        "lm_head",
        "mlp.gate",
        "mlp.shared_expert_gate",
    ]
    quantised = [name for name, m in tree.named_modules() if isinstance(m, Fp8Linear)]
    assert "dense.gate_proj" in quantised and "mlp.shared_expert.gate_proj" in quantised
    assert "block_sparse_moe.experts.0.w1" in quantised and "mlp.experts.15.down_proj" in quantised
    assert replaced == len(quantised) == 16 * 3 + 16 * 3 + 3 + 3 + 3


def test_a_real_qwen2_moe_target_quantises_with_its_routers_left_exact() -> None:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    cfg = Qwen2MoeConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=32,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
    )
    torch.manual_seed(0)
    model = Qwen2MoeForCausalLM(cfg).eval()
    ids = torch.randint(0, 96, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact = model(input_ids=ids).logits
    quantize_linears(model)  # its shared_expert_gate has one output: quantised, it would be refused (not /16)
    assert all(isinstance(layer.mlp.shared_expert_gate, nn.Linear) for layer in model.model.layers)
    assert all(isinstance(layer.mlp.shared_expert.up_proj, Fp8Linear) for layer in model.model.layers)
    with torch.no_grad():
        got = model(input_ids=ids).logits
    assert ((got - exact).norm() / exact.norm()).item() < 0.2


def test_on_llama_3_1_8b_shapes_the_kept_exact_weights_cost_14_gb_beside_7_gb_of_e4m3() -> None:
    from transformers import LlamaForCausalLM

    from engine.trainer.verifier.model_configs import llama3_8b_config

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("meta"):  # shapes and dtypes only: no memory
            model = LlamaForCausalLM(llama3_8b_config())
    finally:
        torch.set_default_dtype(before)
    bf16_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert quantize_linears(model, keep_exact=True) == 7 * 32
    e4m3_bytes = sum(m.weight_fp8.numel() + 4 * m.weight_scale.numel() for m in fp8_linears(model))
    rest_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # embeddings, norms, lm_head
    assert exact_bytes(model) == 13_958_643_712 and round(e4m3_bytes / 1e9, 2) == 6.98
    # bf16 run 16.06 GB; FP8 with the exact weights kept 23.05 GB; FP8 once they are released 9.09 GB.
    assert [round(b / 1e9, 2) for b in (bf16_bytes, rest_bytes + e4m3_bytes + exact_bytes(model))] == [16.06, 23.05]
    assert round((bf16_bytes - exact_bytes(model) + e4m3_bytes) / 1e9, 2) == 9.09


def test_an_exact_forward_between_compiled_fp8_calls_recompiles_nothing() -> None:
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 32))
    quantize_linears(model, keep_exact=True)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend="eager")  # dynamo's guards, which a compiled target checks every call
    x = torch.randn(4, 32)
    first = compiled(x)
    with exact_linears(model):  # the evaluation's forward, eager, between two of the producer's
        exact = model(x)
    assert torch.equal(compiled(x), first) and not torch.allclose(exact, first, atol=1e-3)
    assert counters["stats"]["unique_graphs"] == 1
