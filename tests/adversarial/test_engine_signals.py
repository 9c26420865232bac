"""The engine under signals, supervised for real: `stop` (SIGTERM to the job's group) saves a checkpoint and
`restart` resumes at the same step; SIGKILL loses at most the steps since the last checkpoint, and the
resumed run says how many.

One scenario (module fixture) drives the real CLI against a local agent: launch the engine's cpu-demo preset
(shrunk: one drafter, small buckets, a checkpoint every 3 steps), stop it, restart it, SIGKILL its group, restart
again; the tests read what each run recorded.
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from support.waiting import wait_until

from engine.host import procs
from engine.supervisor import records

pytestmark = [pytest.mark.tmux, pytest.mark.slow]
CHECKPOINT_EVERY = 3


def _events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / records.EVENTS_JSONL
    if not path.exists():
        return []
    out = []
    for line in path.read_bytes().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out


def _steps(run_dir: Path) -> list[int]:
    return [int(e["step"]) for e in _events(run_dir) if e.get("kind") == "step"]


def _checkpoints(run_dir: Path) -> list[int]:
    return [int(e["step"]) for e in _events(run_dir) if e.get("kind") == "checkpoint"]


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory, cli: Callable[..., Any]) -> Iterator[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("engine-signals")
    root, out = tmp / "run-root", tmp / "engine-out"
    root.mkdir()
    config = tmp / "profiles.toml"
    sets = [
        'drafter_devices=["cpu"]', "drafter_lrs=[0.002]", "buckets=[128]", "vocab_sample_batches=8",
        "step_delay_s=0.05",
        f"checkpoint_every={CHECKPOINT_EVERY}", "keep_checkpoints=50", "heartbeat_interval_s=0.5",
    ]  # fmt: skip
    args = ["--output-dir", str(out)]
    for s in sets:
        args += ["--set", s]
    config.write_text(
        f'[profiles.eng]\ndeadlines_s = {{ first-step = 240 }}\n[profiles.eng.engine]\npreset = "cpu-demo"\n'
        f"args = {json.dumps(args)}\n"
    )
    common = ["local", "--run-root", str(root)]
    sc: dict[str, Any] = {"root": root, "out": out}
    try:
        r = cli("launch", *common, "--config", str(config), "--profile", "eng", "--wait", "first-step", "--json",
                timeout_s=300)  # fmt: skip
        assert r.returncode == 0, r.output
        first = records.run_dir_for(root, json.loads(r.stdout)["run_id"])
        wait_until(lambda: len(_steps(first)) >= 4, 120, "a few steps of the first run")
        stop = cli("stop", *common, "--grace", "120", timeout_s=200)
        assert stop.returncode == 0, stop.output
        sc["first"] = first
        r = cli("restart", *common, "--wait", "first-step", "--json", timeout_s=300)
        assert r.returncode == 0, r.output
        second = records.run_dir_for(root, json.loads(r.stdout)["run_id"])
        sc["second"] = second
        # Let it pass a checkpoint and a few steps more, then SIGKILL the job's whole group.
        wait_until(
            lambda: _checkpoints(second) and max(_steps(second)) - max(_checkpoints(second)) >= 2,
            120,
            "a checkpoint and two steps past it",
        )
        launch = records.read_json(second / records.LAUNCH_JSON) or {}
        assert procs.process_alive(launch["job_pid"], launch.get("job_start_ticks"))
        steps_before_kill = _steps(second)
        os.killpg(int(launch["job_pgid"]), signal.SIGKILL)
        wait_until(lambda: (second / records.EXIT_JSON).exists(), 30, "the wrapper's exit record")
        sc["last_step_before_kill"] = max(_steps(second) + steps_before_kill)
        sc["last_checkpoint_before_kill"] = max(_checkpoints(second))
        r = cli("restart", *common, "--wait", "first-step", "--json", timeout_s=300)
        assert r.returncode == 0, r.output
        third = records.run_dir_for(root, json.loads(r.stdout)["run_id"])
        sc["third"] = third
        wait_until(lambda: len(_steps(third)) >= 2, 120, "steps after the second restart")
        yield sc
    finally:
        cli("stop", *common, "--grace", "60", timeout_s=120)


def test_sigterm_through_stop_saves_a_checkpoint_and_restart_resumes_at_that_step(scenario: dict[str, Any]) -> None:
    first, second = scenario["first"], scenario["second"]
    exit_rec = records.read_json(first / records.EXIT_JSON) or {}
    assert exit_rec.get("exit_code") == 0 and exit_rec.get("signal") is None, exit_rec
    end = [e for e in _events(first) if e.get("kind") == "run_end"][-1]
    saved = _checkpoints(first)[-1]
    assert end["reason"] == "SIGTERM" and end["step"] == saved == max(_steps(first)), end
    assert _steps(second)[0] == saved + 1  # not one step repeated, not one skipped
    assert f"at step {saved}" in (second / records.OUTPUT_LOG).read_text()


def test_sigkill_loses_at_most_the_steps_since_the_last_checkpoint(scenario: dict[str, Any]) -> None:
    third = scenario["third"]
    ckpt, last = scenario["last_checkpoint_before_kill"], scenario["last_step_before_kill"]
    assert _steps(third)[0] == ckpt + 1, (ckpt, _steps(third)[:3])
    assert 0 <= last - ckpt <= CHECKPOINT_EVERY + 1, (ckpt, last)  # + the step whose checkpoint was in flight
    exit_rec = records.read_json(scenario["second"] / records.EXIT_JSON) or {}
    assert exit_rec.get("signal") == signal.SIGKILL, exit_rec
    print(f"\n[adversarial] SIGKILL at step {last}, last checkpoint {ckpt}: resumed at {ckpt + 1}, lost {last - ckpt}")


def test_the_resumed_run_says_how_many_steps_the_sigkill_lost(scenario: dict[str, Any]) -> None:
    third = scenario["third"]
    lost = scenario["last_step_before_kill"] - scenario["last_checkpoint_before_kill"]
    text = (third / records.OUTPUT_LOG).read_text()
    said = [int(m.group(1)) for m in re.finditer(r"\blost (\d+) step", text)]
    assert said, f"the resumed run does not say how many steps were lost: {text[:2000]}"
    # The kill can land between a step's event and its progress record: the count may differ by that one step.
    assert abs(said[0] - lost) <= 1, (said, lost)
    print(f"\n[adversarial] the resumed run says it lost {said[0]} step(s); the events showed {lost}")
