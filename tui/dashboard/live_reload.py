"""What the dashboard watches for live reload (watchfiles), and what a batch of changes means.

Watched, not recursively: the shipped ``themes/`` folder, the user's ``<config dir>/themes/`` (created
when missing, so a theme dropped there later is seen) and the folder of the profiles' config file (only
that one file counts: the app's own ``tui.toml`` beside it is ignored). A config file in a folder that
does not exist yet is not watched. ``watch`` runs until ``stop`` is set; it calls ``on_ready`` once the
watches are in place, then ``on_change`` per debounced batch.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import watchfiles

from tui.dashboard import theming

CHANGE_STEP_MS = 50  # a batch is delivered once nothing changed for this long
DEBOUNCE_MS = 1600  # ...or after this long at most, under a stream of writes
STOP_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class Watched:
    theme_dirs: tuple[Path, ...]
    config_file: Path | None

    @property
    def directories(self) -> list[Path]:
        dirs = list(self.theme_dirs)
        if self.config_file is not None and self.config_file.parent not in dirs:
            dirs.append(self.config_file.parent)
        return dirs


@dataclass(frozen=True)
class ChangeKinds:
    theme_files: tuple[Path, ...]
    config: bool


def shipped_themes_dir() -> Path | None:
    folder = resources.files("themes")
    path = Path(str(folder))
    return path if path.is_dir() else None  # an installed zip: nothing there can change


def watched(config_file: Path | None) -> Watched:
    user_themes = theming.config_dir() / "themes"
    with contextlib.suppress(OSError):  # a read-only home: the folder is then simply not watched
        user_themes.mkdir(parents=True, exist_ok=True)
    dirs = [d.resolve() for d in (shipped_themes_dir(), user_themes) if d is not None and d.is_dir()]
    config = config_file.expanduser().resolve() if config_file is not None else None
    if config is not None and not config.parent.is_dir():
        config = None
    return Watched(tuple(dict.fromkeys(dirs)), config)


def classify(changes: Iterable[tuple[watchfiles.Change, str]], w: Watched) -> ChangeKinds:
    themes: list[Path] = []
    config = False
    for _, raw in changes:
        path = Path(raw).resolve()
        if w.config_file is not None and path == w.config_file:
            config = True
        elif path.suffix == ".toml" and path.parent in w.theme_dirs:
            themes.append(path)
    return ChangeKinds(tuple(sorted(set(themes))), config)


async def watch(
    w: Watched,
    stop: asyncio.Event,
    on_ready: Callable[[], None],
    on_change: Callable[[ChangeKinds], Awaitable[None] | None],
) -> None:
    """Watch ``w`` until ``stop`` is set; ``on_change`` gets each batch that touches a theme or the config."""

    def relevant(_: watchfiles.Change, raw: str) -> bool:
        kinds = classify([(watchfiles.Change.modified, raw)], w)
        return kinds.config or bool(kinds.theme_files)

    changes = watchfiles.awatch(
        *w.directories,
        watch_filter=relevant,
        stop_event=stop,
        recursive=False,
        step=CHANGE_STEP_MS,
        debounce=DEBOUNCE_MS,
    )
    pending = asyncio.ensure_future(anext(changes))
    # One loop turn runs the generator to its first await, and it sets up its inotify watches before that.
    await asyncio.sleep(0)
    on_ready()
    try:
        while True:
            try:
                batch = await pending
            except StopAsyncIteration:  # stop was set
                return
            outcome = on_change(classify(batch, w))
            if outcome is not None:
                await outcome
            pending = asyncio.ensure_future(anext(changes))
    finally:
        stop.set()  # the watch thread sees it within CHANGE_STEP_MS and the generator returns
        with contextlib.suppress(StopAsyncIteration, asyncio.CancelledError, asyncio.TimeoutError):
            await asyncio.wait_for(pending, STOP_TIMEOUT_S)
        await changes.aclose()
