"""`specdec-train regenerate` and the files it reads and writes: it never writes over its input, a row it cannot
use (unreadable, huge, refused by the chat template) is counted and the run goes on (a resume too), a progress
file that does not agree with the output is refused naming the key, and a conversation is kept up to the last
turn that fits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from test_regenerate import GOOD, settings, target_dir, write_rows  # same folder

from engine.trainer.config import PRESETS, TrainerConfig
from engine.trainer.verifier import regenerate as regen
from engine.trainer.verifier.tiny_tokenizer import CHAT_TEMPLATE

__all__ = ["target_dir"]  # a fixture of test_regenerate, used here too
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

REPO = Path(__file__).resolve().parents[4]
PLAIN = [GOOD[1], GOOD[2], GOOD[1]]  # user, assistant: what a template with strict alternation takes
BAD_UTF8 = json.dumps(GOOD[1]).encode().replace(b"colour", b"col\xffur")
DEEP_JSON = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
HUGE_NUMBER = b'{"messages": [{"role": "user", "content": "x"}], "n": ' + b"7" * 5000 + b"}"
# Mistral's template raises unless the roles alternate user/assistant from the first message.
ALTERNATING = (
    "{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}{% endfor %}" + CHAT_TEMPLATE
)


def u(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def a(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def write_lines(path: Path, rows: list[object]) -> Path:
    lines = [r if isinstance(r, bytes) else json.dumps(r).encode() for r in rows]
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


def replier(target: Path, source: Path, max_length: int = 200, template: str | None = None) -> regen.Replier:
    model, tok = regen.load_model(str(target), torch.device("cpu"))
    if template is not None:
        tok.chat_template = template
    base = settings(source, target)
    return regen.Replier(
        model, tok, torch.device("cpu"), regen.Settings(**{**base.as_dict(), "max_length": max_length})
    )


def quiet(_line: str) -> None:
    pass


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "engine.trainer", "regenerate", *args, "--threads", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, cwd=REPO, check=False)


# --- 3. the output never writes over the input -------------------------------------------------------------------


@pytest.mark.parametrize("how", ["same-path", "relative-path", "symlink", "hardlink"])
def test_out_naming_the_data_file_or_a_link_to_it_exits_2_and_leaves_the_data_intact(
    target_dir: Path, tmp_path: Path, how: str
) -> None:
    data = write_rows(tmp_path / "chat.jsonl", GOOD)
    before = data.read_bytes()
    out = {
        "same-path": data,
        "relative-path": Path(os.path.relpath(data, REPO)),
        "symlink": tmp_path / "link.jsonl",
        "hardlink": tmp_path / "hard.jsonl",
    }[how]
    if how == "symlink":
        out.symlink_to(data)
    elif how == "hardlink":
        os.link(data, out)
    done = run_cli("--target", str(target_dir), "--data", str(data), "--out", str(out))
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == (
        f"specdec-train regenerate: --out {out} is the --data file {data}: it would write over its input\n"
    )
    assert data.read_bytes() == before


def test_an_existing_file_that_is_no_regenerate_output_is_not_written_over_without_restart(
    target_dir: Path, tmp_path: Path
) -> None:
    source = write_rows(tmp_path / "in.jsonl", GOOD)
    out = tmp_path / "precious.jsonl"
    out.write_text("someone else's rows\n")
    r = replier(target_dir, source)
    with pytest.raises(ValueError, match=r"holds 20 bytes and has no precious.jsonl.progress.json"):
        regen.regenerate(r, source, out, batch_size=2, restart=False, say=quiet)
    assert out.read_text() == "someone else's rows\n"
    regen.regenerate(r, source, out, batch_size=2, restart=True, say=quiet)
    assert len(out.read_text().splitlines()) == 3


# --- 4. bad rows are counted, and the run (and a resume) goes on -------------------------------------------------


def test_unreadable_rows_and_template_errors_are_counted_and_the_rows_after_them_regenerated(
    target_dir: Path, tmp_path: Path
) -> None:
    refused_at_turn_0 = {"messages": [u("one"), u("two"), a("reply")]}
    refused_at_turn_1 = {"messages": [u("hi"), a("hello"), u("and"), u("again"), a("bye")]}
    rows = [PLAIN[0], BAD_UTF8, DEEP_JSON, PLAIN[1], HUGE_NUMBER, refused_at_turn_0, refused_at_turn_1, PLAIN[2]]
    source = write_lines(tmp_path / "in.jsonl", rows)
    out = tmp_path / "out.jsonl"
    progress = regen.regenerate(
        replier(target_dir, source, template=ALTERNATING), source, out, batch_size=3, restart=False, say=quiet
    )
    assert dict(progress.skipped) == {
        "not UTF-8": 1, "JSON nested too deeply": 1, "a number too long to read": 1, "chat template error": 1,
    }  # fmt: skip
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["source_line"] for w in written] == [1, 4, 7, 8]
    kept = written[2]["messages"]  # turn 1's prompt breaks the alternation: turn 0, regenerated, is kept
    assert [m["role"] for m in kept] == ["user", "assistant"] and kept[0]["content"] == "hi"
    assert progress.notes[regen.NOTE_KEPT_BEFORE_TEMPLATE] == 1


class Interrupted(Exception):
    pass


def test_a_resume_goes_past_the_row_that_stopped_nothing(target_dir: Path, tmp_path: Path) -> None:
    """A row nested 100k deep in the second batch: the first run stops after batch 1 (as a kill would), the
    resume goes through the bad row, counts it once and writes every good row once."""
    source = write_lines(tmp_path / "in.jsonl", [PLAIN[0], PLAIN[1], DEEP_JSON, PLAIN[2], PLAIN[0]])
    out = tmp_path / "out.jsonl"
    r = replier(target_dir, source)

    def stop_after_first_batch(line: str) -> None:
        raise Interrupted(line)

    with pytest.raises(Interrupted, match=r"^2/5 rows"):
        regen.regenerate(r, source, out, batch_size=2, restart=False, say=stop_after_first_batch)
    progress = regen.regenerate(r, source, out, batch_size=2, restart=False, say=quiet)
    assert dict(progress.skipped) == {"JSON nested too deeply": 1}
    assert [json.loads(line)["source_line"] for line in out.read_text().splitlines()] == [1, 2, 4, 5]


# --- 2. a huge row is never tokenized ----------------------------------------------------------------------------


def test_a_row_past_the_size_limit_is_skipped_without_reaching_the_tokenizer(
    target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    huge = {"messages": [u("x" * (1 << 20)), a("y")]}
    source = write_lines(tmp_path / "in.jsonl", [PLAIN[0], huge, PLAIN[1]])
    r = replier(target_dir, source)
    longest: list[int] = []
    original = regen.Replier.prompt

    def measured(self: regen.Replier, messages: list[dict[str, str]]) -> list[int]:
        longest.append(max(len(m["content"]) for m in messages))
        return original(self, messages)

    monkeypatch.setattr(regen.Replier, "prompt", measured)
    progress = regen.regenerate(r, source, tmp_path / "out.jsonl", batch_size=4, restart=False, say=quiet)
    assert dict(progress.skipped) == {"row longer than 1 MiB": 1} and progress.written == 2
    assert max(longest) < 100


# --- 5. the progress file is checked against the output before a resume ------------------------------------------


@pytest.fixture
def half_done(target_dir: Path, tmp_path: Path) -> Iterator[tuple[regen.Replier, Path, Path, Path]]:
    """A run of 6 rows stopped after its first batch of 2: (replier, source, out, progress file)."""
    source = write_lines(tmp_path / "in.jsonl", [*PLAIN, *PLAIN])
    out = tmp_path / "out.jsonl"
    r = replier(target_dir, source)

    def stop(line: str) -> None:
        raise Interrupted(line)

    with pytest.raises(Interrupted):
        regen.regenerate(r, source, out, batch_size=2, restart=False, say=stop)
    yield r, source, out, out.with_name(out.name + regen.PROGRESS_SUFFIX)


def tamper(marker: Path, **changes: Any) -> None:
    data = json.loads(marker.read_text())
    data.update(changes)
    marker.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"output_bytes": 10 << 30}, r"output_bytes: 10737418240, but .*out\.jsonl holds \d+ bytes"),
        ({"rows_done": 0, "written": 0}, r"written: 0, but the first \d+ bytes of .*out\.jsonl hold 2"),
        ({"rows_done": 0}, r"rows_done: 0, but 2 written and 0 skipped make 2"),
        ({"rows_done": 99, "written": 99}, r"rows_done: 99, but the source has 6 rows"),
        ({"output_bytes": 7}, r"output_bytes: 7 is not at the end of a row of .*out\.jsonl"),
        ({"rows_done": "2"}, r"rows_done: expected an integer >= 0, got \"2\""),
        ({"skipped": {"not JSON": -1}}, r"skipped: expected counts by reason \(integers >= 0\)"),
        ({"settings": None}, r"settings: missing, or not a table of settings"),
    ],
    ids=[
        "sparse-10-GiB",
        "rows-and-written-reset",
        "rows-reset",
        "rows-past-the-source",
        "mid-row",
        "string",
        "negative-count",
        "no-settings",
    ],
)
def test_a_tampered_progress_file_is_refused_naming_the_key_and_the_output_is_left_alone(
    half_done: tuple[regen.Replier, Path, Path, Path], changes: dict[str, Any], message: str
) -> None:
    r, source, out, marker = half_done
    tamper(marker, **changes)
    before = out.read_bytes()
    with pytest.raises(ValueError, match=rf"^{marker}: {message}; --restart to start over$"):
        regen.regenerate(r, source, out, batch_size=2, restart=False, say=quiet)
    assert out.read_bytes() == before and os.stat(out).st_blocks * 512 < 1 << 20


def test_a_resume_with_another_batch_size_is_refused(half_done: tuple[regen.Replier, Path, Path, Path]) -> None:
    """The batches' boundaries decide their sampling seeds: another batch size would not redo what was done."""
    r, source, out, _ = half_done
    with pytest.raises(ValueError, match=r"was started with other settings \(batch_size\); --restart"):
        regen.regenerate(r, source, out, batch_size=3, restart=False, say=quiet)
    progress = regen.regenerate(r, source, out, batch_size=2, restart=False, say=quiet)
    assert progress.written == 6 and len(out.read_text().splitlines()) == 6


def test_a_resume_from_another_file_at_the_same_path_is_refused_naming_source_sha256(
    half_done: tuple[regen.Replier, Path, Path, Path],
) -> None:
    """As many rows, another dataset: continuing would mix two datasets in one output."""
    r, source, out, _ = half_done
    before = out.read_bytes()
    write_lines(source, [GOOD[2], GOOD[1], GOOD[2]] * 2)  # six rows, other conversations
    with pytest.raises(ValueError, match=r"was started with other settings \(source_sha256\); --restart"):
        regen.regenerate(r, source, out, batch_size=2, restart=False, say=quiet)
    assert out.read_bytes() == before


def test_each_batch_is_on_disk_before_the_progress_file_counts_it(
    target_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = write_lines(tmp_path / "in.jsonl", [*PLAIN, *PLAIN])
    out = tmp_path / "out.jsonl"
    seen: list[tuple[str, int]] = []
    fsync, save = os.fsync, regen.save_progress

    def synced(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")) == out:
            seen.append(("fsync", os.fstat(fd).st_size))
        fsync(fd)

    def saved(path: Path, progress: regen.Progress) -> None:
        seen.append(("progress", progress.output_bytes))
        save(path, progress)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(regen, "save_progress", saved)
    regen.regenerate(replier(target_dir, source), source, out, batch_size=2, restart=False, say=quiet)
    assert [kind for kind, _ in seen] == ["fsync", "progress"] * 3  # one fsync a batch, before its progress
    assert all(seen[i][1] == seen[i + 1][1] for i in range(0, 6, 2))  # what was synced is what is claimed


def test_the_cli_refuses_a_tampered_progress_file_in_one_line(
    half_done: tuple[regen.Replier, Path, Path, Path], target_dir: Path
) -> None:
    _, source, out, marker = half_done
    tamper(marker, output_bytes=10 << 30)
    same = ["--seed", "7", "--max-new-tokens", "6", "--max-length", "200", "--batch-size", "2"]  # as half_done's
    done = run_cli("--target", str(target_dir), "--data", str(source), "--out", str(out), *same)
    assert done.returncode == 2, done.stderr[-2000:]
    line = done.stderr.splitlines()[-1]
    assert line.startswith(f"specdec-train regenerate: {marker}: output_bytes: {10 << 30}, but {out} holds ")
    assert "Traceback" not in done.stderr
    assert out.stat().st_size < 1 << 20


# --- 9. regenerate's limits ------------------------------------------------------------------------------------


def test_the_default_reply_length_covers_the_longest_training_bucket() -> None:
    args = regen.parse_args(["--target", "tiny-trained", "--out", "o.jsonl"])
    longest = max([*TrainerConfig().buckets, *(b for p in PRESETS.values() for b in p.get("buckets", []))])
    assert args.max_new_tokens >= longest
    assert args.max_length >= args.max_new_tokens + longest  # a prompt as long as a bucket still fits


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("--temperature", "nan", "--temperature must be a number >= 0"),  # it ran greedy, saying "temperature nan"
        ("--temperature", "inf", "--temperature must be a number >= 0"),
        ("--temperature", "-1", "--temperature must be a number >= 0"),
        ("--device", "foo", "--device foo: not a device (cpu, cuda, cuda:N)"),
        (
            "--target",
            "/nonexistent",
            "--target '/nonexistent' is neither a built-in preset (tiny, llama3-8b-shape, "
            "tiny-trained) nor a local directory",
        ),
    ],
)
def test_settings_it_cannot_use_exit_2_before_anything_loads(
    option: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        regen.parse_args(["--target", "tiny-trained", "--out", "o.jsonl", option, value])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(f"error: {message}")


def test_a_conversation_is_kept_up_to_the_last_turn_that_fits(target_dir: Path, tmp_path: Path) -> None:
    long_turn = {"messages": [u("short"), a("first"), u("word " * 60), a("second"), u("more"), a("third")]}
    source = write_lines(tmp_path / "in.jsonl", [PLAIN[0], long_turn, {"messages": [u("word " * 60), a("x")]}])
    out = tmp_path / "out.jsonl"
    progress = regen.regenerate(
        replier(target_dir, source, max_length=120), source, out, batch_size=4, restart=False, say=quiet
    )
    written = [json.loads(line) for line in out.read_text().splitlines()]
    assert [w["source_line"] for w in written] == [1, 2]
    kept = written[1]["messages"]
    assert [m["role"] for m in kept] == ["user", "assistant"] and kept[0]["content"] == "short"
    assert dict(progress.skipped) == {regen.SKIP_TOO_LONG: 1}  # too long at its first turn: nothing to keep
    assert progress.notes[regen.NOTE_KEPT_BEFORE_LONG] == 1
