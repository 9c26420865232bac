"""One stop set (the tokenizer's eos ∪ the generation config's eos ids) for regenerate, eval, training-time τ and
serve-check: with a target whose generation_config lists a second eos id, each stops exactly where the target's own
``generate`` with its generation config stops (and where vLLM, which reads the same ids, stops)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from support.stop_target import add_second_stop, own_generate, save_tiny_target

from engine.trainer.serve.evaluate import heldout_prompts
from engine.trainer.threads.metrics import EventLog
from engine.trainer.verifier import regenerate as regen
from engine.trainer.verifier.stops import stop_ids
from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

MAX_NEW = 10
HOLDOUT = 8


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.mark.parametrize(
    "family, tokenizer_eos, generation_eos, stops",
    [
        ("gemma-3-it", 1, [1, 106], {1, 106}),  # <eos>, <end_of_turn>
        ("llama-3.1-instruct", 128009, [128001, 128008, 128009], {128001, 128008, 128009}),  # + <|eom_id|>
        ("gpt-oss", 200002, [200002, 199999, 200012], {199999, 200002, 200012}),  # <|return|>, <|call|>
        ("qwen2.5-instruct", 151645, [151645, 151643], {151643, 151645}),  # <|im_end|>, <|endoftext|>
        ("mistral", 2, 2, {2}),
    ],
)
def test_the_stop_set_is_the_tokenizers_eos_and_every_eos_of_the_generation_config(
    tmp_path: Path, family: str, tokenizer_eos: int, generation_eos: int | list[int], stops: set[int]
) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 0}))  # read only without a generation config
    assert stop_ids(SimpleNamespace(eos_token_id=tokenizer_eos), tmp_path) == stops, family


def test_without_a_generation_config_the_model_configs_eos_ids_count_as_transformers_and_vllm_read_them(
    tmp_path: Path,
) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"eos_token_id": [1, 106]}}))
    assert stop_ids(SimpleNamespace(eos_token_id=1), tmp_path) == {1, 106}
    assert stop_ids(SimpleNamespace(eos_token_id=7), None) == {7}  # a random preset: the tokenizer's alone


GOOD = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"},
                  {"role": "assistant", "content": "Bye."}]},
    {"messages": [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "Red."}]},
]  # fmt: skip


def test_regenerated_replies_end_where_the_targets_own_generate_stops_at_its_second_eos(tmp_path: Path) -> None:
    target = save_tiny_target(tmp_path / "target")
    tok = build_tiny_tokenizer()
    first_prompt = tok(
        tok.apply_chat_template(GOOD[0]["messages"][:2], tokenize=False, add_generation_prompt=True),
        add_special_tokens=False,
    )["input_ids"]
    second = add_second_stop(target, first_prompt, MAX_NEW)
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in GOOD), encoding="utf-8")
    out = tmp_path / "out.jsonl"
    model, tokenizer = regen.load_model(str(target), torch.device("cpu"))
    settings = regen.Settings(str(source), str(target), 0.0, seed=0, max_new_tokens=MAX_NEW, max_length=400)
    replier = regen.Replier(model, tokenizer, torch.device("cpu"), settings)
    regen.regenerate(replier, source, out, batch_size=2, restart=False, say=lambda _line: None)

    stops = {tok.eos_token_id, second}
    ended_at_second = 0
    for row in (json.loads(line) for line in out.read_text().splitlines()):
        conv = row["messages"]
        for turn in (i for i, m in enumerate(conv) if m["role"] == "assistant"):
            reference = own_generate(target, replier.prompt(conv[:turn]), MAX_NEW)
            cut = next((i for i, t in enumerate(reference) if t in stops), len(reference))
            ended_at_second += int(cut < len(reference) and reference[cut] == second)
            assert conv[turn]["content"] == tok.decode(reference[:cut], skip_special_tokens=True)
    assert ended_at_second >= 1  # the first reply stops at the second eos, with text before it
    progress = json.loads((tmp_path / "out.jsonl.progress.json").read_text())
    assert progress["settings"]["generation"]["eos_token_id"] == sorted(stops)


@pytest.fixture(scope="module")
def stop_run(tmp_path_factory: pytest.TempPathFactory, small_corpus: Path) -> SimpleNamespace:
    """A run on a target whose generation config ends replies at a second id, which the greedy reply to the first
    held-out prompt reaches after a few tokens; evaluated (τ) at its one step."""
    from engine.trainer.config import from_dict
    from engine.trainer.run.loop import TrainingRun

    root = tmp_path_factory.mktemp("stop-run")
    target = save_tiny_target(root / "target")
    tok = build_tiny_tokenizer()
    prompt = heldout_prompts(tok, str(small_corpus), HOLDOUT, 0, 1)[0]
    second = add_second_stop(target, prompt, MAX_NEW)
    reference = own_generate(target, prompt, MAX_NEW)
    assert reference[-1] == second and len(reference) < MAX_NEW  # generate stops there, early
    out = root / "out"
    cfg = from_dict(
        {
            "target": str(target),
            "data": str(small_corpus),
            "eval_holdout": HOLDOUT,
            "buckets": [256],
            "ttt_steps": 2,
            "draft_vocab_size": 96,
            "steps": 1,
            "lr": 1e-3,
            "eval_every": 1,
            "eval_k": 3,
            "eval_conversations": 1,
            "eval_max_new_tokens": MAX_NEW,
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
    events.close()
    return SimpleNamespace(out=out, prompt=prompt, reference=reference, second=second, events=seen)


def test_training_time_tau_decodes_each_prompt_to_the_targets_own_stop(stop_run: SimpleNamespace) -> None:
    (ev,) = [e for e in stop_run.events if e["kind"] == "eval"]
    assert ev.get("error") is None and ev["prompts"] == 1
    assert ev["new_tokens"] == len(stop_run.reference)  # through the second eos, not on to MAX_NEW


def test_eval_outputs_end_at_the_targets_own_stop_in_both_countings(
    stop_run: SimpleNamespace, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine.trainer.serve.evaluate import main

    for counting in ("stop", "vllm"):
        args = ["--checkpoint", str(stop_run.out), "--k", "3", "--conversations", "1"]
        assert main([*args, "--max-new-tokens", str(MAX_NEW), "--count", counting, "--outputs", "--json"]) == 0
        (result,) = json.loads(capsys.readouterr().out)["drafters"].values()
        assert result["outputs"] == [stop_run.reference], counting


def test_serve_check_stops_our_side_where_vllm_stops_and_finds_the_outputs_equal(
    stop_run: SimpleNamespace, tmp_path: Path
) -> None:
    """vLLM ends a request at the generation config's eos ids (its output keeps the stop token): a stand-in
    interpreter answers with exactly that, the target's own generate output."""
    from engine.trainer.serve.serve_check import check, parse_args

    served = {
        "vllm": "stand-in",
        "outputs": [stop_run.reference],
        "spec_decode": {"vllm:spec_decode_num_drafts": 1, "vllm:spec_decode_num_accepted_tokens": 0},
    }
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\n[ \"$1\" = -c ] && exit 0\necho 'RESULT {json.dumps(served)}'\n")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    args = parse_args([str(stop_run.out), "--vllm-python", str(python), "--k", "3", "--conversations", "1"])
    args.max_new_tokens = MAX_NEW
    code, report = check(args, lambda _line: None)
    assert code == 0 and report["outputs_equal_to_greedy"] == 1
    assert report["ours"]["vllm"]["new_tokens"] == report["ours"]["stop"]["new_tokens"] == len(stop_run.reference)
