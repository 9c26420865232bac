"""Log follow by offset + inode: every case of issue 2 point 4, asserted byte-exact through the wire encoding."""

from __future__ import annotations

import os
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

from support.waiting import wait_until

from engine import protocol
from engine.agent.follow import CHUNK_BYTES, JsonlReader, LogFollower, read_range, tail_lines, tail_start


class Stream:
    """What a client rebuilds from the events: the bytes of each file (by inode) and the resets seen.

    Every event goes through protocol.encode / parse_event, so the check covers the JSON carriage too.
    A ``log`` event must start exactly where the previous one (or the last reset) ended.
    """

    def __init__(self) -> None:
        self.files: dict[int, bytearray] = {}
        self.resets: list[dict[str, Any]] = []
        self.chunks: list[bytes] = []
        self.inode: int | None = None
        self.pos = 0

    def feed(self, events: list[dict[str, Any]]) -> None:
        for raw in events:
            ev = protocol.parse_event(protocol.encode(raw))
            if ev["ev"] == "log_reset":
                self.resets.append(ev)
                self.inode, self.pos = ev["inode"], ev["offset"]
                self.files[ev["inode"]] = bytearray()
                continue
            assert ev["ev"] == "log"
            data = protocol.decode_log_data(ev["data"])
            if self.inode is None:
                self.inode, self.pos = ev["inode"], ev["offset"]
            assert ev["inode"] == self.inode, "data from another file without a log_reset"
            assert ev["offset"] == self.pos, f"gap or repeat: expected offset {self.pos}, got {ev['offset']}"
            self.files.setdefault(ev["inode"], bytearray()).extend(data)
            self.chunks.append(data)
            self.pos += len(data)

    def reasons(self) -> list[str]:
        return [r["reason"] for r in self.resets]


def drain(f: LogFollower, s: Stream) -> None:
    while True:
        s.feed(f.poll())
        if not f.more:
            return


def append(path: Path, data: bytes) -> None:
    with open(path, "ab") as fh:
        fh.write(data)


def test_file_that_does_not_exist_yet_is_followed_once_created(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    s = Stream()
    with LogFollower(log) as f:
        for _ in range(3):
            s.feed(f.poll())
        assert s.chunks == [] and s.resets == []
        append(log, b"first line\n")
        drain(f, s)
        append(log, b"second\n")
        drain(f, s)
    ino = log.stat().st_ino
    assert s.reasons() == ["created"]
    assert s.resets[0]["inode"] == ino and s.resets[0]["offset"] == 0
    assert bytes(s.files[ino]) == b"first line\nsecond\n"


def test_existing_file_is_read_from_the_start_without_a_reset(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"already here\n")
    s = Stream()
    with LogFollower(log) as f:
        drain(f, s)
    assert s.resets == []
    assert bytes(s.files[log.stat().st_ino]) == b"already here\n"


def test_truncation_restarts_at_zero_with_a_reset(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"0123456789\n" * 10)
    s = Stream()
    with LogFollower(log) as f:
        drain(f, s)
        with open(log, "wb") as fh:  # truncate in place, same inode, then write less than before
            fh.write(b"after truncate\n")
        drain(f, s)
        append(log, b"more\n")
        drain(f, s)
    assert s.reasons() == ["truncated"]
    assert s.resets[0]["offset"] == 0
    assert bytes(s.files[log.stat().st_ino]) == b"after truncate\nmore\n"


def test_rotation_finishes_the_old_file_then_follows_the_new_one(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"old 1\n")
    s = Stream()
    with LogFollower(log) as f:
        drain(f, s)
        old_ino = log.stat().st_ino
        append(log, b"old 2, written just before the rename\n")  # not yet read when rotation happens
        log.rename(tmp_path / "output.log.1")
        log.write_bytes(b"new 1\n")
        drain(f, s)
        append(log, b"new 2\n")
        drain(f, s)
    new_ino = log.stat().st_ino
    assert new_ino != old_ino
    assert s.reasons() == ["rotated"]
    assert s.resets[0]["inode"] == new_ino and s.resets[0]["offset"] == 0
    assert bytes(s.files[old_ino]) == b"old 1\nold 2, written just before the rename\n"
    assert bytes(s.files[new_ino]) == b"new 1\nnew 2\n"


def test_removed_file_recreated_later_counts_as_rotation(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"a\n")
    s = Stream()
    with LogFollower(log) as f:
        drain(f, s)
        os.rename(log, tmp_path / "gone")
        s.feed(f.poll())  # path missing: keeps the old file, no event
        assert s.resets == []
        log.write_bytes(b"b\n")
        drain(f, s)
    assert s.reasons() == ["rotated"]
    assert bytes(s.files[log.stat().st_ino]) == b"b\n"


def test_invalid_utf8_is_carried_losslessly(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    payload = b"ok \xff\xfe bad \xc3\x28 cut \xe2\x82 nul \x00 esc \x1b[31m red \xed\xa0\x80 surrogate\n"
    log.write_bytes(payload)
    s = Stream()
    with LogFollower(log) as f:
        drain(f, s)
        append(log, b"\x80\x80 trailing continuation bytes")
        drain(f, s)
    assert bytes(s.files[log.stat().st_ino]) == payload + b"\x80\x80 trailing continuation bytes"


def test_five_megabyte_line_arrives_in_bounded_chunks(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    # Two-byte characters, so a chunk boundary that fell inside one would show as a split character.
    line = ("é" * (5 * 1024 * 1024 // 2)).encode() + b"\n"
    log.write_bytes(b"before\n" + line + b"after\n")
    s = Stream()
    with LogFollower(log) as f:
        drain(f, s)
    assert bytes(s.files[log.stat().st_ino]) == b"before\n" + line + b"after\n"
    assert len(s.chunks) >= 20
    assert max(len(c) for c in s.chunks) <= CHUNK_BYTES
    for chunk in s.chunks:
        chunk.decode("utf-8")  # no chunk ends inside a character


def test_burst_of_100k_lines_is_complete_and_in_order(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    burst = b"".join(b"step=%d loss=%.4f\n" % (i, 1.0 / (i + 1)) for i in range(100_000))
    s = Stream()
    with LogFollower(log) as f:
        s.feed(f.poll())
        append(log, burst)
        drain(f, s)
    got = bytes(s.files[log.stat().st_ino])
    assert got == burst
    assert got.count(b"\n") == 100_000


def test_concurrent_writer_nothing_skipped_or_repeated(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    rng = random.Random(7)
    pieces = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 3000))) for _ in range(400)]
    done = threading.Event()

    def writer() -> None:
        with open(log, "ab", buffering=0) as fh:
            for p in pieces:
                fh.write(p)
        done.set()

    s = Stream()
    with LogFollower(log, chunk_bytes=4096) as f:
        th = threading.Thread(target=writer)
        th.start()
        while not done.is_set():
            s.feed(f.poll())
        th.join()
        drain(f, s)
    assert bytes(s.files[log.stat().st_ino]) == b"".join(pieces)


def test_resume_from_offset_and_inode_continues_exactly(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"line 1\nline 2\n")
    first = Stream()
    with LogFollower(log) as f:
        drain(f, first)
        pos = f.position()
    append(log, b"line 3\n")
    second = Stream()
    with LogFollower(log, offset=pos["offset"], inode=pos["inode"]) as f2:
        drain(f2, second)
    assert second.resets == []
    assert second.chunks and b"".join(second.chunks) == b"line 3\n"
    assert bytes(first.files[log.stat().st_ino]) + b"".join(second.chunks) == log.read_bytes()


def test_resume_with_another_inode_restarts_at_zero_with_a_reset(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"old file\n")
    old_ino = log.stat().st_ino
    log.rename(tmp_path / "output.log.1")
    log.write_bytes(b"new file, longer than the old one\n")
    s = Stream()
    with LogFollower(log, offset=9, inode=old_ino) as f:
        drain(f, s)
    assert s.reasons() == ["rotated"]
    assert s.resets[0]["offset"] == 0 and s.resets[0]["inode"] == log.stat().st_ino
    assert bytes(s.files[log.stat().st_ino]) == b"new file, longer than the old one\n"


def test_resume_past_the_end_is_a_truncation(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    log.write_bytes(b"short\n")
    s = Stream()
    with LogFollower(log, offset=1000, inode=log.stat().st_ino) as f:
        drain(f, s)
    assert s.reasons() == ["truncated"]
    assert bytes(s.files[log.stat().st_ino]) == b"short\n"


def test_follow_loop_emits_until_stopped(tmp_path: Path) -> None:
    log = tmp_path / "output.log"
    got: list[dict[str, Any]] = []
    stop = threading.Event()
    f = LogFollower(log)
    th = threading.Thread(target=f.follow, args=(got.append, stop), kwargs={"interval_s": 0.01})
    th.start()
    try:
        append(log, b"hello\n")
        wait_until(lambda: any(e["ev"] == "log" for e in got), 5, "a log event from the follow loop")
    finally:
        stop.set()
        th.join(5)
        f.close()
    s = Stream()
    s.feed(got)
    assert bytes(s.files[log.stat().st_ino]) == b"hello\n"


def test_jsonl_reader_holds_back_a_partial_line(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    r = JsonlReader(p)
    assert r.poll() == []
    p.write_bytes(b'{"a":1}\n{"b":')
    assert r.poll() == [(8, b'{"a":1}')]
    assert r.poll() == []
    append(p, b"2}\n")
    assert r.poll() == [(16, b'{"b":2}')]
    append(p, b'{"c":3}\n{"d":4}\n')
    assert r.poll() == [(24, b'{"c":3}'), (32, b'{"d":4}')]
    r.close()
    resumed = JsonlReader(p, offset=16)
    assert [line for _, line in resumed.poll()] == [b'{"c":3}', b'{"d":4}']
    resumed.close()


def test_jsonl_reader_restarts_on_truncation_and_rotation(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    p.write_bytes(b'{"n":1}\n{"n":2}\n')
    r = JsonlReader(p)
    assert len(r.poll()) == 2
    p.write_bytes(b'{"n":9}\n')
    assert r.poll() == [(8, b'{"n":9}')] and r.reset == "truncated"
    r.reset = None
    append(p, b'{"n":10}\n')
    p.rename(tmp_path / "old.jsonl")
    p.write_bytes(b'{"m":1}\n')
    assert [line for _, line in r.poll()] == [b'{"n":10}', b'{"m":1}']
    assert r.reset == "rotated"
    r.close()


def test_tail_lines_returns_the_last_lines_and_the_resume_point(tmp_path: Path) -> None:
    p = tmp_path / "output.log"
    p.write_bytes(b"".join(b"line %d\n" % i for i in range(50_000)) + b"partial \xff")
    res = tail_lines(p, 3, block_bytes=1024)
    assert [protocol.decode_log_data(x) for x in res["lines"]] == [b"line 49998", b"line 49999", b"partial \xff"]
    assert res["offset"] == p.stat().st_size and res["inode"] == p.stat().st_ino
    assert tail_lines(p, 0)["lines"] == []
    small = tmp_path / "small.log"
    small.write_bytes(b"a\nb\n")
    assert tail_lines(small, 10)["lines"] == ["a", "b"]


def test_tail_lines_matches_a_reference_on_random_files(tmp_path: Path) -> None:
    rnd = random.Random(11)
    p = tmp_path / "t.log"
    for _ in range(400):
        data = b"".join(rnd.choice([b"\n", b"ab", b"\xff", b"\x00", b"line\n", b"x" * rnd.randrange(300)])
                        for _ in range(rnd.randrange(40)))  # fmt: skip
        p.write_bytes(data)
        n = rnd.randrange(1, 12)
        body = data[:-1] if data.endswith(b"\n") else data
        want = body.split(b"\n")[-n:] if data else []
        got = tail_lines(p, n, block_bytes=rnd.choice([1, 7, 64, 4096]))["lines"]
        assert [protocol.decode_log_data(x) for x in got] == want, (data, n)


def test_tail_of_a_gigantic_line_is_bounded_fast_and_marked(tmp_path: Path) -> None:
    p = tmp_path / "big.log"
    p.write_bytes(b"y" * (30 * 1024 * 1024) + b"\nend\n")  # read back block by block this took ~20 s (quadratic)
    t0 = time.monotonic()
    res = tail_lines(p, 5, max_bytes=1024 * 1024)
    assert time.monotonic() - t0 < 1.0
    lines = [protocol.decode_log_data(x) for x in res["lines"]]
    assert lines[-1] == b"end" and lines[0].startswith(b"[...cut] y") and len(lines[0]) < 1024 * 1024 + 16
    assert tail_lines(p, 1)["lines"] == ["end"]


def test_tail_start_finds_the_last_n_lines_of_any_count_across_blocks(tmp_path: Path) -> None:
    rng = random.Random(7)
    for trial in range(40):
        lines = [b"x" * rng.randint(0, 30) for _ in range(rng.randint(0, 60))]
        body = b"\n".join(lines) + (b"\n" if lines and rng.random() < 0.7 else b"")
        p = tmp_path / f"f{trial}"
        p.write_bytes(body)
        whole_lines = re.findall(rb"[^\n]*\n|[^\n]+$", body)  # each with its newline; a partial last one too
        for n in (0, 1, 2, 5, 59, 60, 61, 10**9):
            got = tail_start(p, n, block_bytes=rng.choice([1, 3, 7, 64, 1 << 20]))
            want_start = len(body) - sum(len(x) for x in whole_lines[-n:]) if n else len(body)
            assert (got["start"], got["offset"]) == (want_start, len(body)), (trial, n)


def test_read_range_returns_bytes_from_an_offset_without_splitting_a_character(tmp_path: Path) -> None:
    p = tmp_path / "log"
    p.write_bytes(b"ab\xc3\xa9cd")
    first = read_range(p, 0, 3)
    assert protocol.decode_log_data(first["data"]) == b"ab" and first["size"] == 6
    rest = read_range(p, 2, 10)
    assert protocol.decode_log_data(rest["data"]) == b"\xc3\xa9cd"
    assert protocol.decode_log_data(read_range(p, 6, 10)["data"]) == b""


def test_tail_lines_says_when_its_byte_window_held_fewer_lines_than_asked(tmp_path: Path) -> None:
    p = tmp_path / "long-lines.log"
    p.write_bytes(b"".join(b"%04d " % i + b"x" * 995 + b"\n" for i in range(100)))  # 1000-byte lines
    short = tail_lines(p, 50, max_bytes=10_000)
    assert short["window_cut"] is True and len(short["lines"]) <= 11
    enough = tail_lines(p, 5, max_bytes=10_000)
    assert enough["window_cut"] is False
    assert [x[:4] for x in enough["lines"]] == ["0095", "0096", "0097", "0098", "0099"]
    assert tail_lines(p, 500)["window_cut"] is False  # the whole file was read: nothing more exists


def test_jsonl_reader_reads_at_most_its_budget_per_poll_and_says_more(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    lines = [b'{"n":%06d}' % i for i in range(5000)]  # 13 bytes a line with its newline
    p.write_bytes(b"".join(line + b"\n" for line in lines))
    r = JsonlReader(p, poll_bytes=1000)
    got: list[bytes] = []
    polls = 0
    while True:
        batch = r.poll()
        polls += 1
        assert len(batch) <= 1000 // 13 + 1
        got += [line for _, line in batch]
        if not r.more:
            break
    assert got == lines and polls >= 5000 * 13 // 1000
    r.close()


def test_jsonl_reader_with_a_window_reads_a_huge_file_at_its_head_and_its_end(tmp_path: Path) -> None:
    p = tmp_path / "events.jsonl"
    lines = [b'{"n":%06d}' % i for i in range(5000)]
    data = b"".join(line + b"\n" for line in lines)
    p.write_bytes(data)
    r = JsonlReader(p, window=(100, 200))
    got = r.poll()
    head = [line for _, line in got][: 100 // 13]
    tail = [line for _, line in got][100 // 13 :]
    assert head == lines[: 100 // 13] and tail == lines[-(200 // 13) :]
    assert got[-1][0] == len(data) and r.skipped_bytes == len(data) - 13 * len(got)
    assert not r.more
    small = tmp_path / "small.jsonl"
    small.write_bytes(data[:299])
    whole = JsonlReader(small, window=(100, 200))
    assert len(whole.poll()) == 299 // 13 and whole.skipped_bytes == 0  # no larger than the window: read whole
    whole.close()
    r.close()
