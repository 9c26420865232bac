"""`launch --wait` exit codes from the agent's wait result: 4 only for a hang, 1 for any failure."""

from __future__ import annotations

from typing import Any

from engine.protocol import WaitResult
from tui.cli.run import _wait_exit_code


def _result(**fields: Any) -> WaitResult:
    base: dict[str, Any] = {"milestone": "first-step", "stage": "started", "cause": None, "exit_code": None}
    return WaitResult(**{**base, "signal": None, "elapsed_s": 3.0, **fields})


def test_a_dead_engine_thread_in_a_live_process_exits_1_not_4() -> None:
    result = _result(ok=False, alive=True, hung=False, cause="thread drafter1 died: RuntimeError")
    assert _wait_exit_code(result) == 1


def test_a_deadline_with_the_process_alive_and_silent_exits_4() -> None:
    assert _wait_exit_code(_result(ok=False, alive=True, hung=True, cause="hung: no output after 3 s")) == 4


def test_an_exited_process_exits_1_and_success_exits_0() -> None:
    assert _wait_exit_code(_result(ok=False, alive=False, hung=False, exit_code=127)) == 1
    assert _wait_exit_code(_result(ok=True, alive=True, hung=False)) == 0
