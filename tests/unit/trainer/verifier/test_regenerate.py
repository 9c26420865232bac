"""`specdec-train regenerate`: assistant turns rewritten by a real (small, random) target, the turn structure and
the other turns kept, bad rows counted by reason, and a run interrupted after a batch resumed to the same file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.trainer.verifier import regenerate as regen
from engine.trainer.verifier.builtin import save_servable
from engine.trainer.verifier.model_configs import tiny_config
from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[4]
MAX_NEW = 6
GOOD = [
    {"conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "Hi"},
                       {"from": "gpt", "value": "Hello."}, {"from": "human", "value": "Bye"},
                       {"from": "gpt", "value": "Bye."}]},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]},
    {"messages": [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": "1 2 3"}]},
]  # fmt: skip
NO_USER = {"messages": [{"role": "system", "content": "x"}, {"role": "assistant", "content": "unprompted"}]}
NO_REPLY = {"messages": [{"role": "user", "content": "anyone?"}]}
TOO_LONG = {"messages": [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "ok"}]}


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer Llama with the byte tokenizer, saved as tiny-trained saves itself (ids, tokenizer files)."""
    from transformers import LlamaForCausalLM

    tok = build_tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(tiny_config(((len(tok) + 7) // 8) * 8, hidden=32, layers=2, head_dim=16))
    path = tmp_path_factory.mktemp("target")
    save_servable(model, str(path))
    return path


def write_rows(path: Path, rows: list[object]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def settings(source: Path, target: Path, temperature: float = 0.0) -> regen.Settings:
    return regen.Settings(str(source), str(target), temperature, seed=7, max_new_tokens=MAX_NEW, max_length=200)


def replier(target: Path, source: Path, temperature: float = 0.0) -> regen.Replier:
    model, tok = regen.load_model(str(target), torch.device("cpu"))
    return regen.Replier(model, tok, torch.device("cpu"), settings(source, target, temperature))


def test_assistant_turns_become_the_targets_greedy_replies_and_bad_rows_are_counted(
    target_dir: Path, tmp_path: Path
) -> None:
    source = write_rows(tmp_path / "in.jsonl", [GOOD[0], "{not json", NO_USER, GOOD[1], NO_REPLY, TOO_LONG, GOOD[2]])
    out = tmp_path / "out.jsonl"
    said: list[str] = []
    r = replier(target_dir, source)
    progress = regen.regenerate(r, source, out, batch_size=4, restart=False, say=said.append)

    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["source_line"] for row in rows] == [1, 4, 7]  # input order, the bad rows left out
    assert dict(progress.skipped) == {
        regen.SKIP_NOT_JSON: 1, regen.SKIP_NO_USER: 1, regen.SKIP_NO_ASSISTANT: 1, regen.SKIP_TOO_LONG: 1,
    }  # fmt: skip
    first = rows[0]["messages"]
    assert [m["role"] for m in first] == ["system", "user", "assistant", "user", "assistant"]
    assert [first[i]["content"] for i in (0, 1, 3)] == ["Be brief.", "Hi", "Bye"]
    # Each reply is the target's own greedy continuation of the conversation so far (earlier replies regenerated).
    tok = r.tokenizer
    for turn in (2, 4):
        prompt = r.prompt(first[:turn])
        with torch.no_grad():
            ids = r.model.generate(
                input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False,
                eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
            )[0, len(prompt) :].tolist()  # fmt: skip
        if tok.eos_token_id in ids:
            ids = ids[: ids.index(tok.eos_token_id)]
        assert first[turn]["content"] == tok.decode(ids, skip_special_tokens=True)
    assert progress.replies == 4 and progress.written == 3
    assert said[-1].startswith("7/7 rows, 3 written, 4 replies")


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_run_interrupted_after_a_batch_resumes_to_the_same_file(
    target_dir: Path, tmp_path: Path, temperature: float
) -> None:
    source = write_rows(tmp_path / "in.jsonl", [*GOOD, *GOOD])
    whole, parts = tmp_path / "whole.jsonl", tmp_path / "parts.jsonl"
    r = replier(target_dir, source, temperature)
    regen.regenerate(r, source, whole, batch_size=2, restart=False, say=lambda _line: None)

    def stop_after_first_batch(line: str) -> None:
        raise Interrupted(line)

    with pytest.raises(Interrupted, match=r"^2/6 rows"):
        regen.regenerate(r, source, parts, batch_size=2, restart=False, say=stop_after_first_batch)
    with parts.open("a") as f:
        f.write('{"messages": [')  # a batch cut short after the last progress record: dropped on resume
    said: list[str] = []
    regen.regenerate(r, source, parts, batch_size=2, restart=False, say=said.append)
    assert said[0] == "resuming at row 2/6 (2 conversations written)"
    assert parts.read_text() == whole.read_text()


def test_a_resume_with_other_settings_is_refused(target_dir: Path, tmp_path: Path) -> None:
    source = write_rows(tmp_path / "in.jsonl", GOOD)
    out = tmp_path / "out.jsonl"
    regen.regenerate(replier(target_dir, source), source, out, batch_size=8, restart=False, say=lambda _l: None)
    with pytest.raises(ValueError, match="other settings \\(generation, temperature\\)"):
        regen.regenerate(replier(target_dir, source, 0.5), source, out, batch_size=8, restart=False, say=print)


def test_the_command_shows_progress_and_a_run_can_train_on_its_output(target_dir: Path, tmp_path: Path) -> None:
    source = write_rows(tmp_path / "in.jsonl", [*GOOD, NO_USER])
    out = tmp_path / "regen.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "engine.trainer", "regenerate", "--target", str(target_dir), "--data", str(source)]
    cmd += ["--out", str(out), "--max-new-tokens", str(MAX_NEW), "--batch-size", "2", "--threads", "1", "--json"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "regenerate: 2/4 rows, 2 written" in proc.stderr and "regenerate: 4/4 rows, 3 written" in proc.stderr
    assert "skipped: 1 no user turn before an assistant turn" in proc.stderr
    assert json.loads(proc.stdout)["written"] == 3
    from engine.trainer.data.sources import load_conversations

    assert [len(c) for c in load_conversations(out)] == [5, 2, 2]  # what a run with data = "<out>" reads
