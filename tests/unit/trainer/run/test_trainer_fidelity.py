"""Training matches EAGLE-3 as vLLM and SGLang serve it: RoPE per TTT step, the captured target layers,
Hugging Face initialisation, and compile trouble surfacing as events and agent anomalies."""

from __future__ import annotations

import io
import threading
from typing import Any

import pytest
import torch

from engine.agent.anomalies import EngineState, engine_anomalies
from engine.protocol import CompileEvent, decode_engine_event
from engine.trainer.config import ConfigError, from_dict
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.loss import soft_cross_entropy, total_loss
from engine.trainer.draft.model import DraftConfig, Drafter, apply_rotary, rotary_tables, ttt_step
from engine.trainer.threads import compile as guard
from engine.trainer.threads.metrics import EventLog, compile_listener
from engine.trainer.verifier.model import decoder_layers, default_layer_ids, load_target
from engine.trainer.verifier.model_configs import tiny_config

VOCAB = 50


def small_cfg(**extra: Any) -> DraftConfig:
    sizes: dict[str, Any] = {"hidden_size": 32, "intermediate_size": 64, **extra}
    return DraftConfig(num_heads=4, num_kv_heads=2, head_dim=16, vocab_size=VOCAB, draft_vocab_size=20, **sizes)


def small_drafter(*, ttt_rope_offset: bool = True, seed: int = 0, **extra: Any) -> Drafter:
    torch.manual_seed(seed)
    embed = torch.randn(VOCAB, 32)
    return Drafter(small_cfg(**extra), embed, torch.arange(0, 40, 2), ttt_rope_offset=ttt_rope_offset)


def record_cos(drafter: Drafter) -> list[torch.Tensor]:
    """The cos table every TTT step calls the decoder layer with (its third argument), in order."""
    seen: list[torch.Tensor] = []
    drafter.layer.register_forward_pre_hook(lambda _mod, args: seen.append(args[2]))
    return seen


def run_ttt(drafter: Drafter, steps: int, t: int = 12) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    hidden3 = torch.randn(2, t, 96, generator=g)
    ids = torch.randint(0, VOCAB, (2, t), generator=g)
    target_z = torch.randn(2, t, 20, generator=g)
    with torch.no_grad():
        out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = drafter(
            hidden3,
            ids,
            target_z,
            torch.logsumexp(target_z, -1),
            torch.ones(2, t),
            ttt_steps=steps,
            attention=TTTAttention("sdpa"),
            loss_fn=soft_cross_entropy,
        )
    return out


# --- 1. RoPE per TTT step ---------------------------------------------------------------------------------


def test_ttt_step_i_rotates_with_positions_arange_t_plus_i() -> None:
    t, steps = 12, 4
    drafter = small_drafter()
    recorded = record_cos(drafter)
    run_ttt(drafter, steps, t)
    full_cos, _ = rotary_tables(t + steps, 16, drafter.cfg.rope_theta, torch.device("cpu"))
    assert len(recorded) == steps
    for i, cos in enumerate(recorded):
        torch.testing.assert_close(cos, full_cos[i : i + t], rtol=0, atol=0, msg=f"step {i}")
    # Step 1's table is not step 0's: the old behaviour (one table for every step) is gone.
    assert not torch.equal(recorded[1], recorded[0])


def test_rope_offset_off_reuses_step_zeros_table_and_changes_the_later_steps_only() -> None:
    # Large weights (std 0.5) so attention is far from uniform and positions matter to the loss.
    with_offset = run_ttt(small_drafter(ttt_rope_offset=True, initializer_range=0.5), 4)
    without = run_ttt(small_drafter(ttt_rope_offset=False, initializer_range=0.5), 4)
    losses_on, losses_off = with_offset[0], without[0]
    assert torch.equal(losses_on[0], losses_off[0])  # step 0 rotates with arange(T) either way
    assert (losses_on[1:] - losses_off[1:]).abs().min() > 1e-2  # measured: 0.03, 0.16, 0.11


def test_rotated_query_key_scores_depend_on_relative_position_only() -> None:
    # Why the offset matters across steps: a step-1 query at position t+1 against a step-0 key at position t'
    # scores as a step-0 query would at distance t+1-t'. Checked directly on the rotary tables.
    cos, sin = rotary_tables(20, 16, 10000.0, torch.device("cpu"))
    q, k = torch.randn(16), torch.randn(16)

    def score(pq: int, pk: int) -> float:
        return float((apply_rotary(q, cos[pq], sin[pq]) * apply_rotary(k, cos[pk], sin[pk])).sum())

    assert abs(score(7, 3) - score(5, 1)) < 1e-4
    assert abs(score(7, 3) - score(6, 3)) > 1e-3


def test_per_step_tables_are_contiguous_and_shaped_alike_so_a_compiled_step_sees_one_signature() -> None:
    tables = small_drafter().step_rotary(12, 5, torch.device("cpu"))
    shapes = {(c.shape, c.stride(), s.shape, s.stride()) for c, s in tables}
    assert len(tables) == 5 and len(shapes) == 1
    assert all(c.is_contiguous() and s.is_contiguous() for c, s in tables)


def test_ttt_rope_offset_is_a_config_key_on_by_default() -> None:
    assert from_dict({}).ttt_rope_offset is True
    assert from_dict({"ttt_rope_offset": False}).ttt_rope_offset is False


# --- 2. The captured target layers --------------------------------------------------------------------------


def test_default_layers_are_the_outputs_of_1_mid_minus_1_and_l_minus_4() -> None:
    assert default_layer_ids(32) == [1, 15, 28]
    assert default_layer_ids(8) == [1, 3, 4]
    assert default_layer_ids(7) == [1, 2, 3]
    assert default_layer_ids(4) == [0, 1, 3]  # too shallow for the served rule: spread, still distinct
    with pytest.raises(ValueError, match="at least 3"):
        default_layer_ids(2)


def test_captured_hidden_states_are_what_vllm_and_sglang_feed_the_drafter() -> None:
    from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    target = load_target("tiny", torch.device("cpu"), tokenizer=tok, layer_ids=None, seed=0, dtype=torch.float32)
    layers = decoder_layers(target.model)
    depth = len(layers)
    assert depth == 8  # the tiny preset is deep enough for the served rule
    # vLLM/SGLang capture hidden_states + residual entering layers 2, L//2, L-3: the input of those layers.
    served_inputs: dict[int, torch.Tensor] = {}

    def keep_input(lid: int) -> Any:
        def hook(_mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            served_inputs[lid] = (args[0] if args else kwargs["hidden_states"]).clone()

        return hook

    for lid in (2, depth // 2, depth - 3):
        layers[lid].register_forward_pre_hook(keep_input(lid), with_kwargs=True)
    ids = torch.randint(0, target.vocab_size, (1, 16), generator=torch.Generator().manual_seed(0))
    draft_ids = torch.arange(32)
    t2d = torch.zeros(target.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    out = target.run(ids, torch.ones(1, 16), draft_ids, t2d)
    h = target.hidden_size
    assert target.layer_ids == [1, 3, 4]
    for j, lid in enumerate((2, depth // 2, depth - 3)):
        torch.testing.assert_close(out.hidden3[..., j * h : (j + 1) * h], served_inputs[lid], rtol=0, atol=0)


def test_bad_target_layers_are_config_errors_that_say_what_is_allowed() -> None:
    with pytest.raises(ConfigError, match=r"target_layers: \[1, 1, 2\]: three distinct"):
        from_dict({"target_layers": [1, 1, 2]})
    with pytest.raises(ConfigError, match=r"target_layers: \[1, 3, 8\]: the target has 8 decoder layers.*0\.\.7"):
        from_dict({"target_layers": [1, 3, 8]})
    with pytest.raises(ConfigError, match=r"target has 32 decoder layers"):
        from_dict({"target": "llama3-8b-shape", "target_layers": [1, 15, 32]})
    assert from_dict({"target_layers": [0, 3, 7]}).target_layers == [0, 3, 7]


def test_a_local_targets_depth_comes_from_its_config_json(tmp_path: Any) -> None:
    (tmp_path / "config.json").write_text('{"num_hidden_layers": 6}')
    with pytest.raises(ConfigError, match=r"the target has 6 decoder layers"):
        from_dict({"target": str(tmp_path), "target_layers": [1, 2, 6]})


def test_tiny_config_still_builds_a_shallow_target_with_distinct_layers() -> None:
    cfg = tiny_config(64, 64, 4)
    assert cfg.num_hidden_layers == 4 and len(set(default_layer_ids(4))) == 3


# --- 4. Initialisation ----------------------------------------------------------------------------------------


def test_drafter_starts_as_hugging_face_initialises_a_llama() -> None:
    drafter = small_drafter(initializer_range=0.02)
    drafter_big = Drafter(small_cfg(hidden_size=256, intermediate_size=512), torch.randn(VOCAB, 256), torch.arange(20))
    for name, module in drafter.named_modules():
        if isinstance(module, torch.nn.Linear):
            assert module.bias is None or bool((module.bias == 0).all()), name
    for name, p in drafter.named_parameters():
        if "norm" in name:
            assert bool((p == 1).all()), name
    # Standard deviation of every Linear weight ~ initializer_range (thousands of samples per matrix).
    for name, module in drafter_big.named_modules():
        if isinstance(module, torch.nn.Linear):
            std = float(module.weight.detach().std())
            assert abs(std - 0.02) < 0.002, (name, std)
            assert abs(float(module.weight.detach().mean())) < 0.002, name
    # The embeddings are the target's, frozen: a buffer, not a parameter, untouched by init.
    names = {n for n, _ in drafter.named_parameters()}
    assert not any("embed" in n for n in names)
    torch.manual_seed(0)
    assert torch.equal(drafter.embed_table, torch.randn(VOCAB, 32))
    assert all(p.requires_grad for p in drafter.trainable_parameters())


def test_initializer_range_comes_from_the_target_config() -> None:
    hf = tiny_config(64, 64, 8)  # the tiny target uses 0.1
    assert DraftConfig.from_target(hf, 16).initializer_range == pytest.approx(0.1)
    del hf.initializer_range
    assert DraftConfig.from_target(hf, 16).initializer_range == pytest.approx(0.02)


# --- 5. Compile events ----------------------------------------------------------------------------------------


def scaled(x: torch.Tensor, n: int) -> torch.Tensor:
    return (x * n).sin()


def run_in_thread(name: str, fn: Any) -> None:
    errors: list[BaseException] = []

    def body() -> None:
        try:
            fn()
        except BaseException as exc:
            errors.append(exc)

    th = threading.Thread(target=body, name=name)
    th.start()
    th.join(60.0)
    assert not th.is_alive() and not errors, errors


def test_recompile_after_warm_up_and_fallback_to_eager_are_events_and_anomalies() -> None:
    events = EventLog(None, stdout=io.StringIO())
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    lines: list[str] = []
    events.say = lines.append  # type: ignore[method-assign]
    fn = guard.GuardedFunction(scaled, compiled=True, name="ttt_step", backend="eager")
    fn.listeners.append(compile_listener(events))
    old_limit = guard.recompile_limit()

    def drafter_thread() -> None:
        guard.set_recompile_limit(4)
        guard.apply_dynamo_config()
        x = torch.randn(4)
        fn(x, 1)  # warm-up: two graphs, no event
        fn(x, 2)
        fn.mark_warm()
        fn(x, 1)  # a known signature: no compile
        with torch.no_grad():
            fn(x, 1)  # a first no-grad call (evaluation) compiles its graph without an event
        assert seen == []
        fn(x, 3)  # a new graph after warm-up: a recompile event
        fn(x, 4)  # the limit (4 graphs) is reached: runs eagerly, a fallback event
        fn(x, 5)  # still eager: the fallback is reported once

    try:
        torch._dynamo.reset()
        run_in_thread("drafter1", drafter_thread)
    finally:
        guard.set_recompile_limit(old_limit)
        events.close()
    assert [(e["kind"], e["what"], e["thread"], e["function"]) for e in seen] == [
        ("compile", "recompile", "drafter1", "ttt_step"),
        ("compile", "fallback", "drafter1", "ttt_step"),
    ]
    assert seen[1]["graphs"] == 4 and seen[1]["limit"] == 4
    assert any("drafter1: compile fallback" in line for line in lines)

    state = EngineState()
    for ev in seen:
        state.feed(decode_engine_event(ev))
    kinds = {(a.kind, a.thread): a.message for a in engine_anomalies(state, now=seen[-1]["t"], running=True)}
    assert kinds[("compile_fallback", "drafter1")].startswith("drafter1: compile fallback: ttt_step")
    assert "recompiled 1x after warm-up" in kinds[("recompile", "drafter1")]


def aliased(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return x * a + b


def test_a_known_signature_that_recompiles_after_warm_up_is_an_event_too() -> None:
    fn = guard.GuardedFunction(aliased, compiled=True, name="ttt_step", backend="eager")
    seen: list[CompileEvent] = []
    fn.listeners.append(seen.append)
    m = torch.ones(3)
    fn(torch.randn(3), m, m)  # warm-up with one tensor passed twice
    fn.mark_warm()
    fn(torch.randn(3), m, m)
    assert seen == []
    fn(torch.randn(3), torch.ones(3), torch.ones(3))  # same shapes, but dynamo guards on the aliasing
    assert [(e.what, e.graphs) for e in seen] == [("recompile", 2)]
    assert seen[0].guard == "a is b", seen[0].guard  # the aliasing guard of the first graph, in torch 2.13's words


def rows_branch(x: torch.Tensor) -> torch.Tensor:
    # A branch on a dynamic row count: dynamo guards the graph on the side it traced.
    return x * 2 if x.shape[0] > 8192 else x + 1


def test_a_recompile_of_a_known_signature_names_the_guard_that_failed() -> None:
    """A row count marked dynamic is one signature; a graph traced at a count above a threshold it branches on
    holds only for counts above it, and the first count below compiles again: the event and its anomaly name the
    guard, so the cause is on the screen and not only in TORCH_LOGS."""
    fn = guard.GuardedFunction(rows_branch, compiled=True, name="ttt_step", backend="eager")
    events = EventLog(None, stdout=io.StringIO())
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    lines: list[str] = []
    events.say = lines.append  # type: ignore[method-assign]
    fn.listeners.append(compile_listener(events))

    def rows(n: int) -> torch.Tensor:
        x = torch.zeros(n, 2)
        torch._dynamo.mark_dynamic(x, 0)
        return x

    try:
        assert fn(rows(12296)).sum() == 0  # the warm-up's count, above the branch
        fn.mark_warm()
        fn(rows(9000))  # the same side: the same graph
        assert seen == []
        assert fn(rows(4232)).sum() == 4232 * 2  # below: compiled again
    finally:
        events.close()
    assert [(e["what"], e["graphs"]) for e in seen] == [("recompile", 2)]
    reason = seen[0]["guard"]
    assert reason == "8193 <= x.size()[0]", reason  # torch 2.13's words (CI's pin), one line, no source comment
    assert any("the guard that failed: " + reason in line for line in lines), lines
    state = EngineState()
    state.feed(decode_engine_event(seen[0]))
    (anomaly,) = [a for a in engine_anomalies(state, now=seen[0]["t"], running=True) if a.kind == "recompile"]
    assert anomaly.message.endswith(f"(the guard that failed: {reason})"), anomaly.message


def test_failed_guard_picks_the_graph_of_the_signature_and_drops_dynamo_comments() -> None:
    reasons = [
        "0/0: k == 1                                  #   # model.py:6 in f\nUser stack trace:\n  File x",
        "0/3: 8192 < L['rows'].size()[0]              #   # rows.py:9 in f",
    ]
    assert guard.failed_guard(reasons, "0/3") == "8192 < L['rows'].size()[0]"
    assert guard.failed_guard(reasons, "0/0") == "k == 1"
    assert guard.failed_guard(reasons, "0/1") is None
    assert guard.failed_guard(reasons, None) is None


def test_recompile_limit_is_sized_from_steps_buckets_and_devices() -> None:
    assert guard.recompile_limit_for(ttt_steps=7, buckets=1, devices=1) == 28  # 7 graphs x 2 grad modes x 2
    assert guard.recompile_limit_for(ttt_steps=3, buckets=2, devices=4) == 96
    assert guard.recompile_limit_for(ttt_steps=1, buckets=1, devices=1) == 8  # a floor for tiny runs


def test_help_screen_and_chart_tooltip_say_what_loss_i_and_acc_i_divide_by() -> None:
    from tui.dashboard.screens.help import HelpScreen
    from tui.dashboard.widgets.charts import CHARTS_TOOLTIP

    for text in (HelpScreen.charts_text(), CHARTS_TOOLTIP):
        assert "0.8^i" in text and "ALL B x T positions" in text
        assert "divided by the positions in the data's loss mask" in text


@pytest.mark.usefixtures("fresh_dynamo")
def test_compiled_ttt_step_keeps_one_graph_per_step_and_bucket_with_per_step_rope() -> None:
    # Dynamo with the eager backend (fast on the CPU): the per-step rotary tables are inputs of the compiled
    # step, so training compiles ttt_steps x buckets graphs during warm-up and none afterwards.
    torch._dynamo.reset()
    drafter = small_drafter()
    fn = guard.GuardedFunction(ttt_step, compiled=True, name="ttt_step", backend="eager")
    seen: list[CompileEvent] = []
    fn.listeners.append(seen.append)
    attention = TTTAttention("sdpa")

    def train(t: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        h, ids = torch.randn(2, t, 96, generator=g), torch.randint(0, VOCAB, (2, t), generator=g)
        tz, m = torch.randn(2, t, 20, generator=g), torch.ones(2, t)
        lse = torch.logsumexp(tz, -1)
        kw: dict[str, Any] = {"ttt_steps": 2, "attention": attention, "loss_fn": soft_cross_entropy, "loss_mask": m}
        eager = drafter(h, ids, tz, lse, m, **kw)[0]
        compiled = drafter(h, ids, tz, lse, m, step_fn=fn, **kw)[0]
        total_loss(compiled).backward()
        return eager.detach(), compiled.detach()

    for t in (8, 16):
        eager, compiled = train(t, 0)
        torch.testing.assert_close(compiled, eager)
    fn.mark_warm()
    graphs = fn.graph_count()
    for t in (8, 16):
        train(t, 1)
    assert graphs == 2 * 2 and fn.graph_count() == graphs
    assert seen == []


def test_rotary_for_growing_lengths_keeps_one_table_per_device() -> None:
    drafter = small_drafter()
    full_cos, full_sin = rotary_tables(40, 16, drafter.cfg.rope_theta, torch.device("cpu"))
    for n in range(1, 41):
        cos, sin = drafter.rotary(n, torch.device("cpu"))
        torch.testing.assert_close(cos, full_cos[:n], rtol=0, atol=0)
        torch.testing.assert_close(sin, full_sin[:n], rtol=0, atol=0)
    assert len(drafter._positions) == 1 and drafter._positions["cpu"][0].shape[0] <= 2 * 40
