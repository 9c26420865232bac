"""Signalling a process group only while it is provably the run's (a pid or pgid may be reused by then)."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys

import pytest
from support.waiting import wait_until

from engine.host import procs
from engine.supervisor.members import group_is_ours, signal_group_checked
from tui.cli.run import launch_cwd


def _session_sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)


def test_a_group_whose_pinned_members_are_gone_is_not_signalled_as_a_group() -> None:
    stranger = _session_sleeper()  # stands in for a process that reused the run's old group id
    try:
        st = procs.read_stat(stranger.pid)
        assert st is not None and st.pgrp == stranger.pid
        stale_pin = {stranger.pid: st.start_ticks - 1}  # what we pinned was another process of that number
        assert not group_is_ours(stranger.pid, stale_pin)
        assert signal_group_checked(stranger.pid, stale_pin, signal.SIGTERM) is False
        with pytest.raises(subprocess.TimeoutExpired):  # and it lives on: nothing reached it
            stranger.wait(timeout=0.3)
    finally:
        stranger.kill()
        stranger.wait()


def test_a_group_with_a_pinned_live_member_is_signalled_as_a_group() -> None:
    member = _session_sleeper()
    try:
        st = procs.read_stat(member.pid)
        assert st is not None
        assert signal_group_checked(member.pid, {member.pid: st.start_ticks}, signal.SIGTERM) is True
        wait_until(lambda: member.poll() is not None, 5, "the group's member to die of the SIGTERM")
    finally:
        if member.poll() is None:
            member.kill()
        member.wait()


def test_restart_without_a_cwd_option_starts_where_the_profile_or_the_user_is() -> None:
    restart_args = argparse.Namespace(target="local", pct=None)  # the restart parser has no --cwd
    assert launch_cwd(restart_args, "/srv/work") == "/srv/work"
    assert launch_cwd(restart_args, None) == os.getcwd()
