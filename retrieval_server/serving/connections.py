"""Connections that never finish a request head: a deadline for the head, and a bound on the
connections a server holds, so stalled connections can never keep a client out.

uvicorn (0.55) has neither: its keep-alive timer starts only after a first response, so a
connection that sends nothing, or half a request line, holds its socket for as long as the
client likes; and its `limit_concurrency` counts those connections against new requests
(answering 503 to well-behaved clients), which is the denial it should prevent. Past the
process's open-file limit, `accept()` fails and nobody gets in until some close.

`guarded_protocol(...)` is uvicorn's httptools protocol with three additions:

1. **Head deadline.** A timer starts when a connection opens and when a request's first byte
   arrives, and stops when its head (request line and headers) is complete. Past
   `head_timeout_s` the server answers 408 and closes the connection.
2. **A bound on connections.** Past `max_connections`, a new connection closes the oldest
   connection still waiting for a request head, or else the one idle longest between requests;
   only when every held connection is busy with a request is the new one refused (503, then
   closed). So stalled connections are the first to go, and a new client always gets in while
   any are held. Choose the bound below the open-file limit (the default is derived from it).
3. **Arrival time.** When a request's first byte is parsed, its time (`time.perf_counter()`)
   goes into the ASGI scope's extensions (`hdr.arrival`), so the server measures a request
   from its arrival, not from when the app first ran it.
"""

from __future__ import annotations

import asyncio
import resource
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

OPEN_FILES_RESERVE = 256  # descriptors kept for the index, logs, the listener, upstream sockets
ARRIVAL = "hdr.arrival"


def raise_open_file_limit() -> int:
    """Raise this process's soft open-file limit to its hard limit; returns the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def default_max_connections() -> int:
    """The open-file limit less what the process needs besides its connections."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(16, soft - OPEN_FILES_RESERVE)


def status_response(status: int, reason: bytes, detail: str) -> bytes:
    """A whole HTTP/1.1 response with hdr's one-line JSON error body, closing the connection."""
    body = b'{"detail":"%s","errors":[]}' % detail.encode()
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"connection: close\r\n\r\n%s" % (status, reason, len(body), body)
    )


def guarded_protocol(
    head_timeout_s: float,
    max_connections: int,
    on_event: Callable[[str], None] = lambda event: None,
) -> type[asyncio.Protocol]:
    """uvicorn's httptools protocol with a head deadline and a connection bound (one class per
    server: the bound's bookkeeping is shared by its connections). `on_event` hears "opened",
    "closed", and why a connection was cut: "head_timeout", "evicted_stalled",
    "evicted_idle", "refused" (for metrics)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    # connections waiting for a request head, and connections idle between requests, each
    # oldest first: the victims when the bound is reached
    waiting: OrderedDict[Any, None] = OrderedDict()
    idle: OrderedDict[Any, None] = OrderedDict()
    late = status_response(408, b"Request Timeout", "request head not received in time")
    full = status_response(503, b"Service Unavailable", "server busy: too many connections")

    class GuardedHttpToolsProtocol(HttpToolsProtocol):
        head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            on_event("opened")
            self.await_head()
            if len(self.connections) > max_connections and not self.make_room():
                on_event("refused")
                transport.write(full)
                transport.close()

        def make_room(self) -> bool:
            """Close the oldest stalled (else the longest idle) connection; False if none."""
            for pool, why in ((waiting, "evicted_stalled"), (idle, "evicted_idle")):
                for victim in pool:
                    if victim is not self:
                        on_event(why)
                        victim.drop(late if pool is waiting else b"")
                        return True
            return False

        def head_timed_out(self) -> None:
            on_event("head_timeout")
            self.drop(late)

        def drop(self, response: bytes) -> None:
            self.stop_waiting()
            answering = self.cycle is not None and not self.cycle.response_complete
            if response and not answering:  # never inside a response being sent
                self.transport.write(response)
            self.transport.close()

        def await_head(self) -> None:
            if self.head_timer is None:
                self.head_timer = self.loop.call_later(head_timeout_s, self.head_timed_out)
                waiting[self] = None
            idle.pop(self, None)

        def stop_waiting(self) -> None:
            if self.head_timer is not None:
                self.head_timer.cancel()
                self.head_timer = None
            waiting.pop(self, None)
            idle.pop(self, None)

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.scope["extensions"] = {ARRIVAL: time.perf_counter()}
            self.await_head()

        def on_headers_complete(self) -> None:
            self.stop_waiting()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if self.timeout_keep_alive_task is not None:  # idle until the next request
                idle[self] = None

        def connection_lost(self, exc: Exception | None) -> None:
            self.stop_waiting()
            on_event("closed")
            super().connection_lost(exc)

    return GuardedHttpToolsProtocol
