"""Training data the trainer cannot trust: a row that cannot be read is skipped and counted by its reason (never a
crash), a huge row is never held in memory, a data path that is no regular file is refused in one line (never a
hang), and a stop signal while the data loads ends the loading."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.trainer.config import ConfigError, from_dict
from engine.trainer.data.sources import ConversationSource, load_conversations
from engine.trainer.verifier.tiny_tokenizer import build_tiny_tokenizer

REPO = Path(__file__).resolve().parents[4]


def good_row(i: int) -> bytes:
    turns = [{"role": "user", "content": f"question {i}?"}, {"role": "assistant", "content": f"answer {i}."}]
    return json.dumps({"messages": turns}).encode()


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


MAX_ROW_TURNS = 1024  # engine/trainer/data/rows.py (the words below are what the log counts rows under)
BAD_ROWS: dict[str, bytes] = {
    "not UTF-8": good_row(100).replace(b"answer", b"answ\xff\xfer"),
    "JSON nested too deeply": b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a number too long to read": b'{"messages": [], "id": ' + b"7" * 5000 + b"}",
    f"more than {MAX_ROW_TURNS} turns": json.dumps(
        {"messages": [{"role": r, "content": "x"} for _ in range(MAX_ROW_TURNS) for r in ("user", "assistant")]}
    ).encode(),
}
MAX_ROW_BYTES = 1 << 20
ROW_TOO_LONG = "row longer than 1 MiB"


def test_rows_that_cannot_be_read_are_skipped_and_counted_by_reason(tmp_path: Path) -> None:
    """Invalid UTF-8, JSON 100k deep, a 5000-digit integer, too many turns: one each among good rows."""
    lines = [good_row(i) for i in range(8)]
    for n, bad in enumerate(BAD_ROWS.values()):
        lines.insert(2 * n + 1, bad)
    data = write_lines(tmp_path / "d.jsonl", lines)
    src = ConversationSource(build_tiny_tokenizer(), data, buckets=[64], batch_size=2, seed=0)
    assert src.skipped == dict.fromkeys(BAD_ROWS, 1)
    assert src.examples == 8
    assert [w.split(": ", 1)[0] for w in src.bad_lines] == [f"{data}:{2 * n + 2}" for n in range(len(BAD_ROWS))]


def test_strict_data_stops_at_a_row_that_is_not_utf8_naming_its_line(tmp_path: Path) -> None:
    data = write_lines(tmp_path / "d.jsonl", [good_row(0), BAD_ROWS["not UTF-8"], good_row(1)])
    with pytest.raises(ConfigError) as err:
        load_conversations(data, strict=True)
    byte = BAD_ROWS["not UTF-8"].index(b"\xff")
    assert str(err.value) == f"strict_data: {data}:2: not UTF-8 (byte {byte})"


def test_a_row_past_the_size_limit_is_skipped_without_being_held_in_memory(tmp_path: Path) -> None:
    big = json.dumps(
        {"messages": [{"role": "user", "content": "x" * (20 << 20)}, {"role": "assistant", "content": "y"}]}
    )
    data = write_lines(tmp_path / "d.jsonl", [good_row(0), big.encode(), good_row(1)])
    del big
    skipped: Counter[str] = Counter()
    tracemalloc.start()
    try:
        convs = load_conversations(data, skipped)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [c[1]["content"] for c in convs] == ["answer 0.", "answer 1."]
    assert dict(skipped) == {ROW_TOO_LONG: 1}
    assert peak < 3 * MAX_ROW_BYTES, f"{peak / 2**20:.1f} MiB held while reading a 20 MiB row"


def test_a_row_just_under_the_limit_is_kept_and_one_just_over_is_skipped(tmp_path: Path) -> None:
    from engine.trainer.data import rows

    def row_of(size: int) -> bytes:
        head = b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "'
        tail = b'"}]}'
        return head + b"a" * (size - len(head) - len(tail)) + tail

    assert (rows.MAX_ROW_BYTES, rows.SKIP_ROW_TOO_LONG, rows.MAX_ROW_TURNS) == (MAX_ROW_BYTES, ROW_TOO_LONG, 1024)
    limit = rows.MAX_ROW_BYTES
    data = write_lines(tmp_path / "d.jsonl", [row_of(limit), row_of(limit + 1), b"   ", row_of(limit - 1)])
    got = list(rows.read_rows(data))
    assert [(r.lineno, r.size, r.raw is None) for r in got] == [
        (1, limit + 1, False),
        (2, limit + 2, True),
        (4, limit, False),
    ]


@pytest.fixture
def fifo(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "data.fifo"
    os.mkfifo(path)
    yield path


def _train(*args: str, timeout_s: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SPECDEC_RUN_DIR", None)
    return subprocess.run(
        [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", *args],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=timeout_s, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("kind", ["fifo", "char-device", "directory", "empty", "missing"])
def test_a_data_path_that_is_no_regular_file_exits_2_in_one_line_before_torch_loads(
    kind: str, tmp_path: Path, fifo: Path
) -> None:
    path, words = {
        "fifo": (fifo, "is a FIFO (named pipe), not a regular file of JSON lines"),
        "char-device": (Path("/dev/zero"), "is a character device, not a regular file of JSON lines"),
        "directory": (tmp_path, "is a directory, not a regular file of JSON lines"),
        "empty": (tmp_path / "empty.jsonl", "is empty: no conversations to read"),
        "missing": (tmp_path / "missing.jsonl", "does not exist"),
    }[kind]
    if kind == "empty":
        path.write_bytes(b"")
    t0 = time.monotonic()
    done = _train("--set", f"data={path}", "--set", f"output_dir={tmp_path / 'out'}")
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr == f"specdec-train: config error: data: {path} {words}\n"
    assert time.monotonic() - t0 < 10


def test_opening_a_fifo_as_data_is_refused_at_once_not_waiting_for_a_writer(fifo: Path) -> None:
    """The second line of defence, where the path became a FIFO after the check: the open never blocks."""
    from engine.trainer.data import rows

    with pytest.raises(ConfigError, match=r"is a FIFO \(named pipe\), not a regular file"):
        list(rows.read_rows(fifo))


def test_a_stop_signal_while_the_data_is_tokenized_ends_the_loading(tmp_path: Path) -> None:
    from engine.trainer.data.rows import LoadingStopped
    from engine.trainer.run.loop import TrainingRun
    from engine.trainer.threads.metrics import EventLog

    data = write_lines(tmp_path / "d.jsonl", [good_row(i) for i in range(200)])
    cfg = from_dict({"data": str(data), "buckets": [64], "batch_size": 2, "output_dir": str(tmp_path / "out")})
    events = EventLog(tmp_path / "events.jsonl", stdout=open(os.devnull, "w"))  # noqa: SIM115
    stages: list[str] = []

    def on_event(ev: dict[str, Any]) -> None:
        if ev["kind"] == "stage" and ev["stage"] == "data":
            stages.append(ev["detail"])
            if ev["detail"].startswith("tokenized 10%"):
                os.kill(os.getpid(), signal.SIGTERM)  # as `stop` does; the handler only notes it

    events.listeners.append(on_event)
    engine = TrainingRun(cfg, events)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    engine.install_signal_handlers()
    try:
        with pytest.raises(LoadingStopped, match=r"^stopped \(SIGTERM\) while tokenizing "):
            engine.build()
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert [s for s in stages if s.startswith("tokenized")] == ["tokenized 10% (17/168 conversations)"]


def test_sigterm_while_the_data_is_tokenized_ends_the_trainer_at_once_with_exit_0(tmp_path: Path) -> None:
    from support.waiting import wait_until

    from engine.trainer.data.sources import shipped_corpus_path

    data = tmp_path / "chat.jsonl"
    data.write_bytes(shipped_corpus_path().read_bytes() * 4)  # 6000 conversations: seconds of tokenizing
    out, events = tmp_path / "out", tmp_path / "events.jsonl"
    env = {**os.environ, "PYTHONPATH": str(REPO), "SPECDEC_EVENTS": str(events)}
    env.pop("SPECDEC_RUN_DIR", None)
    cmd = [sys.executable, "-m", "engine.trainer", "--preset", "cpu-demo", "--output-dir", str(out)]
    cmd += ["--set", f"data={data}", "--set", "torch_threads=1"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def read() -> list[dict[str, Any]]:
        text = events.read_text() if events.exists() else ""
        return [json.loads(line) for line in text.splitlines() if line.strip()]

    try:
        wait_until(
            lambda: any(e.get("detail", "").startswith("tokenized ") for e in read()) or proc.poll() is not None,
            120,
            "the first tokenizing progress line",
        )
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    evs = read()
    (end,) = [e for e in evs if e["kind"] == "run_end"]
    assert end["ok"] is True and end["reason"] == f"stopped (SIGTERM) while tokenizing {data}"
    assert not any(e["kind"] == "step" for e in evs)
    assert not any(e.get("detail", "").startswith("tokenized 100%") for e in evs)
