"""Every target family stops where its own ``generate`` stops: the matrix's "stops right" column.

Each family's tiny model (tests/support/families.py) has its real stop tokens in ``generation_config.json``
(Gemma-3 ``<eos>`` and ``<end_of_turn>``, Llama-3.1 ``<|end_of_text|>``, ``<|eom_id|>`` and ``<|eot_id|>``,
gpt-oss ``<|return|>`` and ``<|call|>``, ...). A random model rarely emits any of them, so each test makes its
greedy reply reach one: the output row of a stop token that is *not* the tokenizer's eos (where the family has one)
becomes twice the row of the token the reply had at its third position, so that token's logit doubles there and
the stop wins. The reference is transformers' ``generate`` with nothing but the directory's own generation config,
as a server ends a reply; ``specdec-train eval`` (both countings, of a checkpoint and of its export) and
``regenerate`` must end where it ends.
"""

from __future__ import annotations

import itertools
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from support.families import FAMILIES, build_family, stop_ids

from engine.trainer.serve import export
from engine.trainer.serve.evaluate import main as eval_main
from engine.trainer.verifier import regenerate as regen

MAX_NEW = 12
QUESTION = [{"role": "user", "content": "Name a colour."}]
HARMONY = {n for n, f in FAMILIES.items() if "<|channel|>" in f.chat_template}


def load(path: Path) -> tuple[torch.nn.Module, object]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(path))


def prompt_of(tokenizer: object) -> list[int]:
    text = tokenizer.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True)  # type: ignore[attr-defined]
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])  # type: ignore[operator]


def own_generate(path: Path, prompt: list[int]) -> list[int]:
    model, _ = load(path)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=MAX_NEW)  # type: ignore[operator]
    return [int(t) for t in out[0, len(prompt) :]]


def make_reply_reach_a_stop(name: str, path: Path) -> int:
    """Rewrites the saved model so that its greedy reply to QUESTION ends early at one of the family's stop ids
    (one the tokenizer's eos is not, where the family lists one); returns that id."""
    model, tokenizer = load(path)
    eos = tokenizer.eos_token_id  # type: ignore[attr-defined]
    stops = stop_ids(FAMILIES[name], path)
    stop = next((s for s in stops if s != eos), stops[0])
    prompt = prompt_of(tokenizer)
    with torch.no_grad():
        reply: list[int] = []
        for _ in range(3):
            reply.append(int(model(torch.tensor([prompt + reply])).logits[0, -1].argmax()))  # type: ignore[operator]
        head = model.get_output_embeddings()  # type: ignore[operator]
        head.weight[stop] = 2 * head.weight[reply[2]]
        if getattr(head, "bias", None) is not None:
            head.bias[stop] = 2 * head.bias[reply[2]]
    model.save_pretrained(path)  # type: ignore[attr-defined]
    return stop


@pytest.fixture(scope="module")
def stopping_family(
    tmp_path_factory: pytest.TempPathFactory,
) -> Callable[[str], tuple[Path, list[int], list[int], int]]:
    """``(directory, prompt, the directory's own generate output, the stop id it was made to reach)``."""
    built: dict[str, tuple[Path, list[int], list[int], int]] = {}

    def get(name: str) -> tuple[Path, list[int], list[int], int]:
        if name not in built:
            path = build_family(name, tmp_path_factory.mktemp(f"stops-{name}"))
            stop = make_reply_reach_a_stop(name, path)
            prompt = prompt_of(load(path)[1])
            reference = own_generate(path, prompt)
            assert len(reference) < MAX_NEW and reference[-1] in stop_ids(FAMILIES[name], path), reference
            built[name] = (path, prompt, reference, stop)
        return built[name]

    return get


@pytest.mark.parametrize("name", list(FAMILIES))
def test_eval_ends_each_output_where_the_families_own_generate_ends(
    name: str,
    stopping_family: Callable[[str], tuple[Path, list[int], list[int], int]],
    trained_family: Callable[[str], tuple[Path, list[dict[str, object]]]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path, prompt, reference, _stop = stopping_family(name)
    out, _ = trained_family(name)  # the family's 10-step drafter; served here beside the rewritten target
    (step,) = sorted((out / "checkpoints").glob("step_*"))[-1:]
    checkpoint = tmp_path / step.name
    shutil.copytree(step, checkpoint)
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["config"]["target"] = str(path)
    (checkpoint / "meta.json").write_text(json.dumps(meta))
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([prompt]))
    exported = tmp_path / "export"
    export.export_checkpoint(checkpoint, exported, record=False)
    sources = (["--checkpoint", str(checkpoint)], ["--export", str(exported), "--target", str(path)])
    for source, counting in itertools.product(sources, ("stop", "vllm")):
        args = [*source, "--k", "3", "--prompt-ids", str(prompts), "--conversations", "1"]
        assert eval_main([*args, "--max-new-tokens", str(MAX_NEW), "--count", counting, "--outputs", "--json"]) == 0
        (result,) = json.loads(capsys.readouterr().out)["drafters"].values()
        assert result["outputs"] == [reference], (source[0], counting)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_regenerate_ends_each_reply_where_the_families_own_generate_ends(
    name: str, stopping_family: Callable[[str], tuple[Path, list[int], list[int], int]], tmp_path: Path
) -> None:
    path, prompt, reference, stop = stopping_family(name)
    source = tmp_path / "in.jsonl"
    source.write_text(json.dumps({"messages": [*QUESTION, {"role": "assistant", "content": "Red."}]}) + "\n")
    if name in HARMONY:  # gpt-oss: replies are channels; regenerate refuses rather than flatten them
        with pytest.raises(ValueError, match="harmony"):
            regen.load_model(str(path), torch.device("cpu"))
        return
    model, tokenizer = regen.load_model(str(path), torch.device("cpu"))
    settings = regen.Settings(str(source), str(path), 0.0, seed=0, max_new_tokens=MAX_NEW, max_length=400)
    replier = regen.Replier(model, tokenizer, torch.device("cpu"), settings)
    assert replier.prompt(QUESTION) == prompt
    assert stop in replier.stop_ids
    out = tmp_path / "out.jsonl"
    regen.regenerate(replier, source, out, batch_size=1, restart=False, say=lambda _line: None)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    reply = row["messages"][-1]["content"]
    assert reply == tokenizer.decode(reference[:-1], skip_special_tokens=True)
