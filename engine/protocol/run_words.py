"""Run words: what the client and the host agree on about a run, besides the lines between them.

The milestones of a launch, ``launch --wait``'s exit codes, the environment the supervisor gives the job,
which run ids a host accepts (``validate_run_id``), the restart policy table a profile carries in its
LaunchSpec (``parse_policy``), and where the client's bundle puts NVIDIA's NVML binding for the host's loader
(``VENDOR_DIR``...).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

# `--simulate-gpus N` (client and agent): more than any one host has, and a bound, so a typo builds no millions.
MAX_SIMULATED_GPUS = 64

# Milestones of a launch, in order.
MILESTONES: tuple[str, ...] = ("submitted", "started", "output", "first-step")

# `launch --wait` exit codes (README).
EXIT_OK = 0
EXIT_RUN_FAILED = 1
EXIT_USAGE = 2
EXIT_CONNECTION = 3
EXIT_HUNG = 4

# A refused command's reply says "input" (``error_kind``) when the request itself was wrong: exit EXIT_USAGE.
ERROR_KIND_INPUT = "input"

# Environment variables the supervisor sets for the job (the engine writes its events there).
ENV_RUN_DIR = "SPECDEC_RUN_DIR"
ENV_EVENTS_PATH = "SPECDEC_EVENTS"
ENV_RUN_ID = "SPECDEC_RUN_ID"
ENV_ATTEMPT = "SPECDEC_ATTEMPT"  # 1 for the first start, 2 for the first restart under a restart policy, ...
# A run over several nodes: the client's launch sets them on every node (one run id everywhere), and the launch
# record keeps them, so a later stop or restart can tell the multi-node run from another run of that node.
ENV_NNODES = "SPECDEC_NNODES"
ENV_NODE_RANK = "SPECDEC_NODE_RANK"


# --- run ids: what a host accepts as a run directory and tmux session name (the CLI checks it before sending) ---
RUN_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class RunIdError(ValueError):
    """A run id that is not safe as a directory and tmux session name."""


def validate_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or RUN_ID_RE.fullmatch(run_id) is None or run_id in (".", ".."):
        raise RunIdError(
            f"invalid run id {run_id!r}: use 1-64 characters from A-Z a-z 0-9 . _ -, starting with a letter or digit"
        )
    return run_id


# --- the restart policy: a profile's ``restart`` table, carried in the LaunchSpec, applied by the wrapper ---
CAUSES: tuple[str, ...] = ("crash", "hang", "oom")
POLICY_KEYS: tuple[str, ...] = ("on", "max", "backoff_s", "stall_s", "grace_s")
DEFAULT_ON: tuple[str, ...] = ("crash",)
DEFAULT_MAX = 3
DEFAULT_BACKOFF_S = 30.0
DEFAULT_STALL_S = 1800.0  # the stalled-run anomaly's cap: a step slower than this is not training
DEFAULT_GRACE_S = 30.0  # our engine saves a checkpoint on SIGTERM at the next step boundary


class PolicyError(ValueError):
    """A restart table that cannot be used; ``key`` names the offending key inside it (None: the table)."""

    def __init__(self, key: str | None, problem: str) -> None:
        self.key = key
        self.problem = problem
        super().__init__(f"restart{'.' + key if key else ''}: {problem}")


@dataclass(frozen=True)
class Policy:
    on: tuple[str, ...] = DEFAULT_ON
    max: int = DEFAULT_MAX
    backoff_s: float = DEFAULT_BACKOFF_S
    stall_s: float = DEFAULT_STALL_S
    grace_s: float = DEFAULT_GRACE_S

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["on"] = list(self.on)
        return out

    @property
    def watches_hangs(self) -> bool:
        return "hang" in self.on and self.max > 0


def _policy_seconds(raw: dict[str, Any], key: str, default: float, positive: bool) -> float:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise PolicyError(key, f"must be a number of seconds, got {value!r}")
    if positive and value <= 0:
        raise PolicyError(key, f"must be a positive number of seconds, got {value!r}")
    if value < 0:
        raise PolicyError(key, f"must not be negative, got {value!r}")
    return float(value)


def parse_policy(raw: Any) -> Policy:
    """A Policy from a profile's ``restart`` table (or the LaunchSpec's ``restart`` dict); PolicyError names the key."""
    if isinstance(raw, Policy):
        return raw
    if not isinstance(raw, dict):
        raise PolicyError(None, f'must be a table such as {{ on = ["crash", "hang", "oom"], max = 3 }}, got {raw!r}')
    unknown = sorted(str(k) for k in raw if k not in POLICY_KEYS)
    if unknown:
        raise PolicyError(unknown[0], f"unknown key; allowed: {', '.join(POLICY_KEYS)}")
    on_raw = raw.get("on", list(DEFAULT_ON))
    if not isinstance(on_raw, list) or not all(isinstance(c, str) for c in on_raw):
        raise PolicyError("on", f"must be a list of causes among {', '.join(CAUSES)}, got {on_raw!r}")
    for cause in on_raw:
        if cause not in CAUSES:
            raise PolicyError("on", f"unknown cause {cause!r}; allowed: {', '.join(CAUSES)}")
    max_raw = raw.get("max", DEFAULT_MAX)
    if isinstance(max_raw, bool) or not isinstance(max_raw, int):
        raise PolicyError("max", f"must be a whole number of restarts, got {max_raw!r}")
    if max_raw < 0:
        raise PolicyError("max", f"must not be negative, got {max_raw}")
    return Policy(
        on=tuple(c for c in CAUSES if c in on_raw),
        max=max_raw,
        backoff_s=_policy_seconds(raw, "backoff_s", DEFAULT_BACKOFF_S, positive=False),
        stall_s=_policy_seconds(raw, "stall_s", DEFAULT_STALL_S, positive=True),
        grace_s=_policy_seconds(raw, "grace_s", DEFAULT_GRACE_S, positive=False),
    )


# --- the bundled NVML binding: where the client's bundle puts NVIDIA's pynvml and the host's loader finds it ---
VENDOR_DIR = "_vendor"  # a folder beside `engine/` in the bundle (not a package: nothing imports it by name)
VENDORED_MODULE = "pynvml.py"
VENDORED_LICENSE = "pynvml.LICENSE"
VENDORED_MANIFEST = "pynvml.json"  # {"distribution": "nvidia-ml-py", "version": ..., "sha256": ...}
NVML_DISTRIBUTION = "nvidia-ml-py"
