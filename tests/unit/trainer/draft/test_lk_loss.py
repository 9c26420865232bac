"""LK losses (the acceptance rate trained on directly) against numbers worked out by hand, and their config keys."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.trainer.config import ConfigError, from_dict
from engine.trainer.draft.loss import acceptance_rates, lk_loss, loss_function, needs_full_vocab_lse, soft_cross_entropy
from engine.trainer.verifier.model import training_targets

REPO = Path(__file__).resolve().parents[4]

# One position, two draft tokens. The target gives them 0.6 and 0.2 of its whole vocabulary (0.2 elsewhere):
# logits ln 0.6, ln 0.2 with the whole vocabulary's lse 0. The drafter is uniform over its two tokens.
TARGET_LOGITS = torch.tensor([[[math.log(0.6), math.log(0.2)]]])
FULL_LSE = torch.zeros(1, 1)
DRAFT_LOGITS = torch.zeros(1, 1, 2)
ALPHA = min(0.6, 0.5) + min(0.2, 0.5)  # 0.7: speculative sampling accepts the draft with this probability
CE = -(0.75 * math.log(0.5) + 0.25 * math.log(0.5))  # against the target renormalised over the draft: [0.75, 0.25]


def test_acceptance_is_the_sum_of_minima_against_the_targets_unrenormalised_probabilities() -> None:
    accept, log_accept = acceptance_rates(DRAFT_LOGITS, TARGET_LOGITS, FULL_LSE, torch.ones(1, 1))
    assert math.isclose(float(accept), ALPHA, rel_tol=1e-6)
    assert math.isclose(float(log_accept), math.log(ALPHA), rel_tol=1e-6)


def test_lk_alpha_is_minus_log_acceptance_and_its_gradient_is_the_hand_derivative() -> None:
    z = DRAFT_LOGITS.clone().requires_grad_(True)
    loss, correct, count = lk_loss("lk_alpha", "all_positions")(z, TARGET_LOGITS, FULL_LSE, torch.ones(1, 1))
    assert math.isclose(float(loss), -math.log(ALPHA), rel_tol=1e-6)
    assert (float(correct), float(count)) == (1.0, 1.0)  # argmax of uniform is 0 = the target's top token
    loss.backward()
    # alpha = q0 + 0.2 (q0 = 0.5 < 0.6, q1 = 0.5 > 0.2); dq0/dz = q0 (1 - q0, -q1) = (0.25, -0.25); loss = -ln alpha
    expected = torch.tensor([[[-0.25 / ALPHA, 0.25 / ALPHA]]])
    assert z.grad is not None and torch.allclose(z.grad, expected, atol=1e-6)


def test_lk_lambda_blends_cross_entropy_into_one_minus_acceptance_by_the_kl_weight() -> None:
    for scale, decay in ((1.0, 1.0), (0.5, 3.0), (1.0, 0.0)):
        loss, _, _ = lk_loss("lk_lambda", "all_positions", scale, decay)(
            DRAFT_LOGITS, TARGET_LOGITS, FULL_LSE, torch.ones(1, 1)
        )
        w = scale * math.exp(-decay * ALPHA)
        assert math.isclose(float(loss), w * CE + (1 - w) * (1 - ALPHA), rel_tol=1e-6), (scale, decay)


def test_lk_lambda_gradient_holds_the_kl_weight_constant() -> None:
    z = DRAFT_LOGITS.clone().requires_grad_(True)
    loss, _, _ = lk_loss("lk_lambda", "all_positions")(z, TARGET_LOGITS, FULL_LSE, torch.ones(1, 1))
    loss.backward()
    w = math.exp(-ALPHA)
    # d CE / dz = q - p_draft = (0.5 - 0.75, 0.5 - 0.25); d(1 - alpha)/dz = (-0.25, 0.25); w is detached
    expected = torch.tensor([[[w * -0.25 + (1 - w) * -0.25, w * 0.25 + (1 - w) * 0.25]]])
    assert z.grad is not None and torch.allclose(z.grad, expected, atol=1e-6)


def test_masked_positions_and_positions_past_the_end_count_nothing_and_give_finite_gradients() -> None:
    # Position 1 is masked out; position 2 lies past the sequence's end (lse +inf: p = 0, alpha = 0).
    target_logits = torch.cat([TARGET_LOGITS, torch.tensor([[[5.0, -5.0]]]), torch.zeros(1, 1, 2)], dim=1)
    lse = torch.tensor([[0.0, 0.0, float("inf")]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    z = torch.tensor([[[0.0, 0.0], [3.0, 1.0], [2.0, 0.0]]]).requires_grad_(True)
    for kind in ("lk_alpha", "lk_lambda"):
        z.grad = None
        loss, _, count = lk_loss(kind, "masked_positions")(z, target_logits, lse, mask)
        alone, _, _ = lk_loss(kind, "masked_positions")(z[:, :1], target_logits[:, :1], lse[:, :1], mask[:, :1])
        assert math.isclose(float(loss), float(alone), rel_tol=1e-6), kind
        assert float(count) == 1.0
        loss.backward()
        assert z.grad is not None and bool(torch.isfinite(z.grad).all()), kind
        assert float(z.grad[0, 1:].abs().max()) == 0.0, kind


def test_the_lambda_cross_entropy_part_is_the_soft_cross_entropy_over_the_draft_vocabulary() -> None:
    # With kl_scale 1 and kl_decay 0 the weight is 1: the loss is the soft CE, whatever lse the target hands over.
    g = torch.Generator().manual_seed(0)
    z, zt = torch.randn(2, 5, 7, generator=g), torch.randn(2, 5, 7, generator=g)
    mask = (torch.rand(2, 5, generator=g) > 0.3).float()
    full_lse = torch.logsumexp(torch.cat([zt, torch.randn(2, 5, 4, generator=g)], dim=-1), dim=-1)
    lk, _, _ = lk_loss("lk_lambda", "all_positions", 1.0, 0.0)(z, zt, full_lse, mask)
    ce, _, _ = soft_cross_entropy(z, zt, torch.logsumexp(zt, dim=-1), mask)
    assert math.isclose(float(lk), float(ce), rel_tol=1e-6)


def test_lk_targets_carry_the_whole_vocabularys_log_sum_exp() -> None:
    logits = torch.tensor([[[2.0, 0.0, 1.0, -1.0]]])
    draft_ids, t2d = torch.tensor([0, 2]), torch.tensor([True, False, True, False])
    _, lse_draft, _ = training_targets(logits, torch.ones(1, 1), draft_ids, t2d)
    _, lse_full, _ = training_targets(logits, torch.ones(1, 1), draft_ids, t2d, True)
    assert math.isclose(float(lse_draft), math.log(math.exp(2) + math.exp(1)), rel_tol=1e-6)
    assert math.isclose(float(lse_full), float(torch.logsumexp(logits, -1)), rel_tol=1e-6)
    assert needs_full_vocab_lse("lk_lambda") and needs_full_vocab_lse("lk_alpha")
    assert not needs_full_vocab_lse("soft_ce")
    assert loss_function("all_positions", "soft_ce") is soft_cross_entropy


def test_the_full_vocabulary_log_sum_exp_is_taken_in_bounded_chunks_with_the_same_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Eager (an uncompiled target), no float32 copy of the whole (B, T, V) logits: at 8192 x 128k that is 4 GiB."""
    from engine.trainer.verifier import model

    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 50, 40, generator=g) * 4).to(torch.bfloat16)
    draft_ids, t2d = torch.arange(0, 40, 2), torch.arange(40) % 2 == 0
    whole = torch.logsumexp(logits.float(), dim=-1)
    sizes: list[int] = []
    logsumexp = torch.logsumexp

    def counted(x: torch.Tensor, dim: int) -> torch.Tensor:
        sizes.append(x.numel())
        return logsumexp(x, dim=dim)

    monkeypatch.setattr(model, "LSE_CHUNK_ELEMENTS", 2 * 8 * 40)  # eight positions of both rows at a time
    monkeypatch.setattr(torch, "logsumexp", counted)
    _, lse, _ = training_targets(logits, torch.ones(2, 50), draft_ids, t2d, True)
    assert max(sizes) <= 2 * 8 * 40 and len(sizes) == 7  # 50 positions in chunks of 8
    torch.testing.assert_close(lse, whole, rtol=0, atol=0)


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("loss", "kl", "loss: got 'kl'; allowed: soft_ce, lk_lambda, lk_alpha"),
        ("lk_kl_scale", 0.0, r"lk_kl_scale: got 0.0; the KL weight at zero acceptance, in \(0, 1\]"),
        ("lk_kl_scale", 1.5, r"lk_kl_scale: got 1.5"),
        ("lk_kl_decay", -1.0, "lk_kl_decay: got -1.0; a finite number >= 0"),
        ("lk_kl_decay", float("inf"), "lk_kl_decay: got inf"),
    ],
)
def test_bad_lk_settings_are_config_errors_naming_the_key(key: str, value: object, fragment: str) -> None:
    with pytest.raises(ConfigError, match=fragment):
        from_dict({key: value})


def test_a_bad_lk_setting_on_the_command_line_exits_2_with_one_line() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--set", "lk_kl_scale=2", "--print-config"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and done.stderr.startswith("specdec-train: config error: lk_kl_scale: got 2")


def test_an_lk_config_gives_the_workers_its_loss_and_the_targets_the_whole_vocabularys_lse() -> None:
    import os

    from engine.trainer.run import assembly
    from engine.trainer.run.worker import WorkerSettings
    from engine.trainer.threads.metrics import EventLog
    from engine.trainer.verifier.model import load_tokenizer

    cfg = from_dict({"target": "tiny", "tiny_layers": 4, "draft_vocab_size": 32, "loss": "lk_alpha"})
    settings = WorkerSettings.from_config(cfg)
    loss, _, _ = settings.loss_fn(DRAFT_LOGITS, TARGET_LOGITS, FULL_LSE, torch.ones(1, 1))
    assert math.isclose(float(loss), -math.log(ALPHA), rel_tol=1e-6)
    with open(os.devnull, "w") as devnull:
        events = EventLog(None, stdout=devnull)
        (target,) = assembly.load_targets(cfg, [torch.device("cpu")], load_tokenizer("tiny"), lambda *_: None, events)
        (plain,) = assembly.load_targets(
            from_dict({"target": "tiny", "tiny_layers": 4}), [torch.device("cpu")], load_tokenizer("tiny"),
            lambda *_: None, events,
        )  # fmt: skip
    assert target.full_vocab_lse and not plain.full_vocab_lse
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    draft_ids = torch.arange(0, 64, 2)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    out = target.run(ids, torch.ones(1, 8), draft_ids, t2d)
    logits, _ = target.logits_and_hidden3(ids)
    assert torch.allclose(out.target_lse, torch.logsumexp(logits.float(), dim=-1), atol=1e-5)
