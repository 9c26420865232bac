"""The trainer's configuration (TrainerConfig): a TOML file or a named preset, validated with errors that name the key.

Stdlib only (no torch), so the command line can report config errors before the heavy imports.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import math
import os
import stat
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.protocol import ProtocolError, decode_as

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - python 3.10 reads TOML with tomli (presets work without it)
    try:
        import tomli as tomllib
    except ImportError:
        tomllib = None

RANDOM_TARGETS: tuple[str, ...] = ("tiny", "llama3-8b-shape")  # built from a seed: no directory, nothing learned
BUILTIN_TARGETS: tuple[str, ...] = (*RANDOM_TARGETS, "tiny-trained")
TOKENIZERLESS_TARGETS: tuple[str, ...] = ("llama3-8b-shape",)  # random weights, random token data (no chat template)
DRAFTER_MODES: tuple[str, ...] = ("replicas", "independent")
SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")
THREAD_ERROR_POLICIES: tuple[str, ...] = ("stop", "continue")
DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16")
ATTENTION_IMPLS: tuple[str, ...] = ("auto", "merged", "flex", "sdpa")
CUDA_STREAMS: tuple[str, ...] = ("per_thread", "per_device")
OVERLAP_STEPS: tuple[str, ...] = ("auto", "on", "off")
# Where the drafter's head and loss run (engine/trainer/draft/rows.py): the positions each TTT step trains, or all.
HEAD_POSITIONS_TRAINED = "trained"
HEAD_POSITIONS_ALL = "all"
HEAD_POSITIONS: tuple[str, ...] = (HEAD_POSITIONS_TRAINED, HEAD_POSITIONS_ALL)
DISTRIBUTED: tuple[str, ...] = ("auto", "off")
# The drafter's Linear GEMMs (engine/trainer/draft/fp8.py): bf16, or FP8 with row-wise scales (all three GEMMs of
# each Linear, or grad_weight kept in bf16), as torchao's float8 recipes "rowwise" and "rowwise_with_gw_hp".
DRAFTER_FP8_OFF = "off"
DRAFTER_FP8_ROWWISE = "rowwise"
DRAFTER_FP8_ROWWISE_GW_HP = "rowwise_gw_hp"
DRAFTER_FP8: tuple[str, ...] = (DRAFTER_FP8_OFF, DRAFTER_FP8_ROWWISE, DRAFTER_FP8_ROWWISE_GW_HP)
DRAFTER_FP8_MLP_COMPOSED = "composed"
DRAFTER_FP8_MLP_FUSED = "fused"
DRAFTER_FP8_MLP: tuple[str, ...] = (DRAFTER_FP8_MLP_COMPOSED, DRAFTER_FP8_MLP_FUSED)


def fused_mlp_runs(drafter_fp8: str, drafter_fp8_mlp: str) -> bool:
    """Whether gate and up run as the one fused FP8 node (engine/trainer/draft/fp8_mlp.py), and so whether CUDA
    needs its Triton kernels: asked for, under "rowwise" ("rowwise_gw_hp" composes the two Linears for its bf16
    weight GEMMs; "off" has no FP8 node)."""
    return drafter_fp8 == DRAFTER_FP8_ROWWISE and drafter_fp8_mlp == DRAFTER_FP8_MLP_FUSED


LOCAL_DEVICE = "cuda:local"  # cuda:<LOCAL_RANK> of a torchrun rank (engine/trainer/run/distributed.py)
DATA_RANDOM = "random"
DATA_SHIPPED = "shipped"
# loss_i's denominator (engine/trainer/draft/loss.py): every position of the batch (SpecForge) or the masked ones.
LOSS_MEAN_ALL = "all_positions"
LOSS_MEAN_MASKED = "masked_positions"
LOSS_MEANS: tuple[str, ...] = (LOSS_MEAN_ALL, LOSS_MEAN_MASKED)
# The drafter's loss (engine/trainer/draft/loss.py): soft cross-entropy, or an LK loss (the acceptance rate itself).
LOSS_SOFT_CE = "soft_ce"
LOSS_LK_LAMBDA = "lk_lambda"
LOSS_LK_ALPHA = "lk_alpha"
LOSSES: tuple[str, ...] = (LOSS_SOFT_CE, LOSS_LK_LAMBDA, LOSS_LK_ALPHA)
# Decoder-layer counts of the built-in random targets whose depth this config knows without loading them.
BUILTIN_TARGET_LAYERS: dict[str, int] = {"llama3-8b-shape": 32, "tiny-trained": 8}  # = verifier.builtin.Recipe.layers


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and what is allowed."""


@dataclass
class TrainerConfig:
    # The target: a built-in random preset ("tiny", "llama3-8b-shape"), the built-in trained "tiny-trained"
    # (trained on the shipped corpus on first use, then cached), or a local Hugging Face directory.
    target: str = "tiny"
    # 0-based decoder layers whose OUTPUT is captured (SGLang's eagle_aux_hidden_state_layer_ids); None: as
    # served, outputs of 1, L/2-1, L-4 (= inputs of vLLM's and SGLang's default layers 2, L/2, L-3).
    target_layers: list[int] | None = None
    target_devices: list[str] = field(default_factory=lambda: ["cpu"])
    drafter_devices: list[str] = field(default_factory=lambda: ["cpu"])
    drafter_mode: str = "replicas"
    # Data: "shipped" (the corpus in the package), "random" (random token ids), or a ShareGPT JSONL path.
    data: str = DATA_SHIPPED
    # A malformed line of the data file (not JSON, not a conversation object) is skipped and counted with its
    # file:line; true stops the run at the first one instead (exit 2).
    strict_data: bool = False
    buckets: list[int] = field(default_factory=lambda: [256])
    batch_size: int = 1
    # Sequence packing: each row of a bucket holds several whole conversations, kept apart by a document mask
    # (attention, positions and TTT targets stay inside each; engine/trainer/data/packing.py); off by default
    # until measured on the device. Conversations only: random rows are full already. With loss_mean =
    # "all_positions" the loss divides by the batch's B*T positions, so a packed batch (more trained positions
    # a row) takes larger steps at the same lr than padded rows did; "masked_positions" does not change.
    packing: bool = False
    draft_vocab_size: int = 128
    # Ignored (still accepted so old configs load): the draft vocabulary now counts every training conversation.
    vocab_sample_batches: int | None = None
    # Conversations held out of training (a seeded choice, engine/trainer/data/holdout.py) for measuring acceptance.
    eval_holdout: int = 32
    # Where tokenized data is cached ("": <output_dir>/data_cache); a restart with the same data, tokenizer,
    # chat template, longest bucket and held-out split does not tokenize again.
    data_cache_dir: str = ""
    # Acceptance length every eval_every steps (0: never): greedy chain speculation with eval_k draft tokens
    # over eval_conversations held-out prompts, eval_max_new_tokens each (engine/trainer/serve/evaluate.py).
    eval_every: int = 0
    eval_k: int = 5
    eval_conversations: int = 8
    eval_max_new_tokens: int = 64
    ttt_steps: int = 3
    # TTT step i rotates with positions arange(T) + i, as served; False only to compare against the old way.
    ttt_rope_offset: bool = True
    loss_mean: str = LOSS_MEAN_ALL  # loss_i / (B*T) as SpecForge, or "masked_positions": / (masked count)
    # "soft_ce" (default), or an LK loss (SpecForge's lk_loss_type): "lk_lambda", the cross-entropy blended into
    # 1 - acceptance by w = lk_kl_scale * exp(-lk_kl_decay * acceptance), or "lk_alpha", -log acceptance.
    loss: str = LOSS_SOFT_CE
    lk_kl_scale: float = 1.0
    lk_kl_decay: float = 1.0
    lr: float = 1e-3
    drafter_lrs: list[float] | None = None  # independent mode: one learning rate per drafter (a sweep)
    schedule: str = "constant"
    warmup_steps: int = 0
    # Warm-up as a share of steps instead (SpecForge's warmup_ratio: int(warmup_ratio * steps) steps); 0: none.
    warmup_ratio: float = 0.0
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # > 0: export and eval serve an exponential moving average of the drafter's weights over the training steps
    # (mean age about 1 / (1 - ema_decay) steps; engine/trainer/draft/average.py), not the last weights; training
    # still steps the trained weights. 0: off. Costs one float32 copy of the trainable weights per drafter thread.
    ema_decay: float = 0.0
    # AdamW's (beta1, beta2); SpecForge keeps torch's [0.9, 0.999] (the specforge preset).
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # A step whose gradients are NaN or infinite is skipped (no update, an event and an anomaly); this many in a
    # row stop the run with that cause.
    nonfinite_grad_limit: int = 8
    steps: int = 1000
    checkpoint_every: int = 0  # 0: only on SIGTERM and at the end
    keep_checkpoints: int = 2
    compile: bool = False
    compile_guard: bool = True  # False only for the control experiment that shows why the guard exists
    compile_target: bool = False
    # The target's decoder Linears as e4m3 matmuls with row-wise scales (engine/trainer/verifier/fp8.py): faster on
    # FP8 tensor cores, measured against bf16 by tests/bench/bench_fp8_target.py; lm_head and MoE routers stay
    # exact, and so does the target acceptance length is measured with (its exact weights are kept for it).
    target_fp8: bool = False
    # At the start of an FP8 run: top-1 agreement and KL of the FP8 target against the exact one on the loss-masked
    # positions of this many first training batches (an fp8_agreement stage; 0: not measured), and a warning below
    # fp8_min_top1.
    fp8_check_batches: int = 4
    fp8_min_top1: float = 0.98
    # The drafter's Linear GEMMs (fc, q/k/v, o, the MLP, lm_head; forward and both gradients) as e4m3 matmuls with
    # row-wise scales (engine/trainer/draft/fp8.py): "rowwise" all three in FP8, "rowwise_gw_hp" the weight gradient
    # in bf16; "off": bf16 (or float32) as the dtype says. The weights are quantised once a step; the parameters,
    # checkpoints and exports are unchanged. CUDA 9.0+ (or the CPU on torch 2.13+), every Linear size a multiple of 16.
    drafter_fp8: str = DRAFTER_FP8_OFF
    # Under drafter_fp8 = "rowwise": the MLP's gate and up as two FP8 Linears under autograd ("composed"), or as one
    # node whose backward makes both gradients' four e4m3 layouts in one op (draft/fp8_mlp.py; two Triton kernels
    # on CUDA): "fused". The same numbers (bit for bit on the CPU); fused is a candidate until timed on a GPU.
    drafter_fp8_mlp: str = DRAFTER_FP8_MLP_COMPOSED
    # auto: flex on CUDA, sdpa on the CPU. merged (block 0 in a fused causal kernel, the TTT diagonals merged by
    # log-sum-exp) runs on the CPU only: its CUDA gradients were measured wrong (run/assembly.py).
    attention: str = "auto"
    # The flex attention backward's software-pipelining stages (flex's kernel_options bwd_num_stages); 0 leaves
    # inductor's choice. Kernel alone on one H100, 8B drafter shape, batch 4: 2 stages took TTT step 1's fwd+bwd
    # 2.326 -> 2.253 ms and step 6's 3.527 -> 3.316 ms (tests/bench/bench_kernels.py); not yet measured in the
    # whole engine (tests/device/throughput_runs.sh stages). Only the drafters' flex on CUDA reads it.
    flex_bwd_num_stages: int = 0
    # CUDA streams of co-located threads: "per_thread" (target and drafters overlap on the GPU) or
    # "per_device" (one stream per GPU: kernels queue in order, only the CPU work of the threads overlaps).
    cuda_streams: str = "per_thread"
    grad_checkpointing: bool = False
    # Under bf16 autocast: cast the drafter's Linear weights once a training step, not in every compiled TTT step,
    # so the steps' gradients sum in bf16 at the cast and reach the fp32 .grad once, as eager autocast's cached cast
    # does (uncompiled, this changes nothing) and as SpecForge's bf16 parameters with fp32 masters do. No effect in
    # float32. On one H200 at the 8B shape, batch 4, in one run: 17.75k -> 18.0k tok/s, peak 49.5 -> 44.9 GiB
    # (tests/bench/bench_engine.py). False: each compiled step casts its own.
    cast_weights_once: bool = True
    # A drafter launches its next batch's forward before it reads the step just launched (losses, accuracies,
    # gradient norm), so the host never leaves the GPU idle between two steps; a non-finite step is skipped on the
    # device (the fused optimizer's found_inf), not by a host check. A step's event comes once the next forward
    # is queued. auto: on for CUDA drafters (on the CPU every launch runs at once: nothing to overlap); on, off.
    overlap_steps: str = "auto"
    # The drafter's head and loss run on the positions each TTT step trains only ("trained": the loss mask's and the
    # draft vocabulary's positions, gathered once a step; engine/trainer/draft/rows.py) or on every position ("all",
    # as SpecForge does). The same losses, counts and gradients; "trained" saves the head's GEMMs and the loss's
    # reductions over the positions that train nothing.
    head_positions: str = HEAD_POSITIONS_TRAINED
    dtype: str = "auto"  # auto: bfloat16 autocast on CUDA, float32 on CPU
    seed: int = 0
    output_dir: str = "runs/specdec-engine"
    resume: bool = True  # resume from the newest checkpoint in output_dir when there is one
    # An output_dir belongs to one run (its run.json, engine/trainer/checkpoint.py): another run's checkpoints there
    # are refused. resume_from takes a checkpoint (or an output directory's newest) on purpose, another run's too;
    # once this run has written checkpoints of its own, a restart resumes those.
    resume_from: str = ""
    # A resume whose data plan (data file, packing, batch_size, seed, buckets, held-out split) differs from the
    # checkpoint's is refused naming the keys; true re-plans instead, from the start of the checkpoint's epoch.
    replan_data: bool = False
    queue_size: int = 4
    on_thread_error: str = "stop"
    log_every: int = 1
    heartbeat_interval_s: float = 1.0
    stall_after_s: float = 60.0
    starve_after_s: float = 10.0
    stop_grace_s: float = 300.0  # after a stop request, threads still running past this are reported stuck
    step_delay_s: float = 0.0  # a pause after each step, so a demo on a laptop leaves the CPU some air
    torch_threads: int = 0  # 0: leave torch's default
    # torch.distributed: "auto" joins the torchrun world when started by torchrun (RANK/WORLD_SIZE set), "off"
    # ignores it. A training step's collective that waits longer than dist_timeout_s fails the rank (a peer
    # hung); the setup's (peers waiting while rank 0 tokenizes the data or loads a checkpoint) dist_setup_timeout_s.
    distributed: str = "auto"
    dist_timeout_s: float = 600.0
    dist_setup_timeout_s: float = 3600.0
    # The torchrun launch (specdec-train --print-torchrun / --torchrun): ranks per node, nodes, this node's rank,
    # and the c10d rendezvous HOST:PORT (required for more than one node; "" runs a standalone single node).
    nproc_per_node: int = 1
    nnodes: int = 1
    node_rank: int = 0
    rdzv_endpoint: str = ""
    # Tiny target size knobs (only for target = "tiny").
    tiny_hidden: int = 64
    tiny_layers: int = 8  # deep enough for the serve-time layers (outputs of 1, 3, 4) to be distinct

    def validate(self) -> TrainerConfig:
        """This config when it keeps every rule; else a ConfigError naming the first key that breaks one (_RULES)."""
        for key, holds, words in _RULES:
            value = getattr(self, key)
            if not holds(value, self):
                raise ConfigError(f"{key}: {words if isinstance(words, str) else words(value, self)}")
        return self

    def target_depth(self) -> int | None:
        """The target's decoder-layer count where it is known without loading weights, else None."""
        if self.target == "tiny":
            return self.tiny_layers
        if self.target in BUILTIN_TARGET_LAYERS:
            return BUILTIN_TARGET_LAYERS[self.target]
        config_json = Path(self.target).expanduser() / "config.json"
        try:
            hf = json.loads(config_json.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None  # the loader reports an unreadable target; validation only skips the bound here
        text = hf.get("text_config") if isinstance(hf.get("text_config"), dict) else hf
        layers = text.get("num_hidden_layers") if isinstance(text, dict) else None
        return layers if isinstance(layers, int) and not isinstance(layers, bool) and layers > 0 else None

    @property
    def warmup(self) -> int:
        """The warm-up steps: warmup_steps, or warmup_ratio of the steps (rounded down, as SpecForge does)."""
        return self.warmup_steps or int(self.warmup_ratio * self.steps)

    @property
    def uses_cuda(self) -> bool:
        return any(d.startswith("cuda") for d in self.target_devices + self.drafter_devices)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# What a CUDA device needs on the host, looked for without importing torch (a container sees them bind-mounted).
NVIDIA_DEVICE_NODE = "/dev/nvidiactl"
NVIDIA_DRIVER_PROC = "/proc/driver/nvidia"


def check_cuda_present(cfg: TrainerConfig) -> None:
    """A config naming CUDA devices on a machine without an NVIDIA driver is a config error, said before torch
    loads (seconds): the key, the device and what this machine has instead."""
    if not cfg.uses_cuda or Path(NVIDIA_DEVICE_NODE).exists() or Path(NVIDIA_DRIVER_PROC).exists():
        return
    key = "target_devices" if any(d.startswith("cuda") for d in cfg.target_devices) else "drafter_devices"
    named = next(d for d in getattr(cfg, key) if d.startswith("cuda"))
    raise ConfigError(
        f"{key}: names {named}, but this machine has no CUDA device (no {NVIDIA_DEVICE_NODE}, no NVIDIA driver "
        'loaded); use ["cpu"] here or run on a GPU host'
    )


def file_kind(mode: int) -> str:
    """What a file that is not a regular one is, in words ("a directory", "a FIFO (named pipe)", ...)."""
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((words for test, words in kinds if test(mode)), "not a regular file")


def data_file_problem(path: Path) -> str | None:
    """Why ``path`` cannot be a data file (the words after the path: "does not exist", "is a FIFO ..."), or None.
    Only stat(), which never blocks: opening a FIFO would wait for a writer."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return "does not exist"
    except OSError as exc:
        return f"cannot be read: {exc.strerror or exc}"
    if not stat.S_ISREG(st.st_mode):
        return f"is {file_kind(st.st_mode)}, not a regular file of JSON lines"
    if st.st_size == 0:
        return "is empty: no conversations to read"
    return None


def check_data_file(cfg: TrainerConfig) -> None:
    """A ``data`` path that names no readable regular file is a config error, said before torch loads."""
    if cfg.data in (DATA_SHIPPED, DATA_RANDOM) or cfg.target in TOKENIZERLESS_TARGETS:
        return  # no file is read (a tokenizerless target trains on random tokens)
    path = Path(cfg.data).expanduser()
    problem = data_file_problem(path)
    if problem is not None:
        raise ConfigError(f"data: {path} {problem}")


def _finite_positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


# Directories a run must not take as its output_dir (it writes and prunes inside it): the root, the system's own
# directories, and everything under the kernel's pseudo file systems.
SYSTEM_DIRECTORIES = frozenset(
    {
        *("/", "/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/libx32", "/proc", "/run", "/sbin"),
        *("/sys", "/usr", "/usr/bin", "/usr/lib", "/usr/lib64", "/usr/local", "/usr/sbin", "/usr/share", "/var"),
        *("/var/lib", "/var/log"),
    }
)
PSEUDO_FILE_SYSTEMS = ("/proc", "/sys", "/dev")


def system_directory(path: str) -> str | None:
    """What makes ``path`` no place for a run's files ("the root directory", "a system directory", ...), or None."""
    if not path.strip():
        return "empty"
    resolved = Path(path).expanduser().resolve()
    shown = str(resolved)
    if shown == "/":
        return "the root directory"
    if shown in SYSTEM_DIRECTORIES:
        return "a system directory" if shown == path else f"a system directory ({shown})"
    inside = next((fs for fs in PSEUDO_FILE_SYSTEMS if resolved.is_relative_to(fs)), None)
    return f"inside the kernel's {inside}" if inside else None


def _cuda_index(device: str) -> int | None:
    head, _, tail = device.partition(":")
    return int(tail) if head == "cuda" and tail.isdigit() else None


def _endpoint_ok(endpoint: str) -> bool:
    host, sep, port = endpoint.rpartition(":")
    return bool(sep and host.strip("[]") and port.isdigit() and 1 <= int(port) <= 65535)


# --- the rules validate() checks, in order (the first one broken is the error) --------------------------------------
# A rule: the key it names, whether the key's value (v) in the config (c) keeps it, and what the value must be: the
# words after "key: ", or a function of v and c making them where they show what was given.
_Holds = Callable[[Any, TrainerConfig], bool]
_Words = Callable[[Any, TrainerConfig], str]
_Rule = tuple[str, _Holds, str | _Words]


def _one_of(key: str, allowed: tuple[str, ...]) -> _Rule:
    return key, lambda v, _: v in allowed, lambda v, _: f"got {v!r}; allowed: {', '.join(allowed)}"


def _device_ok(device: Any) -> bool:
    return isinstance(device, str) and (device in ("cpu", "cuda", LOCAL_DEVICE) or _cuda_index(device) is not None)


def _devices(key: str) -> list[_Rule]:
    return [
        (key, lambda v, _: isinstance(v, list) and len(v) > 0, "a non-empty list of devices, e.g. ['cuda:0']"),
        (
            key,
            lambda v, _: all(_device_ok(d) for d in v),
            lambda v, _: (
                f"device {next(d for d in v if not _device_ok(d))!r}; allowed: 'cpu', 'cuda', 'cuda:N', "
                f"'{LOCAL_DEVICE}' (cuda:<LOCAL_RANK>)"
            ),
        ),
    ]


def _positive_seconds(*keys: str) -> list[_Rule]:
    return [(key, lambda v, _: v > 0, "a positive number of seconds") for key in keys]


def _at_least_one(*keys: str) -> list[_Rule]:
    return [(key, lambda v, _: v >= 1, "an integer >= 1") for key in keys]


def _within_depth(layers: list[int], cfg: TrainerConfig) -> bool:
    depth = cfg.target_depth()
    return depth is None or max(layers) < depth


def _depth_words(layers: list[int], cfg: TrainerConfig) -> str:
    depth = cfg.target_depth() or 0  # known: the rule is broken only where it is
    return (
        f"{layers}: the target has {depth} decoder layers, so indices run 0..{depth - 1} "
        "(0-based; the output of each listed layer is captured)"
    )


def target_problem(spec: str) -> str | None:
    """Why ``spec`` names no target this machine can load (None: a built-in preset or a local directory)."""
    if spec in BUILTIN_TARGETS or Path(spec).expanduser().is_dir():
        return None
    return f"{spec!r} is neither a built-in preset ({', '.join(BUILTIN_TARGETS)}) nor a local directory"


_RULES: tuple[_Rule, ...] = (
    ("target", lambda v, _: target_problem(v) is None, lambda v, _: str(target_problem(v))),
    _one_of("drafter_mode", DRAFTER_MODES),
    _one_of("schedule", SCHEDULES),
    _one_of("on_thread_error", THREAD_ERROR_POLICIES),
    _one_of("dtype", DTYPES),
    _one_of("attention", ATTENTION_IMPLS),
    _one_of("cuda_streams", CUDA_STREAMS),
    _one_of("overlap_steps", OVERLAP_STEPS),
    _one_of("head_positions", HEAD_POSITIONS),
    _one_of("drafter_fp8", DRAFTER_FP8),
    _one_of("drafter_fp8_mlp", DRAFTER_FP8_MLP),
    _one_of("loss_mean", LOSS_MEANS),
    _one_of("loss", LOSSES),
    (
        "lk_kl_scale",
        lambda v, _: math.isfinite(v) and 0 < v <= 1,
        lambda v, _: (
            f"got {v}; the KL weight at zero acceptance, in (0, 1] (above 1 the acceptance term's weight 1 - w "
            "turns negative)"
        ),
    ),
    (
        "lk_kl_decay",
        lambda v, _: math.isfinite(v) and v >= 0,
        lambda v, _: f"got {v}; a finite number >= 0 (how fast the KL weight falls as acceptance rises)",
    ),
    *_devices("target_devices"),
    *_devices("drafter_devices"),
    ("buckets", lambda v, _: len(v) > 0, "at least one sequence length"),
    ("buckets", lambda v, _: all(isinstance(b, int) and b >= 16 for b in v), "integers >= 16"),
    ("buckets", lambda v, _: v == sorted(set(v)), "strictly increasing"),
    *[
        (key, lambda v, _: isinstance(v, int) and v >= 1, "an integer >= 1")
        for key in ("batch_size", "ttt_steps", "steps", "draft_vocab_size", "queue_size", "log_every")
    ],
    ("checkpoint_every", lambda v, _: v >= 0, "an integer >= 0 (0: only on stop)"),
    ("keep_checkpoints", lambda v, _: v >= 1, "an integer >= 1"),
    ("lr", lambda v, _: _finite_positive(v), lambda v, _: f"a finite positive number, got {v!r}"),
    (
        "drafter_lrs",
        lambda v, c: v is None or c.drafter_mode == "independent",
        "only with drafter_mode = 'independent'",
    ),
    (
        "drafter_lrs",
        lambda v, c: v is None or (len(v) == len(c.drafter_devices) and all(map(_finite_positive, v))),
        lambda v, c: f"one positive learning rate per drafter device ({len(c.drafter_devices)}), each finite",
    ),
    ("warmup_steps", lambda v, _: v >= 0, "an integer >= 0"),
    ("packing", lambda v, c: not (v and c.data == DATA_RANDOM), "needs conversations (random rows are full)"),
    (
        "packing",
        lambda v, c: not (v and c.target in TOKENIZERLESS_TARGETS),
        lambda v, c: f"needs conversations; target {c.target!r} has no tokenizer (it trains on random tokens)",
    ),
    ("eval_holdout", lambda v, _: v >= 0, "an integer >= 0 (0: no held-out conversations)"),
    ("eval_every", lambda v, _: v >= 0, "an integer >= 0 (0: no evaluation during training)"),
    (
        "eval_every",
        lambda v, c: not (v and (c.data == DATA_RANDOM or c.eval_holdout == 0)),
        "needs held-out conversations (data = 'random' has none; eval_holdout = 0 holds none out); set 0",
    ),
    *_at_least_one("eval_k", "eval_conversations", "eval_max_new_tokens"),
    ("fp8_check_batches", lambda v, _: v >= 0, "an integer >= 0 (0: no agreement check)"),
    ("fp8_min_top1", lambda v, _: 0 <= v <= 1, "a share between 0 and 1"),
    (
        "flex_bwd_num_stages",
        lambda v, _: isinstance(v, int) and 0 <= v <= 8,
        "an integer from 0 (inductor's choice) to 8",
    ),
    ("torch_threads", lambda v, _: v >= 0, "an integer >= 0 (0: leave torch's default)"),
    ("warmup_ratio", lambda v, _: 0 <= v < 1, "a share of steps, >= 0 and below 1 (SpecForge's: 0.015)"),
    (
        "warmup_ratio",
        lambda v, c: not (v and c.warmup_steps),
        lambda v, c: f"set warmup_steps ({c.warmup_steps}) or warmup_ratio ({v}), not both",
    ),
    (
        "adam_betas",
        lambda v, _: len(v) == 2 and all(0 <= b < 1 for b in v),
        lambda v, _: f"got {v}; two numbers >= 0 and below 1, e.g. [0.9, 0.999]",
    ),
    ("weight_decay", lambda v, _: 0 <= v < math.inf, "a number >= 0, finite"),
    ("max_grad_norm", lambda v, _: v > 0, "a positive number"),
    ("ema_decay", lambda v, _: 0 <= v < 1, "a number in [0, 1) (0: off; e.g. 0.995)"),
    ("nonfinite_grad_limit", lambda v, _: v >= 1, "an integer >= 1 (skipped steps in a row)"),
    *_positive_seconds("heartbeat_interval_s", "stall_after_s", "starve_after_s", "stop_grace_s"),
    ("step_delay_s", lambda v, _: v >= 0, "a number of seconds >= 0"),
    ("tiny_layers", lambda v, _: v >= 3, "an integer >= 3 (three distinct hidden layers are captured)"),
    (
        "target_layers",
        lambda v, _: v is None or (len(v) == 3 and all(isinstance(i, int) and i >= 0 for i in v)),
        "three non-negative layer indices (low, middle, high)",
    ),
    ("target_layers", lambda v, _: v is None or len(set(v)) == 3, lambda v, _: f"{v}: three distinct layer indices"),
    # vLLM and SGLang concatenate the aux hidden states in ascending layer order: any other order trains a drafter
    # whose fc reads them permuted when served (it accepts almost nothing).
    (
        "target_layers",
        lambda v, _: v is None or v == sorted(v),
        lambda v, _: (
            f"{v} is not in ascending order; the servers concatenate the captured layers in ascending "
            f"order, so write {sorted(v)}"
        ),
    ),
    ("target_layers", lambda v, c: v is None or _within_depth(v, c), _depth_words),
    _one_of("distributed", DISTRIBUTED),
    *_positive_seconds("dist_timeout_s", "dist_setup_timeout_s"),
    ("nproc_per_node", lambda v, _: v >= 1, "an integer >= 1 (ranks on this node)"),
    ("nnodes", lambda v, _: v >= 1, "an integer >= 1 (nodes in the run)"),
    (
        "node_rank",
        lambda v, c: 0 <= v < c.nnodes,
        lambda v, c: f"got {v}; this node's rank runs 0..{c.nnodes - 1} (nnodes = {c.nnodes})",
    ),
    (
        "rdzv_endpoint",
        lambda v, c: not (c.nnodes > 1 or v) or _endpoint_ok(v),
        lambda v, c: (
            f"got {v!r}; HOST:PORT of the c10d rendezvous (node 0's address), port 1..65535"
            + (f", required with nnodes = {c.nnodes}" if c.nnodes > 1 else "")
        ),
    ),
    ("tiny_hidden", lambda v, _: v >= 32 and v % 16 == 0, "a multiple of 16, >= 32"),
    (
        "output_dir",
        lambda v, _: system_directory(v) is None,
        lambda v, _: (
            f"{v!r} is {system_directory(v)}; the run writes checkpoints/, events.jsonl and data_cache/ "
            "into it: name a directory of its own, e.g. 'runs/NAME'"
        ),
    ),
)


# What a key's value must be when its type is wrong, where the plain type name says too little.
_TYPE_WORDS: dict[str, str] = {
    "target_devices": "a non-empty list of devices, e.g. ['cuda:0']",
    "drafter_devices": "a non-empty list of devices, e.g. ['cuda:0']",
    "target_layers": "a list of three integers (low, middle, high)",
    "drafter_lrs": "a list of numbers, one learning rate per drafter",
    "adam_betas": "a list of two numbers, e.g. [0.9, 0.999]",
}


def _show(value: Any) -> str:
    """A value as the user wrote it in TOML (strings in double quotes), cut to a readable length."""
    try:
        text = json.dumps(value, ensure_ascii=False)  # TOML spelling for what TOML can hold: "s", true, [1, 2]
    except (TypeError, ValueError):
        text = repr(value)
    text = f"{text} ({type(value).__name__})"
    return text if len(text) <= 80 else text[:77] + "..."


def _expected(key: str, tp: Any) -> str:
    """What the field type ``tp`` of ``key`` asks for, in the words of an error message."""
    if key in _TYPE_WORDS:
        return _TYPE_WORDS[key]
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(args) == 1:
        tp = args[0]  # optional: None is allowed too, and says nothing about the type
    if typing.get_origin(tp) is list:
        (item,) = typing.get_args(tp)
        return "a list of " + {int: "integers", float: "numbers", str: "strings"}[item]
    if tp is float:
        return "a number of seconds" if key.endswith("_s") else "a number"
    return {bool: "true or false", int: "an integer", str: "a string"}[tp]


def _has_nan(value: Any) -> bool:
    if isinstance(value, list):
        return any(_has_nan(v) for v in value)
    return isinstance(value, float) and math.isnan(value)


def _coerce(key: str, tp: Any, value: Any) -> Any:
    """``value`` checked against the field type ``tp`` by the protocol's typed-JSON decoder (ints become floats
    where a float is wanted); a ConfigError naming the key and the expected type otherwise."""
    wrong = f"{key}: expected {_expected(key, tp)}, got {_show(value)}"
    try:
        decoded = decode_as(tp, value)
    except (ProtocolError, OverflowError):  # OverflowError: an integer too large for a float
        raise ConfigError(wrong) from None
    if _has_nan(decoded):  # TOML can write nan, JSON cannot: the protocol's decoder never meets one
        raise ConfigError(wrong)
    if _beyond_int64(decoded):  # Python's ints have no bound; torch's tensors, file names and counters do
        raise ConfigError(f"{key}: {_show(value)} is out of range; integers run from -2**63 to 2**63 - 1")
    return decoded


def _beyond_int64(value: Any) -> bool:
    if isinstance(value, list):
        return any(_beyond_int64(v) for v in value)
    return isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**63


@functools.cache
def _field_types() -> dict[str, Any]:
    return typing.get_type_hints(TrainerConfig)


def from_dict(values: dict[str, Any], base: TrainerConfig | None = None) -> TrainerConfig:
    """Overlay ``values`` on ``base`` (or the defaults). Unknown keys are errors that list the known ones; every
    value is checked against its field's type before validation, so a wrong type names the key, not a crash."""
    cfg = dataclasses.replace(base) if base is not None else TrainerConfig()
    types_by_key = _field_types()
    flat: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, dict) and key in ("engine", "trainer"):
            flat.update(value)  # allow an [engine] table
        else:
            flat[key] = value
    for key, value in flat.items():
        if key not in types_by_key:
            raise ConfigError(f"{key}: unknown key; known keys: {', '.join(sorted(types_by_key))}")
        setattr(cfg, key, _coerce(key, types_by_key[key], value))
    if base is None and cfg.target not in BUILTIN_TARGETS:
        for key, value in REAL_TARGET_DEFAULTS.items():
            if key not in flat and not (key in WARMUP_KEYS and set(WARMUP_KEYS) & set(flat)):
                setattr(cfg, key, copy.deepcopy(value))
    _one_warmup(cfg, flat)
    return cfg.validate()


WARMUP_KEYS: tuple[str, str] = ("warmup_steps", "warmup_ratio")


def _one_warmup(cfg: TrainerConfig, layer: dict[str, Any]) -> None:
    """A layer (a preset, the file, --set) that sets one way of warming up replaces the one it inherits: the other
    key goes to 0. Both set in one layer are the user's own (validation refuses two non-zero ones)."""
    given = [key for key in WARMUP_KEYS if key in layer]
    if len(given) == 1:
        other = WARMUP_KEYS[1 - WARMUP_KEYS.index(given[0])]
        setattr(cfg, other, 0 if other == "warmup_steps" else 0.0)


class TomlBeyondLimits(ConfigError):
    """TOML the parser gives up on though it is well formed: too many digits or too deep."""


def _parse_toml(text: str) -> dict[str, Any]:
    """``text`` parsed as TOML; a ConfigError saying why not, also where the parser itself gives up: an integer
    longer than Python converts (its int string limit raises ValueError) or nesting deeper than it recurses."""
    assert tomllib is not None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(str(exc)) from None
    except ValueError as exc:
        if "integer string conversion" not in str(exc):
            raise ConfigError(str(exc)) from None
        limit = sys.get_int_max_str_digits()
        raise TomlBeyondLimits(f"an integer of more than {limit} digits") from None
    except RecursionError:
        raise TomlBeyondLimits("arrays or tables nested too deeply") from None


# A Hugging Face target (a local directory) gets these where neither a preset nor the config sets the key: a drafter
# trained to be served (EAGLE-3's 32k draft vocabulary, capped by the target's own; 7 TTT steps; SpecForge's learning
# rate, 1.5 % warm-up and cosine decay). The built-in targets keep the small defaults above (quick CPU runs).
REAL_TARGET_DEFAULTS: dict[str, Any] = {
    "draft_vocab_size": 32000,
    "ttt_steps": 7,
    "lr": 1e-4,
    "schedule": "cosine",
    "warmup_ratio": 0.015,
}
# SpecForge's EAGLE-3 recipe (its TrainingConfig and BF16Optimizer defaults): the specforge preset, for side-by-side
# runs against it on the same layout as h200-single.
SPECFORGE_RECIPE: dict[str, Any] = {
    "lr": 1e-4,
    "schedule": "cosine",
    "warmup_steps": 0,
    "warmup_ratio": 0.015,
    "max_grad_norm": 0.5,
    "adam_betas": [0.9, 0.999],
    "weight_decay": 0.0,
    "draft_vocab_size": 32000,
    "ttt_steps": 7,
    "loss_mean": LOSS_MEAN_ALL,
}


def load_toml(path: str | Path, base: TrainerConfig | None = None) -> TrainerConfig:
    """The config in the TOML file at ``path`` (a ``preset = NAME`` key starts from that preset). Every error
    is a ConfigError whose message starts with ``<path>: ``."""
    p = Path(path).expanduser()
    if tomllib is None:  # pragma: no cover - python 3.10 without tomli
        raise ConfigError(f"{p}: reading TOML on python 3.10 needs the 'tomli' package")
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise ConfigError(f"{p}: no such config file") from None
    except OSError as exc:
        raise ConfigError(f"{p}: cannot read: {exc.strerror or exc}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ConfigError(f"{p}: not valid TOML: not UTF-8 text (byte {exc.start}, line {line})") from None
    try:
        data = _parse_toml(text)
    except ConfigError as exc:
        raise ConfigError(f"{p}: not valid TOML: {exc}") from None  # TOML's own message ends "(at line L, column C)"
    try:
        preset_name = data.pop("preset", None)
        if preset_name is not None and base is None:
            if not isinstance(preset_name, str):
                raise ConfigError(
                    f"preset: expected a string, got {_show(preset_name)}; allowed: {', '.join(sorted(PRESETS))}"
                )
            base = preset(preset_name)
        return from_dict(data, base)
    except ConfigError as exc:
        raise ConfigError(f"{p}: {exc}") from None


PRESETS: dict[str, dict[str, Any]] = {
    # Starts its first step within seconds on two CPU cores and keeps stepping, so the dashboard has live charts.
    "cpu-demo": {
        "target": "tiny",
        "target_devices": ["cpu"],
        "drafter_devices": ["cpu", "cpu"],
        "drafter_mode": "independent",
        "buckets": [128, 256],
        "batch_size": 2,
        "ttt_steps": 3,
        "draft_vocab_size": 128,
        "lr": 2e-3,
        "drafter_lrs": [2e-3, 5e-4],  # a two-point learning-rate sweep: two curves on the dashboard
        "steps": 1_000_000,
        "checkpoint_every": 500,
        "compile": False,
        "log_every": 1,
        "step_delay_s": 0.05,
        "torch_threads": 1,
        "output_dir": "runs/cpu-demo",
    },
    # One H200: target and drafter co-located, compiled TTT steps with flex attention, bf16.
    "h200-single": {
        "target": "llama3-8b-shape",
        "target_devices": ["cuda:0"],
        "drafter_devices": ["cuda:0"],
        "drafter_mode": "replicas",
        "data": DATA_RANDOM,
        "buckets": [2048],
        "batch_size": 2,  # measured on the H200: 16.6k tok/s (66.8% MFU) vs 15.0k at batch 1
        "ttt_steps": 7,
        "draft_vocab_size": 32000,
        "lr": 1e-4,
        "schedule": "cosine",
        "warmup_steps": 50,
        "steps": 2000,
        "checkpoint_every": 500,
        "compile": True,
        "compile_target": True,
        "cuda_streams": "per_device",  # measured: 15.0k tok/s vs 14.4k per-thread with the fused TTT step
        "attention": "flex",
        "queue_size": 2,
        "log_every": 10,
        "stall_after_s": 300.0,
        "output_dir": "runs/h200-single",
    },
}


PRESETS["specforge"] = {**PRESETS["h200-single"], **SPECFORGE_RECIPE, "output_dir": "runs/specforge"}


def preset(name: str) -> TrainerConfig:
    if name not in PRESETS:
        raise ConfigError(f"preset: got {name!r}; allowed: {', '.join(sorted(PRESETS))}")
    return from_dict(PRESETS[name])


def parse_override(text: str) -> tuple[str, Any]:
    """``key=value`` with a TOML value (``steps=10``, ``drafter_devices=["cpu"]``, ``target="tiny"``)."""
    if "=" not in text:
        raise ConfigError(f"--set {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if tomllib is None:  # pragma: no cover
        return key, raw
    try:
        value = _parse_toml(f"v = {raw}")["v"]
    except TomlBeyondLimits as exc:
        shown = text if len(text) <= 60 else text[:57] + "..."
        raise ConfigError(f"--set {shown!r}: {exc}") from None
    except ConfigError:
        value = raw  # a bare string
    return key, value
