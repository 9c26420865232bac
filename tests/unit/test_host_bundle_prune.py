"""The host keeps a few agent bundles, not one per client version and per edit of the engine: INSTALL removes
old ones (bundle and extracted tree) unless a live process runs from the tree or a recorded run would start
it again; CHECK marks the bundle it starts as used. Real scripts, real processes, real files."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tui.link import ship

DAY = 86400.0


def _bundle(agent_dir: Path, n: int, age_s: float) -> tuple[Path, Path]:
    pyz = agent_dir / f"0.0-{n:016x}.pyz"
    pyz.write_bytes(b"old bundle %d" % n)
    tree = agent_dir / pyz.name[: -len(".pyz")]
    (tree / "engine").mkdir(parents=True)
    (tree / "engine" / "__init__.py").write_text("")
    t = time.time() - age_s
    os.utime(pyz, (t, t))
    return pyz, tree


def _install(run_root: Path, data: bytes) -> subprocess.CompletedProcess[bytes]:
    sha = hashlib.sha256(data).hexdigest()
    name = f"9.9-{sha[:16]}.pyz"
    argv = [sys.executable, "-S", "-c", ship.INSTALL_SCRIPT, str(run_root), name, sha]
    return subprocess.run(argv, input=data, capture_output=True, timeout=60, check=False)


@pytest.fixture
def live() -> Iterator[list[subprocess.Popen[bytes]]]:
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for p in procs:
        p.kill()
        p.wait()


def test_install_prunes_idle_unused_bundles_and_keeps_what_runs_or_could_run(
    tmp_path: Path, live: list[subprocess.Popen[bytes]]
) -> None:
    run_root = tmp_path / "root"
    agent_dir = run_root / "agent"
    agent_dir.mkdir(parents=True)
    recent = [_bundle(agent_dir, n, age_s=60.0 * (n + 1)) for n in range(ship.HOST_KEEP + 1)]  # one past KEEP
    old = [_bundle(agent_dir, 100 + n, age_s=2 * DAY + 100.0 * n) for n in range(5)]
    # old[0]: a live process's cwd (a run's supervisor); old[1]: a live process's PYTHONPATH (the engine);
    # old[2]: a finished run's recorded spec (restart relaunches it); old[3], old[4]: nothing.
    live.append(subprocess.Popen(["sleep", "60"], cwd=old[0][1]))
    live.append(subprocess.Popen(["sleep", "60"], env={**os.environ, "PYTHONPATH": str(old[1][1])}))
    run_dir = run_root / "runs" / "20261205-000000-aaaa"
    run_dir.mkdir(parents=True)
    spec = {"spec": {"command": ["python3", "-m", "engine.trainer"], "env": {"PYTHONPATH": str(old[2][1])}}}
    (run_dir / "launch.json").write_text(json.dumps(spec))
    dead_tmp = agent_dir / "0.0-dead.pyz.tmp-123"
    dead_tmp.write_bytes(b"half")
    os.utime(dead_tmp, (time.time() - 7200, time.time() - 7200))
    dead_extract = agent_dir / "0.0-dead.tmp-456"
    (dead_extract / "engine").mkdir(parents=True)
    os.utime(dead_extract, (time.time() - 7200, time.time() - 7200))
    fresh_tmp = agent_dir / "0.0-busy.pyz.tmp-789"  # another client's upload, still being written
    fresh_tmp.write_bytes(b"half")

    done = _install(run_root, b"the new bundle")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["bootstrap"] == "installed" and Path(reply["path"]).read_bytes() == b"the new bundle"
    assert sorted(reply["pruned"]) == sorted(p.name for p, _ in old[3:])
    for pyz, tree in old[3:]:
        assert not pyz.exists() and not tree.exists()
    for pyz, tree in recent + old[:3]:  # the KEEP most recent, one past KEEP but used within the day, the busy
        assert pyz.is_file() and (tree / "engine" / "__init__.py").is_file(), pyz.name
    assert not dead_tmp.exists() and not dead_extract.exists() and fresh_tmp.exists()
    assert done.stderr == b""


def test_a_directory_by_a_bundles_name_is_left_alone_and_the_install_stands(tmp_path: Path) -> None:
    run_root = tmp_path / "root"
    agent_dir = run_root / "agent"
    agent_dir.mkdir(parents=True)
    gone = [_bundle(agent_dir, n, age_s=2 * DAY + n)[0] for n in range(ship.HOST_KEEP + 2)]
    odd = agent_dir / "0.0-ffffffffffffffff.pyz"  # a directory by a bundle's name: no regular file, never pruned
    odd.mkdir()
    os.utime(odd, (time.time() - 3 * DAY, time.time() - 3 * DAY))
    done = _install(run_root, b"another bundle")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert reply["bootstrap"] == "installed" and odd.is_dir()
    assert sorted(reply["pruned"]) == sorted(p.name for p in gone[ship.HOST_KEEP :])  # the KEEP newest stay


def test_check_marks_the_bundle_it_starts_as_used(tmp_path: Path) -> None:
    run_root = tmp_path / "root"
    bundle = ship.agent_bundle()
    argv = [sys.executable, "-S", "-c", ship.INSTALL_SCRIPT, str(run_root), bundle.name, bundle.sha256]
    assert subprocess.run(argv, input=bundle.data, capture_output=True, timeout=60, check=False).returncode == 0
    pyz = run_root / "agent" / bundle.name
    os.utime(pyz, (time.time() - 3 * DAY, time.time() - 3 * DAY))
    check = ship.check_argv(sys.executable, str(run_root), bundle, ["--simulate-gpus", "1"])
    started = subprocess.run(check, stdin=subprocess.DEVNULL, capture_output=True, timeout=60, check=False)
    first = json.loads(started.stdout.splitlines()[0])
    assert first["bootstrap"] == "ok", started.stderr
    assert time.time() - pyz.stat().st_mtime < 60


def test_the_prune_reads_the_run_records_restart_reads() -> None:
    from engine.supervisor import records

    # INSTALL runs with `python3 -S -c` before any engine exists on the host, so it names these files itself.
    for name in (records.LAUNCH_JSON, records.SUBMITTED_JSON, records.SPEC_JSON):
        assert f'"{name}"' in ship.INSTALL_SCRIPT
    assert f'"{records.RUNS_DIR}"' in ship.INSTALL_SCRIPT


# The INSTALL child's address space: a few tens of MiB run it; a record read whole (1 GiB) cannot fit. A limit, not
# the child's ru_maxrss, because that high-water mark keeps the RSS this test process had when it forked (the whole
# suite's pytest: 800 MiB, measured in CI), whatever the child itself reads.
INSTALL_ADDRESS_SPACE = 384 << 20


# Sets the limit, then execs the rest of its argv (no preexec_fn: this process may have threads).
LIMITED = (
    "import os, resource, sys; n = int(sys.argv[1]); resource.setrlimit(resource.RLIMIT_AS, (n, n)); "
    "os.execv(sys.argv[2], sys.argv[2:])"
)


def _install_measured(run_root: Path, data: bytes, timeout_s: float) -> tuple[int, bytes, bytes, float, int]:
    """``_install`` as a child of its own with at most INSTALL_ADDRESS_SPACE of memory, waited with os.wait4:
    (status, stdout, stderr, seconds, ru_maxrss KiB: the child's, or this process's at the fork if larger)."""
    import select

    sha = hashlib.sha256(data).hexdigest()
    install = [sys.executable, "-S", "-c", ship.INSTALL_SCRIPT, str(run_root), f"9.9-{sha[:16]}.pyz", sha]
    argv = [sys.executable, "-S", "-c", LIMITED, str(INSTALL_ADDRESS_SPACE), *install]
    t0 = time.monotonic()
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    proc.stdin.write(data)
    proc.stdin.close()
    out, err = bytearray(), bytearray()
    open_pipes = {proc.stdout.fileno(): out, proc.stderr.fileno(): err}
    while open_pipes:
        left = timeout_s - (time.monotonic() - t0)
        ready, _, _ = select.select(list(open_pipes), [], [], max(0.0, left))
        if not ready:
            proc.kill()
            os.wait4(proc.pid, 0)
            raise AssertionError(f"INSTALL still running after {timeout_s} s: {bytes(out)!r} {bytes(err)!r}")
        for fd in ready:
            chunk = os.read(fd, 65536)
            if chunk:
                open_pipes[fd].extend(chunk)
            else:
                del open_pipes[fd]
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait for it again
    return proc.returncode, bytes(out), bytes(err), time.monotonic() - t0, usage.ru_maxrss


def test_the_prune_reads_no_fifo_and_at_most_a_mib_of_a_huge_record(tmp_path: Path) -> None:
    run_root = tmp_path / "root"
    agent_dir = run_root / "agent"
    agent_dir.mkdir(parents=True)
    for n in range(ship.HOST_KEEP):
        _bundle(agent_dir, n, age_s=60.0)
    named, named_tree = _bundle(agent_dir, 100, age_s=2 * DAY)  # idle, past KEEP: kept only while a run names it
    unnamed, _ = _bundle(agent_dir, 101, age_s=2 * DAY)
    fifo_run = run_root / "runs" / "20261205-000000-fifo"
    fifo_run.mkdir(parents=True)
    os.mkfifo(fifo_run / "launch.json")  # nothing ever writes it: a reader blocks for good
    huge_run = run_root / "runs" / "20261205-000000-huge"
    huge_run.mkdir(parents=True)
    spec = json.dumps({"spec": {"env": {"PYTHONPATH": str(named_tree)}}}).encode()
    with (huge_run / "spec.json").open("wb") as fh:
        fh.write(spec)
        fh.truncate(1 << 30)  # 1 GiB, sparse: reading it whole costs a GiB of memory
    code, out, err, took_s, peak_kib = _install_measured(run_root, b"the new bundle", timeout_s=30.0)
    assert code == 0, err
    reply = json.loads(out)
    # within INSTALL_ADDRESS_SPACE (a whole read of the record fails there), and the huge record's head still read
    assert reply["pruned"] == [unnamed.name] and named.is_file(), reply
    print(f"INSTALL beside a FIFO record and a 1 GiB sparse one: {took_s:.2f} s, ru_maxrss {peak_kib / 1024:.1f} MiB")


@pytest.mark.parametrize("entry", [".pyz", "-.pyz", "x.pyz", "..pyz"])
def test_an_entry_that_is_not_a_bundle_name_never_takes_the_agent_directory_with_it(tmp_path: Path, entry: str) -> None:
    run_root = tmp_path / "root"
    agent_dir = run_root / "agent"
    agent_dir.mkdir(parents=True)
    recent = [_bundle(agent_dir, n, age_s=60.0) for n in range(ship.HOST_KEEP)]
    odd = agent_dir / entry
    odd.write_bytes(b"not a bundle")
    os.utime(odd, (time.time() - 3 * DAY, time.time() - 3 * DAY))  # the oldest, idle: first in line
    done = _install(run_root, b"the new bundle")
    assert done.returncode == 0, done.stderr
    reply = json.loads(done.stdout)
    assert Path(reply["path"]).read_bytes() == b"the new bundle", "the just-installed bundle went"
    assert reply["pruned"] == [] and odd.is_file()
    assert all(pyz.is_file() and tree.is_dir() for pyz, tree in recent)
