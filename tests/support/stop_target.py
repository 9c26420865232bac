"""A tiny random target saved as a Hugging Face directory whose generation_config lists a second eos id, as
Gemma's ``[1, 106]`` (``<end_of_turn>``) and Llama-3.1's ``<|eom_id|>`` do: the second id is a token the target's
own greedy reply reaches, so a reply stops there only where the generation config is read.

``own_generate`` is the reference: transformers' ``generate`` with nothing but the directory's own generation
config, as a server stops (vLLM stops at the same ids)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

GENERATION_CONFIG = "generation_config.json"


def save_tiny_target(path: Path, *, layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    """A random Llama (``layers`` deep, the byte tokenizer) saved as ``tiny-trained`` saves itself."""
    from transformers import LlamaForCausalLM

    from engine.trainer.verifier.builtin import save_servable
    from engine.trainer.verifier.model_configs import tiny_config
    from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

    tok = build_tiny_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(tiny_config(((len(tok) + 7) // 8) * 8, hidden=hidden, layers=layers, head_dim=16))
    path.mkdir(parents=True, exist_ok=True)
    save_servable(model, str(path))
    return path


def load(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def plain_greedy(path: Path, prompt: list[int], n: int) -> list[int]:
    """``n`` tokens of argmax decoding, one full forward each: no cache, no processor, no stop."""
    model = load(path)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([prompt + out])).logits[0, -1].argmax()))
    return out


def update_generation_config(path: Path, **values: Any) -> None:
    file = path / GENERATION_CONFIG
    config = json.loads(file.read_text(encoding="utf-8"))
    config.update(values)
    file.write_text(json.dumps(config, indent=1), encoding="utf-8")


def add_second_stop(path: Path, prompt: list[int], n: int) -> int:
    """Makes the target's generation_config end a reply at a second id as well: the first token of its greedy reply
    to ``prompt`` after the first position that is new in it (the reply stops there, with text before it).
    Returns the id."""
    from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

    eos = build_tiny_tokenizer().eos_token_id
    reply = plain_greedy(path, prompt, n)
    second = next((t for i, t in enumerate(reply) if i >= 1 and t not in reply[:i] and t != eos), None)
    assert second is not None, f"the greedy reply {reply} repeats itself: no token to make a second stop of"
    update_generation_config(path, eos_token_id=[eos, second])
    return second


def own_generate(path: Path, prompt: list[int], n: int) -> list[int]:
    """The directory's own ``generate`` with its own generation config: the reply, through its stop token."""
    model = load(path)
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=n)
    return [int(t) for t in out[0, len(prompt) :]]
