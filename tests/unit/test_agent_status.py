"""The agent as a real subprocess (simulated GPUs): status, subscribe streams, run following, tail, sim, doctor.

``agent`` (tests/unit/conftest.py) is an agent with 8 simulated GPUs on this test's run root."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.agent import REPO_ROOT, AgentClient, Event, agent_argv, checkout_env

from engine import protocol
from engine.host import procs
from engine.supervisor import records


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    p = subprocess.Popen(["sleep", "120"], stdin=subprocess.DEVNULL, start_new_session=True)  # like a real job
    yield p
    p.kill()
    p.wait()


def make_run(run_root: Path, run_id: str, pid: int | None = None) -> Path:
    """A run directory as the supervisor's wrapper leaves it: launch.json naming a live job, current -> it."""
    rd = records.run_dir_for(run_root, run_id)
    rd.mkdir(parents=True)
    if pid is not None:
        st = procs.read_stat(pid)
        assert st is not None
        records.write_json_atomic(
            rd / records.LAUNCH_JSON,
            {
                "run_id": run_id,
                "command": ["sleep", "120"],
                "cwd": str(run_root),
                "job_pid": pid,
                "job_start_ticks": st.start_ticks,
                "job_pgid": st.pgrp,
                "boot_id": procs.read_boot_id(),
                "started_at": time.time(),
            },
        )
    records.set_current(run_root, rd)
    return rd


def is_reply(cmd_id: int) -> Callable[[Event], bool]:
    return lambda e: e["ev"] == "reply" and e.get("id") == cmd_id


def test_hello_then_status_snapshot(agent: AgentClient) -> None:
    hello = agent.events[0]  # the first line the agent wrote
    assert hello["ev"] == "hello" and hello["simulated"] is True
    assert set(hello["capabilities"]) >= {"nvml", "psutil", "watchfiles", "tmux", "py_spy"}
    st = agent.ok("status")
    for key in protocol.STATUS_KEYS:
        assert key in st
    assert st["gpu_source"] == "simulated" and st["simulated"] is True
    assert len(st["gpus"]) == 8 and all(g["simulated"] for g in st["gpus"])
    assert all(g["util_pct"] is not None and g["mem_total_mib"] > 0 for g in st["gpus"])
    assert st["run"] is None and st["anomalies"] == []
    assert st["host"]["boot_id"] == procs.read_boot_id()
    assert st["processes"] == {"run_tree": [], "holders": st["processes"]["holders"]}
    assert st["capabilities"]["nvml"]["detail"]


def test_bad_input_is_answered_and_the_agent_lives_on(agent: AgentClient) -> None:
    for line in [b"garbage\n", b"[1, 2]\n", b'{"cmd": 5}\n', b'{"id": "x", "cmd": "status"}\n', b"\xff\xfe\n"]:
        agent.send_raw(line)
        err = agent.next_event(lambda e: e["ev"] == "error", what=f"error for {line!r}")
        assert "bad command line" in err["message"]
    reply = agent.request("no_such_command")
    assert reply["ok"] is False and "unknown command" in reply["error"]
    bad_args = agent.request("subscribe", gpu_interval_s="fast")
    assert bad_args["ok"] is False and "gpu_interval_s" in bad_args["error"]
    assert agent.request("tail", n=-1)["ok"] is False
    assert agent.request("sim", gpu=99, util_pct=1)["ok"] is False
    assert "t" in agent.ok("ping")
    assert agent.close() == 0


def test_subscribe_streams_gpus_procs_run_and_anomalies(agent: AgentClient, sleeper: subprocess.Popen[bytes]) -> None:
    res = agent.ok("subscribe", gpu_interval_s=0.01, procs_interval_s=0.2)
    assert res["gpu_interval_s"] == 0.1  # clamped to the minimum
    t0 = time.monotonic()
    gpus = [agent.next_event(lambda e: e["ev"] == "gpus", what="gpus") for _ in range(5)]
    assert time.monotonic() - t0 < 5
    assert all(g["simulated"] and len(g["gpus"]) == 8 for g in gpus)
    assert agent.next_event(lambda e: e["ev"] == "procs")["run_tree"] == []
    assert agent.next_event(lambda e: e["ev"] == "run")["run"] is None
    assert agent.next_event(lambda e: e["ev"] == "anomalies")["items"] == []

    agent.ok("sim", gpu=3, util_pct=100, mem_used_mib=0, holder_pid=None)
    ev = agent.next_event(lambda e: e["ev"] == "anomalies" and e["items"], what="phantom anomaly")
    assert [(a["kind"], a["gpu"]) for a in ev["items"]] == [("phantom_utilization", 3)]

    agent.ok("sim", gpu=5, mem_used_mib=30000, holder_pid=None)
    agent.ok("sim", gpu=1, mem_used_mib=20000, holder_pid=sleeper.pid)

    def has_all(e: Event) -> bool:
        return e["ev"] == "anomalies" and {a["kind"] for a in e["items"]} == {
            "phantom_utilization",
            "orphan_memory",
            "stale_holder",
        }

    ev = agent.next_event(has_all, what="three anomalies")
    stale = next(a for a in ev["items"] if a["kind"] == "stale_holder")
    assert stale["pid"] == sleeper.pid and stale["gpu"] == 1
    procs_ev = agent.next_event(lambda e: e["ev"] == "procs" and e["holders"], what="holders")
    h = next(h for h in procs_ev["holders"] if h["pid"] == sleeper.pid)
    assert h["resolved"] and h["source"] == "simulated" and h["cmd"] == "sleep 120" and not h["in_run"]

    agent.ok("sim", reset=True)
    agent.next_event(lambda e: e["ev"] == "anomalies" and e["items"] == [], what="anomalies cleared")


def test_anomalies_are_sent_only_when_they_change(agent: AgentClient) -> None:
    agent.ok("sim", gpu=0, util_pct=100, mem_used_mib=0)
    agent.ok("subscribe", gpu_interval_s=0.1, procs_interval_s=0.1)
    agent.next_event(lambda e: e["ev"] == "anomalies" and e["items"], what="first anomalies")
    for _ in range(8):
        agent.next_event(lambda e: e["ev"] == "gpus")
    assert [e for e in agent.drain() if e["ev"] == "anomalies"] == []


def test_second_subscribe_replaces_the_first(agent: AgentClient) -> None:
    agent.ok("subscribe", gpu_interval_s=0.1)
    for _ in range(3):
        agent.next_event(lambda e: e["ev"] == "gpus")
    agent.ok("subscribe", gpu_interval_s=3.0, procs_interval_s=3.0)
    agent.drain()
    time.sleep(1.0)  # measuring a rate: count what one second of streaming brings
    gpus = [e for e in agent.drain() if e["ev"] == "gpus"]
    assert len(gpus) <= 1


def test_run_log_and_engine_events_follow_the_current_run(
    agent: AgentClient, run_root: Path, sleeper: subprocess.Popen[bytes]
) -> None:
    agent.ok("subscribe", gpu_interval_s=0.1, procs_interval_s=0.1)
    rd = make_run(run_root, "run-a", pid=sleeper.pid)
    payload = b"starting\nbad utf8 \xff\xfe\nstep=1 loss=2.0\n"
    with open(rd / records.OUTPUT_LOG, "ab") as fh:
        fh.write(payload)
    reset = agent.next_event(lambda e: e["ev"] == "log_reset", what="log_reset for the new run")
    assert reset["reason"] == "created" and reset["run_id"] == "run-a" and reset["offset"] == 0
    got = b""
    while len(got) < len(payload):
        ev = agent.next_event(lambda e: e["ev"] == "log", what="log data")
        assert ev["offset"] == len(got)
        got += protocol.decode_log_data(ev["data"])
    assert got == payload

    lines = [{"t": time.time(), "kind": "stage", "stage": "training", "thread": None, "detail": ""}]
    lines += [
        {"t": time.time(), "kind": "step", "thread": "drafter-0", "step": i, "loss": [1.0], "acc": [0.5]}
        for i in (1, 2)
    ]
    blob = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    with open(rd / records.EVENTS_JSONL, "ab") as fh:
        fh.write(blob[:-10])  # a partial last line is held back ...
    engine = [agent.next_event(lambda e: e["ev"] == "engine", what="engine event") for _ in range(2)]
    with open(rd / records.EVENTS_JSONL, "ab") as fh:
        fh.write(blob[-10:])  # ... until it is complete
    engine.append(agent.next_event(lambda e: e["ev"] == "engine", what="last engine event"))
    assert [e["event"]["kind"] for e in engine] == ["stage", "step", "step"]
    assert engine[-1]["offset"] == len(blob) and engine[-1]["run_id"] == "run-a"

    run_ev = agent.next_event(lambda e: e["ev"] == "run" and e["run"] and e["run"]["state"] == "running", what="run")
    assert run_ev["run"]["run_id"] == "run-a" and run_ev["run"]["pid"] == sleeper.pid
    procs_ev = agent.next_event(lambda e: e["ev"] == "procs" and e["run_tree"], what="run tree")
    assert procs_ev["run_tree"][0]["pid"] == sleeper.pid and procs_ev["run_tree"][0]["threads"]
    # The simulated GPUs work for the run: its pid holds them, inside the run tree, so nothing is stale.
    gpus_ev = agent.next_event(lambda e: e["ev"] == "gpus" and e["gpus"][0]["holder_pids"], what="busy gpus")
    assert gpus_ev["gpus"][0]["holder_pids"] == [sleeper.pid]
    st = agent.ok("status")
    assert st["run"]["run_id"] == "run-a" and st["anomalies"] == []
    assert all(h["in_run"] for h in st["processes"]["holders"] if h["pid"] == sleeper.pid)

    tail = agent.ok("tail", n=2)
    assert tail["run_id"] == "run-a" and tail["offset"] == len(payload)
    assert [protocol.decode_log_data(x) for x in tail["lines"]] == [b"bad utf8 \xff\xfe", b"step=1 loss=2.0"]

    rd2 = make_run(run_root, "run-b")
    (rd2 / records.OUTPUT_LOG).write_bytes(b"second run\n")
    reset2 = agent.next_event(lambda e: e["ev"] == "log_reset" and e.get("run_id") == "run-b", what="switch to run-b")
    assert reset2["reason"] == "created"
    ev = agent.next_event(lambda e: e["ev"] == "log" and e["inode"] == reset2["inode"], what="run-b data")
    assert protocol.decode_log_data(ev["data"]) == b"second run\n"


def test_resubscribe_resumes_without_gap_or_repeat(agent: AgentClient, run_root: Path) -> None:
    rd = make_run(run_root, "run-r")
    log = rd / records.OUTPUT_LOG
    log.write_bytes(b"one\ntwo\n")
    events = rd / records.EVENTS_JSONL
    events.write_bytes(b'{"t": 1.0, "kind": "stage", "stage": "imports"}\n')
    agent.ok("subscribe")
    first = agent.next_event(lambda e: e["ev"] == "log", what="log")
    assert protocol.decode_log_data(first["data"]) == b"one\ntwo\n"
    eng = agent.next_event(lambda e: e["ev"] == "engine", what="engine")
    # The client reconnects later and resubscribes from where it stopped; meanwhile both files grew.
    with open(log, "ab") as fh:
        fh.write(b"three\n")
    with open(events, "ab") as fh:
        fh.write(b'{"t": 2.0, "kind": "stage", "stage": "training"}\n')
    agent.ok(
        "subscribe",
        log={"offset": first["offset"] + 8, "inode": first["inode"]},
        engine_offset=eng["offset"],
        engine_inode=eng["inode"],
        run_id="run-r",
    )
    nxt = agent.next_event(lambda e: e["ev"] == "log" and e["offset"] == 8, what="resumed log")
    assert protocol.decode_log_data(nxt["data"]) == b"three\n"
    eng2 = agent.next_event(lambda e: e["ev"] == "engine" and e["event"]["stage"] == "training", what="resumed engine")
    assert eng2["offset"] == events.stat().st_size
    leftovers = [e for e in agent.drain() if e["ev"] in ("log", "log_reset", "engine")]
    assert all(e["ev"] != "log_reset" for e in leftovers)
    assert all(e.get("offset", 0) >= 8 for e in leftovers if e["ev"] == "log")


def test_sim_script_from_the_environment(run_root: Path, tmp_path: Path) -> None:
    script = tmp_path / "sim.json"
    script.write_text(json.dumps([{"gpu": 6, "util_pct": 100, "mem_used_mib": 0}, {"gpu": 7, "mem_used_mib": 9000}]))
    a = AgentClient(run_root, simulate_gpus=8, env={"SPECDEC_SIM_SCRIPT": str(script)})
    try:
        st = a.ok("status")
        assert sorted((x["kind"], x["gpu"]) for x in st["anomalies"]) == [
            ("orphan_memory", 7),
            ("phantom_utilization", 6),
        ]
    finally:
        a.close()


def test_tail_without_a_run_is_a_clear_error(agent: AgentClient) -> None:
    reply = agent.request("tail", n=5)
    assert reply["ok"] is False and "no run" in reply["error"]


def test_doctor_reports_every_check_with_a_fix(agent: AgentClient) -> None:
    res = agent.ok("doctor", reply_within_s=120)
    names = [c["name"] for c in res["checks"]]
    assert names == ["python", "torch", "cuda", "nvml", "tmux", "disk", "run_root", "stale_gpu_holders"]
    for c in res["checks"]:
        assert isinstance(c["ok"], bool) and c["detail"]
        assert c["ok"] or c["fix"], c
    by = {c["name"]: c for c in res["checks"]}
    assert by["python"]["ok"] and by["run_root"]["ok"] and by["stale_gpu_holders"]["ok"]


def test_resume_offsets_of_an_older_run_do_not_skip_the_new_runs_events(agent: AgentClient, run_root: Path) -> None:
    old = make_run(run_root, "run-old")
    (old / records.OUTPUT_LOG).write_bytes(b"old output\n")
    old_inode = (old / records.OUTPUT_LOG).stat().st_ino
    new = make_run(run_root, "run-new")  # launched while the client was away
    (new / records.OUTPUT_LOG).write_bytes(b"new output\n")
    (new / records.EVENTS_JSONL).write_bytes(
        b"".join(b'{"t": %d.0, "kind": "stage", "stage": "s%d"}\n' % (i, i) for i in range(40))
    )
    agent.ok("subscribe", log={"offset": 11, "inode": old_inode}, engine_offset=200)
    reset = agent.next_event(lambda e: e["ev"] == "log_reset", what="reset to the new run's log")
    assert reset["reason"] == "rotated" and reset["offset"] == 0
    data = agent.next_event(lambda e: e["ev"] == "log", what="new run's log")
    assert protocol.decode_log_data(data["data"]) == b"new output\n"
    first = agent.next_event(lambda e: e["ev"] == "engine", what="first engine event")
    assert first["event"]["stage"] == "s0" and first["run_id"] == "run-new"


def test_commands_written_just_before_eof_are_all_answered(tmp_path: Path) -> None:
    """`printf '<commands>' | agent`: the agent answers every command before it exits (it used to exit at EOF with
    the status reply, and often the ping's, still unwritten)."""
    commands = b"".join(
        json.dumps({"id": i, "cmd": cmd, "args": {}}).encode() + b"\n"
        for i, cmd in enumerate(["ping", "status", "ping", "status"], start=1)
    )
    done = subprocess.run(
        agent_argv(tmp_path, "--simulate-gpus", "2"),
        input=commands,
        capture_output=True,
        cwd=REPO_ROOT,
        env=checkout_env(),
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    replies = {e["id"]: e for e in map(protocol.parse_event, done.stdout.splitlines()) if e["ev"] == "reply"}
    assert sorted(replies) == [1, 2, 3, 4]
    assert all(r["ok"] for r in replies.values())
    assert replies[2]["result"]["simulated"] is True and len(replies[2]["result"]["gpus"]) == 2
