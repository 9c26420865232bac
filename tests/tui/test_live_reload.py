"""Live reload with watchfiles: theme files and the profiles' config file changed on disk while the app runs.

Every test waits for the app's own messages (watcher ready, themes or profiles reloaded) with a bound.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from support.pilot import wait_until
from textual.color import Color
from textual.message import Message
from tui_recorded import RecordingSession

from tui.dashboard.app import DashboardApp
from tui.dashboard.messages import LiveReloadReady, ProfilesReloaded, ThemesReloaded

SIZE = (100, 30)
RELOAD_TIMEOUT_S = 10.0


def theme_toml(primary: str) -> str:
    return f'[theme]\nname = "mine"\ndark = true\nprimary = "{primary}"\nbackground = "#101010"\n'


def config_toml(script: str) -> str:
    return f'default_profile = "demo"\n\n[profiles.demo]\ncommand = ["bash", "{script}"]\n'


class Inbox:
    """The reload messages the app posted, in order."""

    def __init__(self) -> None:
        self.messages: list[Message] = []

    def __call__(self, message: Message) -> None:
        if isinstance(message, (LiveReloadReady, ThemesReloaded, ProfilesReloaded)):
            self.messages.append(message)

    def of(self, kind: type[Message]) -> list[Message]:
        return [m for m in self.messages if isinstance(m, kind)]


def notifications(app: DashboardApp) -> list[str]:
    return [n.message for n in app._notifications]


async def test_a_changed_theme_repaints_and_a_broken_one_keeps_the_old(
    recorded_app: Callable[..., DashboardApp], tui_config_dir: Path, tmp_path: Path
) -> None:
    theme_file = tui_config_dir / "themes" / "mine.toml"
    theme_file.parent.mkdir(parents=True)
    theme_file.write_text(theme_toml("#112233"))
    inbox = Inbox()
    app = recorded_app(RecordingSession(), theme="mine", live_reload=True, config=str(tmp_path / "none.toml"))
    async with app.run_test(size=SIZE, message_hook=inbox) as pilot:
        await wait_until(pilot, lambda: inbox.of(LiveReloadReady), RELOAD_TIMEOUT_S, "the watcher")
        assert Color.parse(app.get_css_variables()["primary"]) == Color.parse("#112233")

        theme_file.write_text(theme_toml("#445566"))
        await wait_until(pilot, lambda: inbox.of(ThemesReloaded), RELOAD_TIMEOUT_S, "the theme reload")
        assert app.theme == "mine"
        assert Color.parse(app.get_css_variables()["primary"]) == Color.parse("#445566")
        title = app.dashboard.query_one("#header").get_component_styles("run-header--title")
        assert title.color == Color.parse("#445566")  # repainted: the header's title is drawn in $primary

        theme_file.write_text('[theme]\nname = "mine"\nprimary = "not-a-colour"\n')
        await wait_until(pilot, lambda: len(inbox.of(ThemesReloaded)) == 2, RELOAD_TIMEOUT_S, "the broken reload")
        broken = inbox.of(ThemesReloaded)[-1]
        assert isinstance(broken, ThemesReloaded) and broken.errors and "mine.toml" in broken.errors[0]
        assert any("mine.toml" in n and "not a colour" in n for n in notifications(app))
        assert app.theme == "mine"
        assert Color.parse(app.get_css_variables()["primary"]) == Color.parse("#445566")  # the old one kept


async def test_a_changed_config_reloads_profiles_and_a_broken_one_keeps_the_old(
    recorded_app: Callable[..., DashboardApp], tmp_path: Path
) -> None:
    config = tmp_path / "profiles" / "config.toml"
    config.parent.mkdir()
    config.write_text(config_toml("a.sh"))
    inbox = Inbox()
    app = recorded_app(RecordingSession(), live_reload=True, config=str(config))
    async with app.run_test(size=SIZE, message_hook=inbox) as pilot:
        await wait_until(pilot, lambda: inbox.of(LiveReloadReady), RELOAD_TIMEOUT_S, "the watcher")

        config.write_text(config_toml("b.sh"))
        await wait_until(pilot, lambda: inbox.of(ProfilesReloaded), RELOAD_TIMEOUT_S, "the profiles reload")
        assert app.profile is not None and app.profile["command"] == ["bash", "b.sh"]
        assert any("profile demo reloaded" in n for n in notifications(app))

        config.write_text("[profiles.demo\ncommand = 1\n")
        await wait_until(pilot, lambda: len(inbox.of(ProfilesReloaded)) == 2, RELOAD_TIMEOUT_S, "the broken reload")
        broken = inbox.of(ProfilesReloaded)[-1]
        assert isinstance(broken, ProfilesReloaded) and broken.error and "not valid TOML" in broken.error
        assert any("not valid TOML" in n for n in notifications(app))
        assert app.profile["command"] == ["bash", "b.sh"]  # the old profiles kept
        worker = app.live_reload_worker
    assert worker is not None and worker.is_finished  # stopped with the app


async def test_without_live_reload_no_watcher_runs(recorded_app: Callable[..., DashboardApp]) -> None:
    app = recorded_app(RecordingSession())
    async with app.run_test(size=SIZE):
        assert app.live_reload_worker is None
