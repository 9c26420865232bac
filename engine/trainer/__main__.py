"""``specdec-train`` / ``python3 -m engine.trainer``: run the threaded EAGLE-3 drafter trainer.

    specdec-train --preset cpu-demo
    specdec-train --config engine.toml --set steps=100 --set 'drafter_devices=["cuda:0","cuda:1"]'
    specdec-train export CHECKPOINT_OR_OUTPUT_DIR OUT_DIR [--format eagle3|speculators] [--drafter NAME]
    specdec-train eval --checkpoint runs/cpu-demo [--k 5] [--count stop|vllm] [--json]   (τ: serve/evaluate.py)
    specdec-train regenerate --target tiny-trained --out regen.jsonl   (its own replies: verifier/regenerate.py)
    specdec-train serve-check RUN [--vllm-python PATH]   (vLLM serving the latest export: serve/serve_check.py)

Several processes (torch.distributed, one rank per node by default, each rank the threaded engine):

    specdec-train --print-torchrun --nnodes 2 --node-rank 0 --rdzv-endpoint node0:29500 --preset h200-single
    specdec-train --torchrun --nproc-per-node 2 --preset cpu-demo   # execs the torchrun command line

Events go to $SPECDEC_EVENTS (default <output_dir>/events.jsonl), each tagged with ``rank``, ``world_size`` and
``node`` under torchrun; further ranks of a node write events.rank<R>.jsonl beside it and prefix their human
lines with ``[rank R]``. Human lines ``step=N loss=… acc0=… tok/s=…`` go to stdout. SIGTERM stops every rank at
the next step boundary, rank 0 saves a checkpoint, and all exit 0; one that comes while the run is built (the
target loading, the data tokenizing) ends it there, nothing trained or saved, each rank stopped, exit 0.
SIGUSR1 dumps every thread's stack, named, into <run dir>/stacks/<pid>.txt (to stderr outside the
supervisor). Exit codes: 0 done or stopped, 1 failed, 2 config error.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from engine import stackdump
from engine.protocol import ENV_EVENTS_PATH, ENV_RUN_DIR, RunEndEvent
from engine.trainer.config import (
    BUILTIN_TARGETS,
    PRESETS,
    ConfigError,
    TrainerConfig,
    check_cuda_present,
    check_data_file,
    from_dict,
    load_toml,
    parse_override,
    preset,
)
from engine.trainer.run.dir_hold import hold_output_dir
from engine.trainer.run.torchrun import RankInfo, events_path_for_rank, rank_from_env, shell_line, torchrun_command
from engine.trainer.threads.metrics import EventLog, events_path_for

SUBCOMMANDS_HELP = """\
also:
  specdec-train eval --checkpoint DIR [--k 5] [--count stop|vllm] [--json]
      acceptance length tau of a checkpoint (or a run's output dir) on its held-out conversations
  specdec-train regenerate --target DIR --data FILE --out FILE [--temperature T]
      the data's assistant turns rewritten with the target's own replies (resumable)
  specdec-train serve-check RUN [--vllm-python PATH]
      vLLM serves the run's latest export; its acceptance next to ours (exit 3: vLLM absent)
  specdec-train export CHECKPOINT_OR_OUTPUT_DIR OUT_DIR [--format eagle3|speculators] [--drafter NAME]
      the drafter as vLLM / SGLang load it (each drafter of an independent run in its own subfolder)
  (each has its own --help)
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    # No abbreviations: --torchrun is filtered out of the ranks' argv by its exact spelling (--torch would respawn).
    ap = argparse.ArgumentParser(
        prog="specdec-train",
        description="Threaded EAGLE-3 drafter trainer",
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=SUBCOMMANDS_HELP,
    )
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--config", help="engine config (TOML)")
    src.add_argument("--preset", choices=sorted(PRESETS), help="a built-in config")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override one key (TOML value)")
    ap.add_argument("--output-dir", help="override output_dir")
    ap.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    launch = ap.add_argument_group("torchrun launch (config keys nproc_per_node, nnodes, node_rank, rdzv_endpoint)")
    launch.add_argument("--nproc-per-node", type=int, help="ranks on this node (1: one rank drives every GPU)")
    launch.add_argument("--nnodes", type=int, help="nodes in the run")
    launch.add_argument("--node-rank", type=int, help="this node's rank, 0..nnodes-1")
    launch.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (on node 0)")
    how = launch.add_mutually_exclusive_group()
    how.add_argument("--print-torchrun", action="store_true", help="print the torchrun command line and exit")
    how.add_argument("--torchrun", action="store_true", help="run this config under torchrun (exec)")
    return ap.parse_args(argv)


LAUNCH_KEYS = {"nproc_per_node": "--nproc-per-node", "nnodes": "--nnodes", "node_rank": "--node-rank"}
LAUNCH_ONLY_FLAGS = ("--print-torchrun", "--torchrun")


def engine_argv(argv: list[str]) -> list[str]:
    """The arguments each rank gets: these minus the launch-only flags."""
    return [a for a in argv if a not in LAUNCH_ONLY_FLAGS]


def torchrun_line(cfg: TrainerConfig, argv: list[str]) -> list[str]:
    return torchrun_command(
        engine_argv(argv),
        nproc_per_node=cfg.nproc_per_node,
        nnodes=cfg.nnodes,
        node_rank=cfg.node_rank,
        rdzv_endpoint=cfg.rdzv_endpoint,
    )


def resolve_config(args: argparse.Namespace) -> TrainerConfig:
    overrides = dict(parse_override(s) for s in args.set)
    for key in ("nproc_per_node", "nnodes", "node_rank", "rdzv_endpoint"):
        if getattr(args, key) is not None:
            overrides[key] = getattr(args, key)
    if args.output_dir:
        overrides["output_dir"] = args.output_dir
    if args.config:
        cfg = load_toml(args.config)
    elif args.preset:
        cfg = preset(args.preset)
    elif str(overrides.get("target", "tiny")) not in BUILTIN_TARGETS:
        # A Hugging Face target named with --set alone: the defaults that train a drafter for it, not the tiny demo.
        return place_output_dir(from_dict(overrides), os.environ.get(ENV_RUN_DIR))
    else:
        cfg = preset("cpu-demo")
    cfg = from_dict(overrides, cfg) if overrides else cfg
    return place_output_dir(cfg, os.environ.get(ENV_RUN_DIR))


def place_output_dir(cfg: TrainerConfig, run_dir: str | None) -> TrainerConfig:
    """Under the supervisor, a relative output_dir lives in <run_root>/engine/, not in whatever directory the
    job started in, and stays the same across runs so that `restart` resumes from the last checkpoint."""
    if not run_dir or Path(cfg.output_dir).expanduser().is_absolute():
        return cfg
    run_root = Path(run_dir).resolve().parent.parent  # <run_root>/runs/<run-id>
    return from_dict({"output_dir": str(run_root / "engine" / cfg.output_dir)}, cfg)


def link_checkpoints(cfg: TrainerConfig, run_dir: str | None) -> None:
    """<run_dir>/checkpoints points at the engine's checkpoints (engine.supervisor.records.layout)."""
    if not run_dir:
        return
    link = Path(run_dir) / "checkpoints"
    if link.exists() or link.is_symlink():
        return
    target = Path(cfg.output_dir).expanduser().resolve() / "checkpoints"
    try:
        target.mkdir(parents=True, exist_ok=True)
        link.symlink_to(target, target_is_directory=True)
    except OSError as exc:  # a read-only run dir must not stop training; say it once
        print(f"specdec-train: cannot link {link} -> {target}: {exc}", file=sys.stderr)


def export_main(argv: list[str]) -> int:
    """``specdec-train export``: a checkpoint as the EAGLE-3 draft model vLLM / SGLang load (see export.py)."""
    from engine.trainer.serve import export

    ap = argparse.ArgumentParser(
        prog="specdec-train export",
        description="Export a trained drafter for vLLM / SGLang (EAGLE-3)",
        allow_abbrev=False,
    )
    export.add_arguments(ap)
    return export.run(ap.parse_args(argv))


def main(argv: list[str] | None = None) -> int:
    words = sys.argv[1:] if argv is None else argv
    if words[:1] == ["export"]:
        return export_main(words[1:])
    faulthandler.enable(sys.stderr)
    stackdump.install(os.environ.get(ENV_RUN_DIR))  # SIGUSR1: named stacks into <run dir>/stacks/
    if words[:1] == ["eval"]:
        from engine.trainer.serve.evaluate import main as eval_main

        return interruptible("eval", eval_main, words[1:])
    if words[:1] == ["regenerate"]:
        from engine.trainer.verifier.regenerate import main as regenerate_main

        return interruptible("regenerate", regenerate_main, words[1:])
    if words[:1] == ["serve-check"]:
        from engine.trainer.serve.serve_check import main as serve_check_main

        return interruptible("serve-check", serve_check_main, words[1:])
    args = parse_args(argv)
    try:
        cfg = resolve_config(args)
        if not (args.print_config or args.print_torchrun):
            check_cuda_present(cfg)
            check_data_file(cfg)
    except ConfigError as exc:
        print(f"specdec-train: config error: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        for key, value in cfg.to_dict().items():
            print(f"{key} = {value!r}")
        return 0
    raw_argv = list(sys.argv[1:] if argv is None else argv)
    if args.print_torchrun:
        print(shell_line(torchrun_line(cfg, raw_argv)))
        return 0
    if args.torchrun:
        cmd = torchrun_line(cfg, raw_argv)
        sys.stdout.flush()
        os.execvp(cmd[0], cmd)
    info = rank_from_env() if cfg.distributed == "auto" else RankInfo()
    dir_hold = None
    if info.rank == 0 and not os.environ.get(ENV_EVENTS_PATH):
        # The events go to <output_dir>/events.jsonl: a trainer refused there must not write into the running one's.
        try:
            dir_hold = hold_output_dir(Path(cfg.output_dir).expanduser().resolve())
        except ConfigError as exc:
            print(f"specdec-train: config error: {exc}", file=sys.stderr)
            if info.launched:  # its peers wait for rank 0 in the rendezvous: they see it go now
                sys.stderr.flush()
                os._exit(2)
            return 2
    if info.local_rank == 0:  # the ranks of a node share the run dir: one link
        link_checkpoints(cfg, os.environ.get(ENV_RUN_DIR))
    events = EventLog(
        events_path_for_rank(events_path_for(cfg.output_dir), info),
        tags=info.tags(),
        prefix=f"[rank {info.rank}] " if info.rank > 0 else "",
    )
    t0 = time.perf_counter()
    events.stage("imports", "importing torch")
    try:
        import torch

        from engine.trainer.data.rows import LoadingStopped
        from engine.trainer.run.loop import TrainingRun
    except KeyboardInterrupt:  # Ctrl-C before the stop handlers exist: stopped, nothing built, as a stop later is
        return stopped_in_build(events, info, "stopped (SIGINT) while importing torch")
    except Exception as exc:
        events.emit(RunEndEvent(ok=False, reason=f"import failed: {type(exc).__name__}: {exc}", step=0))
        raise
    events.stage("imports", f"torch {torch.__version__} in {time.perf_counter() - t0:.1f} s")
    engine = TrainingRun(cfg, events, info)
    if dir_hold is not None:
        engine.adopt_output_dir_hold(dir_hold)
    engine.install_signal_handlers()
    try:
        engine.build()
    except LoadingStopped as exc:  # SIGTERM or SIGINT while the run is built (target, data, drafters): nothing saved
        return stopped_in_build(events, info, str(exc))
    except ConfigError as exc:  # found only once torch or the data is there (a device count, strict_data): exit 2
        events.emit(RunEndEvent(ok=False, reason=f"config error: {exc}", step=0))
        print(f"specdec-train: config error: {exc}", file=sys.stderr)
        events.close()
        if info.launched:
            leave_now(events, 2, f"config error: {exc}")
        return 2
    except Exception as exc:
        stopped = engine.stopped_while_building(exc)
        if stopped is not None:
            return stopped_in_build(events, info, stopped)
        events.emit(RunEndEvent(ok=False, reason=f"setup failed: {type(exc).__name__}: {exc}", step=0))
        if info.launched:
            leave_now(events, 1, f"setup failed: {type(exc).__name__}: {exc}")
        raise
    code = engine.run()
    if info.launched:
        # A torchrun rank never runs interpreter teardown, even after a clean run: its records are written and its
        # process group left by now, and the C++ destructors that teardown runs (gloo pairs, the store client) can
        # abort the process (SIGABRT) when a peer closes its sockets meanwhile; torchrun then fails a finished run.
        if code != 0:
            reason: str | None = engine.control.abort_reason or "failed"
        elif engine.finalize_unsafe:
            reason = "left without interpreter teardown: a heartbeat thread is still in a store call"
        else:
            reason = None
        leave_now(events, code, reason)
    events.close()
    return code


def interruptible(name: str, command: Callable[[list[str]], int], argv: list[str]) -> int:
    """Run a subcommand; Ctrl-C ends it with one line and exit 130, not a traceback (regenerate's output stays
    valid, and a rerun resumes it)."""
    try:
        return command(argv)
    except KeyboardInterrupt:
        print(f"specdec-train {name}: interrupted", file=sys.stderr)
        return 130


def stopped_in_build(events: EventLog, info: RankInfo, reason: str) -> int:
    """A stop signal ended the build (nothing trained, nothing to save): run_end ok, exit 0. A torchrun rank leaves
    at once, so a peer waiting in a collective sees it go now rather than after this process's teardown."""
    events.emit(RunEndEvent(ok=True, reason=reason, step=0))
    events.stage("done", reason)
    if info.launched:
        leave_now(events, 0, reason)
    events.close()
    return 0


def leave_now(events: EventLog, code: int, reason: str | None) -> NoReturn:
    """A torchrun rank exits at once, without interpreter teardown: a failed one so that its peers' next
    collective fails fast (naming it) instead of waiting out the timeout; any one so that teardown cannot block
    on threads stuck in a collective or abort in a destructor. ``reason``: the one line said on stderr."""
    events.close()
    if reason is not None:
        print(f"specdec-train: {reason}", file=sys.stderr)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
