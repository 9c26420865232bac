"""One connection to one host's agent, for the dashboard and the headless commands alike.

A ``Session`` sends commands (each gets exactly one reply, matched by id), hands every agent event
to its listeners, measures the round trip with ``ping``, and, when the link breaks, reconnects with
capped exponential backoff plus jitter. After a reconnect the streams resume from the remembered
log offset/inode and events.jsonl offset, so nothing is skipped or repeated.

Every agent line is decoded here, once, into engine.protocol's dataclasses (tui/link/events.py): event
listeners (``add_event_listener``) get those, the session's own ``ConnectionEvent`` on every state change,
and an ``Undecodable`` for a line that is JSON but not the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from engine import protocol
from tui.link.events import ClientEvent, ConnectionEvent, Undecodable, decode
from tui.link.transport import AgentStream, ConnectError, ConnectOptions, SshTransport, Transport, make_transport

__all__ = [
    "AgentSession",
    "CommandFailed",
    "ConnectError",
    "ConnectOptions",
    "ReplyNotUnderstood",
    "Session",
    "open_session",
    "typed_reply",
]

Listener = Callable[[ClientEvent], None]
R = TypeVar("R")

HELLO_TIMEOUT_S = 30.0
HOST_MAP_INTERVAL_S = 2.0  # how often the Proxmox host's map is refreshed under --pct
HOST_MAP_RETRY_S = 30.0  # how long an unreachable host side is left alone before the next try
HOST_MAP_FIRST_WAIT_S = 8.0  # how long status, kill_stale and doctor wait for the host's first map
# Commands whose answer depends on who holds the GPUs: under --pct they wait (bounded) for the host's first map.
HOLDER_COMMANDS = frozenset({"status", "kill_stale", "doctor"})
PING_INTERVAL_S = 2.0
PING_TIMEOUT_S = 5.0
PINGS_MISSED_BEFORE_RECONNECT = 2


# Events only the session itself emits (synthetic connection-state changes).
SESSION_EVENTS = frozenset({"connection"})


class AgentSession(Protocol):
    """One connection to a host's agent as the dashboard and the run words see it: what ``Session`` offers its
    callers (tests' recording stand-ins implement the same), so no caller reaches into the transport."""

    target_display: str
    state: str
    agent: protocol.HelloEvent | None  # the agent's hello, None before the first connect
    rtt_ms: float | None
    opts: ConnectOptions  # what the command line asked for (--python, --profile, --config, ...)

    @property
    def engine_pythonpath(self) -> str | None: ...

    async def connect(self) -> None: ...
    async def request(
        self, cmd: str, *, timeout_s: float | None = None, params: dict[str, Any] | None = None, **args: Any
    ) -> dict[str, Any]: ...
    def add_event_listener(self, fn: Listener) -> Callable[[], None]: ...
    async def start_streams(self, gpu_interval_s: float = 0.5, procs_interval_s: float = 1.0) -> None: ...
    def attach_argv(self, tmux_session: str) -> list[str]: ...
    async def close(self) -> None: ...


class CommandFailed(Exception):
    """A command got an error reply, no reply in time, or the connection went away under it."""

    def __init__(self, message: str, *, cmd: str | None = None, lost: bool = False, kind: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.cmd = cmd
        self.lost = lost  # True when the connection broke before the reply
        self.kind = kind  # the reply's error_kind: protocol.ERROR_KIND_INPUT when the request itself was wrong

    @property
    def bad_input(self) -> bool:
        return self.kind == protocol.ERROR_KIND_INPUT


class ReplyNotUnderstood(CommandFailed):
    """A command's reply came but does not fit its dataclass (engine/protocol/replies.py): the field and why."""


def typed_reply(reply: type[R], cmd: str, result: dict[str, Any]) -> R:
    """A command's result decoded into ``reply``; ReplyNotUnderstood names the field that does not fit."""
    try:
        return protocol.from_json(reply, result, cmd)
    except protocol.ProtocolError as exc:
        raise ReplyNotUnderstood(f"{cmd}: the agent's reply is not understood: {exc}", cmd=cmd) from None


class Session:
    def __init__(self, transport: Transport, opts: ConnectOptions) -> None:
        self.transport = transport
        self.opts = opts
        self.target_display: str = transport.display
        self.state: str = "disconnected"
        self.agent: protocol.HelloEvent | None = None  # the agent's hello, decoded
        self.rtt_ms: float | None = None
        self.auto_reconnect: bool = True
        self.max_reconnect_attempts: int | None = None  # None: keep trying until close()
        # A following client's requests (idempotent reads: tail, read_log, subscribe) are sent again once the link
        # is back when it dropped under them, instead of failing the command.
        self.retry_lost_requests: bool = False
        self.backoff_base_s: float = 0.5
        self.backoff_cap_s: float = 30.0
        self._stream: AgentStream | None = None
        # The link a command could not be written to: not "connected" any more, though its reader may have yet to see
        # the loss (the retry of that command waits for the next link instead of spinning on this one).
        self._unwritable: AgentStream | None = None
        self._pending: dict[int, asyncio.Future[protocol.ReplyEvent]] = {}
        self._next_id = 1
        self._listeners: list[Listener] = []
        self._reader: asyncio.Task[None] | None = None
        self._reconnector: asyncio.Task[None] | None = None
        self._pinger: asyncio.Task[None] | None = None
        self._closing = False
        self._streams: dict[str, float] | None = None  # subscribe intervals once start_streams ran
        self._log_pos: dict[str, int] | None = None  # where the next log byte starts
        self._engine_offset: int | None = None
        self._attempt = 0
        self._host_link: HostLink | None = None
        self._last_rx_s = 0.0  # monotonic time of the last line from the agent
        self._resync: asyncio.Future[None] | None = None

    @property
    def engine_pythonpath(self) -> str | None:
        """PYTHONPATH under which ``python3 -m engine.trainer`` runs on the host (where the engine was shipped)."""
        return self.transport.engine_pythonpath

    # -- listeners ---------------------------------------------------------------------------------

    def add_event_listener(self, fn: Listener) -> Callable[[], None]:
        """Call ``fn`` with every event, decoded; returns the function that removes it."""
        self._listeners.append(fn)

        def unsubscribe() -> None:
            with contextlib.suppress(ValueError):
                self._listeners.remove(fn)

        return unsubscribe

    def _dispatch(self, ev: ClientEvent) -> None:
        """Hand one event to the listeners."""
        for fn in list(self._listeners):
            _call(fn, ev, ev.EV)

    def _warn(self, message: str) -> None:
        self._dispatch(protocol.WarningEvent(message))

    def _set_state(self, state: str, detail: str = "") -> None:
        self.state = state
        self._dispatch(ConnectionEvent(state, detail, self._attempt))

    # -- connecting --------------------------------------------------------------------------------

    async def connect(self, retry: bool = False) -> None:
        """Connect and read the agent's hello; raises ConnectError (exit code 3). ``retry`` (a following command):
        a link that drops while connecting is tried again as a drop after connect is, same backoff and words."""
        self._closing = False
        self._set_state("connecting", self.target_display)
        attempt = 0
        while True:
            try:
                await self._open()
                break
            except ConnectError as exc:
                attempt += 1
                out_of_tries = self.max_reconnect_attempts is not None and attempt > self.max_reconnect_attempts
                if not retry or not exc.retryable or self._closing or out_of_tries:
                    self._set_state("failed", exc.message)
                    raise
                if isinstance(self.transport, SshTransport):
                    self.transport.drop_connection()  # the next try opens a fresh SSH connection
                self._attempt = attempt
                delay = self.backoff_s(attempt)
                self._set_state("reconnecting", f"{exc.message}; retry in {delay:.1f} s")
                await asyncio.sleep(delay)
        self._attempt = 0
        again = f"reconnected after {attempt} attempt(s); " if attempt else ""
        self._set_state("connected", again + self._hello_detail())
        host = self.transport.host_side()
        if host is not None and self._host_link is None:
            self._host_link = HostLink(self, host)
            self._host_link.start()

    def _hello_detail(self) -> str:
        h = self.agent
        return f"agent {h.agent_version} on {h.hostname} (python {h.python})" if h else "no hello"

    async def _open(self) -> None:
        stream = await self.transport.open()
        async with stream.closed_on_failure():
            agent = await self._read_hello(stream)
        self.agent = agent
        self._stream = stream
        self._reader = asyncio.ensure_future(self._read_loop(stream))
        self._dispatch(agent)

    async def _read_hello(self, stream: AgentStream) -> protocol.HelloEvent:
        """The agent's first line, checked; raises ConnectError (the caller closes the stream)."""
        try:
            line = await asyncio.wait_for(stream.readline(), HELLO_TIMEOUT_S)
        except asyncio.TimeoutError:
            raise ConnectError(f"{self.target_display}: the agent sent no hello within {HELLO_TIMEOUT_S:g} s") from None
        except ConnectionError as exc:
            raise ConnectError(f"{self.target_display}: the agent connection broke at start: {exc}") from None
        hello: dict[str, Any] | None = None
        if line:
            with contextlib.suppress(protocol.ProtocolError):
                hello = protocol.parse_event(line)
        if hello is None or hello.get("ev") != "hello":
            rc = await stream.wait_exit(5.0)
            await stream.stderr_settled()
            err = "\n".join(stream.stderr_text().splitlines()[-15:])
            got = line[:200].decode("utf-8", "replace").strip()
            raise ConnectError(
                f"{self.target_display}: the agent did not start (exit {rc}); "
                + (f"first line: {got!r}; " if got else "")
                + (f"its stderr:\n{err}" if err else "no stderr")
            )
        if hello.get("protocol") != protocol.PROTOCOL_VERSION:
            raise ConnectError(
                f"{self.target_display}: agent speaks protocol {hello.get('protocol')}, "
                f"this client {protocol.PROTOCOL_VERSION}"
            )
        try:
            return protocol.from_json(protocol.HelloEvent, hello, "hello")
        except protocol.ProtocolError as exc:
            raise ConnectError(f"{self.target_display}: the agent's hello is not understood: {exc}") from None

    async def _read_loop(self, stream: AgentStream) -> None:
        reason = "the agent closed the connection"
        while True:
            try:
                line = await stream.readline()
            except ConnectionError as exc:
                reason = str(exc)
                break
            except Exception as exc:  # whatever else ends the reader is a lost link: never "connected" with no reader
                reason = f"the link's reader failed: {type(exc).__name__}: {exc}"
                break
            if not line:
                break
            self._last_rx_s = time.monotonic()
            try:
                ev = protocol.parse_event(line)
            except protocol.ProtocolError as exc:
                self._warn(f"unreadable line from the agent: {exc}")
                continue
            except Exception as exc:  # a decoder failure the protocol did not foresee: reconnect and resume
                reason = f"a line from the agent could not be decoded: {type(exc).__name__}: {exc}"
                break
            try:
                self._on_event(ev)
            except Exception as exc:  # one bad event must not end the reader while the state says "connected"
                self._warn(f"event {ev.get('ev')!r} not handled: {exc!r}")
        if stream is self._stream:
            await self._lost(stream, reason)

    def _on_event(self, obj: dict[str, Any]) -> None:
        """One parsed agent line: decoded, then replies matched, stream positions kept, listeners called."""
        kind = obj.get("ev")
        if kind in SESSION_EVENTS:
            # The session's own state events come from the session; an agent that sends one is faulty or hostile.
            self._warn(f"the agent sent a {kind!r} event, which only the session may emit; ignored")
            return
        ev = decode(obj)
        if kind == "engine" and isinstance(obj.get("offset"), int) and not isinstance(obj.get("offset"), bool):
            self._engine_offset = obj["offset"]  # an engine line resumes after its byte even when it did not decode
        if isinstance(ev, Undecodable):
            inner = obj.get("event")
            if kind == "engine" and isinstance(inner, dict) and inner.get("kind") not in protocol.ENGINE_EVENT_KINDS:
                return  # another engine's own event kind: nothing here reads it (forward-compatible, not an error)
            reply_id = obj.get("id")
            if kind == "reply" and isinstance(reply_id, int) and not isinstance(reply_id, bool):
                fut = self._pending.pop(reply_id, None)  # its command fails now instead of waiting out its timeout
                if fut is not None and not fut.done():
                    fut.set_exception(ReplyNotUnderstood(f"the agent's reply is not understood: {ev.reason}"))
            self._dispatch(ev)
            return
        if isinstance(ev, protocol.ReplyEvent):
            if ev.id is None:
                self._warn("reply without an id ignored")
                return
            fut = self._pending.pop(ev.id, None)
            if fut is not None and not fut.done():
                fut.set_result(ev)
        elif isinstance(ev, protocol.LogEvent):
            pos = self._log_pos
            if pos is not None and pos.get("inode") == ev.inode and ev.offset != pos.get("offset"):
                fitted = self._fit_log_event(ev, int(pos.get("offset") or 0))
                if fitted is None:
                    return
                ev = fitted
            self._log_pos = {"offset": ev.offset + len(ev.raw), "inode": ev.inode}
        elif isinstance(ev, protocol.LogResetEvent):
            self._log_pos = {"offset": ev.offset, "inode": ev.inode}
        self._dispatch(ev)

    def _fit_log_event(self, ev: protocol.LogEvent, expected: int) -> protocol.LogEvent | None:
        """A log event that does not start where the received bytes end: trim what was already received, or
        (a gap) drop it and subscribe again from the last byte received, so listeners never see a byte twice or
        a hole."""
        raw = ev.raw
        if ev.offset < expected:
            if ev.offset + len(raw) <= expected:
                return None  # all of it received already
            return protocol.LogEvent(expected, ev.inode, protocol.encode_log_data(raw[expected - ev.offset :]))
        if self._streams is not None and (self._resync is None or self._resync.done()):
            self._warn(f"log bytes {expected}..{ev.offset} missing from the stream; resuming from byte {expected}")
            self._resync = asyncio.ensure_future(self._resubscribe())
        return None

    async def _resubscribe(self) -> None:
        """Ask for the streams again from the remembered positions (after a gap); the link stays up."""
        try:
            await self._subscribe()
        except CommandFailed as exc:
            self._warn(f"re-subscribe after a gap failed: {exc.message}")

    def _fail_pending(self, message: str) -> None:
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(CommandFailed(message, lost=True))

    async def _lost(self, stream: AgentStream, reason: str) -> None:
        self._stream = None
        try:
            rc = await stream.wait_exit(0.5)
            await stream.stderr_settled(0.5)
        except Exception as exc:  # the detail below says what happened; the reconnect must still start
            rc = None
            reason += f" ({type(exc).__name__} while collecting the exit status: {exc})"
        err = stream.stderr_text().strip().splitlines()[-3:]
        detail = reason + (f" (exit {rc})" if rc is not None else "") + (": " + " | ".join(err) if err else "")
        self._fail_pending(f"connection lost: {detail}")
        if self._pinger is not None:
            self._pinger.cancel()
        if self._closing:
            return
        with contextlib.suppress(Exception):
            await stream.close()
        if isinstance(self.transport, SshTransport):
            self.transport.drop_connection()
        if self.auto_reconnect:
            self._reconnector = asyncio.ensure_future(self._reconnect_loop(detail))
        else:
            self._set_state("disconnected", detail)

    def backoff_s(self, attempt: int) -> float:
        """Capped exponential backoff with full jitter over the upper half: attempt 1 -> 0.25..0.5 s."""
        ceiling: float = min(self.backoff_cap_s, self.backoff_base_s * (2 ** (attempt - 1)))
        return float(ceiling * random.uniform(0.5, 1.0))

    async def _reconnect_loop(self, why: str) -> None:
        self._attempt = 0
        while not self._closing:
            self._attempt += 1
            if self.max_reconnect_attempts is not None and self._attempt > self.max_reconnect_attempts:
                self._set_state("failed", f"gave up after {self.max_reconnect_attempts} attempts: {why}")
                return
            delay = self.backoff_s(self._attempt)
            self._set_state("reconnecting", f"{why}; retry in {delay:.1f} s")
            await asyncio.sleep(delay)
            if self._closing:
                return
            try:
                await self._open()
            except ConnectError as exc:
                why = exc.message
                if not exc.retryable:
                    self._set_state("failed", exc.message)
                    return
                continue
            self._set_state("connected", f"reconnected after {self._attempt} attempt(s); {self._hello_detail()}")
            self._attempt = 0
            if self._streams is not None:
                try:
                    await self._subscribe()
                except CommandFailed as exc:
                    self._warn(f"re-subscribe failed: {exc.message}")
            return

    # -- commands ----------------------------------------------------------------------------------

    async def request(
        self, cmd: str, *, timeout_s: float | None = None, params: dict[str, Any] | None = None, **args: Any
    ) -> dict[str, Any]:
        """Send one command and return its result; raises CommandFailed.

        ``timeout_s`` bounds the wait for the reply. Command arguments go in ``**args``; those whose
        name clashes with this signature (``wait``'s and ``stacks``' own ``timeout_s``) go in ``params``.
        With ``retry_lost_requests`` a command the link lost is sent again once it is back.
        """
        while True:
            try:
                return await self._request_once(cmd, timeout_s=timeout_s, params=params, **args)
            except CommandFailed as exc:
                if not (exc.lost and self.retry_lost_requests and self.auto_reconnect) or self._closing:
                    raise
                if not await self.until_connected():
                    raise

    async def until_connected(self) -> bool:
        """Wait for the link to be back (True), or for the session to give up on it (False)."""
        if self.state == "connected" and self._stream is not None and self._stream is not self._unwritable:
            return True
        back: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

        def on_event(ev: ClientEvent) -> None:
            settled = isinstance(ev, ConnectionEvent) and ev.state in ("connected", "failed", "disconnected")
            if settled and not back.done():
                back.set_result(isinstance(ev, ConnectionEvent) and ev.state == "connected")

        unsubscribe = self.add_event_listener(on_event)
        try:
            return await back
        finally:
            unsubscribe()

    async def _request_once(
        self, cmd: str, *, timeout_s: float | None = None, params: dict[str, Any] | None = None, **args: Any
    ) -> dict[str, Any]:
        if params:
            args = {**args, **params}
        if cmd in HOLDER_COMMANDS and self._host_link is not None:
            await self._host_link.first_map(HOST_MAP_FIRST_WAIT_S)
        stream = self._stream
        if stream is None or self.state != "connected":
            raise CommandFailed(f"{cmd}: not connected ({self.state})", cmd=cmd, lost=True)
        cmd_id = self._next_id
        self._next_id += 1
        fut: asyncio.Future[protocol.ReplyEvent] = asyncio.get_running_loop().create_future()
        self._pending[cmd_id] = fut
        try:
            stream.write(protocol.encode(protocol.command(cmd_id, cmd, **args)))
        except (ConnectionError, OSError) as exc:
            self._pending.pop(cmd_id, None)
            self._unwritable = stream
            raise CommandFailed(f"{cmd}: cannot send: {exc}", cmd=cmd, lost=True) from None
        try:
            reply = await asyncio.wait_for(fut, timeout_s)
        except asyncio.TimeoutError:
            self._pending.pop(cmd_id, None)
            raise CommandFailed(f"{cmd}: no reply within {timeout_s:g} s", cmd=cmd) from None
        except ReplyNotUnderstood as exc:
            raise ReplyNotUnderstood(f"{cmd}: {exc.message}", cmd=cmd) from None
        if not reply.ok:
            raise CommandFailed(reply.error or f"{cmd} failed", cmd=cmd, kind=reply.error_kind)
        result = reply.result
        return result if isinstance(result, dict) else {"value": result}

    async def ask(
        self,
        reply: type[R],
        cmd: str,
        *,
        timeout_s: float | None = None,
        params: dict[str, Any] | None = None,
        **args: Any,
    ) -> R:
        """``request``, its result decoded into ``reply``; raises CommandFailed (ReplyNotUnderstood: it did not fit)."""
        return typed_reply(reply, cmd, await self.request(cmd, timeout_s=timeout_s, params=params, **args))

    async def ping(self, timeout_s: float = 10.0) -> float:
        t0 = time.perf_counter()
        await self.request("ping", timeout_s=timeout_s)
        self.rtt_ms = (time.perf_counter() - t0) * 1000.0
        return self.rtt_ms

    async def _ping_loop(self) -> None:
        missed = 0
        while not self._closing:
            if self.state == "connected":
                sent_s = time.monotonic()
                try:
                    await self.ping(timeout_s=PING_TIMEOUT_S)
                    missed = 0
                except CommandFailed as exc:
                    # Lines that kept arriving mean a live link whose reply waits behind them (a slow consumer).
                    missed = 0 if exc.lost or self._last_rx_s > sent_s else missed + 1
                if missed >= PINGS_MISSED_BEFORE_RECONNECT:
                    # A link that stopped answering (no FIN, no RST) would otherwise wait for SSH keepalives.
                    missed = 0
                    await self._abandon_link()
            await asyncio.sleep(PING_INTERVAL_S)

    async def _abandon_link(self) -> None:
        """Give up on the current link; the reader sees it end and the reconnect loop takes over."""
        stream = self._stream
        if stream is None:
            return
        if isinstance(self.transport, SshTransport):
            self.transport.drop_connection()
        else:
            await stream.close()

    async def start_streams(self, gpu_interval_s: float = 0.5, procs_interval_s: float = 1.0) -> None:
        """Subscribe to the live streams; after a reconnect they resume where they stopped."""
        self._streams = {"gpu_interval_s": gpu_interval_s, "procs_interval_s": procs_interval_s}
        await self._subscribe()

    async def _subscribe(self) -> None:
        assert self._streams is not None
        await self.request(
            "subscribe",
            timeout_s=30.0,
            params={"log": self._log_pos, "engine_offset": self._engine_offset, **self._streams},
        )
        if self._pinger is None or self._pinger.done():
            self._pinger = asyncio.ensure_future(self._ping_loop())

    def resume_from(self, log: dict[str, int] | None, engine_offset: int | None) -> None:
        """Set where the streams start (e.g. ``logs -n N`` begins at the tail's offset)."""
        self._log_pos = dict(log) if log else None
        self._engine_offset = engine_offset

    @property
    def log_position(self) -> dict[str, int] | None:
        return dict(self._log_pos) if self._log_pos else None

    @property
    def engine_offset(self) -> int | None:
        return self._engine_offset

    def attach_argv(self, tmux_session: str) -> list[str]:
        return self.transport.attach_argv(tmux_session)

    async def close(self) -> None:
        self._closing = True
        if self._host_link is not None:
            await self._host_link.close()
        for task in (self._reconnector, self._pinger):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        stream, self._stream = self._stream, None
        self._fail_pending("session closed")
        if stream is not None:
            await stream.close()
        if self._reader is not None and not self._reader.done():
            with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError):
                await asyncio.wait_for(self._reader, 2.0)
            if not self._reader.done():
                self._reader.cancel()
        await self.transport.close()
        if self.state != "disconnected":
            self._set_state("disconnected", "closed")


class HostLink:
    """Under --pct: an agent on the Proxmox host itself, asked for its ``host_map`` every few seconds.

    Each answer is handed to the container's agent (``host_holders``), which merges it: holders, anomalies,
    ``status --json`` and kill-stale all come from one place, the container's agent, whatever the client.
    When the host side cannot be used (pct's host has no python3 or no NVML, ...) that is said once (a warning
    event) and handed to the container's agent, whose view stays its own, labelled; the link retries quietly.
    """

    def __init__(self, session: Session, transport: Transport) -> None:
        self.session = session
        self.transport = transport
        self.ready = asyncio.Event()  # set once the first map (or the reason there is none) reached the agent
        self._task: asyncio.Task[None] | None = None
        self._host: Session | None = None
        self._said: str | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def first_map(self, timeout_s: float) -> None:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.ready.wait(), timeout_s)

    async def _run(self) -> None:
        ctid = self.session.opts.pct
        while not self.session._closing:
            error = await self._connect()
            while error is None and not self.session._closing:
                assert self._host is not None
                try:
                    hm = await self._host.request("host_map", timeout_s=20.0, ctid=ctid)
                    said = typed_reply(protocol.HostMap, "host_map", hm)
                except CommandFailed as exc:
                    error = f"the Proxmox host's agent failed: {exc.message}"
                    break
                if said.error is not None:
                    error = f"the Proxmox host cannot list GPU processes: {said.error}"
                    break
                if await self._hand_over(map=hm):
                    self._said = None  # working again: a later failure is news
                await asyncio.sleep(HOST_MAP_INTERVAL_S)
            if error is not None:
                if error != self._said:  # said once; a container agent that reconnected still gets the reason
                    self._said = error
                    self.session._warn(f"{error}; showing the container's own view")
                await self._hand_over(error=error)
            self.ready.set()
            await self._drop_host()
            await asyncio.sleep(HOST_MAP_RETRY_S)

    async def _connect(self) -> str | None:
        """Start the host's agent; the reason when it cannot be used."""
        if self._host is not None and self._host.state == "connected":
            return None
        host = Session(self.transport, self.transport.opts)
        host.auto_reconnect = False
        try:
            await host.connect()
        except ConnectError as exc:
            return f"cannot run the agent on the Proxmox host itself: {exc.message}"
        self._host = host
        return None

    async def _hand_over(self, **args: Any) -> bool:
        """Give the container's agent the map (or the reason there is none); True when it took it."""
        if self.session.state != "connected":
            return False  # the container's agent is reconnecting: the next map goes to the new one
        try:
            await self.session.request("host_holders", timeout_s=10.0, **args)
        except CommandFailed as exc:
            why = f"host map not accepted: {exc.message}"
            if not exc.lost and why != self._said:
                self._said = why
                self.session._warn(why)
            return False
        finally:
            self.ready.set()
        return True

    async def _drop_host(self) -> None:
        host, self._host = self._host, None
        if host is not None:
            await host.close()

    async def close(self) -> None:
        if self._task is not None and not self._task.done():
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task
        await self._drop_host()


def _call(fn: Callable[[Any], None], arg: Any, kind: str) -> None:
    try:
        fn(arg)
    except Exception as exc:  # a broken listener must not stop the stream; the loop reports it
        asyncio.get_running_loop().call_exception_handler(
            {"message": f"session listener {fn!r} failed on {kind!r} event", "exception": exc}
        )


def open_session(target_spec: str, opts: ConnectOptions) -> Session:
    """A session for TARGET (not yet connected); raises ValueError for a malformed TARGET."""
    return Session(make_transport(target_spec, opts), opts)
