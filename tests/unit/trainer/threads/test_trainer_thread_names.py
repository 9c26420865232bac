"""Engine threads carry OS-level names, so the agent's process tree shows `drafter0`, not `python3`."""

from __future__ import annotations

import os
import threading
from pathlib import Path

from engine.trainer.threads.health import name_os_thread


def test_named_thread_shows_its_name_in_proc_comm() -> None:
    seen: dict[str, str] = {}
    ready = threading.Event()

    def body() -> None:
        name_os_thread("drafter-5")
        tid = threading.get_native_id()
        seen["comm"] = Path(f"/proc/{os.getpid()}/task/{tid}/comm").read_text().strip()
        ready.set()

    t = threading.Thread(target=body, name="drafter-5")
    t.start()
    assert ready.wait(5)
    t.join(5)
    assert seen["comm"] == "drafter-5"


def test_long_names_are_cut_to_the_kernel_limit() -> None:
    seen: dict[str, str] = {}

    def body() -> None:
        name_os_thread("producer-with-a-very-long-name")
        seen["comm"] = Path(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/comm").read_text().strip()

    t = threading.Thread(target=body)
    t.start()
    t.join(5)
    assert seen["comm"] == "producer-with-a"
