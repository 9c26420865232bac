"""Training data: every assistant turn masked whatever the chat template does to it, every skipped conversation
counted with its reason, the held-out split never trained on, the draft vocabulary counted over the whole training
set, and the tokenized data cached on disk so that a restart does not tokenize again."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.trainer.data.holdout import heldout_indices
from engine.trainer.data.sources import (
    SKIP_NO_ASSISTANT,
    SKIP_NOT_CONVERSATION,
    SKIP_NOT_JSON,
    SKIP_TOO_LONG,
    ConversationSource,
    DataError,
    load_conversations,
    tokenize_conversations,
)
from engine.trainer.data.vocab import build_draft_vocab, vocab_from_counts
from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

TEMPLATES = Path(__file__).resolve().parents[2] / "chat_templates"
LLAMA_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"]
QWEN_SPECIALS = ["<|im_start|>", "<|im_end|>", "<think>", "</think>"]


def tokenizer_with_template(name: str, specials: list[str], bos: str | None = None) -> Any:
    """The repo's byte-level tokenizer (a real transformers fast tokenizer) with a model's real chat template."""
    tok = copy.deepcopy(build_tiny_tokenizer())
    tok.add_special_tokens({"additional_special_tokens": specials})
    if bos is not None:
        tok.bos_token = bos
    tok.chat_template = (TEMPLATES / name).read_text(encoding="utf-8")
    return tok


def u(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def masked_runs(tok: Any, ids: list[int], mask: list[int]) -> list[str]:
    """The text of each run of consecutive masked tokens."""
    runs: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if m:
            if i == 0 or not mask[i - 1]:
                runs.append([])
            runs[-1].append(t)
    return [tok.decode(r) for r in runs]


# Llama 3.1 trims every message (`message['content'] | trim`): a reply ending in "\n" or padded with blanks is not
# in the rendered text verbatim.
LLAMA_SAMPLE = [
    [u("Hi"), a("Hello there.\n")],
    [{"role": "system", "content": "Be brief."}, u("Q1"), a("A1\n"), u("Q2"), a("A2")],
    [u("Q"), a("  padded answer  ")],
    [u("Q"), a("plain answer")],
]
# Qwen3 drops the reasoning of turns before the last user message, renders the last reply's reasoning as
# "<think>\n{r}\n</think>\n\n{answer}" and gives a reply without reasoning an empty think block.
QWEN_SAMPLE = [
    [u("Q1"), a("<think>\nplan\n</think>\n\nA1"), u("Q2"), a("<think>\nmore\n</think>\n\nA2")],
    [u("Q"), a("Just the answer")],
    [u("Q1"), a("<think>\nr1\n</think>\n\nA1"), u("Q2"), a("<think>\nr2\n</think>\nA2\n")],
]


def llama_expected(conv: list[dict[str, str]]) -> list[str]:
    return [m["content"].strip() + "<|eot_id|>" for m in conv if m["role"] == "assistant"]


def qwen_expected(conv: list[dict[str, str]]) -> list[str]:
    replies = [m["content"] for m in conv if m["role"] == "assistant"]
    out = [r.split("</think>")[-1].lstrip("\n") + "<|im_end|>\n" for r in replies[:-1]]
    last = replies[-1]
    reasoning = last.split("</think>")[0].rstrip("\n").split("<think>")[-1].lstrip("\n") if "</think>" in last else ""
    answer = last.split("</think>")[-1].lstrip("\n")
    out.append("<think>\n" + reasoning.strip("\n") + "\n</think>\n\n" + answer + "<|im_end|>\n")
    return out


def test_llama31_template_trimming_replies_keeps_every_assistant_turn_in_the_mask() -> None:
    tok = tokenizer_with_template("llama-3.1-8b-instruct.jinja", LLAMA_SPECIALS, bos="<|begin_of_text|>")
    got = tokenize_conversations(tok, LLAMA_SAMPLE)
    for conv, res in zip(LLAMA_SAMPLE, got, strict=True):
        assert not isinstance(res, str), res
        ids, mask = res
        assert masked_runs(tok, ids, mask) == llama_expected(conv)


def test_qwen3_template_rewriting_replies_keeps_every_assistant_turn_in_the_mask() -> None:
    tok = tokenizer_with_template("qwen3-8b.jinja", QWEN_SPECIALS)
    got = tokenize_conversations(tok, QWEN_SAMPLE)
    for conv, res in zip(QWEN_SAMPLE, got, strict=True):
        assert not isinstance(res, str), res
        ids, mask = res
        assert masked_runs(tok, ids, mask) == qwen_expected(conv)


def write_jsonl(path: Path, convs: list[list[dict[str, str]]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in convs), encoding="utf-8")
    return path


def marked_corpus(n: int) -> list[list[dict[str, str]]]:
    return [[u(f"question {i}?"), a(f"answer number {i:03d}.")] for i in range(n)]


def test_skipped_conversations_are_counted_with_their_reason(tmp_path: Path) -> None:
    convs = [*marked_corpus(6), [u("only a question")], [u("long " * 40), a("late answer")]]
    data = write_jsonl(tmp_path / "d.jsonl", convs)
    src = ConversationSource(build_tiny_tokenizer(), data, buckets=[64], batch_size=2, seed=0)
    assert src.skipped == {SKIP_NO_ASSISTANT: 1, SKIP_TOO_LONG: 1}
    assert src.examples == 6


def test_held_out_conversations_are_never_trained_on_and_the_evaluator_gets_them(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", marked_corpus(20))
    tok = build_tiny_tokenizer()
    src = ConversationSource(tok, data, buckets=[64], batch_size=2, seed=3, eval_holdout=5)
    held = sorted(heldout_indices(20, 5, seed=3))
    assert src.heldout_indices == held and src.examples == 15
    trained_text = "".join(tok.decode(src.example(i)[0].tolist()) for i in range(src.examples))
    for i in range(20):
        assert (f"answer number {i:03d}." in trained_text) == (i not in held)
    assert src.heldout_conversations() == [load_conversations(data)[i] for i in held]


def test_draft_vocab_counts_every_training_conversation_with_progress(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", marked_corpus(40))
    tok = build_tiny_tokenizer()
    lines: list[str] = []
    src = ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, progress=lines.append)
    assert len(lines) >= 10 and lines[-1].startswith("tokenized 100%")
    expected = torch.zeros(len(tok), dtype=torch.long)
    for i in range(src.examples):
        ids, mask = src.example(i)
        expected += torch.bincount(ids[mask].long(), minlength=len(tok))
    assert torch.equal(src.token_counts(len(tok)), expected)
    vocab = build_draft_vocab(src, len(tok), 24)
    assert torch.equal(vocab.draft_to_target, vocab_from_counts(expected, 24).draft_to_target)


class TokenizerCalls:
    """Counts calls into the tokenizer's templating and encoding, patched on its class from outside."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, tok: Any) -> None:
        self.calls = 0
        cls = type(tok)
        for name in ("apply_chat_template", "__call__"):
            original = getattr(cls, name)

            def counted(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
                self.calls += 1
                return _original(*args, **kwargs)

            monkeypatch.setattr(cls, name, counted)


def test_second_build_reads_the_cache_and_never_calls_the_tokenizer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", marked_corpus(60))
    tok = build_tiny_tokenizer()
    cache = tmp_path / "cache"
    calls = TokenizerCalls(monkeypatch, tok)
    t0 = time.perf_counter()
    first = ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, eval_holdout=4, cache_dir=cache)
    miss_s = time.perf_counter() - t0
    assert not first.cache_hit and calls.calls > 0
    calls.calls = 0
    said: list[str] = []
    t0 = time.perf_counter()
    second = ConversationSource(
        tok, data, buckets=[64], batch_size=2, seed=0, eval_holdout=4, cache_dir=cache, progress=said.append
    )
    hit_s = time.perf_counter() - t0
    assert second.cache_hit and calls.calls == 0, said
    assert torch.equal(first.corpus.ids, second.corpus.ids) and torch.equal(first.corpus.mask, second.corpus.mask)
    assert torch.equal(first.token_counts(len(tok)), second.token_counts(len(tok)))
    assert second.heldout_indices == first.heldout_indices and second.skipped == first.skipped
    print(f"cache miss {miss_s * 1000:.1f} ms, hit {hit_s * 1000:.1f} ms")
    # Another held-out split is another key: tokenized again.
    third = ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, eval_holdout=5, cache_dir=cache)
    assert not third.cache_hit and calls.calls > 0


def test_corrupt_cache_is_rebuilt_and_says_so(tmp_path: Path) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", marked_corpus(10))
    tok = build_tiny_tokenizer()
    cache = tmp_path / "cache"
    first = ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, cache_dir=cache)
    assert first.cache_path is not None
    first.cache_path.write_bytes(b"not a torch file")
    said: list[str] = []
    again = ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, cache_dir=cache, progress=said.append)
    assert not again.cache_hit and any("unusable" in line for line in said), said
    assert torch.equal(again.corpus.ids, first.corpus.ids)
    assert ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, cache_dir=cache).cache_hit


def test_engine_reports_skipped_conversations_in_an_event_and_a_log_line(tmp_path: Path) -> None:
    import io

    from engine.trainer.config import from_dict
    from engine.trainer.run.loop import TrainingRun
    from engine.trainer.threads.metrics import EventLog

    data = write_jsonl(tmp_path / "d.jsonl", [*marked_corpus(8), [u("only a question")]])
    cfg = from_dict(
        {
            "data": str(data),
            "buckets": [64],
            "batch_size": 2,
            "draft_vocab_size": 32,
            "eval_holdout": 2,
            "output_dir": str(tmp_path / "out"),
        }
    )
    said = io.StringIO()
    events = EventLog(tmp_path / "events.jsonl", stdout=said)
    seen: list[dict[str, Any]] = []
    events.listeners.append(seen.append)
    TrainingRun(cfg, events).build()
    (ev,) = [e for e in seen if e["kind"] == "stage" and e["stage"] == "data" and "skipped" in e]
    assert ev["skipped"] == {SKIP_NO_ASSISTANT: 1} and ev["heldout"] == 2 and ev["cached"] is False
    assert "6 conversations to train on, 2 held out, 1 skipped (no assistant turn: 1)" in said.getvalue()


def _with_malformed_lines(path: Path, n_good: int) -> Path:
    lines = [json.dumps({"messages": c}) for c in marked_corpus(n_good)]
    lines.insert(5, '{"conversations": [ oops')  # line 6: cut short
    lines.insert(2, "[1, 2, 3]")  # line 3: JSON, but no conversation object
    lines.insert(9, '{"messages": "hello"}')  # line 10: turns that are no list
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_a_malformed_line_is_skipped_and_counted_by_reason_with_its_file_and_line(tmp_path: Path) -> None:
    data = _with_malformed_lines(tmp_path / "d.jsonl", 12)
    tok = build_tiny_tokenizer()
    src = ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, cache_dir=tmp_path / "c")
    assert src.examples == 12
    assert src.skipped == {SKIP_NOT_JSON: 1, SKIP_NOT_CONVERSATION: 2}
    assert [w.split(": ", 1)[0] for w in src.bad_lines] == [f"{data}:3", f"{data}:7", f"{data}:10"]
    assert src.bad_lines[1].startswith(f"{data}:7: not JSON: ")
    again = ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, cache_dir=tmp_path / "c")
    assert again.cache_hit and again.bad_lines == src.bad_lines and again.skipped == src.skipped


def test_strict_data_stops_at_the_first_malformed_line_even_from_a_cache(tmp_path: Path) -> None:
    data = _with_malformed_lines(tmp_path / "d.jsonl", 12)
    tok = build_tiny_tokenizer()
    with pytest.raises(DataError) as err:
        ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, strict=True)
    assert str(err.value).startswith(f"strict_data: {data}:3: not a conversation object")
    ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, cache_dir=tmp_path / "c")  # caches, lenient
    with pytest.raises(DataError, match=r"^strict_data: "):
        ConversationSource(tok, data, buckets=[64], batch_size=2, seed=0, cache_dir=tmp_path / "c", strict=True)
