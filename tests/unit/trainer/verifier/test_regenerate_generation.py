"""`specdec-train regenerate` generates with a generation config of its own: greedy is plain greedy and sampling is
at the temperature asked for and nothing else, whatever the target's shipped generation_config says (a repetition
penalty, top-p, top-k); the settings used are in the log and the progress file. A harmony target (gpt-oss) is
refused in one line."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from support.stop_target import load, plain_greedy, save_tiny_target, update_generation_config

from engine.trainer.verifier import regenerate as regen
from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

MAX_NEW = 8
CONVERSATION = {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]}
# What instruct models ship (Qwen2.5-Instruct: repetition_penalty 1.05, top_p 0.8, top_k 20), made strong enough
# to change a tiny model's every reply.
SHIPPED = {"do_sample": True, "temperature": 0.3, "top_k": 1, "top_p": 0.001, "repetition_penalty": 10.0,
           "no_repeat_ngram_size": 1}  # fmt: skip


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def shipped_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = save_tiny_target(tmp_path_factory.mktemp("shipped") / "target")
    update_generation_config(target, **SHIPPED)
    return target


def prompt_ids() -> list[int]:
    tok = build_tiny_tokenizer()
    text = tok.apply_chat_template(CONVERSATION["messages"][:1], tokenize=False, add_generation_prompt=True)
    return list(tok(text, add_special_tokens=False)["input_ids"])


def regenerate_one(
    target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], *extra: str
) -> tuple[str, dict[str, object], str]:
    """The command on one conversation: (the reply, the progress file's settings, the log)."""
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(CONVERSATION) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    args = ["--target", str(target), "--data", str(source), "--out", str(out), "--max-new-tokens", str(MAX_NEW)]
    assert regen.main([*args, "--threads", "1", *extra]) == 0
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    progress = json.loads((tmp_path / "out.jsonl.progress.json").read_text())
    return row["messages"][1]["content"], progress["settings"], capsys.readouterr().err


def test_greedy_regeneration_is_plain_greedy_whatever_the_targets_generation_config_ships(
    shipped_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reply, settings, log = regenerate_one(shipped_target, tmp_path, capsys)
    tok = build_tiny_tokenizer()
    greedy = plain_greedy(shipped_target, prompt_ids(), MAX_NEW)
    assert len(set(greedy)) < len(greedy)  # it repeats itself: a shipped penalty or no-repeat rule would change it
    assert reply == tok.decode(greedy, skip_special_tokens=True)
    assert settings["generation"] == {
        "do_sample": False, "num_beams": 1, "repetition_penalty": 1.0, "max_new_tokens": MAX_NEW,
        "eos_token_id": [tok.eos_token_id], "pad_token_id": tok.pad_token_id,
    }  # fmt: skip
    stops = f"[{tok.eos_token_id} <|end|>]"
    assert f"regenerate: generation: greedy, up to {MAX_NEW} tokens, stopping at ids {stops}" in log
    assert (
        "not inherited from the target's generation_config: do_sample=True, no_repeat_ngram_size=1, "
        "repetition_penalty=10.0, temperature=0.3, top_k=1, top_p=0.001"
    ) in log


def test_sampled_regeneration_draws_from_the_whole_distribution_at_the_temperature_alone(
    shipped_target: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    temperature, seed = 2.0, 5
    reply, settings, log = regenerate_one(
        shipped_target, tmp_path, capsys, "--temperature", str(temperature), "--seed", str(seed)
    )
    # The reference: softmax(logits / T) sampled with the seed of the first turn of the first batch, nothing else.
    model, prompt, out = load(shipped_target), prompt_ids(), []
    tok = build_tiny_tokenizer()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed * 1_000_003)
        while len(out) < MAX_NEW and tok.eos_token_id not in out:
            probs = torch.softmax(model(torch.tensor([prompt + out])).logits[0, -1] / temperature, dim=-1)
            out.append(int(torch.multinomial(probs[None], num_samples=1)[0, 0]))
    reference = out[: out.index(tok.eos_token_id)] if tok.eos_token_id in out else out
    assert reply == tok.decode(reference, skip_special_tokens=True)
    assert reference != plain_greedy(shipped_target, prompt, len(reference))  # not the shipped top-p's near-greedy
    generation = settings["generation"]
    assert isinstance(generation, dict)
    assert {k: generation[k] for k in ("do_sample", "temperature", "top_k", "top_p", "repetition_penalty")} == {
        "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0,
    }  # fmt: skip
    assert "generation: sampled at temperature 2, no top-k, top-p or penalty" in log


HARMONY_TEMPLATE = (
    "{% for m in messages %}<|start|>{{ m['role'] }}<|channel|>final<|message|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)


def test_a_harmony_target_is_refused_in_one_line_with_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = save_tiny_target(tmp_path / "gpt-oss-like")
    tok = copy.deepcopy(build_tiny_tokenizer())
    tok.chat_template = HARMONY_TEMPLATE
    tok.save_pretrained(str(target))
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps(CONVERSATION) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    capsys.readouterr()
    assert regen.main(["--target", str(target), "--data", str(source), "--out", str(out), "--threads", "1"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"specdec-train regenerate: target {str(target)!r} writes its replies in the harmony format (analysis and "
        "final channels, gpt-oss); regenerate would flatten the channels into one reply, so it refuses"
    ]
    assert not out.exists() or out.read_text() == ""
