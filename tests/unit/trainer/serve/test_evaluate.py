"""Acceptance length τ: the chain drafting equals the training-time test, and τ's bounds on hand-built drafters."""

from __future__ import annotations

import itertools
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.trainer.data.sources import shipped_corpus_path
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.model import DraftConfig, Drafter
from engine.trainer.serve.evaluate import (
    AcceptanceStats,
    DrafterProposer,
    evaluate,
    heldout_prompts,
    main,
    speculate,
    target_forward,
)
from engine.trainer.threads.metrics import EventLog
from engine.trainer.verifier.model import FrozenTarget, load_target, load_tokenizer

K = 4
MAX_NEW = 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def tiny_drafter(seed: int = 0, vocab: int = 64, draft_vocab: int = 48, *, rope_offset: bool = True) -> Drafter:
    cfg = DraftConfig(
        hidden_size=32,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        intermediate_size=64,
        vocab_size=vocab,
        draft_vocab_size=draft_vocab,
    )
    g = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        embed = torch.randn(vocab, 32, generator=g)
        d2t = torch.sort(torch.randperm(vocab, generator=g)[:draft_vocab]).values
        return Drafter(cfg, embed, d2t, ttt_rope_offset=rope_offset).eval()


@pytest.mark.parametrize("rope_offset", [False, True])
def test_chain_drafting_reproduces_the_training_time_test_at_the_last_position(rope_offset: bool) -> None:
    """Chain step j's logits = TTT step j's logits at the last position when TTT reads the drafted tokens."""
    drafter = tiny_drafter(rope_offset=rope_offset)
    n, k = 9, 4  # positions with target states; then the bonus token and k proposals
    g = torch.Generator().manual_seed(1)
    seq = torch.randint(0, 64, (n + 1,), generator=g).tolist()
    hidden3 = torch.randn(1, n + k, 96, generator=g)  # positions >= n: never seen by position n - 1
    proposer = DrafterProposer(drafter, rope_offset=rope_offset)
    chain = proposer.chain_logits(seq, hidden3[:, :n], k)
    drafted = proposer.propose(seq, hidden3[:, :n], k)

    captured: list[torch.Tensor] = []

    def keep_logits(logits: torch.Tensor, _z: torch.Tensor, _lse: torch.Tensor, _m: torch.Tensor) -> Any:
        captured.append(logits.detach())
        zero = logits.sum() * 0
        return zero, zero, zero

    ids = torch.tensor([seq + drafted[:-1]])  # TTT step i at position n-1 reads token n + i
    with torch.no_grad():
        drafter(
            hidden3,
            ids,
            torch.zeros(1, n + k, 48),
            torch.zeros(1, n + k),
            torch.ones(1, n + k),
            ttt_steps=k,
            attention=TTTAttention("sdpa"),
            loss_fn=keep_logits,
        )
    for j in range(k):
        torch.testing.assert_close(chain[j], captured[j][0, n - 1], rtol=1e-5, atol=1e-5)


def test_acceptance_stats_give_tau_and_per_position_rates() -> None:
    stats = AcceptanceStats(3)
    for accepted in (3, 1, 0, 3):  # tokens per round: 4, 2, 1, 4
        stats.add(accepted)
    assert stats.tau == pytest.approx(11 / 4)
    assert stats.per_position() == pytest.approx([3 / 4, 2 / 4, 2 / 4])
    assert stats.per_position_conditional() == pytest.approx([3 / 4, 2 / 3, 2 / 2])


@pytest.fixture(scope="module")
def tiny_target() -> FrozenTarget:
    tok = load_tokenizer("tiny")
    return load_target("tiny", torch.device("cpu"), tokenizer=tok, layer_ids=None, seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompts(tiny_target: FrozenTarget) -> list[list[int]]:
    return heldout_prompts(tiny_target.tokenizer, "shipped", holdout=32, seed=0, count=2)


class Oracle:
    """Proposes the target's own greedy continuation: every proposal is accepted."""

    def __init__(self, target: FrozenTarget) -> None:
        self.forward = target_forward(target)

    def propose(self, seq: list[int], hidden3: torch.Tensor, k: int) -> list[int]:
        out: list[int] = []
        for _ in range(k):
            logits, _h = self.forward(seq + out)
            out.append(int(logits[-1].argmax()))
        return out


class AlwaysWrong(Oracle):
    def propose(self, seq: list[int], hidden3: torch.Tensor, k: int) -> list[int]:
        right = super().propose(seq, hidden3, 1)[0]
        return [(right + 1) % 64] * k


def greedy(target: FrozenTarget, prompt: list[int], n: int) -> list[int]:
    forward = target_forward(target)
    out: list[int] = []
    for _ in range(n):
        logits, _h = forward(prompt + out)
        out.append(int(logits[-1].argmax()))
    return out


def test_a_drafter_that_proposes_the_targets_tokens_gets_tau_k_plus_one(
    tiny_target: FrozenTarget, prompts: list[list[int]]
) -> None:
    forward = target_forward(tiny_target)
    stats = evaluate(forward, Oracle(tiny_target), prompts, k=K, max_new_tokens=MAX_NEW, eos_id=None)
    assert stats.rounds > 0
    assert stats.tau == K + 1
    assert stats.per_position_conditional() == [1.0] * K


def test_a_drafter_that_is_always_wrong_gets_tau_one(tiny_target: FrozenTarget, prompts: list[list[int]]) -> None:
    forward = target_forward(tiny_target)
    stats = evaluate(forward, AlwaysWrong(tiny_target), prompts[:1], k=K, max_new_tokens=6, eos_id=None)
    assert stats.rounds == 6 - 1  # one token per round after the first (the prompt's own forward)
    assert stats.tau == 1.0
    assert stats.per_position() == [0.0] * K


def test_speculation_with_a_real_drafter_generates_exactly_the_targets_greedy_text(
    tiny_target: FrozenTarget, prompts: list[list[int]]
) -> None:
    cfg = DraftConfig.from_target(tiny_target.config, 64)
    vocab = tiny_target.vocab_size
    d2t = torch.arange(0, vocab, vocab // 64)[:64]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        drafter = Drafter(cfg, tiny_target.embed_weight(), d2t).eval()
    stats = AcceptanceStats(K)
    out = speculate(
        target_forward(tiny_target),
        DrafterProposer(drafter, rope_offset=True),
        prompts[0],
        k=K,
        max_new_tokens=MAX_NEW,
        eos_id=tiny_target.tokenizer.eos_token_id,
        stats=stats,
    )
    assert out == greedy(tiny_target, prompts[0], len(out))
    assert 1.0 <= stats.tau <= K + 1


class PartlyRight(Oracle):
    """The target's own continuation, wrong from a place that moves with the sequence length: rounds accept 0..k."""

    def propose(self, seq: list[int], hidden3: torch.Tensor, k: int) -> list[int]:
        right = super().propose(seq, hidden3, k)
        cut = len(seq) % (k + 1)
        return right[:cut] + [(t + 1) % 64 for t in right[cut:]]


def test_tau_does_not_depend_on_how_many_prompts_are_evaluated_together(tiny_target: FrozenTarget) -> None:
    """SpecForge's simulated τ moves with its micro-batch size. Here every prompt is decoded alone and τ is the ratio
    of the summed counts (AcceptanceStats.merge), so 16 prompts in groups of 1, 4 or 16 give the same histogram and
    τ as one call over all of them: no per-group mean enters it."""
    prompts16 = heldout_prompts(tiny_target.tokenizer, "shipped", holdout=32, seed=0, count=16)
    seen: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}
    target = target_forward(tiny_target)

    def forward(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:  # the same target, each sequence run once
        return seen[tuple(ids)] if tuple(ids) in seen else seen.setdefault(tuple(ids), target(ids))

    proposer = PartlyRight(tiny_target)
    proposer.forward = forward
    settings: dict[str, Any] = {"k": 3, "max_new_tokens": 8, "eos_id": tiny_target.tokenizer.eos_token_id}
    whole = evaluate(forward, proposer, prompts16, **settings)
    assert whole.prompts == 16 and all(whole.hist)  # every acceptance count 0..3 occurs
    for size in (1, 4, 16):
        grouped = AcceptanceStats(3)
        for lo in range(0, len(prompts16), size):
            grouped.merge(evaluate(forward, proposer, prompts16[lo : lo + size], **settings))
        assert (grouped.prompts, grouped.hist, grouped.new_tokens) == (16, whole.hist, whole.new_tokens), size
        assert grouped.tau == whole.tau, size


def test_training_with_eval_every_emits_eval_events_and_the_cli_reads_the_checkpoint(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.trainer.config import from_dict
    from engine.trainer.run.loop import TrainingRun

    out = tmp_path / "out"
    corpus = tmp_path / "small.jsonl"  # tokenizing the whole shipped corpus would be most of the test's time
    corpus.write_text("\n".join(shipped_corpus_path().read_text(encoding="utf-8").splitlines()[:64]) + "\n")
    cfg = from_dict(
        {
            "target": "tiny",
            "data": str(corpus),
            "drafter_devices": ["cpu", "cpu"],
            "drafter_mode": "independent",
            "buckets": [256],
            "batch_size": 1,
            "ttt_steps": 2,
            "draft_vocab_size": 96,
            "steps": 4,
            "eval_every": 2,
            "eval_k": 3,
            "eval_conversations": 1,
            "eval_max_new_tokens": 6,
            "output_dir": str(out),
            "torch_threads": 1,
        }
    )
    events = EventLog(out / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    engine = TrainingRun(cfg, events)
    engine.build()
    assert engine.run() == 0
    evals = [(e["thread"], e["step"]) for e in seen if e["kind"] == "eval"]
    assert sorted(evals) == [("drafter0", 2), ("drafter0", 4), ("drafter1", 2), ("drafter1", 4)]
    for e in (e for e in seen if e["kind"] == "eval"):
        assert 1.0 <= e["tau"] <= 4.0 and len(e["per_position"]) == 3 and e["rounds"] >= 1

    args = ["--checkpoint", str(out), "--k", "3", "--conversations", "1", "--max-new-tokens", "6", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["drafters"]) == {"drafter0", "drafter1"}
    assert report["step"] == 4 and report["ttt_rope_offset"] is True
    assert all(1.0 <= r["tau"] <= 4.0 for r in report["drafters"].values())

    # Input it cannot use: exit 2 and one line, not a traceback.
    newest = out / "checkpoints" / "step_00000004"
    assert main(["--checkpoint", str(out), "--drafter", "nosuch"]) == 2
    assert capsys.readouterr().err == f"specdec-train eval: --drafter nosuch: {newest} has drafter0, drafter1\n"
    ids = tmp_path / "ids.json"
    ids.write_text("[[1, 2], [3, 999999999]]")
    assert main(["--checkpoint", str(out), "--prompt-ids", str(ids)]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith("specdec-train eval: prompt 1: token id 999999999 is outside the target's vocabulary (0..")
    damaged = tmp_path / "damaged"
    shutil.copytree(newest, damaged)
    (damaged / "drafter0.pt").write_bytes((damaged / "drafter0.pt").read_bytes()[:100])
    assert main(["--checkpoint", str(damaged), "--conversations", "1", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.splitlines()[-1]
    assert err.startswith(f"specdec-train eval: cannot load {damaged / 'drafter0.pt'}: "), err
    bad_args = [["--device", "foo"], ["--k", "99999999999999999999"], ["--k", "65"]]
    if not torch.cuda.is_available():
        bad_args.append(["--device", "cuda"])
    for bad in bad_args:
        with pytest.raises(SystemExit) as exit_:
            main(["--checkpoint", str(out), *bad])
        assert exit_.value.code == 2, bad
        assert "Traceback" not in capsys.readouterr().err


def test_eval_of_a_directory_without_checkpoints_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--checkpoint", str(tmp_path)]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


def test_eval_of_a_checkpoint_still_being_written_says_so_as_export_does(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    partial = tmp_path / "checkpoints" / ".tmp-step_00000004-123-456"
    partial.mkdir(parents=True)
    assert main(["--checkpoint", str(partial)]) == 2
    assert "is a checkpoint still being written (no meta.json yet)" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path)]) == 2
    assert "has no complete checkpoint yet: one is still being written" in capsys.readouterr().err


VOCAB = 64


def next_token_target(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A target whose greedy token after ``t`` is ``t + 1``: its continuation of [0] is 1, 2, 3, ..."""
    logits = torch.full((len(ids), VOCAB), -1.0)
    logits[torch.arange(len(ids)), (torch.tensor(ids) + 1) % VOCAB] = 1.0
    return logits, torch.zeros(1, len(ids), 3)


class CountingUp:
    """Proposes the next_token_target's own continuation: every draft is right."""

    def propose(self, seq: list[int], hidden3: torch.Tensor, k: int) -> list[int]:
        return [(seq[-1] + j) % VOCAB for j in range(1, k + 1)]


def test_vllm_counting_counts_the_drafts_past_the_stop_token_and_keeps_the_output() -> None:
    """Token 7 is the stop token. The prompt's forward gives 1; round 1 drafts 2-5 (the target adds 6); round 2
    drafts 7-10, so the stop token is its first draft. Counted as we stop, round 2 accepts no draft and the
    target gives the stop token; counted as vLLM's scheduler does (before it cuts the output), it accepts four."""
    results = {}
    for counting in ("stop", "vllm"):
        outputs: list[list[int]] = []
        stats = evaluate(
            next_token_target, CountingUp(), [[0]], k=K, max_new_tokens=MAX_NEW, eos_id=7, counting=counting,
            outputs=outputs,
        )  # fmt: skip
        results[counting] = (stats, outputs[0])
    (ours, out_ours), (vllm, out_vllm) = results["stop"], results["vllm"]
    assert out_ours == out_vllm == [1, 2, 3, 4, 5, 6, 7]  # the same text, ending with the stop token
    assert ours.hist == [1, 0, 0, 0, 1] and vllm.hist == [0, 0, 0, 0, 2]
    assert ours.accepted_per_position() == [1, 1, 1, 1] and vllm.accepted_per_position() == [2, 2, 2, 2]
    assert vllm.tau == K + 1 and ours.tau == (5 + 1) / 2
    assert vllm.to_dict()["counting"] == "vllm" and ours.to_dict()["counting"] == "stop"
    # Ignoring the stop token, both countings are the same numbers.
    ignore = [evaluate(next_token_target, CountingUp(), [[0]], k=K, max_new_tokens=MAX_NEW, eos_id=None,
                       counting=c) for c in ("stop", "vllm")]  # fmt: skip
    assert ignore[0].hist == ignore[1].hist


def test_unknown_counting_is_refused() -> None:
    with pytest.raises(ValueError, match="one of stop, vllm"):
        evaluate(next_token_target, CountingUp(), [[0]], k=K, max_new_tokens=4, eos_id=None, counting="sglang")


def test_every_turn_prompts_each_reply_of_the_held_out_conversations_and_ends_with_the_last_turns(
    tiny_target: FrozenTarget,
) -> None:
    """``turns = "all"``: each of the first ``count`` held-out conversations up to each of its assistant turns, in
    order; its last prompt is the "last" mode's prompt of that conversation, and no conversation outside them enters."""
    from engine.trainer.serve.evaluate import heldout_conversations

    tok = tiny_target.tokenizer
    convs = heldout_conversations(shipped_corpus_path(), 32, 0)[:6]
    replies = [sum(m["role"] == "assistant" for m in c) for c in convs]
    last = heldout_prompts(tok, "shipped", holdout=32, seed=0, count=6)
    every = heldout_prompts(tok, "shipped", holdout=32, seed=0, count=6, turns="all")
    assert len(every) == sum(replies) > len(last) == 6
    ends = [sum(replies[: i + 1]) - 1 for i in range(6)]
    assert [every[i] for i in ends] == last
    for i, n in enumerate(replies):  # a conversation's prompts grow turn by turn
        own = every[ends[i] - n + 1 : ends[i] + 1]
        assert all(len(a) < len(b) for a, b in itertools.pairwise(own))
    with pytest.raises(ValueError, match=r"^turns: got 'first'; allowed: last, all$"):
        heldout_prompts(tok, "shipped", holdout=32, seed=0, count=6, turns="first")
