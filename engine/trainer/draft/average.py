"""The drafter's weights as an exponential moving average over its training steps (``ema_decay`` > 0).

With a constant learning rate the last weights carry the last steps' noise; a mean over the recent steps does not.
After each optimizer step every trainable weight's float32 shadow moves toward it:

    shadow += (1 - d_t) * (weight - shadow),    d_t = min(ema_decay, (1 + t) / (10 + t)),

``t`` counting the updates since the shadow began, so a short run is not dominated by its random start (the
warm-up of the decay, as timm's and Karras et al.'s EMA do). The mean age of the average is about
``1 / (1 - ema_decay)`` steps (0.995: 200).

Training never reads the shadow: the optimizer steps the trained weights as before. Checkpoints carry both
(``state["ema"]``), resume restores both, and ``specdec-train export`` / ``eval`` read the average by default
(``served_weights``; ``--trained-weights`` the last trained ones), so what is served is what was averaged. It
costs one float32 copy of the trainable weights per drafter thread and one fused ``lerp`` over them a step,
queued on the drafter's stream after its optimizer step (no host sync).
"""

from __future__ import annotations

import copy
from typing import Any, TypeVar

import torch

M = TypeVar("M", bound=torch.nn.Module)
EMA_KEY = "ema"  # a drafter state's moving average: {"decay", "updates", "weights": {name: float32 tensor}}


class WeightAverage:
    """The moving average of ``module``'s trainable parameters (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, decay: float) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema_decay {decay}: needs 0 < ema_decay < 1")
        self.decay = decay
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        with torch.no_grad():
            self.shadow = [p.detach().float().clone() for p in self.params]
        self.updates = 0

    def weight(self) -> float:
        """This update's 1 - d_t."""
        t = self.updates
        return 1.0 - min(self.decay, (1.0 + t) / (10.0 + t))

    @torch.no_grad()
    def update(self) -> None:
        current = [p.detach() if p.dtype == torch.float32 else p.detach().float() for p in self.params]
        torch._foreach_lerp_(self.shadow, current, self.weight())
        self.updates += 1

    def state(self) -> dict[str, Any]:
        """The average as a checkpoint keeps it (CPU copies: safe to keep while training goes on)."""
        weights = {n: s.detach().to("cpu", copy=True) for n, s in zip(self.names, self.shadow, strict=True)}
        return {"decay": self.decay, "updates": self.updates, "weights": weights}

    @torch.no_grad()
    def restore(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's average; ``None`` (a run resumed with ema_decay newly set) starts it from the weights
        now, counting its updates from 0."""
        if state is None:
            for shadow, p in zip(self.shadow, self.params, strict=True):
                shadow.copy_(p.detach())
            self.updates = 0
            return
        weights = state["weights"]
        missing = [n for n in self.names if n not in weights]
        if missing:
            raise ValueError(f"the checkpoint's weight average lacks {', '.join(missing[:3])}")
        for name, shadow in zip(self.names, self.shadow, strict=True):
            shadow.copy_(weights[name])
        self.updates = int(state.get("updates", 0))

    @torch.no_grad()
    def swapped_in(self, module: M) -> M:
        """A copy of ``module`` holding the average, its buffers (the target's embedding table, the vocabulary
        maps) shared, not copied: for an evaluation between steps; the trained module is untouched."""
        twin = copy.deepcopy(module, {id(b): b for b in module.buffers()})
        named = dict(twin.named_parameters())
        for name, shadow in zip(self.names, self.shadow, strict=True):
            named[name].copy_(shadow)
        return twin


def served_weights(state: dict[str, Any], *, trained: bool = False) -> tuple[dict[str, Any], str]:
    """(the model state a drafter state serves, which weights they are): the moving average over the trained
    weights where the state has one, unless ``trained``; else the trained weights. Raises ValueError for an
    average that does not fit the model state."""
    model = state.get("model")
    if not isinstance(model, dict):
        raise ValueError("no model state")
    ema = state.get(EMA_KEY)
    if trained or not isinstance(ema, dict):
        return model, "trained"
    weights = ema.get("weights")
    if not isinstance(weights, dict):
        raise ValueError("a weight average with no weights")
    for name, value in weights.items():
        have = model.get(name)
        if not isinstance(have, torch.Tensor) or not isinstance(value, torch.Tensor) or value.shape != have.shape:
            raise ValueError(f"the weight average's {name!r} does not match the model state")
    merged = {k: (weights[k].to(v.dtype) if k in weights else v) for k, v in model.items()}
    return merged, f"moving average (decay {ema.get('decay')}, {ema.get('updates')} steps)"
