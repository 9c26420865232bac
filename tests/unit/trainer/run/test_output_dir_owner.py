"""An output_dir belongs to one run: another run's checkpoints there are refused in one line (never pruned, never
resumed, never exported in its stead), a restart of the same run still resumes, resume_from takes a checkpoint on
purpose; and a resume under another data plan is refused naming the keys, or re-planned from the epoch's start."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from test_trainer_engine import build, make_config  # same folder: pytest puts it on sys.path

from engine.trainer import checkpoint as ckpt
from engine.trainer.config import ConfigError

REPO = Path(__file__).resolve().parents[4]


@pytest.fixture(scope="module")
def corpus(corpus_head: Callable[[int], Path]) -> Path:
    return corpus_head(40)


def train(out: Path, data: Path, **overrides: Any) -> Any:
    """A finished tiny run in ``out`` (8 conversations to train on: 4 batches of 2 an epoch)."""
    settings: dict[str, Any] = {"eval_holdout": 32, "checkpoint_every": 2, "keep_checkpoints": 2, **overrides}
    engine, _ = build(make_config(out, data, **settings), out)
    assert engine.run() == 0
    return engine


def steps_in(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").glob("step_*"))


# --- 1. an output_dir belongs to one run ------------------------------------------------------------------------


def test_a_new_run_with_resume_false_in_a_used_output_dir_is_refused_and_the_checkpoints_kept(
    tmp_path: Path, corpus: Path
) -> None:
    """The issue's loss: the new run's step 1 was pruned as soon as written (steps 4 and 6 were higher), a restart
    then resumed the other run, and export exported it."""
    out = tmp_path / "run"
    train(out, corpus, steps=6)
    assert steps_in(out) == ["step_00000004", "step_00000006"]
    with pytest.raises(ConfigError) as err:
        train(out, corpus, steps=2, resume=False, checkpoint_every=1)
    assert str(err.value).startswith(f"output_dir: {out} holds the checkpoints of a run (run ")
    assert "up to step_00000006), and resume = false starts a new one" in str(err.value)
    assert steps_in(out) == ["step_00000004", "step_00000006"]


def test_a_run_of_another_model_in_a_used_output_dir_is_refused_naming_the_keys(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "run"
    train(out, corpus, steps=2)
    with pytest.raises(ConfigError) as err:
        train(out, corpus, steps=4, draft_vocab_size=64, ttt_steps=3)  # ttt_steps: a training change, not a model
    assert str(err.value).startswith(f"output_dir: {out} holds another run's checkpoints (run ")
    assert "up to step_00000002; draft_vocab_size: 96 there, 64 here): choose another output_dir" in str(err.value)
    assert steps_in(out) == ["step_00000002"]


def test_a_restart_of_the_same_run_resumes_and_prunes_only_its_own_checkpoints(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "run"
    first = train(out, corpus, steps=2)
    run_id = ckpt.read_marker(out)["run_id"]  # type: ignore[index]
    # Another run's checkpoint lands here by hand (an older version shared the directory): never pruned or resumed.
    foreign = out / "checkpoints" / "step_00000009"
    foreign.mkdir()
    (foreign / "meta.json").write_text(json.dumps({"run_id": "someone-else", "step": 9}))
    resumed = train(out, corpus, steps=6, ttt_steps=3, lr=1e-3)  # same model, other training settings: a restart
    assert resumed.resumed_from == first.last_checkpoint and resumed.workers[0].step == 6
    assert steps_in(out) == ["step_00000004", "step_00000006", "step_00000009"]
    assert [ckpt.read_meta(p)["run_id"] for p in ckpt.owned_checkpoints(out)] == [run_id, run_id]
    assert ckpt.resolve_checkpoint(out)[0] == out / "checkpoints" / "step_00000006"  # what export and eval take


def test_checkpoints_of_a_version_without_run_ids_are_adopted_by_a_run_of_the_same_model(
    tmp_path: Path, corpus: Path
) -> None:
    out = tmp_path / "run"
    train(out, corpus, steps=4)
    (out / "run.json").unlink()  # as an older version left the directory: no run.json, no run_id in the metas
    for path in ckpt.owned_checkpoints(out):
        meta = ckpt.read_meta(path)
        del meta["run_id"], meta["data_plan"]
        (path / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(ConfigError, match=r"holds another run's checkpoints \(up to step_00000004; draft_vocab_size"):
        train(out, corpus, steps=6, draft_vocab_size=64)
    resumed = train(out, corpus, steps=8)
    assert resumed.resumed_from == out / "checkpoints" / "step_00000004"
    assert steps_in(out) == ["step_00000006", "step_00000008"]  # the adopted ones pruned in turn


def test_export_of_an_output_dir_takes_its_owners_newest_not_another_runs_higher_step(tmp_path: Path) -> None:
    out = tmp_path / "run"
    for step, run in ((2, "mine"), (4, "mine"), (9, "theirs")):
        path = out / "checkpoints" / f"step_{step:08d}"
        path.mkdir(parents=True)
        (path / "meta.json").write_text(json.dumps({"run_id": run, "step": step}))
    (out / "run.json").write_text(json.dumps({"run_id": "mine"}))
    assert ckpt.resolve_checkpoint(out)[0] == out / "checkpoints" / "step_00000004"


def test_pruning_never_removes_another_runs_checkpoint(tmp_path: Path, corpus: Path) -> None:
    out, elsewhere = tmp_path / "run", tmp_path / "other"
    train(elsewhere, corpus, steps=2)
    (out / "checkpoints").mkdir(parents=True)
    for step in (7, 8):  # another run's, with higher steps than this run will reach
        path = out / "checkpoints" / f"step_{step:08d}"
        path.mkdir()
        (path / "meta.json").write_text(json.dumps({"run_id": "theirs", "step": step}))
    with pytest.raises(ConfigError, match=r"resume_from takes .* into an output_dir of its own: choose an empty one"):
        train(out, corpus, steps=4, resume_from=str(elsewhere))
    assert steps_in(out) == ["step_00000007", "step_00000008"]


def test_resume_from_takes_another_runs_checkpoint_and_a_restart_resumes_its_own(tmp_path: Path, corpus: Path) -> None:
    theirs, mine = tmp_path / "theirs", tmp_path / "mine"
    train(theirs, corpus, steps=2)
    taken = train(mine, corpus, steps=4, resume_from=str(theirs))
    assert taken.resumed_from == theirs / "checkpoints" / "step_00000002" and taken.workers[0].step == 4
    assert steps_in(mine) == ["step_00000004"] and steps_in(theirs) == ["step_00000002"]
    again = train(mine, corpus, steps=6, resume_from=str(theirs))  # the same command, restarted
    assert again.resumed_from == mine / "checkpoints" / "step_00000004" and again.workers[0].step == 6


def test_the_cli_refuses_another_runs_checkpoints_in_one_line(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "run"
    train(out, corpus, steps=2)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPECDEC_RUN_DIR", None)
    cmd = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--output-dir", str(out)]
    cmd += ["--set", f"data={corpus}", "--set", "resume=false", "--set", "torch_threads=1"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO, timeout=120, check=False)
    assert done.returncode == 2, done.stderr[-3000:]
    assert done.stderr.startswith(f"specdec-train: config error: output_dir: {out} holds the checkpoints of a run")
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert steps_in(out) == ["step_00000002"]


def test_a_second_trainer_in_a_running_trainers_output_dir_is_refused_and_may_start_once_it_ended(
    tmp_path: Path, corpus: Path
) -> None:
    """Two trainers in one output_dir at once: the second one claimed, resumed or pruned what the first was still
    writing (same identity and resume = true: it resumed the first's newest checkpoint; before any checkpoint: a
    second run id beside the first). Now it is refused in one line naming the first's pid, and starts once the first
    has ended. The refused one writes nothing into the first's events.jsonl (it wrote its stages and a failed
    run_end there, which anything reading that file took for the running trainer's end)."""
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPECDEC_RUN_DIR", None)
    base = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--output-dir", str(out)]
    base += ["--set", f"data={corpus}", "--set", "eval_holdout=32", "--set", "torch_threads=1"]
    first = subprocess.Popen(
        [*base, "--set", "steps=100000", "--set", "step_delay_s=0.2"],
        env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while ckpt.read_marker(out) is None:  # run.json: it holds the directory and has claimed it
            assert first.poll() is None and time.monotonic() < deadline, first.stderr.read() if first.stderr else ""
            time.sleep(0.2)
        events_before = (out / "events.jsonl").read_bytes()
        second = subprocess.run([*base, "--set", "steps=1"], capture_output=True, text=True, env=env, cwd=REPO,
                                timeout=120, check=False)  # fmt: skip
        assert second.returncode == 2, second.stderr[-3000:]
        assert second.stderr == (
            f"specdec-train: config error: output_dir: {out} is in use by a running trainer (pid {first.pid}): wait "
            "for it to end or stop it, or choose another output_dir\n"
        )
        assert first.poll() is None  # the first goes on
        events_after = (out / "events.jsonl").read_bytes()
        assert events_after.startswith(events_before)
        assert b"in use by a running trainer" not in events_after
        assert all(json.loads(line).get("kind") != "run_end" for line in events_after.splitlines() if line.strip())
    finally:
        first.terminate()
        first.wait(timeout=60)
    third = subprocess.run([*base, "--set", "steps=1", "--set", "resume=true"], capture_output=True, text=True,
                           env=env, cwd=REPO, timeout=180, check=False)  # fmt: skip
    assert third.returncode == 0, third.stderr[-3000:]


def test_an_output_dir_under_home_holds_the_whole_run_and_no_literal_tilde_directory_is_made(tmp_path: Path) -> None:
    """``output_dir = "~/run"`` in a config file: the checkpoints went to $HOME/run but events.jsonl to ./~/run, a
    directory named ``~`` in the working directory (one ``rm -rf ~`` away from a lost home)."""
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    config = tmp_path / "t.toml"
    config.write_text('preset = "cpu-demo"\nsteps = 2\ntorch_threads = 1\noutput_dir = "~/tilde-run"\n')
    env = {**os.environ, "PYTHONPATH": str(REPO), "HOME": str(home)}
    for key in ("SPECDEC_RUN_DIR", "SPECDEC_EVENTS"):
        env.pop(key, None)
    cmd = [sys.executable, "-m", "engine.trainer", "--config", str(config)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=cwd, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    run = home / "tilde-run"
    kinds = [json.loads(line)["kind"] for line in (run / "events.jsonl").read_text().splitlines()]
    assert "run_end" in kinds and "step" in kinds
    assert (run / "checkpoints" / "step_00000002" / "meta.json").exists()
    assert list(cwd.iterdir()) == []


def test_an_output_dir_that_cannot_be_a_directory_is_refused_in_one_line(tmp_path: Path) -> None:
    """A regular file where the output directory should be, or under its path: exit 2, one line, not a traceback."""
    afile = tmp_path / "afile"
    afile.write_text("keep me\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for key in ("SPECDEC_RUN_DIR", "SPECDEC_EVENTS"):
        env.pop(key, None)
    for out, why in ((afile, "File exists"), (afile / "sub", "Not a directory")):
        cmd = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--output-dir", str(out)]
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120, check=False)
        assert done.returncode == 2, done.stderr[-3000:]
        assert done.stderr == f"specdec-train: config error: output_dir: {out} cannot be made a directory ({why})\n"
    assert afile.read_text() == "keep me\n"


def test_a_filesystem_without_locks_leaves_the_output_dir_unguarded_not_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.trainer.run import dir_hold

    def no_locks(_fd: int, _op: int) -> None:
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(dir_hold.fcntl, "lockf", no_locks)
    hold = dir_hold.hold_output_dir(tmp_path / "run")  # no ConfigError: nothing else holds it
    hold.close()

    def held(_fd: int, _op: int) -> None:
        raise OSError(errno.EAGAIN, "Resource temporarily unavailable")

    monkeypatch.setattr(dir_hold.fcntl, "lockf", held)
    with pytest.raises(ConfigError, match="is in use by a running trainer"):
        dir_hold.hold_output_dir(tmp_path / "run")


def test_a_link_or_fifo_planted_as_the_lock_is_refused_and_the_links_target_left_alone(tmp_path: Path) -> None:
    from engine.trainer.run import dir_hold

    out = tmp_path / "run"
    out.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("keep me\n")
    (out / dir_hold.RUN_LOCK).symlink_to(target)
    with pytest.raises(ConfigError, match=r"\.run\.lock cannot be the run's lock \(.*\): remove it"):
        dir_hold.hold_output_dir(out)
    assert target.read_text() == "keep me\n"
    (out / dir_hold.RUN_LOCK).unlink()
    os.mkfifo(out / dir_hold.RUN_LOCK)
    with pytest.raises(ConfigError, match=r"cannot be the run's lock \(not a regular file\): remove it"):
        dir_hold.hold_output_dir(out)


# --- 6. a resume keeps the data plan, or re-plans on purpose ------------------------------------------------------


@pytest.mark.parametrize(
    "changes,differ",
    [
        ({"batch_size": 4}, "batch_size: 2 there, 4 here"),
        ({"seed": 5}, "seed: 0 there, 5 here"),
        ({"buckets": [128, 256]}, "buckets: [256] there, [128, 256] here"),
        ({"packing": True}, "packing: false there, true here"),
        ({"eval_holdout": 30}, "eval_holdout: 32 there, 30 here"),
    ],
    ids=["batch_size", "seed", "buckets", "packing", "eval_holdout"],
)
def test_a_resume_under_another_data_plan_is_refused_naming_the_keys(
    tmp_path: Path, corpus: Path, changes: dict[str, Any], differ: str
) -> None:
    out = tmp_path / "run"
    train(out, corpus, steps=2)
    with pytest.raises(ConfigError) as err:
        train(out, corpus, steps=4, **changes)
    assert str(err.value).startswith(f"data plan: step_00000002 was trained under another data plan ({differ}), ")
    assert "set replan_data = true" in str(err.value)


def test_a_resume_on_another_data_file_at_the_same_path_is_refused(tmp_path: Path, corpus: Path) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_bytes(corpus.read_bytes())
    out = tmp_path / "run"
    train(out, data, steps=2)
    lines = corpus.read_text().splitlines()
    data.write_text("\n".join([lines[-1], *lines[:-1]]) + "\n")  # the same conversations, another order
    with pytest.raises(ConfigError, match=r"^data plan: step_00000002 was trained under another data plan \(data: "):
        train(out, data, steps=4)


def test_replan_data_starts_the_checkpoints_epoch_over_under_the_new_plan(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "run"
    first = train(out, corpus, steps=6)  # 4 batches of 2 an epoch: step 6 is halfway through epoch 1
    assert first.workers[0].links.ledger.watermark == 6
    engine, rec = build(
        make_config(out, corpus, steps=7, eval_holdout=32, batch_size=4, replan_data=True), out
    )  # 2 batches of 4 an epoch: epoch 1 starts at batch 2
    assert engine.resumed_from == out / "checkpoints" / "step_00000006" and engine.workers[0].step == 6
    assert engine.workers[0].links.ledger.watermark == 2
    said = [e["detail"] for e in rec.of("stage") if "re-planned" in e.get("detail", "")]
    assert said == [
        "data plan changed (batch_size: 2 there, 4 here): re-planned from the start of the checkpoint's epoch"
    ]
    assert engine.run() == 0
    assert ckpt.read_meta(out / "checkpoints" / "step_00000007")["data_position"]["replicas"]["watermark"] == 3
