"""The ``rendezvous`` command: where a multi-node run's c10d rendezvous can live on this machine.

Asked of every node: the address its SSH client reached it at. Asked of the first node with the others'
addresses (``peers``) and a ``port``: the address it routes to them from and a port checked free here.
Argument and result shapes: engine/protocol/replies.py ``RendezvousReply``.
"""

from __future__ import annotations

import socket
from typing import Any

from engine.agent.commands import handler
from engine.agent.server import Agent, CommandError
from engine.host import net


@handler("rendezvous")
def _rendezvous(agent: Agent, cmd_id: int | None, args: dict[str, Any]) -> dict[str, Any]:
    peers = args.get("peers") or []
    if not isinstance(peers, list) or not all(isinstance(p, str) and p for p in peers):
        raise CommandError("peers must be a list of host names or addresses")
    port = args.get("port")
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536):
        raise CommandError("port must be 1..65535")
    routes = {peer: net.route_source(peer) for peer in peers}
    return {
        "hostname": socket.gethostname(),
        "ssh_address": net.ssh_address(),
        "ssh_client": net.ssh_client(),
        "routes": routes,
        "port": net.pick_port(port) if args.get("pick_port") else None,
    }
