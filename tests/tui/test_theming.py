"""Themes are files, validated; a bad user theme is reported, not fatal; the choice persists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tui.dashboard import keys, theming

SHIPPED = {"specdec-dark", "specdec-light", "specdec-high-contrast"}


def test_shipped_themes_load_and_validate() -> None:
    loaded = theming.load_themes()
    assert set(loaded.themes) >= SHIPPED
    assert loaded.errors == []
    assert theming.DEFAULT_THEME in loaded.themes
    assert loaded.themes["specdec-light"].dark is False


def test_user_theme_added_and_bad_one_reported(tui_config_dir: Path) -> None:
    themes = tui_config_dir / "themes"
    themes.mkdir(parents=True)
    (themes / "mine.toml").write_text('[theme]\nname = "mine"\nprimary = "#112233"\nbackground = "#000000"\n')
    (themes / "broken.toml").write_text('[theme]\nname = "broken"\nprimary = "not-a-colour"\n')
    (themes / "nonsense.toml").write_text("this is [ not toml")
    loaded = theming.load_themes()
    assert "mine" in loaded.themes
    assert "broken" not in loaded.themes
    assert len(loaded.errors) == 2
    assert any("broken.toml" in e and "primary" in e for e in loaded.errors)


@pytest.mark.parametrize(
    "doc, problem",
    [
        ({}, "no [theme] table"),
        ({"theme": {"primary": "#fff"}}, "'name'"),
        ({"theme": {"name": "x"}}, "'primary'"),
        ({"theme": {"name": "x", "primary": "#fff", "colour": "#fff"}}, "unknown field"),
        ({"theme": {"name": "x", "primary": "#fff", "dark": "yes"}}, "'dark'"),
        ({"theme": {"name": "x", "primary": "#fff", "text_alpha": 3}}, "text_alpha"),
    ],
)
def test_invalid_theme_documents_rejected(doc: dict[str, object], problem: str) -> None:
    with pytest.raises(theming.ThemeError, match=re.escape(problem)):
        theming.parse_theme(doc, "t.toml")  # type: ignore[arg-type]


def test_theme_choice_and_keymap_persist() -> None:
    assert theming.saved_theme() is None
    theming.save_theme("specdec-light")
    config = theming.read_config()
    config["keys"] = {"restart": "ctrl+r"}
    theming.write_config(config)
    assert theming.saved_theme() == "specdec-light"
    assert theming.saved_keymap() == {"restart": "ctrl+r"}


def test_keymap_validation() -> None:
    good, bad = keys.valid_keymap({"restart": "ctrl+r", "explode": "x"})
    assert good == {"restart": "ctrl+r"}
    assert len(bad) == 1 and "explode" in bad[0]


def test_every_binding_has_id_description_and_tooltip() -> None:
    ids = [b.id for b in keys.bindings()]
    assert len(ids) == len(set(ids))
    for binding in keys.bindings():
        assert binding.id and binding.description and binding.tooltip


def test_no_colour_literals_outside_themes() -> None:
    root = Path(__file__).resolve().parents[2] / "tui"
    hex_colour = re.compile(r"#[0-9a-fA-F]{6}\b|#[0-9a-fA-F]{3}\b")
    named = re.compile(r"\b(?:color|background):\s*(?:red|green|blue|yellow|white|black|magenta|cyan)\b")
    offenders = []
    for path in [*root.rglob("*.py"), *root.rglob("*.tcss")]:
        if path.name in ("theming.py",):
            continue
        text = path.read_text()
        if hex_colour.search(text) or named.search(text):
            offenders.append(path.name)
    assert offenders == []
