"""Live reload with watchfiles: theme files and the profiles' config file changed on disk while the app runs.

Every test waits for the app's own messages (watcher ready, themes or profiles reloaded) with a bound.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from support.pilot import wait_until
from textual.color import Color
from tui_recorded import RecordingSession

from tui.dashboard.app import DashboardApp

SIZE = (100, 30)
RELOAD_TIMEOUT_S = 10.0


def theme_toml(primary: str) -> str:
    return f'[theme]\nname = "mine"\ndark = true\nprimary = "{primary}"\nbackground = "#101010"\n'


def config_toml(script: str) -> str:
    return f'default_profile = "demo"\n\n[profiles.demo]\ncommand = ["bash", "{script}"]\n'


def said(app: DashboardApp, words: str) -> list[str]:
    """The notifications that contain ``words``: what the user was told."""
    return [n.message for n in app._notifications if words in n.message]


async def test_a_changed_theme_repaints_and_a_broken_one_keeps_the_old(
    recorded_app: Callable[..., DashboardApp], tui_config_dir: Path, tmp_path: Path
) -> None:
    theme_file = tui_config_dir / "themes" / "mine.toml"
    theme_file.parent.mkdir(parents=True)
    theme_file.write_text(theme_toml("#112233"))
    app = recorded_app(RecordingSession(), theme="mine", live_reload=True, config=str(tmp_path / "none.toml"))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.watching, RELOAD_TIMEOUT_S, "the watcher")
        assert str(theme_file.parent) in app.watching
        assert Color.parse(app.get_css_variables()["primary"]) == Color.parse("#112233")

        theme_file.write_text(theme_toml("#445566"))
        await wait_until(pilot, lambda: said(app, "theme reloaded: mine"), RELOAD_TIMEOUT_S, "the theme reload")
        assert app.theme == "mine"
        assert Color.parse(app.get_css_variables()["primary"]) == Color.parse("#445566")
        title = app.dashboard.query_one("#header").get_component_styles("run-header--title")
        assert title.color == Color.parse("#445566")  # repainted: the header's title is drawn in $primary

        theme_file.write_text('[theme]\nname = "mine"\nprimary = "not-a-colour"\n')
        await wait_until(pilot, lambda: said(app, "not a colour"), RELOAD_TIMEOUT_S, "the broken reload")
        assert any("mine.toml" in n and "the theme loaded before stays" in n for n in said(app, "not a colour"))
        assert app.theme == "mine"
        assert Color.parse(app.get_css_variables()["primary"]) == Color.parse("#445566")  # the old one kept


async def test_a_changed_config_reloads_profiles_and_a_broken_one_keeps_the_old(
    recorded_app: Callable[..., DashboardApp], tmp_path: Path
) -> None:
    config = tmp_path / "profiles" / "config.toml"
    config.parent.mkdir()
    config.write_text(config_toml("a.sh"))
    app = recorded_app(RecordingSession(), live_reload=True, config=str(config))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.watching, RELOAD_TIMEOUT_S, "the watcher")

        config.write_text(config_toml("b.sh"))
        await wait_until(pilot, lambda: said(app, "profile demo reloaded"), RELOAD_TIMEOUT_S, "the profiles reload")
        assert app.profile is not None and app.profile.command == ["bash", "b.sh"]

        config.write_text("[profiles.demo\ncommand = 1\n")
        await wait_until(pilot, lambda: said(app, "not valid TOML"), RELOAD_TIMEOUT_S, "the broken reload")
        assert app.profile.command == ["bash", "b.sh"]  # the old profiles kept
        worker = app.live_reload_worker
    assert worker is not None and worker.is_finished  # stopped with the app


async def test_without_live_reload_no_watcher_runs(recorded_app: Callable[..., DashboardApp]) -> None:
    app = recorded_app(RecordingSession())
    async with app.run_test(size=SIZE):
        assert app.live_reload_worker is None


HUGE_INTEGER = '[profiles.demo]\ncommand = ["bash", "x.sh"]\ndeadlines_s = { started = ' + "9" * 5000 + " }\n"
DEEP_NESTING = '[profiles.demo]\ncommand = ["bash", "x.sh"]\nenv = ' + "[" * 5000 + "]" * 5000 + "\n"


async def test_a_config_with_a_huge_integer_or_deep_nesting_is_one_error_and_reload_goes_on(
    recorded_app: Callable[..., DashboardApp], tmp_path: Path
) -> None:
    config = tmp_path / "profiles" / "config.toml"
    config.parent.mkdir()
    config.write_text(config_toml("a.sh"))
    app = recorded_app(RecordingSession(), live_reload=True, config=str(config))
    async with app.run_test(size=SIZE) as pilot:
        await wait_until(pilot, lambda: app.watching, RELOAD_TIMEOUT_S, "the watcher")
        for bad, words in ((HUGE_INTEGER, "too large to read"), (DEEP_NESTING, "nested too deep")):
            before = app.profile
            config.write_text(bad)
            await wait_until(pilot, lambda words=words: said(app, words), RELOAD_TIMEOUT_S, f"the error: {words}")
            error = said(app, words)[-1]
            assert "\n" not in error and str(config) in error and len(error) < 300, error
            assert app.profile is before  # the profile loaded before stays

            config.write_text(config_toml("b.sh"))  # fixed: the watcher still reloads it
            reloaded = len(said(app, "profile demo reloaded"))
            await wait_until(
                pilot, lambda n=reloaded: len(said(app, "profile demo reloaded")) > n, RELOAD_TIMEOUT_S, "a reload"
            )
            assert app.profile is not None and app.profile.command == ["bash", "b.sh"]
        worker = app.live_reload_worker
        assert worker is not None and not worker.is_finished
