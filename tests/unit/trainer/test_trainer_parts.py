"""The engine's smaller parts: gradient checkpointing, config errors, the queue, the compile guard, the vocab."""

from __future__ import annotations

import threading
import time
from dataclasses import astuple
from typing import Any

import pytest
import torch
from support.waiting import wait_until

from engine.trainer.config import ConfigError, from_dict, load_toml, preset
from engine.trainer.data.vocab import vocab_from_counts
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.loss import soft_cross_entropy, total_loss
from engine.trainer.draft.model import DraftConfig, Drafter
from engine.trainer.threads import compile as guard
from engine.trainer.threads.metrics import suggest_split
from engine.trainer.threads.queue import BoundedQueue, ProducerFailed, QueueClosed, QueueTimeout
from engine.trainer.verifier.model import default_layer_ids


def tiny_drafter(seed: int = 0) -> Drafter:
    cfg = DraftConfig(
        hidden_size=32,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        intermediate_size=64,
        vocab_size=50,
        draft_vocab_size=20,
    )
    torch.manual_seed(seed)
    embed = torch.randn(50, 32)
    return Drafter(cfg, embed, torch.arange(0, 40, 2))


def grads_of(
    drafter: Drafter, grad_checkpointing: bool, attention: str = "sdpa"
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    b, t = 2, 24
    hidden3 = torch.randn(b, t, 96, generator=g)
    ids = torch.randint(0, 50, (b, t), generator=g)
    target_z = torch.randn(b, t, 20, generator=g)
    mask = torch.ones(b, t)
    drafter.zero_grad(set_to_none=True)
    losses, _, _ = drafter(
        hidden3,
        ids,
        target_z,
        torch.logsumexp(target_z, -1),
        mask,
        ttt_steps=4,
        attention=TTTAttention(attention),
        loss_fn=soft_cross_entropy,
        grad_checkpointing=grad_checkpointing,
    )
    loss = total_loss(losses)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def test_gradient_checkpointing_with_prior_kv_inputs_gives_the_same_grads() -> None:
    drafter = tiny_drafter()
    loss_plain, plain = grads_of(drafter, grad_checkpointing=False)
    loss_ckpt, ckpt = grads_of(drafter, grad_checkpointing=True)
    assert torch.equal(loss_plain, loss_ckpt)
    assert plain.keys() == ckpt.keys() and len(plain) == len(list(drafter.parameters()))
    for name in plain:
        torch.testing.assert_close(plain[name], ckpt[name], rtol=0, atol=0, msg=name)


def test_the_merged_attention_trains_the_drafter_as_the_masked_softmax_does() -> None:
    """Four TTT steps through the whole drafter: the loss and every parameter's gradient, merged against SDPA."""
    drafter = tiny_drafter()
    loss_sdpa, sdpa = grads_of(drafter, grad_checkpointing=False)
    loss_merged, merged = grads_of(drafter, grad_checkpointing=False, attention="merged")
    torch.testing.assert_close(loss_merged, loss_sdpa, rtol=1e-6, atol=0)
    assert merged.keys() == sdpa.keys()
    for name in sdpa:
        torch.testing.assert_close(merged[name], sdpa[name], rtol=1e-4, atol=1e-6, msg=name)


def test_config_errors_name_the_key_and_the_allowed_values(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"drafter_mode: got 'both'; allowed: replicas, independent"):
        from_dict({"drafter_mode": "both"})
    with pytest.raises(ConfigError, match=r"on_thread_error: .*allowed: stop, continue"):
        from_dict({"on_thread_error": "ignore"})
    with pytest.raises(ConfigError, match=r"drafter_devices: device 'gpu0'"):
        from_dict({"drafter_devices": ["gpu0"]})
    with pytest.raises(ConfigError, match=r"stepz: unknown key"):
        from_dict({"stepz": 3})
    with pytest.raises(ConfigError, match=r"target: '/nope' is neither a built-in preset"):
        from_dict({"target": "/nope"})
    with pytest.raises(ConfigError, match=r"drafter_lrs: one positive learning rate per drafter device \(2\)"):
        from_dict({"drafter_mode": "independent", "drafter_devices": ["cpu", "cpu"], "drafter_lrs": [1e-3]})
    with pytest.raises(ConfigError, match=r"preset: got 'x'"):
        preset("x")
    toml = tmp_path / "e.toml"
    toml.write_text('preset = "cpu-demo"\nsteps = 7\n[engine]\nttt_steps = 2\n')
    cfg = load_toml(toml)
    assert (cfg.steps, cfg.ttt_steps, cfg.target) == (7, 2, "tiny")
    assert preset("h200-single").attention == "flex"  # merged is refused on CUDA (run/assembly.py)


def test_queue_blocks_closes_and_propagates_producer_errors() -> None:
    q: BoundedQueue[int] = BoundedQueue(2)
    q.put(1)
    q.put(2)
    with pytest.raises(QueueTimeout):
        q.put(3, timeout_s=0.05)
    assert q.get() == 1
    q.close()
    assert q.get() == 2  # drains what is left
    with pytest.raises(QueueClosed):
        q.get(timeout_s=1)
    with pytest.raises(QueueClosed):
        q.put(4)
    failing: BoundedQueue[int] = BoundedQueue(1)
    got: list[BaseException] = []

    def consumer() -> None:
        try:
            failing.get()
        except ProducerFailed as exc:
            got.append(exc)

    t = threading.Thread(target=consumer)
    t.start()
    failing.fail(KeyError("lost"), "target0")
    t.join(5)
    assert got and isinstance(got[0].__cause__, KeyError) and "target0" in str(got[0])


def test_guard_serialises_first_calls_per_signature_then_lets_calls_run_concurrently(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "compile", lambda fn, **_kw: fn)  # the guard's logic, not inductor, is under test
    inside = 0
    peak = 0
    lock = threading.Lock()

    def body(x: torch.Tensor) -> torch.Tensor:
        nonlocal inside, peak
        with lock:
            inside += 1
            peak = max(peak, inside)
        time.sleep(0.05)
        with lock:
            inside -= 1
        return x

    fn = guard.GuardedFunction(body, compiled=True, name="probe")

    def run_all(shape: tuple[int, ...]) -> int:
        nonlocal peak
        peak = 0
        threads = [threading.Thread(target=fn, args=(torch.zeros(shape),)) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return peak

    assert run_all((2,)) == 1  # first calls of a new signature: one at a time
    assert run_all((2,)) == 3  # known signature: concurrent
    guard.set_guard_enabled(False)
    try:
        assert run_all((3,)) == 3  # the control: no guard, no serialisation
    finally:
        guard.set_guard_enabled(True)


def test_draft_vocab_takes_the_most_frequent_tokens_with_consistent_maps() -> None:
    counts = torch.tensor([0, 5, 1, 9, 0, 5, 2])
    vocab = vocab_from_counts(counts, 4)
    assert vocab.draft_to_target.tolist() == [1, 3, 5, 6]
    assert (torch.arange(4) + vocab.d2t()).tolist() == [1, 3, 5, 6]
    assert vocab.t2d(7).tolist() == [False, True, False, True, False, True, True]


def test_default_layers_are_distinct_for_any_depth_from_three() -> None:
    assert default_layer_ids(32) == [1, 15, 28]  # outputs of 1, L/2-1, L-4 = inputs of vLLM's 2, L/2, L-3
    for depth in range(3, 64):
        ids = default_layer_ids(depth)
        assert len(set(ids)) == 3 and max(ids) < depth and ids == sorted(ids)


def test_split_suggestion_balances_target_and_drafter_rates_when_they_do_not_fit_together() -> None:
    tight = {"target_gib": 100.0, "drafter_gib": 60.0, "gpu_gib": 140.0}
    assert astuple(suggest_split(27_000, 9_000, 8, **tight))[:3] == (False, 2, 6)
    assert astuple(suggest_split(10_000, 10_000, 8, **tight))[:3] == (False, 4, 4)
    assert astuple(suggest_split(1.0, 1000.0, 4, **tight))[:3] == (False, 3, 1)


def test_heartbeats_flag_a_stalled_thread_and_a_starving_queue() -> None:
    from engine.trainer.threads.health import HealthBoard
    from engine.trainer.threads.metrics import EventLog

    events = EventLog(None)
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    board = HealthBoard(events, stall_after_s=0.05, starve_after_s=0.05)
    board.register("drafter0", "drafter")
    board.register("target0", "producer")
    board.beat("drafter0", state="waiting", queue_depth=0)
    board.beat("target0", state="training", step=3)
    assert board.publish() == []
    raised: list[tuple[str, str]] = []

    def three_raised() -> bool:
        raised.extend(board.publish())
        return len(raised) >= 3

    wait_until(three_raised, 5, "stall and starve flags", observe=lambda: raised)
    assert set(raised) == {("drafter0", "stalled"), ("drafter0", "starving"), ("target0", "stalled")}
    last = {e["thread"]: e for e in seen if e["kind"] == "heartbeat"}
    assert last["target0"]["state"] == "training" and "stalled" in last["target0"]["flags"]
    board.beat("target0", state="training", step=4)
    board.publish()
    assert [e for e in seen if e["kind"] == "heartbeat"][-1]["flags"] == []  # target0 beat again: flag cleared
