"""Monitoring commands: status, subscribe, tail, doctor, sim.

One ``Monitor`` per agent (kept in ``agent.extras``) owns the GPU source (NVML initialised once), the
CPU-percent tracker and the engine-event state used for anomalies. ``subscribe`` starts two threads:
a sampler (gpus / procs / run / anomalies events) and a follower (log / log_reset / engine events of
the current run, switching when ``<run_root>/current`` points at a new run).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Any

from engine import protocol
from engine.agent import anomalies
from engine.agent.commands import handler, run_dir_arg
from engine.agent.doctor import run_doctor
from engine.agent.follow import POLL_INTERVAL_S, JsonlReader, LogFollower, read_range, tail_lines, tail_start
from engine.agent.server import Agent, CommandError
from engine.host import host_map, procs
from engine.host.agents import live_agents
from engine.host.capabilities import probe_capabilities
from engine.host.gpu_source import open_gpu_source
from engine.host.gpus import GpuSample, GpuSource
from engine.host.holders import NvmlView, find_holders, mark_holders
from engine.host.simulate import SimError, SimulatedGpus
from engine.protocol import Anomaly, HolderInfo, HostMap, ProcInfo, RunInfo
from engine.supervisor import kill_stale, records

GPU_INTERVAL_DEFAULT_S = 0.5
LOG_START_BYTES = 1 << 20  # a client with no position in a run's output.log gets its last MiB first, not all of it
PROCS_INTERVAL_DEFAULT_S = 1.0
MIN_INTERVAL_S = 0.1
RUN_CHECK_INTERVAL_S = 0.25  # how often the follower looks at <run_root>/current
TAIL_MAX_LINES = 10000  # lines in one tail reply; more are read with tail(stream=True) + read_log
READ_LOG_MAX_BYTES = 4 * 1024 * 1024
_TICK_SLACK_S = 0.005  # a procs scan due within this of a GPU tick runs on that tick
# A huge events file is never read whole: the anomaly state and a new stream read its head and its end.
# (head, tail) bytes: the first stages, then the newest steps (a few times the 256 the stall check uses) and beats.
ANOMALY_EVENTS_WINDOW = (64 * 1024, 512 * 1024)
# What a client new to a run is sent of a huge events file: its first lines (stages, the data summary) and some
# thousand steps with their heartbeats, which the agent encodes in about a second.
STREAM_EVENTS_WINDOW = (256 * 1024, 2 * 1024 * 1024)
ANOMALY_POLLS_MAX = 16  # of POLL_BYTES each, per collect: a burst is caught up over several collects


def _now() -> float:
    return time.time()


def _disk_free_gib(path: Path) -> float | None:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return round(shutil.disk_usage(probe).free / 1024**3, 2)
    except OSError:
        return None


def _anomaly_keys(items: list[Anomaly]) -> list[tuple[Any, ...]]:
    # Messages carry live numbers (MiB, seconds): a change of state, not of wording, is news.
    return [(a.kind, a.gpu, a.pid, a.thread) for a in items]


class Snapshot:
    """One collected view of the host (what ``status`` returns and the sampler streams)."""

    def __init__(
        self,
        t: float,
        sample: GpuSample,
        holders: list[HolderInfo],
        run: RunInfo | None,
        run_pids: set[int],
        run_tree: list[ProcInfo],
        items: list[Anomaly],
    ) -> None:
        self.t, self.sample, self.holders, self.run = t, sample, holders, run
        self.run_pids, self.run_tree, self.anomalies = run_pids, run_tree, items


class Monitor:
    def __init__(self, agent: Agent) -> None:
        self.agent = agent
        self.gpu_source: GpuSource = open_gpu_source(agent.simulate_gpus)
        self.cpu = procs.CpuTracker()
        self._lock = threading.Lock()
        self._engine_dir: Path | None = None
        self._engine_reader: JsonlReader | None = None
        self.engine_state = anomalies.EngineState()
        self._ended_runs: set[str] = set()  # run ids with an exit record (kill_stale.supervised_run_pids' cache)
        self._engine_restarts = 0  # restarts of the watched run: a restarted attempt's threads start afresh
        self.stall_limits: dict[str, float] = {}
        self.subscription: Subscription | None = None
        self._sub_lock = threading.Lock()
        # The Proxmox host's view (``host_holders``, only under --pct): the last map and when it came, or why none.
        self.host_map: HostMap | None = None
        self.host_map_received_m: float | None = None
        self.host_map_error: str | None = None

    @property
    def run_root(self) -> Path:
        return Path(self.agent.run_root)

    # -- the run -------------------------------------------------------------------------------

    def current_run(self) -> RunInfo | None:
        run_dir = records.current_run_dir(self.run_root)
        if run_dir is None:
            return None
        return records.read_run(run_dir, self.agent.boot_id, self.agent.scanners)

    def run_pids(self, run: RunInfo | None) -> set[int]:
        """Pids of the running run's processes, each still the one its launch record pinned (records.run_pids)."""
        if run is None or run.state != "running":
            return set()
        return records.run_pids(records.read_launch(run.run_dir))

    def supervised_pids(self, run: RunInfo | None, run_pids: set[int]) -> set[int]:
        """``run_pids`` (``run``'s, the current run's) and the processes of the run root's other runs still going:
        none of them is a stale holder (a second launch made itself current while the first trains on). Most of the
        time no other run is going, and this reads no process table."""
        counted = run.run_id if run is not None and run.state == "running" else None  # run_pids holds its processes
        return run_pids | kill_stale.supervised_run_pids(self.run_root, self._ended_runs, exclude=counted)

    def _run_tree(self, run_pids: set[int], with_threads: bool = True) -> list[ProcInfo]:
        out: list[ProcInfo] = []
        for pid in sorted(run_pids):
            st = procs.read_stat(pid)
            if st is not None:
                out.append(procs.proc_info(st, self.cpu, with_threads))
        return out

    def _poll_engine(self, run: RunInfo | None) -> None:
        run_dir = Path(run.run_dir) if run is not None else None
        if run_dir != self._engine_dir:
            if self._engine_reader is not None:
                self._engine_reader.close()
            self._engine_dir = run_dir
            events = run_dir / records.EVENTS_JSONL if run_dir is not None else None
            self._engine_reader = JsonlReader(events, window=ANOMALY_EVENTS_WINDOW) if events is not None else None
            self.engine_state = anomalies.EngineState()
            self._engine_restarts = len(run.restarts) if run is not None else 0
        elif run is not None and len(run.restarts) != self._engine_restarts:
            # Restarted in the same run dir: the dead threads and step times of the attempt before are not this one's.
            self.engine_state = anomalies.EngineState()
            self._engine_restarts = len(run.restarts)
        reader = self._engine_reader
        if reader is None:
            return
        for _ in range(ANOMALY_POLLS_MAX):
            for _, line in reader.poll():
                ev = protocol.decode_engine_line(line)
                if ev is not None:
                    self.engine_state.feed(ev)
            if not reader.more:
                break
        reader.reset = None

    # -- collection ----------------------------------------------------------------------------

    def gpu_sample(self, run: RunInfo | None) -> GpuSample:
        busy = run.pid if run is not None and run.state == "running" else None
        return self.gpu_source.sample(busy)

    def fresh_host_map(self) -> HostMap | None:
        """The host's map when one came recently and carries processes: it then replaces the container's guess."""
        hm, at = self.host_map, self.host_map_received_m
        if hm is None or at is None or hm.error is not None:
            return None
        return hm if time.monotonic() - at <= host_map.HOST_MAP_MAX_AGE_S else None

    def host_map_state(self) -> dict[str, Any] | None:
        """None without --pct; else whether the host's view is in use, and why not when it is not."""
        hm, at = self.host_map, self.host_map_received_m
        if hm is None and self.host_map_error is None:
            return None
        if hm is None or hm.error is not None:
            why = self.host_map_error or (hm.error if hm is not None else None)
            return {"state": "unavailable", "detail": why, "ctid": hm.ctid if hm is not None else None}
        age_s = time.monotonic() - at if at is not None else None
        state = "ok" if self.fresh_host_map() is not None else "stale"
        nvml = "simulated GPUs" if hm.source == "simulated" else "NVML"
        detail = (
            f"{nvml} on the Proxmox host {hm.hostname}, mapped into container {hm.ctid}"
            if state == "ok"
            else f"the host's last map is {age_s:.0f} s old: showing the container's own view"
        )
        return {"state": state, "detail": detail, "ctid": hm.ctid, "age_s": round(age_s or 0.0, 1), "host": hm.hostname}

    def set_host_map(self, hm: HostMap | None, error: str | None) -> None:
        with self._lock:
            self.host_map, self.host_map_error = hm, error
            self.host_map_received_m = time.monotonic()

    def holders_attribution(self, holders: list[HolderInfo]) -> dict[str, Any]:
        """Where the holders' GPU indices come from, in one word and one sentence (screen and status --json)."""
        host = self.host_map_state()
        if self.fresh_host_map() is not None:
            return {"source": "host-nvml", "detail": host["detail"] if host else ""}
        if self.gpu_source.source == "simulated":
            return {"source": "simulated", "detail": "the simulated GPU source's process lists"}
        guessed = [h.pid for h in holders if h.gpus_source == "fd-scan"]
        if guessed or (self.gpu_source.source != "nvml" and holders):
            why = (
                "NVML's PIDs do not resolve in this PID namespace (a container)"
                if self.gpu_source.source == "nvml"
                else "no NVML here"
            )
            extra = f"; host view: {host['detail']}" if host and host["state"] != "ok" else ""
            return {
                "source": "fd-scan",
                "detail": f"{why}: GPUs from /dev/nvidia* descriptors, which a CUDA process opens for every GPU{extra}",
            }
        return {"source": "nvml", "detail": "NVML's per-GPU process lists (PIDs of this namespace)"}

    def gpu_view(self, sample: GpuSample) -> NvmlView:
        """What the GPU source says about processes, with the Proxmox host's map while it is fresh."""
        return NvmlView.of_sample(sample, self.gpu_source.source, self.fresh_host_map())

    def holders(self, sample: GpuSample, run_pids: set[int]) -> list[HolderInfo]:
        found = find_holders(None, self.gpu_view(sample), run_pids)
        mark_holders(sample.gpus, found)
        return found

    def anomalies_for(
        self, sample: GpuSample, holders: list[HolderInfo], run: RunInfo | None, run_pids: set[int]
    ) -> list[Anomaly]:
        running = run is not None and run.state == "running"
        host_view = self.fresh_host_map() is not None
        agents = live_agents(self.run_root)
        items = anomalies.gpu_anomalies(sample.gpus, holders, run_pids, running, host_view=host_view, agents=agents)
        items.extend(anomalies.engine_anomalies(self.engine_state, _now(), running, **self.stall_limits))
        items.extend(anomalies.disk_anomalies(self.run_root))
        return items

    def collect(self, with_threads: bool = True) -> Snapshot:
        with self._lock:
            run = self.current_run()
            run_pids = self.run_pids(run)
            sample = self.gpu_sample(run)
            holders = self.holders(sample, run_pids)
            self._poll_engine(run)
            tree = self._run_tree(run_pids, with_threads)
            items = self.anomalies_for(sample, holders, run, self.supervised_pids(run, run_pids))
            return Snapshot(_now(), sample, holders, run, run_pids, tree, items)

    def host_info(self) -> dict[str, Any]:
        mem = procs.memory_mib()
        try:
            load = list(os.getloadavg())
        except OSError:
            load = []
        return {
            "hostname": self.agent.hostname,
            "boot_id": self.agent.boot_id,
            "kernel": os.uname().release,
            "python": sys.version.split()[0],
            "agent_pid": os.getpid(),
            "agent_uptime_s": round(_now() - self.agent.started_at, 3),
            "cpu_count": os.cpu_count(),
            "loadavg": load,
            "mem_total_mib": mem.get("MemTotal"),
            "mem_available_mib": mem.get("MemAvailable"),
            "run_root": str(self.run_root),
            "run_root_free_gib": _disk_free_gib(self.run_root),
            "dev_dir": procs.default_dev_dir(),
        }

    def status(self) -> dict[str, Any]:
        snap = self.collect()
        simulated = self.gpu_source.source == "simulated"
        return {
            "t": snap.t,
            "host": self.host_info(),
            "gpus": snap.sample.gpus,
            "gpu_source": self.gpu_source.source,
            "simulated": simulated,
            "nvml_error": self.gpu_source.error,
            "processes": {"run_tree": snap.run_tree, "holders": snap.holders},
            "holders_source": self.holders_attribution(snap.holders),
            "host_map": self.host_map_state(),
            "run": snap.run,
            "anomalies": snap.anomalies,
            "capabilities": probe_capabilities(),
        }


def _parse_engine_line(line: bytes) -> dict[str, Any] | None:
    try:
        ev = json.loads(line)
    except ValueError:
        return None
    return ev if isinstance(ev, dict) else None


def monitor_of(agent: Agent) -> Monitor:
    mon = agent.extras.get("monitor")
    if mon is None:
        with _monitor_lock:
            mon = agent.extras.get("monitor")
            if mon is None:
                mon = Monitor(agent)
                agent.extras["monitor"] = mon
    assert isinstance(mon, Monitor)
    return mon


_monitor_lock = threading.Lock()


def _interval(args: dict[str, Any], key: str, default: float) -> float:
    v = args.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool) or v != v:
        raise CommandError(f"{key} must be a number of seconds, got {v!r}")
    return max(MIN_INTERVAL_S, float(v))


def _opt_int(obj: dict[str, Any], key: str) -> int | None:
    v = obj.get(key)
    if v is None:
        return None
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise CommandError(f"{key} must be a non-negative integer, got {v!r}")
    return v


class Subscription:
    """The streams of one ``subscribe``: a sampler thread and a follower thread."""

    def __init__(self, monitor: Monitor, args: dict[str, Any]) -> None:
        self.monitor = monitor
        self.agent = monitor.agent
        self.gpu_interval_s = _interval(args, "gpu_interval_s", GPU_INTERVAL_DEFAULT_S)
        self.procs_interval_s = _interval(args, "procs_interval_s", PROCS_INTERVAL_DEFAULT_S)
        log = args.get("log")
        if log is not None and not isinstance(log, dict):
            raise CommandError("log must be {'offset': int, 'inode': int} or null")
        self.log_offset = _opt_int(log, "offset") if log else None
        self.log_inode = _opt_int(log, "inode") if log else None
        self.engine_offset = _opt_int(args, "engine_offset")
        self.engine_inode = _opt_int(args, "engine_inode")
        run_id = args.get("run_id")  # the run the offsets belong to; another run starts from 0
        if run_id is not None and not isinstance(run_id, str):
            raise CommandError("run_id must be a string or null")
        self.resume_run_id = run_id
        # Offsets apply to the run that is current now; any later run is new to the client.
        self.initial_run_dir = records.current_run_dir(monitor.run_root)
        self._rank_readers: dict[str, JsonlReader] = {}  # events.rank<R>.jsonl of the followed run
        self._rank_dir: Path | None = None
        self._rank_from_end = False
        self._resumed_run = False
        self.stop = threading.Event()
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, target in (("sampler", self._sample_loop), ("follower", self._follow_loop)):
            th = threading.Thread(target=self._guard, args=(target,), name=f"monitor-{name}", daemon=True)
            self._threads.append(th)
            th.start()

    def close(self, timeout_s: float = 2.0) -> None:
        self.stop.set()
        for th in self._threads:
            if th is not threading.current_thread():
                th.join(timeout_s)

    def _stopped(self) -> bool:
        return self.stop.is_set() or self.agent.stopping.is_set()

    def _emit(self, msg: dict[str, Any]) -> None:
        if not self.stop.is_set():
            self.agent.emit(msg)

    def _guard(self, loop: Any) -> None:
        # A bug in a stream becomes a visible error event, then the stream retries after a pause.
        while not self._stopped():
            try:
                loop()
                return
            except Exception as exc:
                self._emit(
                    protocol.event("error", message=f"{threading.current_thread().name}: {type(exc).__name__}: {exc}")
                )
                self.stop.wait(1.0)

    # -- sampler -------------------------------------------------------------------------------

    def _sample_loop(self) -> None:
        mon = self.monitor
        simulated = mon.gpu_source.source == "simulated"
        last_run_json: str | None = None
        last_keys: list[tuple[Any, ...]] | None = None
        holders: list[HolderInfo] = []
        run: RunInfo | None = None
        run_pids: set[int] = set()
        not_stale: set[int] = set()
        next_procs = 0.0
        next_gpu = time.monotonic()
        while not self._stopped():
            now_m = time.monotonic()
            procs_due = now_m + _TICK_SLACK_S >= next_procs
            with mon._lock:
                if procs_due:
                    run = mon.current_run()
                    run_pids = mon.run_pids(run)
                    not_stale = mon.supervised_pids(run, run_pids)
                sample = mon.gpu_sample(run)
                if procs_due:
                    holders = mon.holders(sample, run_pids)
                    mon._poll_engine(run)
                    tree = mon._run_tree(run_pids)
                else:
                    mark_holders(sample.gpus, holders)
                items = mon.anomalies_for(sample, holders, run, not_stale)
            self._emit(
                protocol.event(
                    "gpus",
                    t=sample.t,
                    simulated=simulated,
                    source=mon.gpu_source.source,
                    gpus=sample.gpus,
                    nvml_error=mon.gpu_source.error,
                )
            )
            if procs_due:
                next_procs = max(next_procs + self.procs_interval_s, now_m)
                self._emit(
                    protocol.event(
                        "procs",
                        t=_now(),
                        run_tree=tree,
                        holders=holders,
                        holders_source=mon.holders_attribution(holders),
                        host_map=mon.host_map_state(),
                    )
                )
                run_json = json.dumps(protocol.to_jsonable(run), sort_keys=True)
                if run_json != last_run_json:
                    last_run_json = run_json
                    self._emit(protocol.event("run", run=run))
            keys = _anomaly_keys(items)
            if keys != last_keys:
                last_keys = keys
                self._emit(protocol.event("anomalies", t=_now(), items=items))
            next_gpu += self.gpu_interval_s
            delay = next_gpu - time.monotonic()
            if delay < 0:  # fell behind (a slow scan): do not try to catch up in a burst
                next_gpu = time.monotonic()
                delay = 0.0
            self.stop.wait(delay)

    # -- follower ------------------------------------------------------------------------------

    def _follow_loop(self) -> None:
        root = self.monitor.run_root
        run_dir: Path | None = None
        log: LogFollower | None = None
        engine: JsonlReader | None = None
        next_check = 0.0
        try:
            while not self._stopped():
                now_m = time.monotonic()
                if now_m >= next_check:
                    next_check = now_m + RUN_CHECK_INTERVAL_S
                    current = records.current_run_dir(root)
                    if current is not None and current != run_dir:
                        if log is not None:
                            self._drain(log, engine, run_dir)  # finish the old run's tail first
                            log.close()
                        if engine is not None:
                            engine.close()
                        run_dir = current
                        log, engine = self._open_run(current, resume=current == self.initial_run_dir)
                if log is not None and run_dir is not None:
                    busy = self._pump(log, engine, run_dir)
                    if busy:
                        continue
                self.stop.wait(POLL_INTERVAL_S)
        finally:
            if log is not None:
                log.close()
            if engine is not None:
                engine.close()
            for reader in self._rank_readers.values():
                reader.close()

    def _open_run(self, run_dir: Path, resume: bool) -> tuple[LogFollower, JsonlReader]:
        same_run = self.resume_run_id is None or self.resume_run_id == run_dir.name
        self._resumed_run = resume and same_run and bool(self.engine_offset)  # the client has this run's history
        log_path = run_dir / records.OUTPUT_LOG
        if resume and same_run:
            log = LogFollower(log_path, offset=self.log_offset, inode=self.log_inode, start_tail_bytes=LOG_START_BYTES)
            engine_offset = self.engine_offset or 0
            if self.log_inode is not None and self.resume_run_id is None:
                # Without a run id, the log's inode tells whether the offsets belong to this run's files.
                try:
                    if os.stat(log_path).st_ino != self.log_inode:
                        engine_offset = 0
                except OSError:
                    pass  # no output.log yet: nothing says the offsets are foreign
            engine = _events_reader(run_dir / records.EVENTS_JSONL, offset=engine_offset)
            if self.engine_inode is not None and engine_offset:
                try:
                    if os.stat(run_dir / records.EVENTS_JSONL).st_ino != self.engine_inode:
                        engine = _events_reader(run_dir / records.EVENTS_JSONL, offset=0)
                except OSError:
                    engine = _events_reader(run_dir / records.EVENTS_JSONL, offset=0)
        else:
            # A run the client has not seen: announce it and stream both files from their start.
            log = LogFollower(log_path, announce_open=True, start_tail_bytes=LOG_START_BYTES)
            engine = _events_reader(run_dir / records.EVENTS_JSONL, offset=0)
        return log, engine

    def _pump(self, log: LogFollower, engine: JsonlReader | None, run_dir: Path) -> bool:
        """Forward what is new; True when the log follower stopped at its budget (more is waiting)."""
        run_id = run_dir.name
        skipped_head = log.skipped_head
        for ev in log.poll():
            if ev["ev"] == "log_reset":
                ev["run_id"] = run_id
            self._emit(ev)
        if log.skipped_head and not skipped_head:
            mib = log.skipped_head / (1 << 20)
            self._emit(protocol.event("warning", message=(
                f"output.log of {run_id}: its first {mib:.0f} MiB not sent, the log starts at its last "
                f"{LOG_START_BYTES >> 20} MiB (specdec-tui logs -n N shows more)"
            )))  # fmt: skip
        more = log.more
        if engine is not None:
            skipped = engine.skipped_bytes
            lines = engine.poll()
            more = more or engine.more
            if engine.reset:
                self._emit(
                    protocol.event(
                        "warning", message=f"events.jsonl of {run_id} was {engine.reset}; engine events restart at 0"
                    )
                )
                engine.reset = None
            if engine.skipped_bytes > skipped:
                self._emit(protocol.event("warning", message=_skipped_message(run_id, engine.skipped_bytes - skipped)))
            for end, line in lines:
                eng = _parse_engine_line(line)
                if eng is None:
                    self._emit(
                        protocol.event(
                            "warning", message=f"events.jsonl of {run_id}: unreadable line ending at byte {end}"
                        )
                    )
                    continue
                self._emit(protocol.event("engine", offset=end, inode=engine.inode, run_id=run_id, event=eng))
            more = self._pump_ranks(run_dir) or more
        return more

    def _pump_ranks(self, run_dir: Path) -> bool:
        """The other ranks' events files of a torchrun node (events.rank<R>.jsonl), forwarded as engine events
        without an offset: a resumed stream starts them at their end (their heartbeats are live state). True when
        one of them stopped at its byte budget."""
        if self._rank_dir != run_dir:
            for reader in self._rank_readers.values():
                reader.close()
            self._rank_readers, self._rank_dir = {}, run_dir
            self._rank_from_end = self._resumed_run
        try:
            names = records.rank_events_names(run_dir)
        except OSError:
            return False
        more = False
        for name in names:
            found = self._rank_readers.get(name)
            if found is not None:
                reader = found
            else:
                start = 0
                if self._rank_from_end:
                    try:
                        start = os.stat(run_dir / name).st_size
                    except OSError:
                        start = 0
                reader = self._rank_readers[name] = _events_reader(run_dir / name, offset=start)
            skipped = reader.skipped_bytes
            for _, line in reader.poll():
                eng = _parse_engine_line(line)
                if eng is not None:
                    self._emit(protocol.event("engine", run_id=run_dir.name, source=name, event=eng))
            if reader.skipped_bytes > skipped:
                message = _skipped_message(run_dir.name, reader.skipped_bytes - skipped, name)
                self._emit(protocol.event("warning", message=message))
            reader.reset = None
            more = more or reader.more
        return more

    def _drain(self, log: LogFollower, engine: JsonlReader | None, run_dir: Path | None) -> None:
        if run_dir is None:
            return
        while self._pump(log, engine, run_dir) and not self._stopped():
            pass


def _events_reader(path: Path, offset: int) -> JsonlReader:
    """A stream's reader of one events file: bounded per poll, and from byte 0 of a huge file only its ends."""
    return JsonlReader(path, offset=offset, window=STREAM_EVENTS_WINDOW)


def _skipped_message(run_id: str, skipped: int, name: str = records.EVENTS_JSONL) -> str:
    head, tail = STREAM_EVENTS_WINDOW
    return (
        f"{name} of {run_id}: {skipped / 2**20:.1f} MiB of engine events not sent (a huge file: its first "
        f"{head // 1024} KiB and its last {tail // 1024} KiB are)"
    )


def subscribe_to(agent: Agent, args: dict[str, Any]) -> Subscription:
    mon = monitor_of(agent)
    sub = Subscription(mon, args)  # validates args before the old streams are stopped
    with mon._sub_lock:
        old, mon.subscription = mon.subscription, sub
        if old is not None:
            old.close()
        limits = args.get("stall")
        if isinstance(limits, dict):
            mon.stall_limits = {k: float(v) for k, v in limits.items() if isinstance(v, (int, float))}
        sub.start()
    return sub


@handler("status")
def _status(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    return monitor_of(agent).status()


@handler("subscribe")
def _subscribe(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    sub = subscribe_to(agent, args)
    run_dir = records.current_run_dir(sub.monitor.run_root)
    return {
        "gpu_interval_s": sub.gpu_interval_s,
        "procs_interval_s": sub.procs_interval_s,
        "run_id": run_dir.name if run_dir is not None else None,
        "gpu_source": sub.monitor.gpu_source.source,
    }


@handler("unsubscribe")
def _unsubscribe(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    mon = monitor_of(agent)
    with mon._sub_lock:
        old, mon.subscription = mon.subscription, None
    if old is not None:
        old.close()
    return {"stopped": old is not None}


@handler("tail")
def _tail(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """The last ``n`` lines (at most TAIL_MAX_LINES in the reply); with ``stream``: only where they start
    (``start``), for any ``n``, the client then reads the bytes with ``read_log``."""
    n = args.get("n", 50)
    if not isinstance(n, int) or isinstance(n, bool) or n < 0:
        raise CommandError(f"n must be a non-negative integer, got {n!r}")
    run_dir = run_dir_arg(agent, args)
    log = run_dir / records.OUTPUT_LOG
    try:
        if args.get("stream"):
            res = {"lines": [], **tail_start(log, n)}
        else:
            res = tail_lines(log, min(n, TAIL_MAX_LINES))
            res["cut_to"] = TAIL_MAX_LINES if n > TAIL_MAX_LINES else None
    except FileNotFoundError:
        res = {"lines": [], "start": 0, "offset": 0, "inode": None}
    res["run_id"] = run_dir.name
    res["current"] = run_dir == records.current_run_dir(agent.run_root)
    return res


@handler("read_log")
def _read_log(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """Bytes of a run's output.log: {data, offset, inode, size} from ``offset``, at most ``max_bytes``."""
    offset = _opt_int(args, "offset") or 0
    max_bytes = min(_opt_int(args, "max_bytes") or READ_LOG_MAX_BYTES, READ_LOG_MAX_BYTES)
    run_dir = run_dir_arg(agent, args)
    try:
        res = read_range(run_dir / records.OUTPUT_LOG, offset, max_bytes)
    except FileNotFoundError:
        raise CommandError(f"run {run_dir.name} has no output.log") from None
    res["run_id"] = run_dir.name
    return res


@handler("doctor")
def _doctor(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    mon = monitor_of(agent)
    agent.progress(cmd_id, "sampling GPUs and processes")
    snap = mon.collect(with_threads=False)
    running = snap.run is not None and snap.run.state == "running"
    agent.progress(cmd_id, "importing torch in a child interpreter")
    checks = run_doctor(
        Path(agent.run_root),
        (
            mon.gpu_source.source,
            mon.gpu_source.error,
            snap.sample.gpus,
            snap.holders,
            mon.supervised_pids(snap.run, snap.run_pids),
            running,
        ),
        python=args.get("python") if isinstance(args.get("python"), str) else None,
        expect_gpu=args.get("expect_gpu") is True,
    )
    return {"checks": checks, "ok": all(c["ok"] or c["level"] == "warn" for c in checks)}


@handler("host_map")
def _host_map(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """Run on the Proxmox host: NVML's processes there, each placed in its container at its PID inside it."""
    ctid = args.get("ctid")
    if isinstance(ctid, bool) or not isinstance(ctid, (int, str)) or not str(ctid).isdigit():
        raise CommandError(f"ctid must be a numeric container id, got {ctid!r}")
    mon = monitor_of(agent)
    out: dict[str, Any] = protocol.to_jsonable(host_map.build_host_map(mon.gpu_source, str(ctid)))
    return out


@handler("host_holders")
def _host_holders(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    """The client hands this container's agent the Proxmox host's map (or why there is none)."""
    error = args.get("error")
    if error is not None and not isinstance(error, str):
        raise CommandError("error must be a string or null")
    hm: HostMap | None = None
    if args.get("map") is not None:
        try:
            hm = host_map.host_map_from_json(args["map"])
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
    if hm is None and error is None:
        raise CommandError("give map (the host's host_map reply) or error (why the host cannot be read)")
    mon = monitor_of(agent)
    mon.set_host_map(hm, error)
    return {"accepted": True, "host_map": mon.host_map_state()}


@handler("sim")
def _sim(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    src = monitor_of(agent).gpu_source
    if not isinstance(src, SimulatedGpus):
        raise CommandError("sim works only when the agent runs with --simulate-gpus N")
    try:
        touched = src.apply(args)
    except SimError as exc:
        raise CommandError(str(exc)) from exc
    return {"gpus": touched, "overrides": src.describe()}
