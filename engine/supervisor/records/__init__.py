"""engine.supervisor.records: a run's records on disk, in one room, one module per job.

Each module imports only those above it in this list (no module imports this package's ``__init__``)::

    layout       run ids and the run directory: where each record lives, ``current``, listing runs
    documents    submitted.json, launch.json, exit.json as typed dataclasses; ``run_pids``, the one answer to
                 "which live processes are this run's"
    atomic       atomic JSON writes, the exit record's reserved blocks (a full disk cannot lose the exit)
    log_failure  what output.log says failed: the first exception, torchrun's root-cause block
    scanner      the incremental scan of output.log and the events files (``RunScanner``, ``ScannerCache``)
    cause        why a run failed (the failing rank, the cause line) or will never start (tmux, setsid)
    read         ``read_run``: records, scan and process table joined into the RunInfo the agent reports

The names callers use are re-exported here, so a caller writes ``records.read_run`` without knowing which
module holds it. Stdlib only: this runs on hosts that have nothing but python3.
"""

from engine.supervisor.records.atomic import (
    EXIT_RESERVE_BYTES,
    reserve_exit_record,
    write_exit_record,
    write_json_atomic,
)
from engine.supervisor.records.cause import (
    PEER_FAILURE,
    ROOT_CAUSE_KEY,
    STARTING_GRACE_S,
    RankFailure,
    failure_cause,
    never_started_cause,
    pane_note,
    rank_failure,
    root_cause,
    signal_name,
    stopped_cause,
)
from engine.supervisor.records.documents import (
    ExitRecord,
    LaunchRecord,
    Record,
    SubmittedRecord,
    read_exit,
    read_launch,
    read_submitted,
    run_pids,
)
from engine.supervisor.records.layout import (
    CHECKPOINTS_DIR,
    CURRENT_LINK,
    EVENTS_JSONL,
    EXIT_JSON,
    EXIT_RESERVED,
    LAUNCH_JSON,
    MILESTONES_JSON,
    OUTPUT_LOG,
    RANK_EVENTS_FILES_MAX,
    RANK_EVENTS_RE,
    RESTARTS_JSON,
    RUNS_DIR,
    SPEC_JSON,
    SUBMITTED_JSON,
    current_refusal,
    current_run_dir,
    list_runs,
    new_run_id,
    rank_events_names,
    read_json,
    run_dir_for,
    runs_dir,
    set_current,
)
from engine.supervisor.records.log_failure import Failure, FailureScan, last_step_in
from engine.supervisor.records.read import last_lines, rank_last_lines, read_milestones, read_run, unended_runs
from engine.supervisor.records.scanner import (
    LOG_LINE_MAX_BYTES,
    RankState,
    RunScanner,
    ScannerCache,
    ScanState,
    new_scanner,
    nproc_per_node,
)

__all__ = [
    "CHECKPOINTS_DIR",
    "CURRENT_LINK",
    "EVENTS_JSONL",
    "EXIT_JSON",
    "EXIT_RESERVED",
    "EXIT_RESERVE_BYTES",
    "LAUNCH_JSON",
    "LOG_LINE_MAX_BYTES",
    "MILESTONES_JSON",
    "OUTPUT_LOG",
    "PEER_FAILURE",
    "RANK_EVENTS_FILES_MAX",
    "RANK_EVENTS_RE",
    "RESTARTS_JSON",
    "ROOT_CAUSE_KEY",
    "RUNS_DIR",
    "SPEC_JSON",
    "STARTING_GRACE_S",
    "SUBMITTED_JSON",
    "ExitRecord",
    "Failure",
    "FailureScan",
    "LaunchRecord",
    "RankFailure",
    "RankState",
    "Record",
    "RunScanner",
    "ScanState",
    "ScannerCache",
    "SubmittedRecord",
    "current_refusal",
    "current_run_dir",
    "failure_cause",
    "last_lines",
    "last_step_in",
    "list_runs",
    "never_started_cause",
    "new_run_id",
    "new_scanner",
    "nproc_per_node",
    "pane_note",
    "rank_events_names",
    "rank_failure",
    "rank_last_lines",
    "read_exit",
    "read_json",
    "read_launch",
    "read_milestones",
    "read_run",
    "read_submitted",
    "reserve_exit_record",
    "root_cause",
    "run_dir_for",
    "run_pids",
    "runs_dir",
    "set_current",
    "signal_name",
    "stopped_cause",
    "unended_runs",
    "write_exit_record",
    "write_json_atomic",
]
