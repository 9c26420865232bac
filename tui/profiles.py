"""Run profiles: what ``launch`` starts and how long each milestone may take, from a TOML file.

The config file (``--config FILE``, default ``<user config dir>/specdec-tui/config.toml``)::

    default_profile = "demo"          # optional: used when --profile is not given

    [profiles.demo]
    command = ["bash", "start_training.sh"]   # argv list; omit to start our engine (see [profiles.X.engine])
    cwd = "/root/work"
    env = { HF_HOME = "/data/hf" }
    step_pattern = 'step=\\d+'      # a regex per output line (\\r ends one too); the step: its group, else the
                                    # first integer of the match ('\\d+/1000' on '90/1000' is 90)
    deadlines_s = { started = 10, output = 60, first-step = 900 }
    # Restart on the host when it exits non-zero, hangs (no step for stall_s) or dies of CUDA OOM (then with
    # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): at most max times, backoff_s apart; `stop` cancels it.
    restart = { on = ["crash", "hang", "oom"], max = 3, backoff_s = 30, stall_s = 1800, grace_s = 30 }

    [profiles.demo.engine]             # used when there is no command: python3 -m engine.trainer ...
    preset = "cpu-demo"                # or: config = "/root/work/train.toml" (a path on the host)
    args = []                          # extra trainer arguments

    [profiles.two-nodes]               # one run over several machines: the engine as torchrun on each
    nodes = ["gpu-a", { target = "root@gpu-b", pct = 200, port = 2222 }]   # the first hosts the rendezvous
    rendezvous = { address = "10.0.0.1", port = 29500 }   # optional: default the first node's route, a free port

    [profiles.watch]                   # readonly: watch someone else's run; nothing is launched, stopped,
    readonly = true                    # restarted, killed or serve-checked (headless verbs exit 2)

Without any file, the built-in profile ``default`` starts the engine's ``cpu-demo`` preset.
Every error names the file, the key and what is allowed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine import protocol
from tui.tomlfile import TomlFileError, read_toml, shown

DEFAULT_PROFILE = "default"
DEFAULT_STEP_PATTERN = r"step=\d+"
# Milestone deadlines (seconds after launch) when a profile sets none: the engine's CPU demo
# compiles nothing and reaches its first step in seconds; a real target load can take minutes.
DEFAULT_DEADLINES_S: dict[str, float] = {"submitted": 10.0, "started": 15.0, "output": 60.0, "first-step": 900.0}
ENGINE_PRESET_DEFAULT = "cpu-demo"

_PROFILE_KEYS = {
    "command", "cwd", "env", "step_pattern", "deadlines_s", "engine", "restart", "nodes", "rendezvous", "readonly",
}  # fmt: skip
_NODE_KEYS = {"target", "pct", "port", "identity", "known_hosts", "python", "run_root"}
_RENDEZVOUS_KEYS = {"address", "port"}
_ENGINE_KEYS = {"preset", "config", "args"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


class ProfileError(ValueError):
    """A config file or profile that cannot be used; the message names file, key and what is allowed."""


@dataclass
class EngineConfig:
    preset: str | None = ENGINE_PRESET_DEFAULT
    config: str | None = None
    args: list[str] = field(default_factory=list)

    def trainer_args(self) -> list[str]:
        """Arguments after ``python3 -m engine.trainer`` (engine/trainer/__main__.py: --preset / --config)."""
        out: list[str] = []
        if self.config:
            out += ["--config", self.config]
        elif self.preset:
            out += ["--preset", self.preset]
        return out + list(self.args)


@dataclass(frozen=True)
class Node:
    """One machine of a multi-node profile: an SSH target and its own connection options (None: the command
    line's, else ``~/.ssh/config``'s)."""

    target: str
    pct: int | None = None
    port: int | None = None
    identity: str | None = None
    known_hosts: str | None = None
    python: str | None = None
    run_root: str | None = None


@dataclass(frozen=True)
class Rendezvous:
    """Where the c10d rendezvous of a multi-node run listens: None picks the first node's route to the others
    (the address) and a port checked free there (29500 when it is)."""

    address: str | None = None
    port: int | None = None


@dataclass
class Profile:
    name: str
    command: list[str] | None = None  # None: our engine
    cwd: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    step_pattern: str = DEFAULT_STEP_PATTERN
    deadlines_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_DEADLINES_S))
    engine: EngineConfig = field(default_factory=EngineConfig)
    restart: dict[str, Any] | None = None  # protocol.parse_policy's table, as a dict; None: never restarted
    nodes: list[Node] = field(default_factory=list)  # several: one run across them (the first: rendezvous host)
    rendezvous: Rendezvous = field(default_factory=Rendezvous)
    readonly: bool = False  # watch only: no key or verb launches, stops, restarts, kills or serve-checks
    source: str = "built-in"

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "command": self.command,
            "cwd": self.cwd,
            "env": dict(self.env),
            "step_pattern": self.step_pattern,
            "deadlines_s": dict(self.deadlines_s),
            "engine": {"preset": self.engine.preset, "config": self.engine.config, "args": list(self.engine.args)},
            "restart": dict(self.restart) if self.restart is not None else None,
            "nodes": [{k: v for k, v in vars(n).items() if v is not None} for n in self.nodes],
            "rendezvous": {"address": self.rendezvous.address, "port": self.rendezvous.port},
            "readonly": self.readonly,
            "source": self.source,
        }

    def launch_spec(
        self, command: list[str] | None, *, python: str, engine_pythonpath: str | None, run_id: str | None = None
    ) -> protocol.LaunchSpec:
        """What to start: ``command`` (from ``-- COMMAND``) if given, else the profile's, else our engine."""
        env = dict(self.env)
        argv = command or self.command
        if not argv:
            argv = [python, "-m", "engine.trainer", *self.engine.trainer_args()]
            if engine_pythonpath:
                env["PYTHONPATH"] = engine_pythonpath + (":" + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        return protocol.LaunchSpec(
            command=list(argv),
            cwd=self.cwd,
            env=env,
            run_id=run_id,
            step_pattern=self.step_pattern,
            deadlines_s=dict(self.deadlines_s),
            profile=self.name,
            restart=dict(self.restart) if self.restart is not None else None,
        )


def default_config_path() -> Path:
    try:
        import platformdirs

        return Path(platformdirs.user_config_dir("specdec-tui")) / "config.toml"
    except ImportError:
        base = os.environ.get("XDG_CONFIG_HOME") or os.path.expanduser("~/.config")
        return Path(base) / "specdec-tui" / "config.toml"


def _err(path: Path | str, key: str, problem: str) -> ProfileError:
    return ProfileError(f"{path}: {key}: {problem}")


def _str_list(path: Path, key: str, value: Any) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _err(path, key, f'must be a list of strings (an argv, e.g. ["bash", "run.sh"]), got {shown(value)}')
    return list(value)


def _parse_profile(path: Path, name: str, raw: Any) -> Profile:
    where = f"profiles.{name}"
    if not _NAME_RE.match(name):
        raise _err(path, where, "a profile name is letters, digits, '_', '.', '-' (at most 64)")
    if not isinstance(raw, dict):
        raise _err(path, where, "must be a table ([profiles.NAME])")
    unknown = sorted(set(raw) - _PROFILE_KEYS)
    if unknown:
        raise _err(path, f"{where}.{unknown[0]}", f"unknown key; allowed: {', '.join(sorted(_PROFILE_KEYS))}")
    prof = Profile(name=name, source=str(path))
    if "command" in raw:
        prof.command = _str_list(path, f"{where}.command", raw["command"])
        if not prof.command:
            raise _err(path, f"{where}.command", "must not be empty (leave it out to start the engine)")
    if "cwd" in raw:
        if not isinstance(raw["cwd"], str) or not raw["cwd"]:
            raise _err(path, f"{where}.cwd", "must be a non-empty string (a directory on the host)")
        prof.cwd = raw["cwd"]
    if "env" in raw:
        env = raw["env"]
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise _err(path, f"{where}.env", 'must be a table of string values, e.g. env = { HF_HOME = "/data" }')
        for k in env:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k):
                raise _err(path, f"{where}.env.{k}", "an environment variable name is [A-Za-z_][A-Za-z0-9_]*")
        prof.env = dict(env)
    if "step_pattern" in raw:
        pat = raw["step_pattern"]
        if not isinstance(pat, str):
            raise _err(path, f"{where}.step_pattern", "must be a string (a Python regular expression)")
        try:
            re.compile(pat)
        except re.error as exc:
            raise _err(path, f"{where}.step_pattern", f"not a valid regular expression: {exc}") from None
        prof.step_pattern = pat
    if "deadlines_s" in raw:
        dl = raw["deadlines_s"]
        allowed = ", ".join(protocol.MILESTONES)
        if not isinstance(dl, dict):
            raise _err(path, f"{where}.deadlines_s", f"must be a table with keys among {allowed}")
        for k, v in dl.items():
            if k not in protocol.MILESTONES:
                raise _err(path, f"{where}.deadlines_s.{k}", f"unknown milestone; allowed: {allowed}")
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
                raise _err(path, f"{where}.deadlines_s.{k}", f"must be a positive number of seconds, got {shown(v)}")
            prof.deadlines_s[k] = float(v)
    if "restart" in raw:
        try:
            prof.restart = protocol.parse_policy(raw["restart"]).as_dict()
        except protocol.PolicyError as exc:
            key = f"{where}.restart" + (f".{exc.key}" if exc.key else "")
            raise _err(path, key, exc.problem) from None
    if "nodes" in raw:
        prof.nodes = _parse_nodes(path, f"{where}.nodes", raw["nodes"])
    if "rendezvous" in raw:
        prof.rendezvous = _parse_rendezvous(path, f"{where}.rendezvous", raw["rendezvous"])
    if "readonly" in raw:
        if not isinstance(raw["readonly"], bool):
            raise _err(path, f"{where}.readonly", f"must be true or false, got {shown(raw['readonly'])}")
        prof.readonly = raw["readonly"]
    if "engine" in raw:
        eng = raw["engine"]
        if not isinstance(eng, dict):
            raise _err(path, f"{where}.engine", f"must be a table with keys among {', '.join(sorted(_ENGINE_KEYS))}")
        unknown = sorted(set(eng) - _ENGINE_KEYS)
        if unknown:
            raise _err(path, f"{where}.engine.{unknown[0]}", f"unknown key; allowed: {', '.join(sorted(_ENGINE_KEYS))}")
        for k in ("preset", "config"):
            if k in eng and (not isinstance(eng[k], str) or not eng[k]):
                raise _err(path, f"{where}.engine.{k}", "must be a non-empty string")
        if "preset" in eng and "config" in eng:
            raise _err(path, f"{where}.engine", "set either preset or config, not both")
        prof.engine = EngineConfig(
            preset=eng.get("preset", None if "config" in eng else ENGINE_PRESET_DEFAULT),
            config=eng.get("config"),
            args=_str_list(path, f"{where}.engine.args", eng["args"]) if "args" in eng else [],
        )
    return prof


def _parse_node(path: Path, key: str, raw: Any) -> Node:
    if isinstance(raw, str):
        raw = {"target": raw}
    if not isinstance(raw, dict):
        raise _err(path, key, 'a node is an SSH target ("gpu-a") or a table { target = "gpu-a", pct = 200, ... }')
    unknown = sorted(set(raw) - _NODE_KEYS)
    if unknown:
        raise _err(path, f"{key}.{unknown[0]}", f"unknown key; allowed: {', '.join(sorted(_NODE_KEYS))}")
    target = raw.get("target")
    if not isinstance(target, str) or not target:
        raise _err(path, f"{key}.target", "must be an SSH target: [user@]host[:port] or a Host alias, or 'local'")
    if any(c.isspace() for c in target) or target.startswith("-"):
        raise _err(path, f"{key}.target", f"not an SSH target: {shown(target)}")
    ints: dict[str, int] = {}
    for k, top in (("pct", 999_999_999), ("port", 65535)):
        if k in raw:
            v = raw[k]
            if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= top:
                raise _err(path, f"{key}.{k}", f"must be an integer 1..{top}, got {shown(v)}")
            ints[k] = v
    strs: dict[str, str] = {}
    for k in ("identity", "known_hosts", "python", "run_root"):
        if k in raw:
            if not isinstance(raw[k], str) or not raw[k]:
                raise _err(path, f"{key}.{k}", "must be a non-empty string")
            strs[k] = raw[k]
    return Node(target=target, pct=ints.get("pct"), port=ints.get("port"), **strs)


def _parse_nodes(path: Path, key: str, raw: Any) -> list[Node]:
    if not isinstance(raw, list) or not raw:
        raise _err(path, key, 'must be a non-empty list of SSH targets, e.g. nodes = ["gpu-a", "gpu-b"]')
    nodes = [_parse_node(path, f"{key}[{i}]", item) for i, item in enumerate(raw)]
    seen: set[tuple[str, int | None, int | None, str | None]] = set()
    for i, n in enumerate(nodes):
        ident = (n.target, n.port, n.pct, n.run_root)
        if ident in seen:
            raise _err(path, f"{key}[{i}]", f"names {n.target} twice (same port, container and run root)")
        seen.add(ident)
    return nodes


def _parse_rendezvous(path: Path, key: str, raw: Any) -> Rendezvous:
    if not isinstance(raw, dict):
        raise _err(path, key, 'must be a table, e.g. rendezvous = { address = "10.0.0.1", port = 29500 }')
    unknown = sorted(set(raw) - _RENDEZVOUS_KEYS)
    if unknown:
        raise _err(path, f"{key}.{unknown[0]}", f"unknown key; allowed: {', '.join(sorted(_RENDEZVOUS_KEYS))}")
    address = raw.get("address")
    if address is not None and (not isinstance(address, str) or not address or any(c.isspace() for c in address)):
        raise _err(path, f"{key}.address", "must be a host name or address the other nodes reach the first at")
    port = raw.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise _err(path, f"{key}.port", f"must be a port 1..65535, got {shown(port)}")
    return Rendezvous(address=address, port=port)


def load_profiles(config: str | None) -> tuple[dict[str, Profile], str | None, Path | None]:
    """All profiles of the config file: (profiles by name, default profile name, the file read or None)."""
    explicit = config is not None
    path = Path(config).expanduser() if config else default_config_path()
    profiles: dict[str, Profile] = {DEFAULT_PROFILE: Profile(name=DEFAULT_PROFILE)}
    try:
        data = read_toml(path)  # a regular file only, bounded; a huge integer or deep nesting is a TomlFileError
    except FileNotFoundError:
        if explicit:
            raise ProfileError(f"{path}: no such config file (--config)") from None
        return profiles, None, None
    except TomlFileError as exc:
        raise ProfileError(str(exc)) from None
    unknown = sorted(set(data) - {"profiles", "default_profile"})
    if unknown:
        raise _err(path, unknown[0], "unknown top-level key; allowed: default_profile, [profiles.NAME]")
    raw_profiles = data.get("profiles", {})
    if not isinstance(raw_profiles, dict):
        raise _err(path, "profiles", "must be tables: [profiles.NAME]")
    for name, raw in raw_profiles.items():
        profiles[name] = _parse_profile(path, name, raw)
    default = data.get("default_profile")
    if default is not None and (not isinstance(default, str) or default not in profiles):
        raise _err(path, "default_profile", f"names no profile; defined: {', '.join(sorted(profiles))}")
    return profiles, default, path


def resolve_profile(name: str | None, config: str | None) -> Profile:
    """The profile to use: --profile NAME, else the file's default_profile, else the built-in default."""
    profiles, default, path = load_profiles(config)
    chosen = name or default or DEFAULT_PROFILE
    if chosen not in profiles:
        defined = ", ".join(sorted(profiles))
        if path is None:  # no file was read: say so, rather than name a file that does not exist as if it did
            raise ProfileError(
                f"no such profile: {chosen} (--profile): no config file defines profiles here ({default_config_path()} "
                f"does not exist; --config FILE names another); built in: {defined}"
            )
        raise ProfileError(f"{path}: profiles.{chosen}: no such profile (--profile); defined: {defined}")
    return profiles[chosen]
