"""The client's bundle cache keeps the most recently used bundles only (every install and every edit of the
engine's sources makes a new key)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tui.link import ship


def _touch(path: Path, age_s: float) -> Path:
    path.write_bytes(b"x")
    t = time.time() - age_s
    os.utime(path, (t, t))
    return path


def test_prune_keeps_the_most_recently_used_bundles_and_drops_stale_temporaries(tmp_path: Path) -> None:
    bundles = [_touch(tmp_path / f"{n:02d}.pyz", age_s=100.0 * n) for n in range(12)]  # 00 newest
    fresh_tmp = _touch(tmp_path / "aa.pyz.tmp-123", age_s=10.0)  # a writer still writing
    dead_tmp = _touch(tmp_path / "bb.pyz.tmp-456", age_s=7200.0)
    other = _touch(tmp_path / "notes.txt", age_s=7200.0)
    removed = ship.prune_cache(tmp_path, keep=8)
    assert sorted(removed) == sorted([*bundles[8:], dead_tmp])
    assert sorted(p for p in tmp_path.iterdir()) == sorted([*bundles[:8], fresh_tmp, other])


def test_a_missing_cache_directory_prunes_nothing(tmp_path: Path) -> None:
    assert ship.prune_cache(tmp_path / "absent") == []


def test_building_a_bundle_prunes_the_cache_and_a_read_marks_it_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "specdec-tui" / "bundles"
    cache.mkdir(parents=True)
    old = [_touch(cache / f"old{n:02d}.pyz", age_s=1000.0 + n) for n in range(ship.CACHE_KEEP + 3)]
    ship.agent_bundle.cache_clear()
    try:
        built = ship.agent_bundle()
        kept = sorted(cache.glob("*.pyz"))
        assert len(kept) == ship.CACHE_KEEP, kept
        mine = [p for p in kept if p not in old]
        assert len(mine) == 1 and mine[0].read_bytes() == built.data
        assert set(kept) - set(mine) == set(old[: ship.CACHE_KEEP - 1])  # the oldest went
        t = time.time() - 5000.0
        os.utime(mine[0], (t, t))
        ship.agent_bundle.cache_clear()
        assert ship.agent_bundle().data == built.data  # read from the cache, not rebuilt
        assert time.time() - mine[0].stat().st_mtime < 60.0  # the read marked it used
    finally:
        ship.agent_bundle.cache_clear()
