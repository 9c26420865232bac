"""Every supervised Python process answers SIGUSR1 with every thread's stack, ours or not, on a bare host.

Our engine registers ``engine.stackdump`` itself. Any other Python job only answered with py-spy installed, so a
``hang`` restart of such a job on a bare host recorded "no stack dump". The wrapper therefore puts a directory of
the run first on the job's PYTHONPATH holding a ``sitecustomize`` that, in each Python process of the job (at
startup, in its main thread), registers the same dump under a private module name (a copy of
``engine.stackdump``: stdlib only, so nothing of the job's own imports is shadowed), then runs the sitecustomize it
shadows, if there is one. The supervisor's ``stacks`` then finds the job as it finds the engine: the named dump in
``stacks/<pid>.txt``, faulthandler's in ``stacks/<pid>.faulthandler`` when no Python code can run.

A process that later takes SIGUSR1 or SIGUSR2 for itself (``signal.signal``: a save-on-preemption handler, say)
removes its markers at that moment, so ``stacks`` never signals it (py-spy, where installed, still reads it); our
engine installing its own dumps takes the process over (the ``.hook`` marker goes). Where py-spy is installed,
``stacks`` reads a hooked job with it rather than signalling it. The hook costs a process the import of a stdlib
module (no ``threading`` until a dump is asked for) and one empty marker file.

Not covered, and said so in the README: a process started with ``python -I``, ``-E`` or ``-S`` (no PYTHONPATH or
no site), a handler set through C (``sigaction``) rather than ``signal.signal``, and a job's environment with
``SPECDEC_STACK_HOOK=0`` (the opt-out).
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path

from engine import stackdump

SITE_DIR = "site"  # <run dir>/site: what goes first on the job's PYTHONPATH
MODULE = "_specdec_stackdump"
OPT_OUT_ENV = "SPECDEC_STACK_HOOK"

HOOK_SUFFIX = ".hook"  # stacks/<pid>.hook: this process's dumps come from the hook, not from our engine itself

SITECUSTOMIZE = '''"""specdec: this supervised run's stack dumps on SIGUSR1 (<run dir>/stacks/<pid>.txt), for its hang
handling and `specdec-tui stacks`; then the sitecustomize this one shadows, if any. SPECDEC_STACK_HOOK=0: off.
A process that takes SIGUSR1 or SIGUSR2 for itself drops its markers, so no dump request ever reaches its handler."""

import os as _os
import sys as _sys


def _specdec_install():
    run_dir = _os.environ.get("SPECDEC_RUN_DIR")
    if not run_dir or _os.environ.get("SPECDEC_STACK_HOOK") == "0":
        return
    try:
        import signal

        import _specdec_stackdump

        files = _specdec_stackdump.install(run_dir)
        if files is None:
            return
        hook = _os.path.join(_os.path.dirname(str(files.raw)), f"{_os.getpid()}@SUFFIX@")
        open(hook, "w").close()
    except Exception as exc:  # the job runs on without dumps, and says why
        print(f"specdec: no stack dumps for pid {_os.getpid()}: {exc}", file=_sys.stderr)
        return
    ours = ("engine.stackdump", "_specdec_stackdump")
    markers = {"engine.stackdump": [hook], None: [hook, str(files.raw)]}
    original = signal.signal
    pid = _os.getpid()  # a forked child shares these names, not these markers

    def _specdec_signal(signalnum, handler):
        if signalnum in (signal.SIGUSR1, signal.SIGUSR2) and _os.getpid() == pid:
            module = getattr(handler, "__module__", None)
            # our engine taking over its own dumps: no longer the hook's; anything else: no dumps asked of it
            for path in markers.get(module if module in ours else None, []):
                try:
                    _os.unlink(path)
                except OSError:
                    pass
        return original(signalnum, handler)

    signal.signal = _specdec_signal


def _specdec_chain():
    import importlib.machinery
    import importlib.util

    here = _os.path.dirname(_os.path.abspath(__file__))
    path = [p for p in _sys.path if _os.path.abspath(p or _os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    _sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_specdec_install()
_specdec_chain()
'''.replace("@SUFFIX@", HOOK_SUFFIX)


def hook_marker(run_dir: Path | str, pid: int) -> Path:
    """The file that says ``pid``'s dumps come from the hook (a job of the user's, not our engine)."""
    return stackdump.dump_files(run_dir, pid).raw.with_name(f"{pid}{HOOK_SUFFIX}")


def prepare(run_dir: Path, env: dict[str, str]) -> Path | None:
    """Write <run dir>/site (once per run) and return it; None when the job's environment opts out or the run
    directory cannot take it (the job then runs without the hook, as before)."""
    if env.get(OPT_OUT_ENV) == "0":
        return None
    site = run_dir / SITE_DIR
    try:
        site.mkdir(exist_ok=True)
        (site / f"{MODULE}.py").write_text(inspect.getsource(stackdump), encoding="utf-8")
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE, encoding="utf-8")
    except OSError:
        return None
    return site


def with_hook(env: dict[str, str], site: Path) -> dict[str, str]:
    """The job's environment with ``site`` first on its PYTHONPATH."""
    rest = env.get("PYTHONPATH")
    return {**env, "PYTHONPATH": str(site) + (os.pathsep + rest if rest else "")}
