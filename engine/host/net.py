"""What the machine's network says: the address it reaches a peer from, whether a TCP port is free, and the
address an SSH client reached it at. Used to place a multi-node run's rendezvous (torchrun's c10d store).

No packet is sent: the route to a peer is what the kernel picks for a UDP socket connected to it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket

RDZV_PORT_DEFAULT = 29500  # torchrun's default rendezvous port, tried first


def route_source(peer: str) -> str | None:
    """The local address this machine would send from to reach ``peer`` (a name or an address), None when the
    peer does not resolve or has no route from here."""
    try:
        infos = socket.getaddrinfo(peer, 9, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, kind, proto, _name, addr in infos:
        with contextlib.suppress(OSError), socket.socket(family, kind, proto) as s:
            s.connect(addr)  # UDP: picks the route and the source address, sends nothing
            return str(s.getsockname()[0])
    return None


def port_free(port: int) -> bool:
    """Whether a TCP listener could bind ``port`` on every address now (as torchrun's store will)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("", port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def pick_port(preferred: int | None) -> int:
    """``preferred`` (default 29500) when it is free here, else a port the kernel hands out as free."""
    wanted = preferred or RDZV_PORT_DEFAULT
    if port_free(wanted):
        return wanted
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


def ssh_address(env: dict[str, str] | None = None) -> str | None:
    """The address an SSH client reached this machine at (the third word of ``SSH_CONNECTION``), None outside
    SSH."""
    words = (os.environ if env is None else env).get("SSH_CONNECTION", "").split()
    return words[2] if len(words) == 4 else None


def ssh_client(env: dict[str, str] | None = None) -> str | None:
    """The address the SSH client came from (the first word of ``SSH_CONNECTION``), None outside SSH."""
    words = (os.environ if env is None else env).get("SSH_CONNECTION", "").split()
    return words[0] if len(words) == 4 else None
