"""Acceptance length τ: greedy chain speculation with the real target over held-out conversations.

For each held-out prompt (a conversation up to its last assistant turn, chat-templated) the target decodes
greedily; every round the drafter proposes ``k`` tokens as a chain and the target verifies them:

* step 0: ``fc(hidden3)`` of the target at the last position whose hidden state the target has computed,
  with the embedding of the token after it (the target's own last greedy token), attending causally to the
  drafter's step-0 keys over the whole prefix (recomputed from the target's hidden states every round);
* step ``j``: the drafter's previous (pre-norm) hidden output with the embedding of its previous argmax
  (draft id mapped to a target id with ``d2t``), attending to the prefix keys plus its own chain keys;
  rotary position = the step-0 position + ``j`` when the drafter was trained with ``ttt_rope_offset``,
  else the step-0 position (the training-time test's convention either way);
* accepted = the longest prefix of the proposals equal to the target's greedy tokens; the round commits
  those and the target's next greedy token, so it yields ``accepted + 1`` tokens. τ = mean over rounds.

That is how vLLM and SGLang chain-draft an EAGLE-3 head. The target is always the exact one: an FP8 target
(``target_fp8``) runs its kept exact weights here (``target_forward``), as the bf16 model a server verifies with.
Two countings of the last round, which differ only when a
prompt ends at a stop token (the tokenizer's eos and the generation config's eos ids, verifier/stops.py, where vLLM
stops too; with ``--ignore-eos`` they are the same numbers):

* ``stop`` (the default): a round's accepted drafts end before the stop token, which the target's own token of the
  round then supplies; τ counts the tokens the reader receives;
* ``vllm``: every leading draft equal to the target's greedy token counts, the stop token and drafts after it
  included, and only then is the output cut at the stop token, as vLLM's scheduler counts (it records a round's
  accepted drafts before it checks for stop tokens). Its counts equal vLLM's ``spec_decode_num_drafts`` and
  ``spec_decode_num_accepted_tokens_per_pos`` on the same prompt ids.

vLLM's "mean acceptance length" is τ (1 + accepted / drafts); its per-position acceptance rate is ``per_position``
here (accepted at position i / drafts, unconditional), not ``per_position_conditional`` (accepted at i given i-1).
 No KV cache: the target and the drafter's prefix
are recomputed each round (one target forward per round), which is plenty for small targets and bounded
evaluations, and keeps the arithmetic the same as training's.

    specdec-train eval --checkpoint runs/cpu-demo [--k 5] [--conversations 8] [--turns last|all] [--max-new-tokens 64]
        [--json]
    specdec-train eval --export DIR --target tiny-trained [--data shipped] [--k 3] [--count vllm] [--json]

A checkpoint's drafter is evaluated with its weights rounded to bfloat16 as ``export`` writes them, so its counts
are those of the export a server loads; ``--export`` reads an exported directory itself (serve/exported.py).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from engine.protocol import EvalEvent
from engine.trainer.config import target_problem
from engine.trainer.data.holdout import heldout_indices
from engine.trainer.data.sources import load_conversations, shipped_corpus_path
from engine.trainer.draft.attention import TTTAttention
from engine.trainer.draft.average import served_weights
from engine.trainer.draft.model import Drafter, rotary_tables
from engine.trainer.serve.exported import as_exported
from engine.trainer.verifier.stops import StopIds, first_stop, stop_set, target_stop_ids

COUNT_STOP = "stop"
COUNT_VLLM = "vllm"
COUNTINGS = (COUNT_STOP, COUNT_VLLM)

TargetForward = Callable[[list[int]], tuple[torch.Tensor, torch.Tensor]]  # ids -> (logits (T, V), hidden3 (1, T, 3H))


@dataclass
class AcceptanceStats:
    """Counts of accepted draft tokens per verification round; τ and per-position acceptance derive from them."""

    k: int
    hist: list[int] = field(default_factory=list)  # hist[a] = rounds that accepted exactly a tokens, a = 0..k
    prompts: int = 0
    new_tokens: int = 0
    counting: str = "stop"  # COUNT_STOP or COUNT_VLLM (the module docstring)

    def __post_init__(self) -> None:
        if not self.hist:
            self.hist = [0] * (self.k + 1)

    def add(self, accepted: int) -> None:
        self.hist[accepted] += 1

    def merge(self, other: AcceptanceStats) -> None:
        self.hist = [a + b for a, b in zip(self.hist, other.hist, strict=True)]
        self.prompts += other.prompts
        self.new_tokens += other.new_tokens

    @property
    def rounds(self) -> int:
        return sum(self.hist)

    def at_least(self, j: int) -> int:
        """Rounds whose first ``j`` proposals were all accepted."""
        return sum(self.hist[j:])

    @property
    def tau(self) -> float:
        """Mean tokens per target forward: accepted proposals + the target's own token."""
        n = self.rounds
        return sum((a + 1) * c for a, c in enumerate(self.hist)) / n if n else float("nan")

    def accepted_per_position(self) -> list[int]:
        """Rounds whose proposal j was accepted, j = 1..k (vLLM's ``spec_decode_num_accepted_tokens_per_pos``)."""
        return [self.at_least(j) for j in range(1, self.k + 1)]

    def per_position(self) -> list[float]:
        """P(proposal j accepted) for j = 1..k, unconditional: accepted at j / rounds. vLLM's per-position
        acceptance rate (``num_accepted_tokens_per_pos[j] / num_drafts``)."""
        n = self.rounds
        return [self.at_least(j) / n if n else float("nan") for j in range(1, self.k + 1)]

    def per_position_conditional(self) -> list[float]:
        """P(proposal j accepted | proposal j-1 accepted), j = 1..k: accepted at j / accepted at j-1 (not what
        vLLM reports; see ``per_position``)."""
        out = []
        for j in range(1, self.k + 1):
            before = self.at_least(j - 1)
            out.append(self.at_least(j) / before if before else float("nan"))
        return out

    def as_event(self, thread: str, step: int, *, eval_s: float | None = None) -> EvalEvent:
        """These counts as the ``eval`` event of ``thread`` at ``step``."""
        return EvalEvent(
            thread=thread,
            step=step,
            tau=self.tau,
            k=self.k,
            counting=self.counting,
            rounds=self.rounds,
            accepted_per_position=self.accepted_per_position(),
            prompts=self.prompts,
            new_tokens=self.new_tokens,
            per_position=list(self.per_position()),
            per_position_conditional=list(self.per_position_conditional()),
            accepted_hist=list(self.hist),
            eval_s=eval_s,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tau": self.tau,
            "k": self.k,
            "counting": self.counting,
            "rounds": self.rounds,
            "accepted_per_position": self.accepted_per_position(),
            "prompts": self.prompts,
            "new_tokens": self.new_tokens,
            "per_position": self.per_position(),
            "per_position_conditional": self.per_position_conditional(),
            "accepted_hist": list(self.hist),
        }


class Proposer(Protocol):
    def propose(self, seq: list[int], hidden3: torch.Tensor, k: int) -> list[int]:
        """``k`` target token ids to follow ``seq``; ``hidden3`` holds the target's states of ``seq[:-1]``."""
        ...


class DrafterProposer:
    """The EAGLE-3 drafter proposing a chain (see the module docstring for the exact inputs of each step)."""

    def __init__(self, drafter: Drafter, *, rope_offset: bool, autocast_dtype: torch.dtype | None = None) -> None:
        self.drafter = drafter
        self.rope_offset = rope_offset
        self.autocast_dtype = autocast_dtype
        self.attention = TTTAttention("sdpa")  # a single query per chain step: no block mask to exploit
        self.device = drafter.fc.weight.device
        self._tables: tuple[torch.Tensor, torch.Tensor] | None = None

    def _autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def rotary(self, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin for positions 0..length-1: one table, grown by doubling (the drafter's own cache keeps every
        length it was asked for, and every round here asks for a new one)."""
        if self._tables is None or self._tables[0].shape[0] < length:
            cfg = self.drafter.cfg
            self._tables = rotary_tables(max(256, 2 * length), cfg.head_dim, cfg.rope_theta, self.device)
        cos, sin = self._tables
        return cos[:length], sin[:length]

    @torch.no_grad()
    def chain_logits(self, seq: list[int], hidden3: torch.Tensor, k: int) -> list[torch.Tensor]:
        """The draft-vocabulary logits of the ``k`` chain steps, each ``(Vd,)``, greedy within the chain."""
        d = self.drafter
        n = len(seq) - 1  # positions 0..n-1 have target states; seq[n] is the target's latest greedy token
        if hidden3.shape[1] != n or n < 1:
            raise ValueError(f"hidden3 covers {hidden3.shape[1]} positions; the sequence needs {n} (>= 1)")
        ids = torch.tensor([seq], device=self.device)
        cos, sin = self.rotary(n + k)
        causal = torch.ones(n, n, dtype=torch.bool, device=self.device).tril()
        d2t = self.d2t
        out: list[torch.Tensor] = []
        token = ids[0, -1]
        with self._autocast():
            h0 = d.fc(hidden3.to(self.device))
            emb = F.embedding(ids[:, 1:], d.embed_table)  # position p reads token p + 1
            h, k_all, v_all = d.layer(h0, emb, cos[:n], sin[:n], None, None, causal, self.attention)
            hidden = h[:, -1:]
            for j in range(k):
                if j > 0:
                    pos = n - 1 + (j if self.rope_offset else 0)
                    emb = F.embedding(token.view(1, 1), d.embed_table)
                    hidden, k_all, v_all = d.layer(
                        hidden, emb, cos[pos : pos + 1], sin[pos : pos + 1], k_all, v_all, None, self.attention
                    )
                logits = d.lm_head(d.norm(hidden))[0, 0].float()
                out.append(logits)
                draft_id = logits.argmax()
                token = draft_id + d2t[draft_id]  # EAGLE-3's map: target id = draft id + d2t[draft id]
        return out

    @property
    def d2t(self) -> torch.Tensor:
        d2t = self.drafter.d2t
        assert isinstance(d2t, torch.Tensor)
        return d2t

    def propose(self, seq: list[int], hidden3: torch.Tensor, k: int) -> list[int]:
        d2t = self.d2t
        return [int(i + d2t[i]) for i in (lg.argmax() for lg in self.chain_logits(seq, hidden3, k))]


def target_forward(target: Any) -> TargetForward:
    """A ``TargetForward`` over a ``FrozenTarget`` (its hooks give hidden3; its lock keeps other threads out).

    Always the exact target: an FP8 one (``target_fp8``) runs its Linears with their kept exact weights, as the
    bf16 target a server verifies with; the FP8 forward would agree with an FP8-trained drafter more often and
    overstate τ."""

    def forward(ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.tensor([ids], device=target.device)
        # eager: a new length every round, never compile
        logits, hidden3 = target.logits_and_hidden3(x, eager=True, exact=True)
        return logits[0], hidden3

    return forward


def speculate(
    forward: TargetForward,
    proposer: Proposer,
    prompt: list[int],
    *,
    k: int,
    max_new_tokens: int,
    eos_id: StopIds,
    stats: AcceptanceStats,
) -> list[int]:
    """Greedy chain speculation on one prompt; adds each round to ``stats`` (counted as ``stats.counting`` says,
    see the module docstring); returns the generated tokens, up to and including the first stop token
    (``eos_id``: one id or a set, verifier/stops.py; None: none).

    The output equals plain greedy decoding by the target (speculation changes speed, never the text).
    """
    stops = stop_set(eos_id)
    logits, hidden3 = forward(prompt)
    generated = [int(logits[-1].argmax())]
    stats.prompts += 1
    past_stop = stats.counting == COUNT_VLLM
    while len(generated) < max_new_tokens and first_stop(generated, stops) is None:
        seq = prompt + generated
        draft = proposer.propose(seq, hidden3[:, : len(seq) - 1], k)
        logits, hidden3 = forward(seq + draft)
        greedy = logits[len(seq) - 1 :].argmax(-1).tolist()  # the target's token after seq, seq+d1, ..., (k + 1)
        accepted = 0
        while accepted < k and draft[accepted] == greedy[accepted] and (past_stop or greedy[accepted] not in stops):
            accepted += 1
        stats.add(accepted)
        generated.extend(greedy[: accepted + 1])
    at = first_stop(generated, stops)
    if at is not None:
        del generated[at + 1 :]
    del generated[max_new_tokens:]
    stats.new_tokens += len(generated)
    return generated


# --- held-out prompts -----------------------------------------------------------------------------------------


def heldout_conversations(data_path: str | Path, holdout: int, seed: int) -> list[list[dict[str, str]]]:
    """The conversations the trainer held out (holdout.heldout_indices), in file order."""
    convs = load_conversations(data_path)
    held = heldout_indices(len(convs), holdout, seed)
    return [c for i, c in enumerate(convs) if i in held]


def prompt_ids(tokenizer: Any, conversation: list[dict[str, str]]) -> list[int]:
    """The chat-templated conversation up to (not including) its last assistant turn, ready for the reply."""
    last = max(i for i, m in enumerate(conversation) if m["role"] == "assistant")
    text: str = tokenizer.apply_chat_template(conversation[:last], tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def read_prompt_ids(path: Path) -> list[list[int]]:
    """A JSON list of prompts, each a non-empty list of token ids (what a server is fed as ``prompt_token_ids``)."""
    data = json.loads(path.read_text(encoding="utf-8"))
    if not isinstance(data, list) or not all(
        isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p) for p in data
    ):
        raise ValueError(f"{path}: not a JSON list of non-empty token-id lists")
    return data


def data_path_of(data: str) -> Path:
    from engine.trainer.config import DATA_RANDOM, DATA_SHIPPED

    if data == DATA_RANDOM:
        raise ValueError("data = 'random' has no conversations to hold out: acceptance needs real text")
    return shipped_corpus_path() if data == DATA_SHIPPED else Path(data).expanduser()


TURNS = ("last", "all")


def heldout_prompts(
    tokenizer: Any, data: str, holdout: int, seed: int, count: int, turns: str = "last"
) -> list[list[int]]:
    """The first ``count`` held-out conversations as prompts: each up to its last assistant turn (``turns`` "last"),
    or up to each of its assistant turns in order ("all": every reply of a conversation is counted, about 2.6 prompts
    a conversation on the shipped corpus; held out whole, so no turn was trained on)."""
    if tokenizer is None:
        raise ValueError("the target has no tokenizer (random-weight preset): acceptance needs real text")
    if holdout <= 0:
        raise ValueError("eval_holdout = 0: no held-out conversations to evaluate on")
    if turns not in TURNS:
        raise ValueError(f"turns: got {turns!r}; allowed: {', '.join(TURNS)}")
    convs = heldout_conversations(data_path_of(data), holdout, seed)[:count]
    if turns == "last":
        return [prompt_ids(tokenizer, c) for c in convs]
    return [prompt_ids(tokenizer, c[: i + 1]) for c in convs for i, m in enumerate(c) if m["role"] == "assistant"]


def evaluate(
    forward: TargetForward,
    proposer: Proposer,
    prompts: Sequence[list[int]],
    *,
    k: int,
    max_new_tokens: int,
    eos_id: StopIds,
    on_prompt: Callable[[int, AcceptanceStats], None] | None = None,
    counting: str = COUNT_STOP,
    outputs: list[list[int]] | None = None,
) -> AcceptanceStats:
    """τ over ``prompts``; the generated tokens of each prompt are appended to ``outputs`` when given."""
    if counting not in COUNTINGS:
        raise ValueError(f"counting {counting!r}: one of {', '.join(COUNTINGS)}")
    stats = AcceptanceStats(k, counting=counting)
    for i, prompt in enumerate(prompts):
        out = speculate(forward, proposer, prompt, k=k, max_new_tokens=max_new_tokens, eos_id=eos_id, stats=stats)
        if outputs is not None:
            outputs.append(out)
        if on_prompt is not None:
            on_prompt(i + 1, stats)
    return stats


def rope_offset_of(config: dict[str, Any]) -> bool:
    """Whether the drafter was trained with rotary positions advancing per TTT step (absent: the old, no)."""
    return bool(config.get("ttt_rope_offset", False))


def legacy_layer_ids(spec: str, config: dict[str, Any]) -> list[int] | None:
    """The target layers of a checkpoint that did not record them: the first engine's rule (2, L/2, L-3)."""
    layers = int(config.get("tiny_layers", 4)) if spec == "tiny" else None
    if layers is None:
        return None  # another target: its depth is known only once loaded, and load_target's default applies
    low, mid = min(2, layers // 4), layers // 2
    return [low, mid, max(mid + 1, layers - 3)]


# --- during training -----------------------------------------------------------------------------------------


@dataclass
class EvalSubject:
    """One drafter to evaluate: evaluated in its own worker thread, between two of its steps."""

    drafter: Drafter
    target: Any
    autocast_dtype: torch.dtype | None
    # The drafter as served, where that is not the trained one (ema_decay: a copy holding the weights' average).
    served: Callable[[], Drafter] | None = None


class PeriodicEvaluation:
    """An ``EventLog`` listener: on a drafter's step event that crosses a multiple of ``every``, measures τ
    and emits an ``eval`` event (thread, step, tau, per_position, ...).

    It runs in the worker thread that emitted the step (that drafter is idle between steps; the target's
    lock serialises its forwards with the producers'), so training pauses for one small evaluation.
    A failed evaluation is reported as an ``eval`` event with ``error`` and training goes on.
    """

    def __init__(
        self,
        events: Any,
        subjects: dict[str, EvalSubject],
        prompts: list[list[int]],
        *,
        every: int,
        k: int,
        max_new_tokens: int,
        eos_id: StopIds,
        rope_offset: bool,
        beat: Callable[[str], None] | None = None,
    ) -> None:
        self.events = events
        self.subjects = subjects
        self.prompts = prompts
        self.every = every
        self.k = k
        self.max_new_tokens = max_new_tokens
        self.eos_id = eos_id
        self.rope_offset = rope_offset
        self.beat = beat
        self._last: dict[str, int] = {}

    def on_event(self, event: dict[str, Any]) -> None:
        if event.get("kind") != "step":
            return
        thread, step = event.get("thread"), event.get("step")
        subject = self.subjects.get(thread) if isinstance(thread, str) else None
        if subject is None or not isinstance(step, int):
            return
        assert isinstance(thread, str)
        if step // self.every <= self._last.get(thread, 0) // self.every:
            return
        self._last[thread] = step
        self.run(thread, step, subject)

    def run(self, thread: str, step: int, subject: EvalSubject) -> dict[str, Any]:
        t0 = time.perf_counter()
        drafter = subject.served() if subject.served is not None else subject.drafter
        proposer = DrafterProposer(drafter, rope_offset=self.rope_offset, autocast_dtype=subject.autocast_dtype)
        beat = self.beat

        def alive(_done: int, _stats: AcceptanceStats) -> None:
            if beat is not None:
                beat(thread)  # the stall detector sees a thread that is evaluating, not a hung one

        try:
            stats = evaluate(
                target_forward(subject.target),
                proposer,
                self.prompts,
                k=self.k,
                max_new_tokens=self.max_new_tokens,
                eos_id=self.eos_id,
                on_prompt=alive,
            )
        except Exception as exc:  # training goes on (this runs inside a drafter's step); the failure is an event
            self.events.say(f"warning: evaluation of {thread} at step {step} failed: {type(exc).__name__}: {exc}")
            return self.events.emit(EvalEvent(thread=thread, step=step, error=f"{type(exc).__name__}: {exc}"))
        event = self.events.emit(stats.as_event(thread, step, eval_s=round(time.perf_counter() - t0, 3)))
        per = " ".join(f"{p:.2f}" for p in stats.per_position())
        self.events.say(f"eval step={step} thread={thread} tau={stats.tau:.3f} accept_i={per} rounds={stats.rounds}")
        return event


# --- the command line ----------------------------------------------------------------------------------------


def load_drafter(path: Path, name: str, target: Any, device: torch.device, *, trained_weights: bool = False) -> Drafter:
    from engine.trainer import checkpoint as ckpt
    from engine.trainer.draft.model import DraftConfig

    meta = ckpt.read_meta(path)
    dcfg = DraftConfig(**meta["draft_config"])
    rope_offset = rope_offset_of(meta.get("config") or {})
    embed, vocab = target.embed_weight().to(device), ckpt.load_vocab(path).to(device)
    drafter = Drafter(dcfg, embed, vocab, ttt_rope_offset=rope_offset)
    try:
        state = ckpt.load_drafter_state(path, name)
    except Exception as exc:  # torch.load raises many types for a damaged file; each is this one error to the user
        raise ValueError(f"cannot load {path / (name + '.pt')}: {type(exc).__name__}: {exc}") from exc
    try:  # the weights export serves: the moving average where the run kept one (ema_decay), else the trained ones
        weights, _which = served_weights(state, trained=trained_weights)
    except ValueError as exc:
        raise ValueError(f"{path / (name + '.pt')}: {exc}") from exc
    # the weights as `specdec-train export` writes them (bfloat16): the counts are those of the drafter served
    drafter.load_state_dict(as_exported(weights))
    return drafter.to(device).eval()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="specdec-train eval",
        description="Acceptance length τ of a checkpoint's drafters on held-out data",
        allow_abbrev=False,
    )
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a checkpoint directory, or an output_dir (newest one)")
    source.add_argument(
        "--export",
        help="an exported drafter directory (ours, or another trainer's LlamaForCausalLMEagle3), read as vLLM reads "
        "it; with --target and --data",
    )
    ap.add_argument("--target", help="with --export: the target (tiny-trained or a Hugging Face directory)")
    ap.add_argument("--data", default="shipped", help="with --export: the data whose held-out conversations prompt")
    ap.add_argument("--k", type=int, default=5, help="draft tokens per round (chain length)")
    ap.add_argument(
        "--conversations", type=int, default=16, help="held-out conversations to decode (with --prompt-ids: prompts)"
    )
    ap.add_argument(
        "--turns",
        choices=TURNS,
        default="last",
        help="each conversation up to its last assistant turn, or up to each of them (all: about 2.6x the prompts "
        "on the shipped data, so a tighter count for the same held-out conversations)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate per prompt")
    ap.add_argument("--drafter", action="append", help="only this drafter (repeatable); default: all")
    ap.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    ap.add_argument(
        "--as-served",
        action="store_true",
        help="feed the drafter as vLLM/SGLang do by default, whatever it was trained with: rotary positions "
        "advancing per draft token, and the outputs of target layers 1, L/2-1, L-4",
    )
    ap.add_argument(
        "--count",
        choices=COUNTINGS,
        default=COUNT_STOP,
        help="how the round that reaches the stop token counts. stop (default): its accepted drafts end before the "
        "stop token, so τ counts the tokens the reader gets; vllm: every draft equal to the target's token counts, "
        "the stop token and past it, before the output is cut there, as vLLM's scheduler counts (its "
        "num_accepted_tokens_per_pos and mean acceptance length on the same prompt ids)",
    )
    ap.add_argument(
        "--ignore-eos", action="store_true", help="decode --max-new-tokens for every prompt, through stop tokens"
    )
    ap.add_argument("--prompt-ids", help="a JSON file of prompts as token-id lists, instead of the held-out ones")
    ap.add_argument("--outputs", action="store_true", help="add each prompt's generated token ids to --json")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    ap.add_argument(
        "--trained-weights",
        action="store_true",
        help="--checkpoint of a run with ema_decay > 0: the last trained weights, not their average (the default)",
    )
    args = ap.parse_args(argv)
    for key in ("k", "conversations", "max_new_tokens"):
        if getattr(args, key) < 1:
            ap.error(f"--{key.replace('_', '-')} must be >= 1")
    if args.k > MAX_K:
        ap.error(f"--k must be <= {MAX_K} (draft tokens a round)")
    if args.prompt_ids and args.turns != "last":
        ap.error("--turns all: picks turns of the held-out conversations, not of --prompt-ids (already prompts)")
    from engine.trainer.verifier.model import device_refusal

    reason = device_refusal(args.device)
    if reason is not None:
        ap.error(f"--device {args.device}: {reason}")
    reason = target_problem(args.target) if args.target else None
    if reason is not None:
        ap.error(f"--target {reason}")
    return args


MAX_K = 64  # draft tokens a round: servers chain a handful; the histogram is k + 1 long


def check_token_ids(prompts: list[list[int]], vocab_size: int) -> None:
    """ValueError naming the first token id outside the target's vocabulary (an embedding lookup would fail)."""
    for i, prompt in enumerate(prompts):
        bad = next((t for t in prompt if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise ValueError(f"prompt {i}: token id {bad} is outside the target's vocabulary (0..{vocab_size - 1})")


def main(argv: list[str] | None = None) -> int:
    from engine.trainer import checkpoint as ckpt
    from engine.trainer.verifier.model import load_target, load_tokenizer

    args = parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)  # small ops on a shared CPU: extra threads mostly wait for each other

    def say(line: str) -> None:
        print(f"eval: {line}", file=sys.stderr, flush=True)

    if args.export:
        return evaluate_export(args, say)
    try:
        path, _picked = ckpt.resolve_checkpoint(args.checkpoint)
    except ckpt.CheckpointNotFound as exc:
        return usage(str(exc))
    meta = ckpt.read_meta(path)
    known = list(meta.get("drafters") or [])
    unknown = [n for n in args.drafter or [] if n not in known]
    if unknown:  # before the target loads
        return usage(f"--drafter {unknown[0]}: {path} has {', '.join(known) or 'no drafters'}")
    cfg: dict[str, Any] = meta.get("config") or {}
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    spec = str(cfg.get("target", "tiny"))
    problem = target_problem(spec)
    if problem is not None:  # trained against a target directory moved or removed since
        return usage(f"{path}: its target {problem}")
    tokenizer = load_tokenizer(spec)
    layer_ids = meta.get("target_layers") or cfg.get("target_layers")
    if not layer_ids:
        layer_ids = legacy_layer_ids(spec, cfg)
    if args.as_served:
        layer_ids = None  # load_target's default is the servers' default
    say(f"{path}: target {spec}, layers {layer_ids}")
    target = load_target(
        spec,
        device,
        tokenizer=tokenizer,
        layer_ids=list(layer_ids) if layer_ids else None,
        seed=int(cfg.get("seed", 0)),
        dtype=dtype,
        tiny_hidden=int(cfg.get("tiny_hidden", 64)),
        tiny_layers=int(cfg.get("tiny_layers", 4)),
    )
    try:
        prompts = chosen_prompts(
            args, tokenizer, str(cfg.get("data", "shipped")), int(cfg.get("eval_holdout", 32)), int(cfg.get("seed", 0))
        )
        check_token_ids(prompts, target.vocab_size)
    except (ValueError, OSError) as exc:
        return usage(str(exc))
    names = args.drafter or known
    drafters = {
        name: functools.partial(load_drafter, path, name, target, device, trained_weights=args.trained_weights)
        for name in names
    }
    rope_offset = True if args.as_served else rope_offset_of(cfg)
    subject = {"checkpoint": str(path), "step": meta.get("step")}
    return report(
        args, say, target, spec, prompts, drafters, rope_offset, subject, f"checkpoint {path} (step {meta.get('step')})"
    )


def usage(msg: str) -> int:
    """Exit 2 with one line: input eval cannot read."""
    print(f"specdec-train eval: {msg}", file=sys.stderr)
    return 2


def chosen_prompts(args: Any, tokenizer: Any, data: str, holdout: int, seed: int) -> list[list[int]]:
    """``--prompt-ids`` (its first ``--conversations``), else the held-out conversations' prompts of ``data``."""
    if args.prompt_ids:
        return read_prompt_ids(Path(args.prompt_ids))[: args.conversations]
    return heldout_prompts(tokenizer, data, holdout, seed, args.conversations, args.turns)


def report(
    args: Any,
    say: Callable[[str], None],
    target: Any,
    spec: str,
    prompts: list[list[int]],
    drafters: Mapping[str, Callable[[], Drafter]],
    rope_offset: bool,
    subject: dict[str, Any],
    heading: str,
) -> int:
    """τ of each drafter (loaded when its turn comes) on ``prompts``, with the target's stop ids; the summary as one
    JSON object (``--json``: ``subject``'s keys first) or as lines under ``heading``."""
    device = torch.device(args.device)
    eos_id = None if args.ignore_eos else target_stop_ids(spec, target.tokenizer)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    results: dict[str, Any] = {}
    for name, load in drafters.items():
        try:
            drafter = load()
        except ValueError as exc:  # a drafter file it cannot read (load_drafter): one line, exit 2
            return usage(str(exc))
        t0 = time.perf_counter()

        def progress(i: int, stats: AcceptanceStats, name: str = name) -> None:
            say(f"{name}: {i}/{len(prompts)} prompts, {stats.rounds} rounds, tau {stats.tau:.3f}")

        outputs: list[list[int]] = []
        stats = evaluate(
            target_forward(target),
            DrafterProposer(drafter, rope_offset=rope_offset, autocast_dtype=autocast),
            prompts,
            k=args.k,
            max_new_tokens=args.max_new_tokens,
            eos_id=eos_id,
            on_prompt=progress,
            counting=args.count,
            outputs=outputs,
        )
        results[name] = {**stats.to_dict(), "eval_s": round(time.perf_counter() - t0, 2)}
        if args.outputs:
            results[name]["outputs"] = outputs
    summary = {
        **subject,
        "target": spec,
        "target_layers": target.layer_ids,
        "ttt_rope_offset": rope_offset,
        "as_served": args.as_served,
        "counting": args.count,
        "ignore_eos": args.ignore_eos,
        "turns": "prompt ids" if args.prompt_ids else args.turns,
        "drafters": results,
    }
    if args.json:
        print(json.dumps(summary))
        return 0
    print(
        f"{heading}, target {spec} layers {target.layer_ids}, k={args.k}, "
        f"rope offset {rope_offset}{' (as served)' if args.as_served else ''}, counting {args.count}"
        f"{', ignoring eos' if args.ignore_eos else ''}"
        f"{f', {len(prompts)} prompts (every assistant turn)' if args.turns == 'all' else ''}"
    )
    for name, r in results.items():
        cond = " ".join(f"{v:.3f}" for v in r["per_position_conditional"])
        uncond = " ".join(f"{v:.3f}" for v in r["per_position"])
        print(f"{name}: tau={r['tau']:.3f} rounds={r['rounds']} prompts={r['prompts']} new_tokens={r['new_tokens']}")
        print(f"  accepted at i / drafts (vLLM's per-position rate): {uncond}")
        print(f"  accepted at i / accepted at i-1 (conditional):   {cond}")
    return 0


def evaluate_export(args: Any, say: Callable[[str], None]) -> int:
    """``specdec-train eval --export DIR``: τ of an exported drafter with its target on held-out prompts (or
    ``--prompt-ids``), rotary positions advancing per draft token as vLLM runs it. Exit 2 (one line) for an export
    or target it cannot read."""
    from engine.trainer.config import TrainerConfig
    from engine.trainer.serve.exported import (
        ExportedDrafterError,
        aux_layer_ids,
        load_exported,
        read_config,
        sglang_differs,
    )
    from engine.trainer.verifier.model import load_target, load_tokenizer

    if not args.target:
        return usage("--export needs --target (tiny-trained or the target's Hugging Face directory)")
    defaults = TrainerConfig()
    device = torch.device(args.device)
    try:
        config = read_config(Path(args.export))
        layer_ids = None if args.as_served else aux_layer_ids(config)
        note = None if args.as_served else sglang_differs(config)
        if note is not None:
            say(note)
        tokenizer = load_tokenizer(args.target)
        target = load_target(
            args.target,
            device,
            tokenizer=tokenizer,
            layer_ids=layer_ids,
            seed=defaults.seed,
            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
        )
        loaded = load_exported(Path(args.export), target.embed_weight())
        prompts = chosen_prompts(args, tokenizer, args.data, defaults.eval_holdout, defaults.seed)
        check_token_ids(prompts, target.vocab_size)
    except (ExportedDrafterError, ValueError, OSError) as exc:
        return usage(str(exc))
    say(f"{args.export}: target {args.target}, layers {target.layer_ids}, {len(prompts)} prompts")
    drafters = {"export": lambda: loaded.drafter.to(device)}
    return report(
        args, say, target, args.target, prompts, drafters, True, {"export": str(args.export)}, f"export {args.export}"
    )
