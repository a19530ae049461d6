"""Connections: how long a client may take to send its request, and how many it may hold.

uvicorn bounds only the idle time between requests of a kept-alive connection
(--timeout-keep-alive); a client that opens a connection and then trickles its request
(slowloris) holds it forever, and enough of them exhaust the file descriptors. Here
uvicorn's h11 protocol gets three deadlines and a cap:

- the request head (request line and headers) must be complete within --header-timeout
  of the connection opening or of the previous response ending;
- a body must be complete within --timeout of its head;
- a client that stops reading its reply (the socket's write buffer stays full) is
  dropped after --timeout;
- past --max-connections, a new connection closes the oldest one still waiting for its
  request head (a trickler or an idle kept-alive client), so fresh clients and /health
  always get in; when every connection is serving a request, the new one gets a 503.

A deadline runs from the start of its phase: bytes arriving do not extend it, which is
what cuts off a client that sends one byte a second. Closing is an abort (no flush: a
trickler reads nothing), and the app sees the request's http.disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("localspec.serve")

DEFAULT_HEADER_TIMEOUT = 15.0
DEFAULT_TIMEOUT = 60.0
DEFAULT_MAX_CONNECTIONS = 512


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout: float = DEFAULT_HEADER_TIMEOUT  # seconds for the request head
    timeout: float = DEFAULT_TIMEOUT  # seconds for a body; for a stalled reader
    max_connections: int = DEFAULT_MAX_CONNECTIONS


_BUSY_BODY = json.dumps({"error": {
    "message": "The server has too many open connections. Retry later.",
    "type": "rate_limit_error", "param": None, "code": "too_many_connections"}}).encode()
_BUSY = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
         b"retry-after: 1\r\nconnection: close\r\ncontent-length: " + str(len(_BUSY_BODY)).encode()
         + b"\r\n\r\n" + _BUSY_BODY)


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with read deadlines, a write-stall deadline and a cap
    on connections (class attributes, set by `protocol_class`)."""

    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self._phase: str | None = None  # "head", "body" or None (request read)
        self._phase_since = 0.0
        self._read_timer: asyncio.TimerHandle | None = None
        self._write_timer: asyncio.TimerHandle | None = None

    # ----- the asyncio protocol ---------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch()
        if len(self.connections) > self.limits.max_connections:
            self._make_room()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read()
        self._cancel_write()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._watch()  # the next request's head is awaited from now

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._write_timer = self.loop.call_later(self.limits.timeout, self._cut, "stopped reading its reply")

    def resume_writing(self) -> None:
        super().resume_writing()
        self._cancel_write()

    # ----- deadlines --------------------------------------------------------------------

    def _watch(self) -> None:
        """Arm the deadline of the phase the client's side of the connection is in."""
        if self.transport is None or self.transport.is_closing():
            return
        state = self.conn.their_state
        phase = "head" if state is h11.IDLE else "body" if state is h11.SEND_BODY else None
        if phase == self._phase:
            return
        self._cancel_read()
        self._phase, self._phase_since = phase, self.loop.time()
        if phase == "head":
            self._read_timer = self.loop.call_later(self.limits.header_timeout, self._cut,
                                                    f"sent no complete request head in {self.limits.header_timeout:g} s")
        elif phase == "body":
            self._read_timer = self.loop.call_later(self.limits.timeout, self._cut,
                                                    f"sent no complete body in {self.limits.timeout:g} s")

    def _cut(self, why: str) -> None:
        if not self.transport.is_closing():
            log.debug("closing the connection of %s: it %s", _peer(self.client), why)
            self.transport.abort()

    def _cancel_read(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _cancel_write(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None

    # ----- the cap ----------------------------------------------------------------------

    def _make_room(self) -> None:
        """Over the cap: close the oldest connection still waiting for a request head
        (this one, the newest, only when it is the only such); else refuse this one."""
        waiting = [c for c in self.connections
                   if isinstance(c, GuardedH11Protocol) and c._phase == "head" and c is not self
                   and not c.transport.is_closing()]
        if waiting:
            oldest = min(waiting, key=lambda c: c._phase_since)
            log.debug("too many connections: closing the idle one of %s", _peer(oldest.client))
            oldest.transport.abort()
            return
        log.warning("localspec serve: %d connections, all serving requests: refusing a new one "
                    "(--max-connections)", len(self.connections) - 1)
        self.transport.write(_BUSY)
        self.transport.close()


def _peer(client: tuple[str, int] | None) -> str:
    return f"{client[0]}:{client[1]}" if client else "a client"


def protocol_class(limits: ConnectionLimits) -> type[GuardedH11Protocol]:
    """The protocol uvicorn instantiates per connection, with these limits."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_config(app: Any, host: str, port: int, limits: ConnectionLimits = ConnectionLimits(),
                   **kw: Any) -> uvicorn.Config:
    """uvicorn's Config for the server: h11 with these limits. An idle kept-alive
    connection is closed after uvicorn's 5 s, as before."""
    return uvicorn.Config(app, host=host, port=port, http=protocol_class(limits), **kw)
