"""The FP8 target (target_fp8): row-wise e4m3 matmuls close to the exact Linear, lm_head kept exact."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.trainer.config import ConfigError, from_dict, preset
from engine.trainer.target.fp8 import E4M3_MAX, Fp8Linear, fp8_unsupported_reason
from engine.trainer.target.model import load_target, load_tokenizer


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
    fp8 = load_target(
        "tiny", torch.device("cpu"), tokenizer=tok, layer_ids=None, seed=0, dtype=torch.float32, fp8=True
    )
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
        load_target("tiny", torch.device("meta"), tokenizer=load_tokenizer("tiny"), layer_ids=None, seed=0,
                    dtype=torch.float32, fp8=True)


def test_fp8_linear_rejects_sizes_the_fp8_matmul_cannot_take() -> None:
    with pytest.raises(ValueError, match="divisible by 16"):
        Fp8Linear(nn.Linear(30, 16))


def test_target_fp8_is_a_config_key_of_type_bool() -> None:
    cfg = from_dict({"target_fp8": True}, preset("cpu-demo"))
    assert cfg.target_fp8 is True
    with pytest.raises(ConfigError):
        from_dict({"target_fp8": "yes"}, preset("cpu-demo"))
