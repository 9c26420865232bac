"""The frozen target model: a Hugging Face causal LM under ``no_grad``, with hooks on three decoder layers.

Which hidden states: ``target_layers`` (the config key, ``FrozenTarget.layer_ids`` and a checkpoint's
``meta["target_layers"]``) are 0-based indices of decoder layers whose OUTPUT a forward hook captures
(the residual stream after that layer; Hugging Face's ``output_hidden_states[i + 1]``). That is SGLang's
``eagle_aux_hidden_state_layer_ids`` (it captures the input of layer ``i + 1``, "we plus 1 here") and one
less than vLLM's ``aux_hidden_state_layers`` (it captures ``hidden_states + residual`` entering layer
``i``). Both servers default to the inputs of layers ``2, L//2, L-3``, so the default here is the outputs
of ``1, L//2 - 1, L - 4`` (SpecForge's default too). Targets too shallow for three distinct ids under that
rule (fewer than 7 layers) use ``0, (L-1)//2, L-1``; a server would need those ids spelled out.

Built-in random presets need no download: ``tiny`` (an 8-layer Llama with a byte-level tokenizer, for the
CPU) and ``llama3-8b-shape`` (Llama-3.1-8B's shapes with random weights, for GPU throughput work).
``tiny-trained`` is trained on the shipped corpus on first use and cached (engine/trainer/verifier/builtin.py).

Packed rows (``documents``, data/packing.py): the forward gets per-conversation ``position_ids`` and each attention
kind's 4-D mask inside each conversation (causal; sliding windows and chunks kept: verifier/packed.py), so every
conversation's hidden states and distribution are those it would have alone in a row (tests compare them, causal
and windowed). Targets whose layers carry state along the row (linear attention) are refused before they load.

Attention runs as ``specdec_causal_sdpa`` (``use_causal_fast_path``): Hugging Face's SDPA attention with a mask
function that, for a plain causal forward (no padding mask, no offsets), makes no mask at all, so SDPA takes its
``is_causal`` kernels. Hugging Face's own ``sdpa`` skips the mask only outside torch.compile; compiled, it
materialised a (B, 1, T, T) mask and SDPA ran the masked cuDNN kernel over every pair: measured on an H200 at
the 8B shape, batch 4 x 2048, that attention took 32 ms of the target's 227 ms a step. Right-padded rows need
no mask either: a causal query never sees the padding after it, and padded positions are out of the loss.
Anything else (a padding mask, a 4-D mask, a cache) goes to Hugging Face's ``sdpa_mask``; a model with sliding
windows or chunked attention, a multimodal one, and a transformers whose mask API takes no ``q_length`` keep
Hugging Face's ``sdpa`` as it is.
Packed rows in the compiled CUDA forward get a flex ``BlockMask`` instead of the 4-D mask (causal inside each
conversation, ``document_block_mask``): flex skips the tiles across conversations, where SDPA would run the
masked kernel over every pair.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.trainer.config import RANDOM_TARGETS
from engine.trainer.data.packing import document_positions
from engine.trainer.threads.compile import GuardedFunction, compile_guard
from engine.trainer.verifier.builtin import ensure_built
from engine.trainer.verifier.fp8 import exact_linears, fp8_unsupported_reason, quantize_linears
from engine.trainer.verifier.model_configs import llama3_8b_config, tiny_config
from engine.trainer.verifier.packed import FULL, layer_kinds, packed_masks, text_config

CAUSAL_SDPA = "specdec_causal_sdpa"


def _causal_or_sdpa_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
) -> Any:
    """No mask for a forward without a padding mask, offsets or cache (SDPA's ``is_causal``); Hugging Face's
    ``sdpa_mask`` otherwise.

    Only installed on models without sliding windows (``use_causal_fast_path``), whose mask for such a forward is
    the causal one. Compiled, Hugging Face also hands a packed-sequence mask function made from the default
    ``position_ids`` (it cannot look at their values while tracing); this module's packed rows always come with
    their 4-D mask, which Hugging Face passes through before asking here."""
    from transformers.masking_utils import sdpa_mask

    plain = kwargs.get("local_size") is None  # chunked attention is more than causal
    if plain and attention_mask is None and q_offset == 0 and kv_offset == 0 and q_length == kv_length:
        return None
    return sdpa_mask(
        batch_size=batch_size,
        q_length=q_length,
        kv_length=kv_length,
        q_offset=q_offset,
        kv_offset=kv_offset,
        attention_mask=attention_mask,
        **kwargs,
    )


def _attention(
    module: nn.Module,
    query: torch.Tensor,  # (B, Hq, T, D)
    key: torch.Tensor,  # (B, Hkv, T, D)
    value: torch.Tensor,
    attention_mask: Any,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:  # (B, T, Hq, D), as Hugging Face's attention functions return it
    """Hugging Face's SDPA attention, or flex attention for a ``BlockMask`` (packed rows, compiled on CUDA)."""
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    if isinstance(attention_mask, BlockMask):
        out: Any = flex_attention(
            query,
            key,
            value,
            block_mask=attention_mask,
            scale=kwargs.get("scaling"),
            enable_gqa=query.shape[1] != key.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    result: tuple[torch.Tensor, None] = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    return result


def document_block_mask(documents: torch.Tensor) -> Any:  # (B, T) -> flex BlockMask (B, 1, T, T)
    """The packed target's attention as a flex BlockMask: causal, inside the query's conversation."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx <= q_idx) & (documents[b, kv_idx] == documents[b, q_idx])

    b, t = documents.shape
    return create_block_mask(mask_mod, B=b, H=None, Q_LEN=t, KV_LEN=t, device=str(documents.device))


def _masks_beyond_causal(config: Any) -> bool:
    """Models whose masks can be more than causal without a padding mask: any layer not full attention (sliding
    windows, chunked attention, packed.layer_kinds), and multimodal configs (image tokens attend both ways through
    or/and mask functions)."""
    if any(kind != FULL for kind in layer_kinds(config)):
        return True
    return any(getattr(config, key, None) is not None for key in ("text_config", "vision_config", "audio_config"))


def _mask_api_has_lengths() -> bool:
    """Hugging Face calls mask functions with ``q_length``/``q_offset`` (5.17 and 5.24 do); earlier versions from
    4.53 (through 5.5 at least) passed ``cache_position`` instead, which this mask function does not take."""
    import inspect

    from transformers.masking_utils import sdpa_mask

    return "q_length" in inspect.signature(sdpa_mask).parameters


def use_causal_fast_path(model: nn.Module) -> bool:
    """Switch an SDPA model whose masks are causal to ``specdec_causal_sdpa`` (see the module docstring); False
    where this transformers has no attention and mask registries (before 4.53) or calls mask functions the old
    way (``cache_position``), or the model runs another attention, slides, chunks or is multimodal:
    it stays as it was."""
    config: Any = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa" or _masks_beyond_causal(config):
        return False
    try:
        from transformers import AttentionInterface
        from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        return False
    if not _mask_api_has_lengths():
        return False
    AttentionInterface.register(CAUSAL_SDPA, _attention)
    AttentionMaskInterface.register(CAUSAL_SDPA, _causal_or_sdpa_mask)
    setter: Any = getattr(model, "set_attn_implementation", None)
    try:
        if setter is not None:
            setter(CAUSAL_SDPA)
        else:
            config._attn_implementation = CAUSAL_SDPA
    except (ValueError, KeyError):
        return False
    return bool(getattr(config, "_attn_implementation", None) == CAUSAL_SDPA)


def default_layer_ids(num_layers: int) -> list[int]:
    """The layers whose outputs are captured by default: ``1, L//2 - 1, L - 4`` as served (see above).

    Below 7 layers that rule repeats an id; ``0, (L-1)//2, L-1`` stays distinct down to 3 layers.
    """
    if num_layers < 3:
        raise ValueError(f"the target has {num_layers} layers; at least 3 are needed for three distinct layers")
    served = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(served)) == 3 and min(served) >= 0:
        return served
    return [0, (num_layers - 1) // 2, num_layers - 1]


def check_layer_ids(layer_ids: list[int], num_layers: int) -> list[int]:
    """``layer_ids`` when they are three distinct decoder-layer indices of this target, else a ValueError."""
    ids = list(layer_ids)
    if len(ids) != 3 or len(set(ids)) != 3 or min(ids) < 0 or max(ids) >= num_layers:
        raise ValueError(
            f"target_layers {ids}: need 3 distinct 0-based decoder-layer indices in 0..{num_layers - 1} "
            f"(the target has {num_layers} layers; the output of each listed layer is captured; "
            f"the default here is {default_layer_ids(num_layers) if num_layers >= 3 else 'none'})"
        )
    return ids


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


# Where the decoder layers sit: causal LMs, then multimodal wrappers' text decoders (Gemma-3, Llava-style models).
DECODER_PATHS: tuple[str, ...] = (
    "model.layers",
    "transformer.h",
    "gpt_neox.layers",
    "model.decoder.layers",
    "model.language_model.layers",
    "language_model.model.layers",
)


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    for path in DECODER_PATHS:
        obj: Any = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, nn.ModuleList):
            return obj
    raise ValueError(f"cannot find the decoder layers of {type(model).__name__}")


@dataclass
class TargetOutput:
    hidden3: torch.Tensor  # (B, T, 3H): the three captured layers side by side
    target_logits: torch.Tensor  # (B, T, Vd): the target's logits over the draft vocabulary, in its dtype
    target_lse: torch.Tensor  # (B, T) float32: their log-sum-exp (p = exp(logits - lse): draft/loss.py)
    position_mask: torch.Tensor  # (B, T) float32: loss mask and the target's top token is in the draft vocab
    loss_mask: torch.Tensor  # (B, T): the data's loss mask as given (the accuracy's denominator, see loss.py)


class FrozenTarget:
    def __init__(self, model: nn.Module, tokenizer: Any, layer_ids: list[int], device: torch.device) -> None:
        self.model = model.eval().requires_grad_(False)
        self.tokenizer = tokenizer
        self.config: Any = text_config(model.config)  # a multimodal wrapper's decoder config (sizes, attention)
        self.device = device
        layers = decoder_layers(model)
        self.layer_ids = check_layer_ids(layer_ids, len(layers))
        self._captured: dict[int, torch.Tensor] = {}
        # The hooks write one shared dict: a forward from another thread (the evaluation) waits for this one.
        self.lock = threading.Lock()
        for lid in self.layer_ids:
            layers[lid].register_forward_hook(self._hook(lid))
        self._forward: Any = model
        self._targets: Any = training_targets
        # target_lse over the whole vocabulary instead of the draft vocabulary (an LK loss: draft/loss.py)
        self.full_vocab_lse = False

    def compile(self) -> None:
        """The forward and ``training_targets`` compiled (the latter: argmax, gather and softmax in two fused
        kernels instead of four eager passes over the logits)."""
        self._forward = GuardedFunction(self.model, compiled=True, name="target")
        self._targets = GuardedFunction(training_targets, compiled=True, name="training_targets")

    def compiled_functions(self) -> list[GuardedFunction]:
        """The compiled functions, once ``compile`` was called (for compile-event listeners)."""
        return [fn for fn in (self._forward, self._targets) if isinstance(fn, GuardedFunction)]

    def _hook(self, lid: int) -> Any:
        def hook(_mod: nn.Module, _inp: Any, out: Any) -> None:
            self._captured[lid] = out[0] if isinstance(out, (tuple, list)) else out

        return hook

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    @property
    def vocab_size(self) -> int:
        return int(self.config.vocab_size)

    def embed_weight(self) -> torch.Tensor:
        get: Any = self.model.get_input_embeddings
        emb = get()
        assert isinstance(emb, nn.Embedding)
        return emb.weight

    @torch.no_grad()
    def logits_and_hidden3(
        self,
        input_ids: torch.Tensor,  # (B, T) long
        *,
        eager: bool = False,
        exact: bool = False,
        documents: torch.Tensor | None = None,  # (B, T): packed rows' conversation numbers
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's logits ``(B, T, V)`` and the three captured layers side by side ``(B, T, 3H)``.

        ``eager``: the uncompiled model, for calls whose lengths vary (evaluation), which would otherwise compile
        one graph per length while holding the target and the compile guard. ``exact``: an FP8 target's Linears
        run with their kept exact weights (fp8.exact_linears; eager), as the target a server runs. ``documents``:
        no token attends across a conversation and positions restart in each (a 4-D mask and ``position_ids``)."""
        forward = self.model if eager or exact else self._forward
        packed: dict[str, Any] = {}
        if documents is not None:
            packed = {"attention_mask": self._packed_mask(documents, compiled=forward is not self.model)}
            packed["position_ids"] = document_positions(documents)
        with self.lock, exact_linears(self.model) if exact else contextlib.nullcontext():
            self._captured.clear()
            logits = forward(input_ids=input_ids, use_cache=False, **packed).logits
            hidden3 = torch.cat([self._captured[i] for i in self.layer_ids], dim=-1)
            self._captured.clear()
        return logits, hidden3

    def _packed_mask(self, documents: torch.Tensor, *, compiled: bool) -> Any:
        """A packed batch's attention mask: a flex BlockMask for the compiled CUDA forward under
        ``specdec_causal_sdpa`` (causal targets only), else each attention kind's 4-D mask (sliding windows and
        chunks kept, packed.py; eager flex would compile outside the guard)."""
        if compiled and documents.is_cuda and self.config._attn_implementation == CAUSAL_SDPA:
            with compile_guard():  # mask creation can trace (vmap over the mask_mod); taken before self.lock
                return document_block_mask(documents)
        return packed_masks(self.config, documents, dtype=self.embed_weight().dtype)

    @torch.no_grad()
    def run(
        self,
        input_ids: torch.Tensor,  # (B, T) long
        loss_mask: torch.Tensor,  # (B, T): the data's
        draft_ids: torch.Tensor,  # (Vd,) long: the target id of each draft token
        t2d: torch.Tensor,  # (V,) bool: the target ids in the draft vocabulary
        documents: torch.Tensor | None = None,  # (B, T): packed rows' conversation numbers
    ) -> TargetOutput:
        logits, hidden3 = self.logits_and_hidden3(input_ids, documents=documents)
        target_logits, target_lse, position_mask = self._targets(logits, loss_mask, draft_ids, t2d, self.full_vocab_lse)
        return TargetOutput(
            hidden3=hidden3,
            target_logits=target_logits,
            target_lse=target_lse,
            position_mask=position_mask,
            loss_mask=loss_mask,
        )


def training_targets(
    logits: torch.Tensor,
    loss_mask: torch.Tensor,
    draft_ids: torch.Tensor,
    t2d: torch.Tensor,
    full_vocab_lse: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What the drafter learns from the target's logits ``(B, T, V)``: the logits over the draft vocabulary (in
    their dtype, ``(B, T, Vd)``), their float32 log-sum-exp ``(B, T)`` (the target's distribution is
    ``exp(logits - lse)``, made in the loss: half the bytes of a float32 softmax) and the position mask (the loss
    mask where the target's top token is in the draft vocab). ``full_vocab_lse``: the log-sum-exp of all ``V``
    logits instead, so that ``exp(logits - lse)`` are the draft tokens' probabilities out of the whole vocabulary
    (the LK losses' acceptance, draft/loss.py)."""
    in_draft = t2d[logits.argmax(dim=-1)]
    draft_logits = logits.index_select(-1, draft_ids)
    lse = logsumexp_float32(logits if full_vocab_lse else draft_logits)
    return draft_logits, lse, loss_mask * in_draft.to(loss_mask.dtype)


LSE_CHUNK_ELEMENTS = 1 << 26  # float32 elements one eager log-sum-exp chunk may take (256 MiB)


def logsumexp_float32(logits: torch.Tensor) -> torch.Tensor:
    """``logsumexp(logits.float(), -1)`` of ``(B, T, V)`` logits, ``(B, T)``. Eager, in chunks along ``T`` of at
    most LSE_CHUNK_ELEMENTS: the float32 copy and logsumexp's own temporary of a whole batch would be 4 GiB each at
    8192 x 128k (the full vocabulary, an LK loss). Compiled, one reduction, into which inductor fuses the cast."""
    if torch.compiler.is_compiling():
        return torch.logsumexp(logits.float(), dim=-1)
    b, t, v = logits.shape
    step = max(1, LSE_CHUNK_ELEMENTS // max(1, b * v))
    if step >= t:
        return torch.logsumexp(logits.float(), dim=-1)
    return torch.cat([torch.logsumexp(logits[:, i : i + step].float(), dim=-1) for i in range(0, t, step)], dim=1)


def device_refusal(spec: str) -> str | None:
    """Why ``spec`` is no device this machine can run on (None: it is one)."""
    try:
        device = torch.device(spec)
    except (RuntimeError, ValueError):
        return "not a device (cpu, cuda, cuda:N)"
    if device.type == "cpu":
        return None
    if device.type != "cuda":
        return "not a device (cpu, cuda, cuda:N)"
    if not torch.cuda.is_available():
        return "this machine has no CUDA device torch can use"
    if device.index is not None and device.index >= torch.cuda.device_count():
        return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    return None


def load_tokenizer(spec: str) -> Any:
    if spec in ("tiny", "tiny-trained"):
        from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

        return build_tiny_tokenizer()
    if spec == "llama3-8b-shape":
        return None  # random weights, random token data
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(Path(spec).expanduser()))


def load_pretrained(auto: Any, path: str, dtype: torch.dtype) -> Any:
    """``auto.from_pretrained`` with SDPA attention, or eager where the model has no SDPA path (gpt-oss: its
    attention sinks)."""
    for attention in ("sdpa", "eager"):
        try:
            try:
                return auto.from_pretrained(path, dtype=dtype, attn_implementation=attention)
            except TypeError:  # transformers 4.x spells it torch_dtype
                return auto.from_pretrained(path, torch_dtype=dtype, attn_implementation=attention)
        except ValueError as exc:
            if attention != "sdpa" or "scaled_dot_product_attention" not in str(exc):
                raise
    raise AssertionError("unreachable: eager attention either loads or raises")


def load_target(
    spec: str,
    device: torch.device,
    *,
    tokenizer: Any,
    layer_ids: list[int] | None,
    seed: int,
    dtype: torch.dtype,
    tiny_hidden: int = 64,
    tiny_layers: int = 8,
    fp8: bool = False,
    keep_exact: bool = False,
) -> FrozenTarget:
    """Builds (random presets, seeded) or loads (local directory) the target on ``device``.

    ``fp8``: its decoder's Linear layers become FP8 matmuls (see fp8.py); a device without FP8 tensor cores is
    a named error. ``keep_exact``: they keep their exact weights too, for ``logits_and_hidden3(exact=True)``.
    """
    if fp8:
        reason = fp8_unsupported_reason(device)
        if reason is not None:
            raise RuntimeError(reason)
    from transformers import LlamaForCausalLM

    if spec == "tiny-trained":  # trained by the project on first use, then a local directory like any other
        spec = str(ensure_built())
    if spec in RANDOM_TARGETS:
        if spec == "tiny":
            vocab = ((len(tokenizer) + 7) // 8) * 8
            cfg = tiny_config(vocab, tiny_hidden, tiny_layers)
        else:
            cfg = llama3_8b_config()
        with torch.random.fork_rng(devices=[]), _default_dtype(dtype), torch.device(device):
            torch.manual_seed(seed)
            model: nn.Module = LlamaForCausalLM(cfg)
    else:
        from transformers import AutoModelForCausalLM

        model = load_pretrained(AutoModelForCausalLM, str(Path(spec).expanduser()), dtype).to(device)
    layers = decoder_layers(model)
    ids = layer_ids if layer_ids is not None else default_layer_ids(len(layers))
    use_causal_fast_path(model)
    if fp8:  # the text decoder's Linears only: a multimodal wrapper's vision tower never runs here
        for layer in layers:
            quantize_linears(layer, keep_exact=keep_exact)
    return FrozenTarget(model, tokenizer, ids, device)
