"""Colour themes: TOML files shipped in ``themes/`` plus the user's ``<config dir>/themes/*.toml``.

Every theme is validated before it is registered with Textual; a bad user file becomes a message
to show, never a crash. The chosen theme and key remaps persist in ``<config dir>/tui.toml``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import tomllib
from textual.color import Color, ColorParseError
from textual.theme import Theme

from tui.tomlfile import TomlFileError, read_toml

DEFAULT_THEME = "specdec-dark"
CONFIG_DIR_ENV = "SPECDEC_TUI_CONFIG_DIR"
CONFIG_FILE_NAME = "tui.toml"

_COLOUR_FIELDS = (
    "primary",
    "secondary",
    "accent",
    "warning",
    "error",
    "success",
    "foreground",
    "background",
    "surface",
    "panel",
    "boost",
)
_NUMBER_FIELDS = ("luminosity_spread", "text_alpha")
_ALLOWED_FIELDS = {"name", "dark", *_COLOUR_FIELDS, *_NUMBER_FIELDS}


class ThemeError(ValueError):
    """A theme file that cannot be used; the message names the file and the field."""


def config_dir() -> Path:
    """The user's config directory: $SPECDEC_TUI_CONFIG_DIR, else $XDG_CONFIG_HOME/specdec-tui."""
    explicit = os.environ.get(CONFIG_DIR_ENV)
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "specdec-tui"


def parse_theme(data: dict[str, Any], source: str) -> Theme:
    """Validate one theme document (``[theme]`` table plus optional ``[variables]``)."""
    table = data.get("theme")
    if not isinstance(table, dict):
        raise ThemeError(f"{source}: no [theme] table")
    unknown = set(table) - _ALLOWED_FIELDS
    if unknown:
        raise ThemeError(f"{source}: unknown field(s) {sorted(unknown)}")
    name = table.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ThemeError(f"{source}: 'name' must be a non-empty string")
    if "primary" not in table:
        raise ThemeError(f"{source}: 'primary' colour is required")
    colours: dict[str, str] = {}
    for key in _COLOUR_FIELDS:
        if key not in table:
            continue
        value = table[key]
        if not isinstance(value, str):
            raise ThemeError(f"{source}: {key} must be a colour string")
        try:
            Color.parse(value)
        except ColorParseError as exc:
            raise ThemeError(f"{source}: {key} = {value!r} is not a colour ({exc})") from exc
        colours[key] = value
    dark = table.get("dark", True)
    if not isinstance(dark, bool):
        raise ThemeError(f"{source}: 'dark' must be true or false")
    numbers: dict[str, float] = {}
    for key in _NUMBER_FIELDS:
        if key in table:
            value = table[key]
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= float(value) <= 1.0:
                raise ThemeError(f"{source}: {key} must be a number between 0 and 1")
            numbers[key] = float(value)
    variables = data.get("variables", {})
    if not isinstance(variables, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in variables.items()
    ):
        raise ThemeError(f"{source}: [variables] must map names to strings")
    return Theme(
        name=name.strip(),
        primary=colours.pop("primary"),
        dark=dark,
        variables=dict(variables),
        **colours,  # type: ignore[arg-type]
        **numbers,  # type: ignore[arg-type]
    )


def load_theme_file(path: Path) -> Theme:
    try:
        data = read_toml(path)  # a regular file only, bounded; a huge integer or deep nesting: one line
    except (OSError, TomlFileError) as exc:
        raise ThemeError(str(exc) if isinstance(exc, TomlFileError) else f"{path}: {exc}") from exc
    return parse_theme(data, str(path))


@dataclass
class ThemeSet:
    themes: dict[str, Theme] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # one sentence per rejected file


def _shipped_theme_texts() -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    for entry in sorted(resources.files("themes").iterdir(), key=lambda e: e.name):
        if entry.name.endswith(".toml"):
            out.append((f"themes/{entry.name}", entry.read_text(encoding="utf-8")))
    return out


def load_themes(user_dir: Path | None = None) -> ThemeSet:
    """Shipped themes first, then user themes (a user theme with a shipped name replaces it)."""
    result = ThemeSet()
    for source, text in _shipped_theme_texts():
        theme = parse_theme(tomllib.loads(text), source)  # a broken shipped theme is a bug: let it raise
        result.themes[theme.name] = theme
    directory = (user_dir if user_dir is not None else config_dir()) / "themes"
    if directory.is_dir():
        for path in sorted(directory.glob("*.toml")):
            try:
                theme = load_theme_file(path)
            except ThemeError as exc:
                result.errors.append(str(exc))
                continue
            result.themes[theme.name] = theme
    return result


# --- the user config file (theme choice, key remaps) -------------------------------------------


def config_path() -> Path:
    return config_dir() / CONFIG_FILE_NAME


def read_config() -> dict[str, Any]:
    path = config_path()
    try:
        return read_toml(path)
    except (OSError, TomlFileError):
        return {}


def _toml_str(value: str) -> str:
    escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
    return f'"{escaped}"'


def write_config(config: dict[str, Any]) -> Path:
    """Write the config (string values and one level of string tables) atomically."""
    lines: list[str] = ["# specdec-tui dashboard settings (written by the app; safe to edit)"]
    tables: list[tuple[str, dict[str, Any]]] = []
    for key, value in config.items():
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, str):
            lines.append(f"{key} = {_toml_str(value)}")
    for name, table in tables:
        lines.append("")
        lines.append(f"[{name}]")
        for key, value in table.items():
            if isinstance(value, str):
                lines.append(f"{_toml_str(key)} = {_toml_str(value)}")
    path = config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".toml.tmp")
    tmp.write_text("\n".join(lines) + "\n", encoding="utf-8")
    tmp.replace(path)
    return path


def saved_theme() -> str | None:
    value = read_config().get("theme")
    return value if isinstance(value, str) else None


def save_theme(name: str) -> Path:
    config = read_config()
    config["theme"] = name
    return write_config(config)


def saved_keymap() -> dict[str, str]:
    keys = read_config().get("keys", {})
    if not isinstance(keys, dict):
        return {}
    return {str(k): v for k, v in keys.items() if isinstance(v, str)}
