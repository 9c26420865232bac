"""The one reader of appended files: offset, identity, the carried partial line, the bounded last lines."""

from __future__ import annotations

import os
from pathlib import Path

from engine.host.appended import AppendedFile, last_lines, split_lines
from engine.supervisor import records


def test_a_partial_line_is_carried_until_its_end_arrives(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    p.write_bytes(b'{"a": 1}\n{"b"')
    f = AppendedFile(p)
    st, reset = f.check()
    assert st is not None and reset is None
    start, complete = f.take_complete(f.read_path(1024))
    assert (start, complete, f.carry, f.offset, f.position) == (0, b'{"a": 1}\n', b'{"b"', 9, 13)
    with open(p, "ab") as fh:
        fh.write(b": 2}\n")
    f.check()
    assert split_lines(*f.take_complete(f.read_path(1024))) == [(18, b'{"b": 2}')]
    assert f.carry == b"" and f.offset == 18


def test_a_file_renamed_over_the_path_or_truncated_is_read_again_from_its_start(tmp_path: Path) -> None:
    p = tmp_path / "output.log"
    p.write_bytes(b"one\ntwo\n")
    f = AppendedFile(p)
    f.check()
    f.take_complete(f.read_path(1024))
    new = tmp_path / "new.log"
    new.write_bytes(b"three\n")
    os.replace(new, p)
    assert f.check()[1] == "rotated" and f.position == 0
    assert f.take_complete(f.read_path(1024)) == (0, b"three\n")
    p.write_bytes(b"x")  # same inode, shorter than what was read
    assert f.check()[1] == "truncated" and f.position == 0


def test_last_lines_marks_a_first_line_cut_by_its_window_and_the_run_report_drops_it(tmp_path: Path) -> None:
    p = tmp_path / "output.log"
    p.write_bytes(b"a" * 100 + b"\nsecond\r\nthird")
    tail = last_lines(p, 5, block_bytes=16, max_bytes=20)
    assert tail.starts_mid_line and tail.window_cut and tail.partial
    assert tail.lines == [b"aaaaaa", b"second\r", b"third"]  # 20 bytes back: the end of the first line
    assert records.last_lines(p, 5, max_bytes=20) == ["second", "third"]
    assert records.last_lines(tmp_path / "missing.log") == []


def test_skip_to_hands_out_lines_again_from_the_first_that_starts_at_or_after_the_offset(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    p.write_bytes(b"aaaa\nbbbb\ncccc\ndddd\n")  # lines start at 0, 5, 10, 15
    for offset, first, skipped in ((7, b"cccc", 10), (10, b"cccc", 10), (11, b"dddd", 15)):
        f = AppendedFile(p)
        f.take_complete(f.read_path(3))  # "aaa" carried: dropped with the skip
        f.skip_to(offset)
        start, complete = f.take_complete(f.read_path(1024))
        assert split_lines(start, complete)[0] == (start + len(first) + 1, first)
        assert (start, f.skipped_bytes) == (skipped, skipped)


def test_a_skip_into_a_line_without_end_drops_it_until_its_end_arrives(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    p.write_bytes(b"ok\n" + b"x" * 100)
    f = AppendedFile(p)
    f.skip_to(50)
    assert f.take_complete(f.read_path(1024)) == (103, b"") and f.carry == b""
    assert f.skipped_bytes == 103 and f.position == 103  # the skipped first line too
    with open(p, "ab") as fh:
        fh.write(b"x\nnext\n")
    assert f.take_complete(f.read_path(1024)) == (105, b"next\n") and f.skipped_bytes == 105
