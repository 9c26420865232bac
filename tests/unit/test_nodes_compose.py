"""Several nodes, one run, as the client composes it (tui/nodes.py, the profile's ``nodes``, the agent's
``rendezvous`` probe): no connection anywhere; the loopback sshd tests are tests/integration/test_nodes.py."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from engine import protocol
from engine.host import net
from tui.link.session import CommandFailed, ConnectOptions
from tui.nodes import NodeRun, combined_run, launch_run, node_spec, resolve_nodes, tag_line
from tui.profiles import Profile, ProfileError, load_profiles, resolve_profile

REPO = Path(__file__).resolve().parents[2]


def write(tmp: Path, text: str) -> str:
    path = tmp / "config.toml"
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_a_profile_names_its_nodes_as_targets_or_tables_and_a_rendezvous(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        '[profiles.two]\nnodes = ["gpu-a", { target = "root@gpu-b", pct = 200, port = 2222, run_root = "/r" }]\n'
        'rendezvous = { address = "127.0.0.1", port = 29511 }\n',
    )
    prof = resolve_profile("two", cfg)
    assert [n.target for n in prof.nodes] == ["gpu-a", "root@gpu-b"]
    assert (prof.nodes[1].pct, prof.nodes[1].port, prof.nodes[1].run_root) == (200, 2222, "/r")
    assert (prof.rendezvous.address, prof.rendezvous.port) == ("127.0.0.1", 29511)


@pytest.mark.parametrize(
    ("nodes", "key", "says"),
    [
        ("[]", "profiles.p.nodes", "non-empty list"),
        ('[{ target = "a", colour = 1 }]', "profiles.p.nodes[0].colour", "unknown key"),
        ('["a", { target = "b", port = 70000 }]', "profiles.p.nodes[1].port", "1..65535"),
        ('["a", "-oProxyCommand=x"]', "profiles.p.nodes[1].target", "not an SSH target"),
        ('["a", "a"]', "profiles.p.nodes[1]", "names a twice"),
        ("[3]", "profiles.p.nodes[0]", "SSH target"),
    ],
)
def test_a_bad_node_list_is_refused_naming_the_key(tmp_path: Path, nodes: str, key: str, says: str) -> None:
    cfg = write(tmp_path, f"[profiles.p]\nnodes = {nodes}\n")
    with pytest.raises(ProfileError) as info:
        load_profiles(cfg)
    assert f": {key}: " in str(info.value) and says in str(info.value), info.value


def test_each_node_keeps_its_own_options_over_the_command_lines_and_labels_stay_apart(tmp_path: Path) -> None:
    cfg = write(
        tmp_path,
        '[profiles.p]\nnodes = [{ target = "u@127.0.0.1", port = 2201 }, { target = "u@127.0.0.1", port = 2202, '
        'run_root = "/n1" }, "u@127.0.0.1:2201"]\n',
    )
    base = ConnectOptions(identity="/k", run_root="/base", port=22)
    nodes = resolve_nodes([], resolve_profile("p", cfg), base)
    assert [n.label for n in nodes] == ["u@127.0.0.1:2201", "u@127.0.0.1:2202", "u@127.0.0.1:2201#2"]
    assert [(n.opts.port, n.opts.run_root, n.opts.identity) for n in nodes[:2]] == [
        (2201, "/base", "/k"),
        (2202, "/n1", "/k"),
    ]
    assert [n.rank for n in nodes] == [0, 1, 2]
    given = resolve_nodes(["h1", "h2"], resolve_profile("p", cfg), base)  # TARGETs on the command line win
    assert [(n.target, n.opts.port) for n in given] == [("h1", 22), ("h2", 22)]


def test_each_node_runs_the_engine_as_torchrun_with_its_rank_and_the_shared_endpoint() -> None:
    nodes = resolve_nodes(["local", "local"], Profile(name="p"), ConnectOptions(python="/usr/bin/python3"))
    for n in nodes:
        n.open()
    specs = [node_spec(Profile(name="p"), n, nnodes=2, endpoint="127.0.0.1:29500", run_id="r1") for n in nodes]
    for rank, spec in enumerate(specs):
        assert spec.command[:3] == ["/usr/bin/python3", "-m", "engine.trainer"]
        assert spec.command[3:11] == ["--torchrun", "--nnodes", "2", "--node-rank", str(rank),
                                      "--rdzv-endpoint", "127.0.0.1:29500", "--preset"]  # fmt: skip
        assert spec.run_id == "r1" and spec.env["SPECDEC_NODE_RANK"] == str(rank)
    foreign = node_spec(Profile(name="p"), nodes[1], nnodes=2, endpoint="h:1", run_id=None, command=["bash", "x"])
    assert foreign.command == ["bash", "x"]  # a foreign command is told in its environment, never rewritten
    assert (foreign.env["SPECDEC_NNODES"], foreign.env["SPECDEC_RDZV_ENDPOINT"]) == ("2", "h:1")


def run(state: str, cause: str | None = None, rank: int | None = None, ended: float | None = None) -> protocol.RunInfo:
    return protocol.RunInfo(run_id="r1", run_dir="/d", state=state, cause=cause, failed_rank=rank, ended_at=ended)


def test_the_combined_state_names_the_node_whose_own_rank_failed_not_the_peer_that_saw_it_go() -> None:
    parts = [
        NodeRun("a", run("failed", "rank 1 (node 1) failed or left the run; rank 0 (node 0) said: x", 1, 10.0)),
        NodeRun("b", run("failed", "rank 1 (node 1) killed by SIGKILL", 1, 11.0)),
    ]
    combined = combined_run(parts)
    assert (combined["state"], combined["failed_node"], combined["failed_rank"]) == ("failed", "b", 1)
    assert combined["cause"] == "node b: rank 1 (node 1) killed by SIGKILL"
    assert combined_run([NodeRun("a", run("running")), NodeRun("b", run("running"))])["state"] == "running"
    lost = combined_run([NodeRun("a", run("running")), NodeRun("b", None, "connection refused")])
    assert lost["state"] == "unreachable" and lost["unreachable"] == ["b"] and "node b unreachable" in lost["cause"]
    assert combined_run([NodeRun("a", None), NodeRun("b", None)])["state"] == "none"


def test_a_run_stopped_on_every_node_is_stopped_and_one_that_failed_anywhere_is_failed() -> None:
    said = "stopped (SIGTERM), torchrun exited with code 1; every rank ended cleanly"
    both = combined_run([NodeRun("a", run("stopped", said)), NodeRun("b", run("stopped", said))])
    assert (both["state"], both["cause"], both["failed_node"]) == ("stopped", None, None)
    one = combined_run([NodeRun("a", run("stopped", said)), NodeRun("b", run("failed", "rank 1 (node 1): boom", 1))])
    assert (one["state"], one["failed_node"]) == ("failed", "b")


def test_while_only_the_survivor_has_spoken_the_failure_sits_on_the_node_of_the_rank_that_went() -> None:
    echo = "rank 1 (node 1) failed or left the run; rank 0 (node 0) said: PeerFailure"
    parts = [NodeRun("a", run("failed", echo, 1, 10.0)), NodeRun("b", run("running"))]
    combined = combined_run(parts, rank_nodes={0: "a", 1: "b"})
    assert (combined["failed_node"], combined["failed_rank"]) == ("b", 1), combined
    assert combined["cause"].startswith("node b: rank 1 failed or left the run (node a saw it go: "), combined
    assert combined_run(parts)["failed_node"] == "a"  # no rank map, no node ranks: the survivor, in its words
    # `status --profile` has no rank map; the survivor's records name the rank's node (node 1), and each part says
    # its own node rank: the failure sits on node 1 from the first status that shows it.
    said = protocol.RunInfo(run_id="r1", run_dir="/d", state="failed", cause=echo, failed_rank=1, failed_node=1,
                            ended_at=10.0, node_rank=0)  # fmt: skip
    alive = protocol.RunInfo(run_id="r1", run_dir="/d", state="running", node_rank=1)
    placed = combined_run([NodeRun("a", said), NodeRun("b", alive)])
    assert (placed["failed_node"], placed["failed_rank"]) == ("b", 1), placed
    assert placed["cause"].startswith("node b: rank 1 failed or left the run (node a saw it go: "), placed


def test_log_lines_are_tagged_by_node_and_a_further_ranks_by_node_and_rank() -> None:
    assert tag_line("gpu-a", "step=3 loss=1") == "[gpu-a] step=3 loss=1"
    assert tag_line("gpu-b", "[rank 1] step=3") == "[gpu-b/rank 1] step=3"
    assert tag_line("gpu-b", "[rank x] odd") == "[gpu-b] [rank x] odd"


def test_the_agent_probe_picks_a_free_port_and_routes_loopback_from_loopback() -> None:
    assert net.route_source("127.0.0.1") == "127.0.0.1"
    assert net.route_source("no-such-host.invalid") is None
    with socket.socket() as held:
        held.bind(("", 0))
        held.listen()
        taken = int(held.getsockname()[1])
        assert not net.port_free(taken)
        other = net.pick_port(taken)
        assert other != taken and net.port_free(other)
    assert net.ssh_address({"SSH_CONNECTION": "::1 5555 127.0.0.1 22"}) == "127.0.0.1"
    assert net.ssh_client({"SSH_CONNECTION": "::1 5555 127.0.0.1 22"}) == "::1"
    assert net.ssh_address({}) is None


@pytest.mark.parametrize(
    "argv", [["status"], ["doctor", "a", "b"], ["runs", "a", "b"], ["stop", "a b", "c"], ["connect", "a b", "c"]]
)
def test_bad_targets_on_the_command_line_exit_2_with_one_error_line(argv: list[str], tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text("[profiles.one]\n", encoding="utf-8")  # a profile with no nodes
    done = subprocess.run(
        [sys.executable, "-m", "tui", *argv, "--config", str(config), "--profile", "one"],
        capture_output=True, text=True, timeout=60, cwd=REPO, env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    errors = [ln for ln in done.stderr.splitlines() if "error:" in ln]
    assert len(errors) == 1 and "Traceback" not in done.stderr, done.stderr
    assert "TARGET" in errors[0], errors


def test_a_node_log_line_that_never_ends_is_cut_not_kept() -> None:
    """A progress bar redrawn with \\r never sends a newline: the merged log cuts it at 64 KiB instead of holding
    (and re-copying) all of it."""
    from tui.cli.nodes import HELD_MAX_BYTES, _TaggedLines

    written: list[str] = []
    lines = _TaggedLines("gpu-a", written.append)
    for _ in range(100):
        lines.feed(b"\r 42%|####      | 420/1000 " * 40)
    assert len(lines.held) <= HELD_MAX_BYTES
    assert written and all(w.startswith("[gpu-a]") for w in written)
    lines.feed(b" done\nstep=1\n")
    assert written[-1].endswith("step=1")


class ScriptedNode:
    """A node's session for ``launch_run``: what a launch spec reads of it (the interpreter, where the engine is),
    and each command answered from ``answers`` (a reply, or a CommandFailed to raise), what it was asked kept."""

    def __init__(self, answers: dict[str, dict[str, Any] | CommandFailed]) -> None:
        self.answers = answers
        self.asked: list[tuple[str, dict[str, Any]]] = []
        self.opts, self.agent, self.engine_pythonpath = ConnectOptions(python="/usr/bin/python3"), None, "/srv/engine"

    async def request(self, cmd: str, *, timeout_s: float | None = None, **args: Any) -> dict[str, Any]:
        self.asked.append((cmd, args))
        answer = self.answers[cmd]
        if isinstance(answer, CommandFailed):
            raise answer
        return answer

    async def ask(self, reply: type[Any], cmd: str, *, timeout_s: float | None = None, **args: Any) -> Any:
        return protocol.from_json(reply, await self.request(cmd, timeout_s=timeout_s, **args), cmd)


@pytest.mark.parametrize("kind", [protocol.ERROR_KIND_INPUT, None])
def test_a_launch_the_second_node_refuses_stops_the_first_by_run_id_and_keeps_the_refusals_kind(
    kind: str | None,
) -> None:
    """Node 0 started, node 1 refused: node 0's part is stopped (by the run's id), the cause names node 1 and what
    was stopped, and a refusal of the request itself stays bad input (the CLI's exit 2). On loopback both nodes share
    one filesystem and one profile, so no request node 0 accepts is refused by node 1 there: hence a script."""
    nodes = resolve_nodes(["gpu-a", "gpu-b"], Profile(name="p"), ConnectOptions())
    probe = {"hostname": "h", "port": 29500}
    first = ScriptedNode({
        "rendezvous": probe,
        "launch": {"run_id": "r1", "run_dir": "/runs/r1"},
        "run_info": {"run": {"run_id": "r1", "run_dir": "/runs/r1", "state": "running"}},
        "stop": {"stopped": True, "steps": ["SIGTERM to the run's process group; it exited"], "run_id": "r1"},
    })  # fmt: skip
    refusal = CommandFailed("working directory /w does not exist on the host", cmd="launch", kind=kind)
    second = ScriptedNode({"rendezvous": probe, "launch": refusal})
    nodes[0].session, nodes[1].session = first, second  # type: ignore[assignment]
    done = asyncio.run(launch_run(nodes, Profile(name="p"), command=None, cwd=lambda _n: "/w", wait="first-step",
                                  timeout_s=10))  # fmt: skip
    assert not done.ok and done.run_id == "r1" and done.failed_node == "gpu-b" and done.bad_input == (kind is not None)
    assert done.cause == "node gpu-b: launch refused: working directory /w does not exist on the host; stopped gpu-a"
    assert done.stopped == ["gpu-a"]
    launched = [args for cmd, args in second.asked if cmd == "launch"]
    assert len(launched) == 1 and launched[0]["run_id"] == "r1"  # node 1 was asked under node 0's run id
    stops = [args for cmd, args in first.asked if cmd == "stop"]
    assert len(stops) == 1 and stops[0]["run_id"] == "r1"  # by its id, never "the node's current run"
    assert not any(cmd == "wait" for cmd, _ in first.asked + second.asked)  # no wait after a refusal
