"""The log model never doubles or drops a line; the chart model never doubles a point."""

from __future__ import annotations

import pytest

from engine.protocol import decode_engine_event, encode_log_data
from tui.dashboard.widgets.charts import ChartModel, parse_log_metrics, sparkline
from tui.dashboard.widgets.log_tail import LogModel, clean_line, is_error_line


def feed(model: LogModel, offset: int, data: bytes, inode: int = 7) -> int:
    return model.feed(offset, inode, encode_log_data(data))


def test_resent_chunk_after_reconnect_is_not_doubled() -> None:
    model = LogModel()
    assert feed(model, 0, b"a\nb\nc") == 2
    # the resumed stream starts over from an older offset, overlapping what we have
    assert feed(model, 2, b"b\nc\nd\n") == 2
    assert feed(model, 0, b"a\n") == 0
    assert list(model.lines) == ["a", "b", "c", "d"]
    assert model.next_offset == 8
    assert model.duplicate_bytes == 3 + 2


def test_gap_in_offsets_is_marked_not_hidden() -> None:
    model = LogModel()
    feed(model, 0, b"one\n")
    feed(model, 10, b"two\n")
    assert model.gap_bytes == 6
    assert model.lines[0] == "one"
    assert "6 bytes not received" in list(model.lines)[1]
    assert list(model.lines)[2] == "two"


def test_ansi_stripped_and_carriage_return_progress_collapsed() -> None:
    assert clean_line("\x1b[31mred\x1b[0m text") == "red text"
    assert clean_line(" 10%|#   |\r 50%|##  |\r100%|####|") == "100%|####|"
    assert clean_line("crlf line\r") == "crlf line"
    model = LogModel()
    feed(model, 0, b"\x1b[1mbold\x1b[0m\n 1/3\r 2/3\r 3/3\n")
    assert list(model.lines) == ["bold", " 3/3"]


def test_invalid_utf8_survives() -> None:
    model = LogModel()
    feed(model, 0, b"bad \xff byte\n")
    assert list(model.lines) == ["bad \ufffd byte"]


def test_bounded_memory_counts_every_line() -> None:
    model = LogModel(max_lines=100)
    offset = 0
    for i in range(1000):
        data = f"line {i}\n".encode()
        feed(model, offset, data)
        offset += len(data)
    assert len(model.lines) == 100
    assert model.total_lines == 1000
    assert list(model.lines)[-1] == "line 999"
    assert len(model.take_unflushed()) == 100
    assert model.unflushed_overflow == 900


def test_log_reset_starts_a_new_file() -> None:
    model = LogModel()
    feed(model, 0, b"old run\n", inode=1)
    model.reset(2, 0, "created")
    feed(model, 0, b"new run\n", inode=2)
    assert list(model.lines) == ["old run", "── log created: following from byte 0 ──", "new run"]


def test_error_lines_recognised() -> None:
    for line in (
        "Traceback (most recent call last):",
        "RuntimeError: CUDA error: out of memory",
        "ValueError: boom",
        "step=3 loss=nan",
        "Exception in thread drafter-1",
        "loss NaN at step 4",
    ):
        assert is_error_line(line), line
    for line in ("step=3 loss=2.1", "loading target", "errors=0 handled"):
        assert not is_error_line(line), line


def test_foreign_log_metrics_parsed() -> None:
    assert parse_log_metrics("step=12 loss=2.5 13.2k tok/s") == {"step": 12.0, "loss": 2.5, "tok/s": 13200.0}
    assert parse_log_metrics("epoch 1 tok/s=900 loss: 1e-3") == {"tok/s": 900.0, "loss": 0.001}
    assert parse_log_metrics("hello") == {}


def test_engine_events_deduplicated_by_offset() -> None:
    model = ChartModel()
    ev = {"kind": "step", "thread": "drafter-0", "t": 1.0, "step": 1, "tok_s": 10.0, "loss": [2.0], "acc": [0.5]}
    assert model.add_engine_event(100, decode_engine_event(ev))
    assert not model.add_engine_event(100, decode_engine_event(ev))  # the same line again after a resume
    assert not model.add_engine_event(50, decode_engine_event(ev))
    assert model.add_engine_event(200, decode_engine_event({**ev, "step": 2}))
    assert model.series[("step", "drafter-0")].values() == [1.0, 2.0]
    assert model.duplicate_events == 2


def test_engine_loss_series_is_the_loss_its_log_line_prints() -> None:
    """The chart's loss and the engine log line's loss= are one number (the weighted total trained on)."""
    from engine.trainer.metrics import step_line, weighted_total

    per_position = [2.0, 3.0, 4.0]
    model = ChartModel()
    ev = {"kind": "step", "thread": "drafter0", "t": 1.0, "step": 7, "tok_s": 10.0, "acc": [0.5, 0.4, 0.3]}
    step = decode_engine_event({**ev, "loss": per_position, "loss_total": weighted_total(per_position)})
    model.add_engine_event(100, step)
    drawn = model.series[("loss", "drafter0")].values()[-1]
    assert drawn == pytest.approx(2.0 + 0.8 * 3.0 + 0.64 * 4.0)
    logged = parse_log_metrics(step_line("drafter0", 7, per_position, [0.5, 0.4, 0.3], 10.0))["loss"]
    assert logged == pytest.approx(drawn, abs=1e-4)
    # An engine without loss_total (older events files): the first position's loss, as before.
    model.add_engine_event(200, decode_engine_event({**ev, "step": 8, "loss": per_position}))
    assert model.series[("loss", "drafter0")].values()[-1] == 2.0


def test_sparkline_scales() -> None:
    assert sparkline([0, 1, 2, 3, 4, 5, 6, 7], 8) == "▁▂▃▄▅▆▇█"
    assert sparkline([3, 3, 3], 10) == "▄▄▄"
    assert sparkline([], 5) == ""
