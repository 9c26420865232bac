"""How the client reaches the host agent: a local subprocess, an asyncssh channel, or either behind ``pct exec``.

Every transport ends in an ``AgentStream``: JSON lines from the agent's stdout, commands to its stdin.
The host needs only ``python3``: the SSH and pct transports ship the agent bundle (tui/link/ship.py)
over the same connection, hash-checked, before starting it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import re
import shlex
import sys
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tui.link import ship

if TYPE_CHECKING:
    import asyncssh

EXIT_CONNECTION = 3
_STDERR_KEEP_LINES = 60
_LINE_LIMIT_BYTES = 1 << 27  # a log event can carry a multi-megabyte line, escaped
_SSH_READ_CHUNK_BYTES = 1 << 16
_STDERR_LINE_BYTES = 1 << 16


class ConnectError(Exception):
    """The host cannot be reached or used: bad host key, auth, unreachable, no python3, pct. Exit code 3."""

    def __init__(self, message: str, exit_code: int = EXIT_CONNECTION, *, retryable: bool = True) -> None:
        super().__init__(message)
        self.message = message
        self.exit_code = exit_code
        self.retryable = retryable  # False for host key and authentication failures: retrying cannot help


@dataclass
class ConnectOptions:
    pct: int | None = None
    identity: str | None = None
    port: int | None = None
    known_hosts: str | None = None
    python: str | None = None
    run_root: str | None = None
    simulate_gpus: int = 0
    connect_timeout_s: float = 10.0
    keepalive_s: float = 15.0
    profile: str | None = None
    config: str | None = None
    passphrase: str | None = field(default=None, repr=False)  # of --identity, typed at a prompt; never shown
    readonly: bool = False  # watch only: the agent refuses every command that acts, tmux is attached read-only


@dataclass(frozen=True)
class Target:
    """A parsed TARGET: ``local``, ``[user@]host[:port]`` or a Host alias of ~/.ssh/config."""

    local: bool
    host: str = ""
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Target:
        spec = spec.strip()
        if spec == "local":
            return cls(local=True)
        if not spec or any(c.isspace() for c in spec) or spec.startswith("-"):
            raise ValueError(f"bad TARGET {spec!r}: expected 'local', [user@]host[:port] or a Host alias")
        user: str | None = None
        if "@" in spec:
            user, spec = spec.rsplit("@", 1)
            if not user:
                raise ValueError("bad TARGET: empty user before '@'")
        port: int | None = None
        m = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", spec)  # [ipv6]:port
        if m:
            spec, port_s = m.group(1), m.group(2)
            port = int(port_s) if port_s else None
        elif spec.count(":") == 1:
            spec, port_s = spec.split(":")
            if not port_s.isdigit():
                raise ValueError(f"bad port {port_s!r} in TARGET")
            port = int(port_s)
        if not spec:
            raise ValueError("bad TARGET: empty host")
        if port is not None and not 0 < port < 65536:
            raise ValueError(f"bad port {port} in TARGET")
        return cls(local=False, host=spec, user=user, port=port)


def pct_wrap(argv: list[str], pct: int | None) -> list[str]:
    """``pct exec CTID -- argv``: pct hands the argv to lxc-attach as is (no shell inside)."""
    if pct is None:
        return list(argv)
    if isinstance(pct, bool) or not isinstance(pct, int) or pct < 0:
        raise ValueError(f"--pct wants a numeric container id, got {pct!r}")
    return ["pct", "exec", str(pct), "--", *argv]


def remote_command(argv: list[str]) -> str:
    """One shell command line for the remote login shell: every argument quoted."""
    return " ".join(shlex.quote(a) for a in argv)


class AgentStream(ABC):
    """A running agent: read its event lines, write command lines."""

    def __init__(self) -> None:
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_KEEP_LINES)
        self._stderr_task: asyncio.Task[None] | None = None

    @abstractmethod
    async def readline(self) -> bytes:
        """One line, newline included; b"" at end of stream."""

    @abstractmethod
    def write(self, data: bytes) -> None: ...

    @abstractmethod
    async def close(self) -> None:
        """Close stdin (the agent exits on EOF), wait a bounded time, then make sure it is gone."""

    @contextlib.asynccontextmanager
    async def closed_on_failure(self) -> AsyncIterator[AgentStream]:
        """This stream, closed if the block raises: its own error, or a cancel (the user quits, close() ends a
        reconnect, a caller's deadline). An agent started for an attempt never outlives it, nor its pipes the loop."""
        try:
            yield self
        except BaseException:
            await self.close()
            raise

    @property
    @abstractmethod
    def exit_status(self) -> int | None: ...

    @abstractmethod
    async def wait_exit(self, timeout_s: float) -> int | None: ...

    def stderr_text(self) -> str:
        return "\n".join(self._stderr)

    async def _drain_stderr(self, reader: Any) -> None:
        """Keep the last lines of the agent's stderr; never raises (a broken link ends it with a note)."""
        buf = b""
        while True:
            try:
                chunk = await reader.read(65536)
            except Exception as exc:  # asyncssh.ConnectionLost and friends: the reader loop reports the loss
                self._stderr.append(f"[stderr ended: {type(exc).__name__}: {exc}]")
                break
            if not chunk:
                break
            buf += chunk if isinstance(chunk, bytes) else chunk.encode()
            *lines, buf = buf.split(b"\n")
            buf = buf[-_STDERR_LINE_BYTES:]  # a line with no end keeps only its tail
            for line in lines:
                self._stderr.append(line.decode("utf-8", "replace"))
        if buf:
            self._stderr.append(buf.decode("utf-8", "replace"))

    async def stderr_settled(self, timeout_s: float = 1.0) -> None:
        if self._stderr_task is not None:
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(asyncio.shield(self._stderr_task), timeout_s)


class _LocalStream(AgentStream):
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        super().__init__()
        self.proc = proc
        assert proc.stderr is not None
        self._stderr_task = asyncio.ensure_future(self._drain_stderr(proc.stderr))

    async def readline(self) -> bytes:
        assert self.proc.stdout is not None
        try:
            return await self.proc.stdout.readline()
        except (ValueError, asyncio.LimitOverrunError) as exc:
            raise ConnectionError(f"agent line over the read limit: {exc}") from exc

    def write(self, data: bytes) -> None:
        assert self.proc.stdin is not None
        if self.proc.stdin.is_closing():
            raise ConnectionError("agent stdin is closed")
        self.proc.stdin.write(data)

    @property
    def exit_status(self) -> int | None:
        return self.proc.returncode

    async def wait_exit(self, timeout_s: float) -> int | None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        return self.proc.returncode

    async def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        if await self.wait_exit(3.0) is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.terminate()
            if await self.wait_exit(2.0) is None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.kill()
                await self.wait_exit(2.0)
        await self.stderr_settled()


class _SshStream(AgentStream):
    def __init__(self, proc: asyncssh.SSHClientProcess[bytes]) -> None:
        super().__init__()
        self.proc = proc
        self._stderr_task = asyncio.ensure_future(self._drain_stderr(proc.stderr))
        self._buf = bytearray()
        self._scanned = 0  # bytes of _buf already searched for a newline

    async def readline(self) -> bytes:
        """One line, bounded as the local transport bounds it: a longer line ends the link (and says so) instead of
        growing the buffer with whatever the host sends."""
        import asyncssh

        while True:
            end = self._buf.find(b"\n", self._scanned)
            if end >= 0:
                line = bytes(self._buf[: end + 1])
                del self._buf[: end + 1]
                self._scanned = 0
                return line
            if len(self._buf) > _LINE_LIMIT_BYTES:
                size = len(self._buf)
                self._buf.clear()
                self._scanned = 0
                raise ConnectionError(
                    f"agent line over the read limit ({_LINE_LIMIT_BYTES} bytes): {size} bytes dropped"
                )
            self._scanned = len(self._buf)
            try:
                chunk: bytes = await self.proc.stdout.read(_SSH_READ_CHUNK_BYTES)
            except (asyncssh.Error, OSError) as exc:
                raise ConnectionError(f"ssh channel failed: {exc}") from exc
            if not chunk:
                line = bytes(self._buf)
                self._buf.clear()
                self._scanned = 0
                return line
            self._buf += chunk

    def write(self, data: bytes) -> None:
        if self.proc.stdin.channel.is_closing():
            raise ConnectionError("ssh channel is closed")
        self.proc.stdin.write(data)

    @property
    def exit_status(self) -> int | None:
        return self.proc.exit_status

    async def wait_exit(self, timeout_s: float) -> int | None:
        import asyncssh

        # A cut connection ends the channel without an exit status: that is the answer (None), not an error.
        with contextlib.suppress(asyncio.TimeoutError, asyncssh.Error, OSError):
            await asyncio.wait_for(self.proc.wait_closed(), timeout_s)
        return self.proc.exit_status

    async def close(self) -> None:
        with contextlib.suppress(OSError, Exception):
            self.proc.stdin.write_eof()
        if await self.wait_exit(3.0) is None:
            self.proc.close()
            await self.wait_exit(2.0)
        await self.stderr_settled()


@dataclass
class _Completed:
    returncode: int | None
    stdout: bytes
    stderr: bytes


class Transport(ABC):
    """Connects to one host and starts an agent there; can be asked again after a disconnect."""

    def __init__(self, target: Target, opts: ConnectOptions) -> None:
        self.target = target
        self.opts = opts
        if opts.pct is not None:
            pct_wrap([], opts.pct)  # validates the CTID
        self.bundle_path: str | None = None  # the directory holding `engine` on the host, once known

    @property
    @abstractmethod
    def display(self) -> str: ...

    @property
    def python(self) -> str:
        return self.opts.python or "python3"

    def agent_args(self) -> list[str]:
        args = ["--simulate-gpus", str(self.opts.simulate_gpus)] if self.opts.simulate_gpus else []
        return [*args, "--readonly"] if self.opts.readonly else args

    def attach_words(self, tmux_session: str) -> list[str]:
        """tmux's words that attach to the run's session: a read-only client (``-r``) in read-only mode."""
        return ["attach-session", *(["-r"] if self.opts.readonly else []), "-t", tmux_session]

    @abstractmethod
    async def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> AgentStream: ...

    @abstractmethod
    async def _run(self, argv: list[str], stdin: bytes, timeout_s: float) -> _Completed: ...

    async def open(self) -> AgentStream:
        """Connect (if needed) and start the agent; raises ConnectError."""
        return await self._bootstrap()

    async def close(self) -> None:  # noqa: B027 - a transport without a connection has nothing to close
        pass

    @property
    def engine_pythonpath(self) -> str | None:
        """PYTHONPATH under which ``python3 -m engine.trainer`` runs on the host."""
        return self.bundle_path

    @abstractmethod
    def attach_argv(self, tmux_session: str) -> list[str]: ...

    def host_side(self) -> Transport | None:
        """Under --pct: a transport to the Proxmox host itself (no `pct exec` hop), for the agent that reads the
        host's NVML and maps host PIDs into the container (engine/host/host_map.py). None without --pct."""
        return None

    def _host_side_opts(self, run_root: str | None) -> ConnectOptions:
        # The host's agent: the host's python3, no container, the same simulation (its GPUs then match ours by UUID).
        return dataclasses.replace(self.opts, pct=None, python=None, run_root=run_root)

    def _host_argv(self, argv: list[str]) -> list[str]:
        return pct_wrap(argv, self.opts.pct)

    async def _bootstrap(self) -> AgentStream:
        bundle = ship.agent_bundle()
        check = self._host_argv(ship.check_argv(self.python, self.opts.run_root, bundle, self.agent_args()))
        stream = await self._spawn(check)
        first = await self._first_line(stream)
        if first.get("bootstrap") == "ok":
            self.bundle_path = str(first.get("tree") or first.get("path"))
            return stream
        await stream.close()
        install = self._host_argv(ship.install_argv(self.python, self.opts.run_root, bundle))
        done = await self._run(install, bundle.data, timeout_s=max(60.0, self.opts.connect_timeout_s))
        if done.returncode != 0:
            stderr = done.stderr.decode("utf-8", "replace")
            raise self._classify_failure(done.returncode, stderr, "installing the agent")
        stream = await self._spawn(check)
        first = await self._first_line(stream)
        if first.get("bootstrap") != "ok":
            await stream.close()
            raise ConnectError(f"{self.display}: the agent bundle was installed but does not verify: {first}")
        self.bundle_path = str(first.get("tree") or first.get("path"))
        return stream

    async def _first_line(self, stream: AgentStream) -> dict[str, Any]:
        """The bootstrap's first line as a dict with "bootstrap"; else ConnectError, the stream closed."""
        async with stream.closed_on_failure():
            return await self._read_first_line(stream)

    async def _read_first_line(self, stream: AgentStream) -> dict[str, Any]:
        try:
            line = await asyncio.wait_for(stream.readline(), self.opts.connect_timeout_s + 20.0)
        except asyncio.TimeoutError:
            raise ConnectError(
                f"{self.display}: the agent bootstrap did not answer within {self.opts.connect_timeout_s + 20.0:.0f} s"
            ) from None
        except ConnectionError as exc:
            line = b""
            stream._stderr.append(str(exc))
        if line:
            with contextlib.suppress(ValueError):
                obj = json.loads(line)
                if isinstance(obj, dict) and "bootstrap" in obj:
                    return obj
        rc = await stream.wait_exit(5.0)
        await stream.stderr_settled()
        err = stream.stderr_text()
        if line:
            err = (line.decode("utf-8", "replace") + "\n" + err).strip()
        raise self._classify_failure(rc, err, "starting the agent")

    def _classify_failure(self, rc: int | None, stderr: str, what: str) -> ConnectError:
        err = stderr.strip()
        low = err.lower()
        tail = "\n".join(err.splitlines()[-8:])
        pct = self.opts.pct
        if pct is not None and re.search(r"\bpct\b.*(not found|no such file)", low):
            return ConnectError(
                f"{self.display}: `pct` is not available on the host ({tail or f'exit {rc}'}).\n"
                f"--pct {pct} needs a Proxmox node where `pct exec` works; connect to the node, not the container."
            )
        if rc == 127 or re.search(r"python[0-9.]*\W.*(not found|no such file)|(not found|no such file).*python", low):
            return ConnectError(
                f"{self.display}: no `{self.python}` on the host{f' (container {pct})' if pct is not None else ''}"
                f" while {what} (exit {rc}): {tail}\n"
                "Install python3 there (apt-get install -y python3) or pass --python PATH to an interpreter."
            )
        if pct is not None:
            return ConnectError(
                f"{self.display}: `pct exec {pct}` failed while {what} (exit {rc}): {tail}\n"
                "Check the container id and that it is running: `pct list` on the Proxmox node."
            )
        return ConnectError(f"{self.display}: the host failed while {what} (exit {rc}): {tail}")


class LocalTransport(Transport):
    """The agent as a subprocess of this client (or, with --pct, of `pct exec` on this Proxmox node)."""

    @property
    def display(self) -> str:
        return "local" + (f" [pct {self.opts.pct}]" if self.opts.pct is not None else "")

    async def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> AgentStream:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=env,
                limit=_LINE_LIMIT_BYTES,
                start_new_session=True,  # Ctrl-C in this terminal reaches the client, which closes the agent
            )
        except FileNotFoundError as exc:
            raise self._classify_failure(127, f"{argv[0]}: not found ({exc})", "starting the agent") from None
        except PermissionError as exc:
            raise ConnectError(f"{self.display}: cannot run {argv[0]}: {exc}") from None
        return _LocalStream(proc)

    async def _run(self, argv: list[str], stdin: bytes, timeout_s: float) -> _Completed:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
            )
        except FileNotFoundError as exc:
            return _Completed(127, b"", f"{argv[0]}: not found ({exc})".encode())
        try:
            out, err = await asyncio.wait_for(proc.communicate(stdin), timeout_s)
        except BaseException as exc:  # its deadline, or a cancel of the connect: the command must not outlive it
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            if isinstance(exc, asyncio.TimeoutError):
                return _Completed(None, b"", f"timed out after {timeout_s:.0f} s".encode())
            raise
        return _Completed(proc.returncode, out, err)

    @property
    def python(self) -> str:
        if self.opts.pct is None:
            return self.opts.python or sys.executable
        return self.opts.python or "python3"

    async def open(self) -> AgentStream:
        if self.opts.pct is not None:
            return await self._bootstrap()
        # This machine already has the engine package: run it from here, no shipping.
        root = str(Path(ship._package_root()))
        env = dict(os.environ)
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        argv = [self.python, "-m", "engine.agent.main", *self.agent_args()]
        if self.opts.run_root:
            argv += ["--run-root", os.path.expanduser(self.opts.run_root)]
        self.bundle_path = root
        return await self._spawn(argv, env=env)

    def host_side(self) -> Transport | None:
        if self.opts.pct is None:
            return None
        # This machine is the Proxmox node: the host's agent runs here, from this client's own engine package.
        return LocalTransport(self.target, self._host_side_opts(self.opts.run_root))

    def attach_argv(self, tmux_session: str) -> list[str]:
        argv = ["tmux"]
        sock = os.environ.get("SPECDEC_TMUX_SOCKET")
        if sock:
            argv += ["-L", sock]
        argv += self.attach_words(tmux_session)
        return pct_wrap(argv, self.opts.pct)


class _HostKeyRecorder:
    """Remembers the key a server presented when known_hosts did not trust it (we then refuse it)."""

    def __init__(self) -> None:
        self.presented: tuple[str, str, int, Any] | None = None


def _ssh_config_known_hosts(host: str) -> list[str] | None:
    """The known_hosts files ~/.ssh/config names for HOST (UserKnownHostsFile, then GlobalKnownHostsFile).

    [] when it names none (the default, ~/.ssh/known_hosts, applies); None for ``UserKnownHostsFile none``,
    which here means no file is trusted (unknown keys are refused), never that keys go unchecked.
    Raises asyncssh.ConfigParseError for a config it cannot read.
    """
    import asyncssh

    path = Path("~/.ssh/config").expanduser()
    if not os.access(path, os.R_OK):
        return []
    known = asyncssh.SSHClientConnectionOptions(host=host, config=[str(path)]).known_hosts
    if known is None:
        return None
    return [str(p) for p in known] if isinstance(known, (list, tuple)) else []


def _known_hosts_files(opts: ConnectOptions, host: str) -> tuple[list[str], str | None]:
    """(the existing files whose keys are trusted, the file a new key belongs in: None when the config says none)."""
    if opts.known_hosts:
        return [os.path.expanduser(opts.known_hosts)], opts.known_hosts
    configured = _ssh_config_known_hosts(host)
    if configured is None:
        return [], None
    named = configured or ["~/.ssh/known_hosts"]
    return [p for p in (os.path.expanduser(n) for n in named) if os.path.isfile(p)], named[0]


def _effective_endpoint(host: str, port: int | None) -> str:
    """HOST:PORT as the connection reached for it: ~/.ssh/config's HostName and Port for an alias (a TARGET's or
    -p port wins), so an error names where it tried, not the alias with port 22."""
    import asyncssh

    path = Path("~/.ssh/config").expanduser()
    if not os.access(path, os.R_OK):
        return f"{host}:{port or 22}"
    try:
        given: dict[str, Any] = {"port": port} if port else {}  # None would mean 22 here, not "the config's"
        options = asyncssh.SSHClientConnectionOptions(host=host, config=[str(path)], agent_path=None, **given)
    except (OSError, ValueError, asyncssh.Error):
        return f"{host}:{port or 22}"
    return f"{options.host or host}:{options.port or port or 22}"


def _config_identity_is_locked(host: str) -> bool:
    """Whether ~/.ssh/config names an IdentityFile for HOST that needs a passphrase (asyncssh skips such keys)."""
    import asyncssh

    path = Path("~/.ssh/config").expanduser()
    if not os.access(path, os.R_OK):
        return False
    try:
        asyncssh.SSHClientConnectionOptions(host=host, config=[str(path)], ignore_encrypted=False, agent_path=None)
    except asyncssh.KeyImportError as exc:
        return "passphrase" in str(exc).lower()
    except (OSError, ValueError, asyncssh.Error):
        return False
    return False


def shell_path(path: str) -> str:
    """PATH for a shell command line: quoted, but a leading ``~/`` left for the shell to expand."""
    return "~/" + shlex.quote(path[2:]) if path.startswith("~/") and len(path) > 2 else shlex.quote(path)


class SshTransport(Transport):
    """The agent over one asyncssh connection; host keys always verified against known_hosts."""

    def __init__(self, target: Target, opts: ConnectOptions, *, shares: SshTransport | None = None) -> None:
        super().__init__(target, opts)
        self._conn: asyncssh.SSHClientConnection | None = None
        self._shares = shares  # the host side's channel rides on the container transport's connection

    def host_side(self) -> Transport | None:
        if self.opts.pct is None:
            return None
        # The SSH login lands on the Proxmox host: the same connection, without the `pct exec` hop; the host's
        # agent bundle lives under the host user's default run root (--run-root names a path in the container).
        return SshTransport(self.target, self._host_side_opts(None), shares=self)

    @property
    def port(self) -> int | None:
        return self.opts.port or self.target.port

    @property
    def display(self) -> str:
        host = f"{self.target.user}@{self.target.host}" if self.target.user else self.target.host
        if self.port:
            host += f":{self.port}"
        return host + (f" [pct {self.opts.pct}]" if self.opts.pct is not None else "")

    def _connect_kwargs(self) -> dict[str, Any]:
        import asyncssh

        kw: dict[str, Any] = {
            "connect_timeout": self.opts.connect_timeout_s,
            "keepalive_interval": self.opts.keepalive_s,
            "keepalive_count_max": 3,
        }
        if self.port:
            kw["port"] = self.port
        if self.target.user:
            kw["username"] = self.target.user
        if self.opts.identity:
            path = os.path.expanduser(self.opts.identity)
            if not os.path.isfile(path):
                raise ConnectError(f"identity file {path} does not exist (-i/--identity)")
            kw["client_keys"] = [path]
            if self.opts.passphrase is not None:
                kw["passphrase"] = self.opts.passphrase
        try:
            files, _ = _known_hosts_files(self.opts, self.target.host)
        except asyncssh.ConfigParseError as exc:
            raise ConnectError(f"{self.display}: ~/.ssh/config cannot be read: {exc}", retryable=False) from None
        except ValueError as exc:  # an option asyncssh refuses (a bad port in the config, ...)
            raise ConnectError(f"{self.display}: bad SSH settings: {exc}", retryable=False) from None
        if self.opts.known_hosts:
            if not os.path.exists(files[0]) or os.path.isdir(files[0]):
                raise ConnectError(f"known_hosts file {files[0]} does not exist (--known-hosts)")
            if not os.path.isfile(files[0]):
                files = []  # /dev/null (or another device): an empty known_hosts, so no key is trusted
        # Explicit, never None (no checking) and never empty: asyncssh reads an empty value (b"", [], ()) as
        # "use ~/.ssh/known_hosts". No trusted file is the tuple of (trusted keys, CA keys, revoked keys), all empty:
        # every host key is then unknown and refused.
        kw["known_hosts"] = files if files else ([], [], [])
        return kw

    async def connect(self) -> asyncssh.SSHClientConnection:
        import asyncssh

        if self._shares is not None:
            return await self._shares.connect()
        if self._conn is not None and not self._conn.is_closed():
            return self._conn
        recorder = _HostKeyRecorder()

        class _Client(asyncssh.SSHClient):
            def validate_host_public_key(self, host: str, addr: str, port: int, key: asyncssh.SSHKey) -> bool:
                recorder.presented = (host, addr, port, key)
                return False  # not in known_hosts: refuse

        kw = self._connect_kwargs()
        try:
            self._conn = await asyncssh.connect(self.target.host, client_factory=_Client, **kw)
        except asyncssh.HostKeyNotVerifiable as exc:
            raise self._host_key_error(recorder, str(exc)) from None
        except asyncssh.PermissionDenied as exc:
            who = self.target.user or "(default user)"
            keys = self.opts.identity or "the default keys (~/.ssh/id_*, ssh-agent)"
            advice = "Check the user name and that the public key is in the host's authorized_keys."
            if not self.opts.identity and _config_identity_is_locked(self.target.host):
                advice = (
                    "The IdentityFile that ~/.ssh/config names for this host is passphrase-protected and was skipped: "
                    "load it into ssh-agent (ssh-add <key>), or pass it with -i to be asked for its passphrase."
                )
            raise ConnectError(
                f"{self.display}: authentication failed for user {who} with {keys}: {exc.reason}.\n{advice}",
                retryable=False,
            ) from None
        except (asyncio.TimeoutError, TimeoutError):
            where = _effective_endpoint(self.target.host, self.port)
            raise ConnectError(
                f"{self.display}: no answer from {where} within {self.opts.connect_timeout_s:g} s (unreachable?)"
            ) from None
        except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as exc:
            key = self.opts.identity or "a default key (~/.ssh/id_*)"
            remedy = (
                f"run the command on a terminal to be asked for the passphrase, or load the key into ssh-agent "
                f"(ssh-add {self.opts.identity}) and connect without -i"
                if self.opts.identity
                else "load it into ssh-agent (ssh-add <key>), or pass it with -i to be asked for its passphrase"
            )
            hint = (
                f"it is passphrase-protected: {remedy}"
                if "passphrase" in str(exc).lower() or isinstance(exc, asyncssh.KeyEncryptionError)
                else "it is not a private key asyncssh can read"
            )
            raise ConnectError(f"{self.display}: cannot use identity {key}: {hint} ({exc})", retryable=False) from None
        except asyncssh.ConfigParseError as exc:
            raise ConnectError(f"{self.display}: ~/.ssh/config cannot be read: {exc}", retryable=False) from None
        except (OSError, asyncssh.Error) as exc:
            where = _effective_endpoint(self.target.host, self.port)
            raise ConnectError(f"{self.display}: cannot connect to {where}: {exc}") from None
        except ValueError as exc:  # any other option asyncssh refuses (a bad port in the config, ...)
            raise ConnectError(f"{self.display}: bad SSH settings: {exc}", retryable=False) from None
        return self._conn

    def _host_key_error(self, recorder: _HostKeyRecorder, reason: str) -> ConnectError:
        import asyncssh

        files, kh_file = _known_hosts_files(self.opts, self.target.host)
        kh_display = kh_file or "~/.ssh/known_hosts"
        if recorder.presented is None:
            return ConnectError(f"{self.display}: host key verification failed: {reason}", retryable=False)
        host, addr, port, key = recorder.presented
        fingerprint = key.get_fingerprint("sha256")
        alg = key.get_algorithm()
        label = host if port == 22 else f"[{host}]:{port}"
        known: list[Any] = []
        for path in files:
            with contextlib.suppress(OSError, ValueError):
                known += list(asyncssh.match_known_hosts(path, host, addr, None if port == 22 else port)[0])
        if known:
            # A key recorded under both the name and the address (or in two files) is one key: listed once.
            recorded = ", ".join(dict.fromkeys(f"{k.get_algorithm()} {k.get_fingerprint('sha256')}" for k in known))
            return ConnectError(
                "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n"
                "@    WARNING: REMOTE HOST IDENTIFICATION HAS CHANGED!     @\n"
                "@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@@\n"
                "IT IS POSSIBLE THAT SOMEONE IS DOING SOMETHING NASTY!\n"
                f"The {alg} host key for {label} has changed: it is now\n  {fingerprint}\n"
                f"while {kh_display} records\n  {recorded}\n"
                "Connection refused. If the host was really reinstalled, verify the new fingerprint out of band,\n"
                f"then remove the old key with: ssh-keygen -R {shlex.quote(label)} -f {shell_path(kh_display)}",
                retryable=False,
            )
        if kh_file is None:
            return ConnectError(
                f"{self.display}: the host key of {label} is unknown and ~/.ssh/config sets UserKnownHostsFile none"
                f" for {self.target.host}, so no key is trusted; refusing to connect.\n"
                f"It presented {alg} {fingerprint}\n"
                "Verify that fingerprint out of band, record it in a known_hosts file and pass --known-hosts FILE.",
                retryable=False,
            )
        scan = f"ssh-keyscan{'' if port == 22 else f' -p {port}'} {shlex.quote(host)} >> {shell_path(kh_display)}"
        return ConnectError(
            f"{self.display}: the host key of {label} is unknown (not in {kh_display}); refusing to connect.\n"
            f"It presented {alg} {fingerprint}\n"
            "Verify that fingerprint out of band (on the host: ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub),\n"
            f"then trust it with:\n  {scan}",
            retryable=False,
        )

    async def _spawn(self, argv: list[str], env: dict[str, str] | None = None) -> AgentStream:
        import asyncssh

        conn = await self.connect()
        try:
            proc = await conn.create_process(remote_command(argv), encoding=None)
        except (asyncssh.Error, OSError) as exc:
            raise ConnectError(f"{self.display}: cannot start a command over ssh: {exc}") from None
        return _SshStream(proc)

    async def _run(self, argv: list[str], stdin: bytes, timeout_s: float) -> _Completed:
        import asyncssh

        conn = await self.connect()
        try:
            done = await conn.run(remote_command(argv), input=stdin, encoding=None, check=False, timeout=timeout_s)
        except asyncssh.TimeoutError as exc:
            return _Completed(None, b"", f"timed out after {timeout_s:.0f} s: {exc}".encode())
        except (asyncssh.Error, OSError) as exc:
            raise ConnectError(f"{self.display}: ssh command failed: {exc}") from None
        out = done.stdout if isinstance(done.stdout, bytes) else (done.stdout or "").encode()
        err = done.stderr if isinstance(done.stderr, bytes) else (done.stderr or "").encode()
        return _Completed(done.exit_status, out, err)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._conn.wait_closed(), 3.0)
            self._conn = None

    def drop_connection(self) -> None:
        """Forget the connection (after it broke) so the next open() makes a new one."""
        if self._conn is not None:
            self._conn.abort()
            self._conn = None

    def attach_argv(self, tmux_session: str) -> list[str]:
        argv = ["ssh", "-t", "-o", "StrictHostKeyChecking=yes"]
        if self.port:
            argv += ["-p", str(self.port)]
        if self.opts.identity:
            argv += ["-i", os.path.expanduser(self.opts.identity)]
        if self.opts.known_hosts:
            argv += ["-o", f"UserKnownHostsFile={self.opts.known_hosts}"]
        argv.append(f"{self.target.user}@{self.target.host}" if self.target.user else self.target.host)
        argv += ["--", remote_command(self._host_argv(["tmux", *self.attach_words(tmux_session)]))]
        return argv


def make_transport(target_spec: str, opts: ConnectOptions) -> Transport:
    """A transport for TARGET; raises ValueError for a malformed TARGET or option."""
    target = Target.parse(target_spec)
    if target.local:
        return LocalTransport(target, opts)
    return SshTransport(target, opts)
