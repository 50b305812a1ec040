"""Connection-level defences against slow and greedy clients, below the ASGI app.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but never one that is slow to send
its request: a socket that sends nothing, drips header lines, or announces a body and drips it is
held forever, and enough of them exhaust the process's file limit. GuardedH11Protocol adds:

- a header timeout: the request line and headers must arrive within `header_timeout_s` of the
  connection opening (or of the previous response ending);
- a body timeout: the whole body must arrive within `body_timeout_s` of the headers;
- a connection cap: a connection beyond `max_connections` gets a 503 at once, before it has sent
  anything, and is closed, so a refused client holds a file descriptor for a moment only.

uvicorn's own `limit_concurrency` answers 503 only once the request headers have arrived (an idle
socket keeps its slot) and logs a warning per refused request, so the cap lives here instead.
Repeated events (refusals, accept() out of file descriptors) are logged once per interval.
"""
from __future__ import annotations

import asyncio
import errno
import json
import logging
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .metrics import ServerMetrics
from .protocol import error_body

log = logging.getLogger(__name__)
BODY_TIMEOUT_KEY = "tercel.body_timeout"  # set in the ASGI scope of a request whose body timed out

FD_RESERVE = 64  # file descriptors beside client sockets: model files, the listener, logs, threads
REFUSED_LINGER_S = 1.0  # keep reading (and dropping) a refused client's request so the 503 is not reset
ACCEPT_RESOURCE_ERRNOS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    max_connections: int = 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: float = 5.0
    log_interval_s: float = 60.0  # at most one line per interval for each repeated event

    def __post_init__(self) -> None:
        if self.max_connections < 1:
            raise ValueError(f"max_connections={self.max_connections} must be >= 1.")
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s", "log_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)} must be > 0 seconds.")


class RateLimitedLog:
    """One line per interval for an event that may repeat thousands of times a second; the next line
    says how many occurrences it stood for."""

    def __init__(self, logger: logging.Logger, level: int, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger, self.level, self.interval_s, self.clock = logger, level, interval_s, clock
        self._last = -float("inf")
        self._unlogged = 0

    def __call__(self, msg: str, *args: Any) -> None:
        now = self.clock()
        if now - self._last < self.interval_s:
            self._unlogged += 1
            return
        if self._unlogged:
            msg += f" (and {self._unlogged} more times in the last {now - self._last:.0f} s)"
        self.logger.log(self.level, msg, *args)
        self._last, self._unlogged = now, 0


class _RateLimitedWarnings:
    """uvicorn's protocol logger with its warnings (one per malformed request, per unsupported
    upgrade) rate-limited per message, since a hostile client can cause thousands a second; every
    other call goes to the logger unchanged."""

    def __init__(self, logger: logging.Logger, interval_s: float) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._by_message: dict[str, RateLimitedLog] = {}

    def warning(self, msg: str, *args: Any, **kw: Any) -> None:
        rl = self._by_message.get(msg)
        if rl is None:
            rl = self._by_message[msg] = RateLimitedLog(self._logger, logging.WARNING, self._interval_s)
        rl(msg, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._logger, name)


@dataclass(slots=True)
class ConnectionGuard:
    """What the protocol instances of one server share: limits, metrics, rate-limited logs."""

    limits: ConnectionLimits
    metrics: ServerMetrics | None = None
    open_connections: int = 0
    _refusal_log: RateLimitedLog = field(init=False)
    _accept_log: RateLimitedLog = field(init=False)
    _protocol_log: _RateLimitedWarnings | None = field(init=False, default=None)

    def protocol_logger(self, logger: logging.Logger) -> _RateLimitedWarnings:
        if self._protocol_log is None:
            self._protocol_log = _RateLimitedWarnings(logger, self.limits.log_interval_s)
        return self._protocol_log

    def __post_init__(self) -> None:
        self._refusal_log = RateLimitedLog(log, logging.WARNING, self.limits.log_interval_s)
        self._accept_log = RateLimitedLog(log, logging.WARNING, self.limits.log_interval_s)
        if self.metrics is not None:
            self.metrics.connections_open.set_function(lambda: self.open_connections)

    def closed(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.connections_closed.labels(reason).inc()

    def refused(self) -> None:
        self.closed("over_limit")
        self._refusal_log("refusing connections beyond --max-connections %d with 503",
                          self.limits.max_connections)

    def install_accept_error_handler(self, loop: asyncio.AbstractEventLoop) -> None:
        """asyncio logs 'socket.accept() out of system resource' with a traceback each time it
        retries accept() (every second) while the process is out of file descriptors; log it once
        per interval instead. Any other loop error goes to the handler that was there before."""
        previous = loop.get_exception_handler()

        def handle(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
            exc = context.get("exception")
            if isinstance(exc, OSError) and exc.errno in ACCEPT_RESOURCE_ERRNOS and "accept" in context.get(
                    "message", ""):
                self._accept_log("cannot accept new connections: %s (open file limit %d; lower "
                                 "--max-connections or raise `ulimit -n`)", exc.strerror or exc, open_file_limit())
                return
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)

        loop.set_exception_handler(handle)


def open_file_limit() -> int:
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def ensure_file_limit(max_connections: int) -> None:
    """Raise the soft open-file limit so max_connections sockets fit beside FD_RESERVE others; a
    ValueError naming the flag and the fix when even the hard limit is too low."""
    need = max_connections + FD_RESERVE
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard == resource.RLIM_INFINITY or hard >= need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))
        return
    raise ValueError(f"--max-connections {max_connections} needs about {need} open files, but this process may "
                     f"open at most {hard} (ulimit -n). Lower --max-connections to {max(1, hard - FD_RESERVE)} or "
                     f"raise the limit (ulimit -n {need}).")


def default_max_connections() -> int:
    """1024, or fewer when the hard open-file limit cannot fit that many."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    room = 1024 if hard == resource.RLIM_INFINITY else hard - FD_RESERVE
    return max(1, min(1024, room))


def raw_error_response(status: int, reason: str, message: str, code: str, extra: str = "") -> bytes:
    """A complete HTTP/1.1 error response with an OpenAI-style body and `Connection: close`, written
    straight to the socket (the connection is closed right after, so h11's state does not matter)."""
    body = json.dumps(error_body(message, "service_unavailable" if status == 503 else "invalid_request_error",
                                 code=code)).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {len(body)}\r\n"
            f"connection: close\r\n{extra}\r\n")
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header/body timeouts and a connection cap (see the module doc).
    Built by uvicorn with functools.partial(GuardedH11Protocol, guard=...) as Config(http=...)."""

    def __init__(self, *args: Any, guard: ConnectionGuard, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._guard = guard
        self.logger = guard.protocol_logger(self.logger)  # type: ignore[assignment]
        self._phase = ""  # "header" or "body" while a deadline runs
        self._deadline: asyncio.TimerHandle | None = None
        self._got_data = False  # any byte of the current request yet (a silent close if not)
        self._refused = False
        self._counted = False

    # ---- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._guard.open_connections >= self._guard.limits.max_connections:
            self._refuse()
            return
        self._guard.open_connections += 1
        self._counted = True
        self._track()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # drop the request of a refused client: its 503 is on its way
        self._got_data = True
        super().data_received(data)
        self._track()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._counted:
            self._guard.open_connections -= 1
            self._counted = False
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self._refused:
            self._track()

    # ---- deadlines ---------------------------------------------------------------------------
    def _track(self) -> None:
        """Arm the deadline that fits where the parser is: waiting for headers, reading a body, or
        none (the app is answering)."""
        theirs, ours = self.conn.their_state, self.conn.our_state
        if theirs is h11.IDLE and ours is h11.IDLE:
            if self._phase != "header":
                self._got_data = False
                self._arm("header", self._guard.limits.header_timeout_s)
        elif theirs is h11.SEND_BODY:
            if self._phase != "body":
                self._arm("body", self._guard.limits.body_timeout_s)
        else:
            self._disarm()

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._on_deadline)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline, self._phase = None, ""

    def _on_deadline(self) -> None:
        phase, self._deadline, self._phase = self._phase, None, ""
        if self.transport.is_closing():
            return
        self._guard.closed(f"{phase}_timeout")
        log.debug("closing %s: no complete request %s within the timeout", self.client, phase)
        cycle = self.cycle if phase == "body" else None
        if cycle is not None:  # the app may still wait for the body: it sees a disconnect
            answered = cycle.response_started
            if not answered:  # the app counts the request as the 408 written below, not as a client hang-up
                cycle.scope[BODY_TIMEOUT_KEY] = True
            cycle.disconnected = True
            cycle.message_event.set()
        else:
            answered = not self._got_data  # nothing sent at all: just close, like an idle keep-alive
        if not answered:
            seconds = self._guard.limits.header_timeout_s if phase == "header" else self._guard.limits.body_timeout_s
            self.transport.write(raw_error_response(
                408, "Request Timeout", f"The request {'headers' if phase == 'header' else 'body'} did not arrive "
                f"within {seconds:g} s.", "request_timeout"))
        self.transport.close()

    def _refuse(self) -> None:
        """503 now, then a half-close; drop what the client sends until it closes (or a second
        passes), so its request bytes do not make the kernel reset the connection over the 503."""
        self._refused = True
        self.connections.discard(self)  # not a live connection for uvicorn's bookkeeping
        self._guard.refused()
        self.transport.write(raw_error_response(
            503, "Service Unavailable", f"The server has too many open connections (limit "
            f"{self._guard.limits.max_connections}); retry later.", "too_many_connections", "retry-after: 1\r\n"))
        try:
            if self.transport.can_write_eof():
                self.transport.write_eof()
        except OSError:  # the client already left (it waited in the listen backlog): nothing to linger for
            self.transport.close()
            return
        self._deadline = self.loop.call_later(REFUSED_LINGER_S, self.transport.close)
