"""Every thread's stack of a running engine, on SIGUSR1, into files of the run directory nobody else writes.

The engine calls ``install(run_dir)`` in its main thread. On SIGUSR1 the Python-level handler writes
``stacks/<pid>.txt`` (tmp file, then rename): every thread by its ``threading`` name (``drafter0``,
``target0``), native id and frames, ending with ``END_MARKER``. It holds the GIL while it reads the other
threads' frames, so they stand still.

faulthandler's C-level dump answers on ``FALLBACK_SIGNAL`` (SIGUSR2) only, appended to
``stacks/<pid>.faulthandler``. It walks every thread's frames from inside a signal handler without the GIL:
while other threads run Python code, their frames change under it and the walk can read a freed frame and
kill the process with SIGSEGV (chained in front of every SIGUSR1, it did so once in twelve dumps of a busy
CPU run). So the reader (the supervisor's ``stacks``) signals SIGUSR1, waits a bounded time for a new
``<pid>.txt`` that ends with the marker, and only when none came, which means no Python code can run
(a thread holds the GIL, so every other thread is parked waiting for it), asks for faulthandler's dump.
Nothing else writes these files, so a busy log never delays or pollutes a dump. Stdlib only: the agent and
supervisor import it too.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    import threading

STACKS_DIR = "stacks"
END_MARKER = "# end of stack dump"
SIGNAL = signal.SIGUSR1
FALLBACK_SIGNAL = signal.SIGUSR2  # faulthandler's unnamed dump, asked for only when the named one cannot come


@dataclass(frozen=True)
class DumpFiles:
    text: Path  # the Python-level dump with thread names, replaced whole on every signal
    raw: Path  # faulthandler's dumps, appended on every FALLBACK_SIGNAL


def dump_files(run_dir: Path | str, pid: int) -> DumpFiles:
    base = Path(run_dir) / STACKS_DIR
    return DumpFiles(text=base / f"{pid}.txt", raw=base / f"{pid}.faulthandler")


def format_threads(interrupted: FrameType | None = None) -> str:
    """Every Python thread's stack, named (most recent call last); the signal handler's own frames left out."""
    import threading  # here, not at import: the stack hook loads this module into every process of a job
    import traceback

    frames = sys._current_frames()
    by_ident = {t.ident: t for t in threading.enumerate()}
    me = threading.get_ident()
    if interrupted is not None:
        frames[me] = interrupted  # the frame the signal interrupted, not the handler's
    out: list[str] = []
    for ident, frame in sorted(frames.items(), key=lambda item: _order(by_ident.get(item[0]))):
        thread = by_ident.get(ident)
        name = thread.name if thread is not None else "(not a threading.Thread)"
        native = getattr(thread, "native_id", None)
        flags = [f"native id {native}" if native is not None else f"ident 0x{ident:x}"]
        if thread is not None and thread.daemon:
            flags.append("daemon")
        out.append(f"Thread {name} ({', '.join(flags)}), most recent call last:")
        out.extend(line.rstrip("\n") for line in traceback.format_stack(frame))
        out.append("")
    return "\n".join(out)


def _order(thread: threading.Thread | None) -> tuple[int, str]:
    import threading

    if thread is None:
        return (2, "")
    return (0 if thread is threading.main_thread() else 1, thread.name)


def write_dump(path: Path, interrupted: FrameType | None = None) -> None:
    """The named dump into ``path`` (tmp file, then rename: a reader never sees half a dump)."""
    body = format_threads(interrupted)
    header = f"# stack dump of pid {os.getpid()} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
    tmp = path.with_name(f"{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write(header + body + f"\n{END_MARKER}\n")
    os.replace(tmp, path)


def _install_on_stream(stream: IO[str]) -> None:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        header = f"# stack dump of pid {os.getpid()} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n"
        stream.write(header + format_threads(frame) + f"\n{END_MARKER}\n")
        stream.flush()

    signal.signal(SIGNAL, on_signal)
    faulthandler.register(FALLBACK_SIGNAL, file=stream, all_threads=True)


_raw_file: IO[bytes] | None = None  # kept open for the process's life: faulthandler writes to its descriptor


def install(run_dir: Path | str | None, fallback: IO[str] | None = None) -> DumpFiles | None:
    """Register the SIGUSR1 dumps (main thread only). Without a (writable) run dir: the named dump to
    ``fallback``/stderr, faulthandler's on FALLBACK_SIGNAL to the same stream."""
    global _raw_file
    if not hasattr(signal, "SIGUSR1"):
        return None
    if not run_dir:
        _install_on_stream(fallback or sys.stderr)
        return None
    files = dump_files(run_dir, os.getpid())
    try:
        files.text.parent.mkdir(parents=True, exist_ok=True)
        _raw_file = open(files.raw, "ab")  # noqa: SIM115 - must outlive this function
    except OSError as exc:  # a read-only run dir must not stop the run: dumps go to stderr as before
        print(f"stack dumps go to stderr: cannot write {files.raw}: {exc}", file=fallback or sys.stderr)
        _install_on_stream(fallback or sys.stderr)
        return None

    def on_signal(signum: int, frame: FrameType | None) -> None:
        try:
            write_dump(files.text, frame)
        except OSError as exc:  # a full or read-only disk: say it where the run's log goes
            print(f"stack dump to {files.text} failed: {exc}", file=sys.stderr)

    signal.signal(SIGNAL, on_signal)
    faulthandler.register(FALLBACK_SIGNAL, file=_raw_file, all_threads=True)
    return files
