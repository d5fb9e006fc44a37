"""What guards the app before FastAPI reads a request (`RequestGuard`: the concurrency limit,
the bearer token, the body cap) and what counts every request (`RequestMetricsMiddleware`),
both pure ASGI."""

import asyncio
import hmac
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from retrieval_server.config import ServerConfig
from retrieval_server.serving.connections import ARRIVAL
from retrieval_server.serving.errors import (
    error_response,
)
from retrieval_server.serving.metrics import ServerMetrics

KNOWN_PATHS = {"/retrieve", "/health", "/metrics"}
UNLIMITED_PATHS = {"/health", "/metrics"}  # answered even at the concurrency limit
OPEN_PATHS = {"/health"}  # no token needed (orchestrator health checks)


class BodyRefused(Exception):
    """A request body not received: the status, its one-line detail, and the metric reason."""

    def __init__(self, status: int, detail: str, reason: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail
        self.reason = reason


class RequestGuard:
    """Pure ASGI middleware that protects the app before FastAPI reads anything:

    1. at most `max_concurrent_requests` requests inside the app at once (503 + Retry-After
       beyond, checked before the body is read and again after; /health and /metrics are
       exempt, so monitoring works under load);
    2. the bearer token, when configured, from the headers alone (401), on every path but
       /health;
    3. the body: at most `max_body_bytes` (a Content-Length above it, or a streamed body that
       grows past it, is a 413 without reading further); all bodies together at most
       `max_buffered_body_bytes` of memory, counted as bytes arrive and released when the
       request is answered (503 + Retry-After and the connection closed for the body whose
       chunk would pass it); no gap between chunks longer than `body_idle_timeout_s` and the
       whole body within `body_read_timeout_s` (408 and the connection closed past either).
       The body is then handed to the app from memory.

    A request receiving its body holds only the bytes it has sent: no slot of any count, so
    stalled senders cannot keep ready requests out, whatever their number, and cost memory in
    proportion to what they actually sent.
    """

    def __init__(self, app: ASGIApp, config: ServerConfig, metrics: ServerMetrics) -> None:
        self.app = app
        self.config = config
        self.metrics = metrics
        self.token = config.api_token.get_secret_value().encode() if config.api_token else None
        self.in_flight = 0  # requests inside the app (bodies received)
        self.reading = 0  # requests whose body is arriving
        self.buffered = 0  # body bytes held in memory, arriving or being served
        metrics.in_flight.set_function(lambda: self.in_flight)
        metrics.receiving.set_function(lambda: self.reading)
        metrics.buffered_bytes.set_function(lambda: self.buffered)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        limited = path not in UNLIMITED_PATHS
        if limited and self.in_flight >= self.config.max_concurrent_requests:
            await self.refuse_busy(scope, receive, send, "concurrency", "too many requests")
            return
        if self.token is not None and path not in OPEN_PATHS and not self.authorized(scope):
            await self.refuse(scope, receive, send, 401, "missing or wrong bearer token")
            return
        held = [0]  # this request's bytes in self.buffered, released however it ends
        try:
            self.reading += limited
            try:
                body = await self.read_body(scope, receive, held)
            except BodyRefused as refused:
                if refused.status == 503:
                    self.metrics.rejected.labels(refused.reason).inc()
                elif refused.status == 408:
                    self.metrics.slow_bodies.labels(refused.reason).inc()
                # the rest of the body may still be on its way: the connection cannot be reused
                await self.refuse(scope, receive, send, refused.status, refused.detail, close=True)
                return
            finally:
                self.reading -= limited
            if limited and self.in_flight >= self.config.max_concurrent_requests:
                await self.refuse_busy(scope, receive, send, "concurrency", "too many requests")
                return
            self.in_flight += limited
            try:
                await self.app(scope, receive_buffered(body, receive), send)
            finally:
                self.in_flight -= limited
        finally:
            self.buffered -= held[0]

    def authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization" and value[:7].lower() == b"bearer ":
                given = value[7:].strip()
        return hmac.compare_digest(given, self.token or b"")

    async def read_body(self, scope: Scope, receive: Receive, held: list[int]) -> bytes:
        """The whole body; raises `BodyRefused` as soon as it is known to exceed the cap or the
        budget, or a deadline passes. Adds the bytes it holds to `held[0]` and the budget."""
        config = self.config
        cap = config.max_body_bytes
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > cap:
                raise BodyRefused(413, f"body larger than {cap} bytes", "too_large")
        loop = asyncio.get_running_loop()
        started = loop.time()
        whole_by = started + config.body_read_timeout_s
        chunks, size = [], 0
        # one timer for the whole body, moved on with every chunk: the earlier of the idle and
        # the whole-body deadline
        try:
            async with asyncio.timeout(min(whole_by, started + config.body_idle_timeout_s)) as t:
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return b""  # disconnected; the app meets the disconnect next
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > cap:
                        raise BodyRefused(413, f"body larger than {cap} bytes", "too_large")
                    if self.buffered + len(chunk) > config.max_buffered_body_bytes:
                        raise BodyRefused(
                            503,
                            "server busy: too many request bytes in transit; retry",
                            "body_bytes",
                        )
                    self.buffered += len(chunk)
                    held[0] += len(chunk)
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
                    t.reschedule(min(whole_by, loop.time() + config.body_idle_timeout_s))
        except TimeoutError:
            if loop.time() >= whole_by:
                limit = config.body_read_timeout_s
                detail = f"request body not received within the {limit:g} s body deadline"
                raise BodyRefused(408, detail, "deadline") from None
            idle = config.body_idle_timeout_s
            raise BodyRefused(408, f"request body idle for {idle:g} s", "idle") from None

    async def refuse_busy(
        self, scope: Scope, receive: Receive, send: Send, reason: str, what: str
    ) -> None:
        self.metrics.rejected.labels(reason).inc()
        await self.refuse(scope, receive, send, 503, f"server busy: {what}; retry")

    async def refuse(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        status: int,
        detail: str,
        close: bool = False,
    ) -> None:
        headers = {}
        if status == 503:
            headers["Retry-After"] = str(self.config.retry_after_s)
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if close:
            headers["Connection"] = "close"
        await error_response(status, detail, headers)(scope, receive, send)


def receive_buffered(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the body `RequestGuard` buffered, in one message, then
    the server's own messages (so the app still learns of a disconnect)."""
    handed = False

    async def receive_body_then_server() -> Message:
        nonlocal handed
        if not handed:
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return receive_body_then_server


class RequestMetricsMiddleware:
    """Pure ASGI middleware (cheaper than `@app.middleware`): counts every HTTP request and its
    latency by endpoint and status; unknown paths are counted as "other". The latency is the
    server's own: from the request's arrival (its first byte parsed, as the guarded protocol
    records it; else from when the app first ran it) to its last byte handed to the socket;
    each response also says its time to the response's start in a `Server-Timing` header
    (`total;dur=MILLISECONDS`), so a client can put the server's view beside its own."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
        started = scope.get("extensions", {}).get(ARRIVAL) or time.perf_counter()
        status = 500  # if the app fails before answering

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                took = b"total;dur=%.3f" % (1000 * (time.perf_counter() - started))
                message["headers"] = [*message.get("headers", ()), (b"server-timing", took)]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if status >= 400:
                self.metrics.errors.labels(endpoint, str(status)).inc()
