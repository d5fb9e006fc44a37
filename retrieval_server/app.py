"""The FastAPI app: `POST /retrieve` (Search-R1 compatible), `GET /health`, `GET /metrics`.

`create_app(config)` builds an app whose heavy resources (FAISS index, BM25, encoder, corpus
offsets) are loaded in its lifespan, never at import. Searches go through a `MicroBatcher`, which
runs them in a worker thread; documents are read from disk in a thread too, so the event loop only
parses, validates and batches.

It degrades instead of dying: `RequestGuard` (outside FastAPI) enforces the concurrency limit,
the bearer token and the body cap before a body is read or parsed; the batcher's queue is bounded
in queries; every request has a deadline; a client that disconnects stops its search. Bad input
is a 4xx whose `detail` is one readable line and never echoes the input; refusals under load are
503 with Retry-After. Prometheus metrics use a registry owned by the app, so several apps can
live in one process.
"""

# No `from __future__ import annotations`: FastAPI must see the request model created in
# `create_app` as a real annotation, not as a string to resolve in module globals.

import asyncio
import contextlib
import hmac
import json
import math
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import UserError
from retrieval_server.api import (
    ErrorResponse,
    HealthResponse,
    PlainResponse,
    ScoredResponse,
    profile_request_model,
)
from retrieval_server.batching import MicroBatcher, Overloaded, SearchFailed
from retrieval_server.config import ServerConfig
from retrieval_server.emulated_cost import CostEmulator
from retrieval_server.index import DocumentStore, LoadedIndex, load_index
from retrieval_server.retrievers import Hit, Retriever, available_retrievers, make_retrievers

KNOWN_PATHS = {"/retrieve", "/health", "/metrics"}
UNLIMITED_PATHS = {"/health", "/metrics"}  # answered even at the concurrency limit
OPEN_PATHS = {"/health"}  # no token needed (orchestrator health checks)
MAX_LOC_CHARS = 64  # a validation error names the field, cut to this; input is never echoed
CLIENT_GONE = 499  # recorded in metrics for a client that left; nobody receives it


class ServerMetrics:
    """The app's Prometheus collectors, in a registry of its own."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "hdr_retrieval_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.errors = Counter(
            "hdr_retrieval_errors",
            "HTTP requests answered with a 4xx or 5xx.",
            ["endpoint", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "hdr_retrieval_request_seconds",
            "Request latency by endpoint.",
            ["endpoint"],
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=self.registry,
        )
        self.queries = Counter(
            "hdr_retrieval_queries",
            "Queries searched, by retriever.",
            ["retriever"],
            registry=self.registry,
        )
        self.batch_queries = Histogram(
            "hdr_retrieval_batch_queries",
            "Queries per micro-batch search, by retriever.",
            ["retriever"],
            buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=self.registry,
        )
        self.rejected = Counter(
            "hdr_retrieval_rejected",
            "Requests answered 503 before any search, by reason "
            "(queue_full, concurrency, body_bytes, unhealthy).",
            ["reason"],
            registry=self.registry,
        )
        self.expired = Counter(
            "hdr_retrieval_expired",
            "Requests answered 503 because their deadline passed (unsearched queries dropped).",
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "hdr_retrieval_requests_in_flight",
            "Requests inside the app (bodies received), of max_concurrent_requests.",
            registry=self.registry,
        )
        self.receiving = Gauge(
            "hdr_retrieval_bodies_receiving",
            "Requests whose body is arriving.",
            registry=self.registry,
        )
        self.buffered_bytes = Gauge(
            "hdr_retrieval_body_bytes_buffered",
            "Request body bytes held in memory (arriving or being served), of "
            "max_buffered_body_bytes.",
            registry=self.registry,
        )
        self.slow_bodies = Counter(
            "hdr_retrieval_slow_bodies",
            "Requests answered 408 because their body stalled (idle: body_idle_timeout_s) or "
            "did not arrive whole in time (deadline: body_read_timeout_s).",
            ["reason"],
            registry=self.registry,
        )
        self.disconnected = Counter(
            "hdr_retrieval_disconnected",
            "Requests whose client went away before the answer (unsearched queries dropped).",
            registry=self.registry,
        )
        self.truncated = Counter(
            "hdr_retrieval_truncated_queries",
            "Queries cut to max_query_chars (search-r1 profile).",
            registry=self.registry,
        )

    def observe_batch(self, retriever: str, queries: int) -> None:
        self.queries.labels(retriever).inc(queries)
        self.batch_queries.labels(retriever).observe(queries)


@dataclass
class ServingState:
    """What the lifespan loads and the handlers use."""

    index: LoadedIndex
    retrievers: dict[str, Retriever]
    batcher: MicroBatcher


class BatcherCollector:
    """Reads the batcher's queue and supervision state when /metrics is scraped."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self) -> Iterator[Any]:
        state: ServingState | None = getattr(self.app.state, "serving", None)
        if state is None:
            return
        batcher = state.batcher
        yield GaugeMetricFamily(
            "hdr_retrieval_queue_queries",
            "Queries queued or being searched.",
            value=batcher.queued_queries,
        )
        yield GaugeMetricFamily(
            "hdr_retrieval_queue_requests",
            "Requests with queries still waiting for a batch.",
            value=batcher.waiting_requests,
        )
        yield GaugeMetricFamily(
            "hdr_retrieval_healthy",
            "1 while /health answers ok (the worker serves, no search is stalled).",
            value=batcher.unhealthy_reason() is None,
        )
        yield GaugeMetricFamily(
            "hdr_retrieval_search_running_seconds",
            "How long the running batch search has taken so far (0: none runs).",
            value=batcher.search_running_s,
        )
        yield CounterMetricFamily(
            "hdr_retrieval_worker_restarts",
            "Batch-worker crashes survived by a restart.",
            value=batcher.counts.worker_restarts,
        )
        yield CounterMetricFamily(
            "hdr_retrieval_failed_searches",
            "Requests whose search raised (each retried alone first); answered 503.",
            value=batcher.counts.failed_requests,
        )


Passage = tuple[bytes, float]  # a hit's document as response JSON, and its score


def fetch_passages(store: DocumentStore, hits: list[list[Hit]]) -> list[list[Passage]]:
    """The hit rows' documents as response JSON (the corpus line's own bytes where its id is a
    string): result[query][rank]. Runs in the search thread, after the search."""
    return [[(store.get_json(row), score) for row, score in query_hits] for query_hits in hits]


def score_json(score: float) -> bytes:
    return repr(score).encode() if math.isfinite(score) else b"null"


def render_result(passages: list[list[Passage]], with_scores: bool) -> bytes:
    """`{"result": [[...], ...]}` from pre-encoded documents, without parsing them again:
    `{"document": ..., "score": ...}` items with scores, the documents alone without."""
    queries = []
    for query in passages:
        if with_scores:
            items = b",".join(
                b'{"document":%s,"score":%s}' % (document, score_json(score))
                for document, score in query
            )
        else:
            items = b",".join(document for document, _ in query)
        queries.append(b"[" + items + b"]")
    return b'{"result":[' + b",".join(queries) + b"]}"


# --- errors ------------------------------------------------------------------------------


class SafeJSONResponse(JSONResponse):
    """JSON with non-ASCII escaped, so text that is not valid UTF-8 (a lone surrogate in a
    field name) can never fail the response."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(status: int, detail: str, headers: dict[str, str] | None = None) -> Response:
    return SafeJSONResponse(ErrorResponse(detail=detail).model_dump(), status, headers=headers)


def _location(loc: Any) -> list[str | int]:
    """An error location without "body", each part cut to MAX_LOC_CHARS."""
    parts = loc if isinstance(loc, (list, tuple)) else [loc]
    return [
        part if isinstance(part, int) else str(part)[:MAX_LOC_CHARS]
        for part in parts
        if part != "body"
    ]


def validation_message(exc: RequestValidationError) -> str:
    """One line from the first validation error: 'queries.3: String should have at most ...'."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        position = first.get("loc", ("body", "?"))[-1]
        reason = first.get("ctx", {}).get("error", "not valid JSON")
        return f"malformed JSON body at character {position}: {reason}"
    where = ".".join(str(part) for part in _location(first.get("loc", ())))
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where or 'request'}: {first.get('msg', 'invalid')}{more}"


def install_error_handlers(app: FastAPI) -> None:
    """Errors as `ErrorResponse`: malformed JSON is a 400, other invalid input a 422. The
    offending input is never echoed (it may be huge, or not encodable)."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> Response:
        status = 400 if any(e.get("type") == "json_invalid" for e in exc.errors()) else 422
        errors = [
            {"loc": _location(e.get("loc", ())), "msg": e.get("msg", ""), "type": e.get("type")}
            for e in exc.errors()[:20]
        ]
        body = ErrorResponse(detail=validation_message(exc), errors=jsonable_encoder(errors))
        return SafeJSONResponse(body.model_dump(), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), exc.headers)


# --- middleware --------------------------------------------------------------------------


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
                await self.app(scope, replay(body, receive), send)
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


def replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that yields the buffered body once, then the server's own messages (so the
    app still learns of a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class RequestMetricsMiddleware:
    """Pure ASGI middleware (cheaper than `@app.middleware`): counts every HTTP request and its
    latency by endpoint and status; unknown paths are counted as "other"."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        endpoint = scope["path"] if scope["path"] in KNOWN_PATHS else "other"
        started = time.perf_counter()
        status = 500  # if the app fails before answering

        async def send_and_record(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_record)
        finally:
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - started)
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if status >= 400:
                self.metrics.errors.labels(endpoint, str(status)).inc()


# --- the app -----------------------------------------------------------------------------


def load_serving_state(config: ServerConfig, metrics: ServerMetrics) -> ServingState:
    """Load the index and every retriever it supports; the default must be among them."""
    wanted = config.retrievers
    index = load_index(
        config.index_dir,
        config.corpus,
        config.dense,
        with_dense=wanted is None or "dense" in wanted,
        with_bm25=wanted is None or "bm25" in wanted,
        max_topk=config.max_topk,
    )
    names = available_retrievers(index)
    if "default_retriever" not in config.model_fields_set and "dense" not in names and names:
        config.default_retriever = names[0]  # none asked for: the index's own (--no-dense: bm25)
    missing = sorted(set(wanted or []) - set(names))
    if missing or config.default_retriever not in names:
        index.close()
        raise UserError(
            f"retriever {(missing or [config.default_retriever])[0]!r} is not available for "
            f"index {config.index_dir}; available: {', '.join(names)}"
        )
    retrievers = make_retrievers(index, names, config)
    batcher = MicroBatcher(
        retrievers,
        max_batch_queries=config.max_batch_queries,
        max_queued_queries=config.max_queued_queries,
        batch_wait_ms=config.batch_wait_ms,
        max_restarts=config.worker_max_restarts,
        stall_after_s=config.search_stall_s,
        on_batch=metrics.observe_batch,
        fetch=lambda hits: fetch_passages(index.documents, hits),
    )
    return ServingState(index=index, retrievers=retrievers, batcher=batcher)


async def client_gone(request: Request) -> None:
    """Returns once the client has disconnected (call it after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def search_or_give_up(
    state: ServingState, config: ServerConfig, metrics: ServerMetrics, request: Request, args
) -> list[list[Passage]] | Response:
    """The batcher's passages, or the response for a request that could not be searched: 503
    when refused, failed or past its deadline; a response nobody reads when the client left."""
    retry = {"Retry-After": str(config.retry_after_s)}
    search = asyncio.ensure_future(state.batcher.search(*args))
    gone = asyncio.ensure_future(client_gone(request))
    try:
        await asyncio.wait(
            {search, gone}, timeout=config.request_deadline_s, return_when=asyncio.FIRST_COMPLETED
        )
    finally:
        gone.cancel()
    if not search.done():  # the client left, or the deadline passed: stop its search
        search.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await search
        if not gone.cancelled() and gone.done():
            metrics.disconnected.inc()
            return error_response(CLIENT_GONE, "client closed the request")
        metrics.expired.inc()
        limit = config.request_deadline_s
        return error_response(503, f"not answered within the {limit:g} s deadline", retry)
    try:
        return search.result()
    except Overloaded as err:
        metrics.rejected.labels(err.reason.replace(" ", "_")).inc()
        return error_response(503, f"server {err.reason}; retry later", retry)
    except SearchFailed as err:
        return error_response(503, f"{err}; retry", retry)


def create_app(config: ServerConfig) -> FastAPI:
    """The retrieval service for one index; resources load when the app starts."""
    metrics = ServerMetrics()
    emulator = CostEmulator(config.emulated_cost)
    RetrieveBody = profile_request_model(
        config.profile, config.query_limit, config.max_query_chars, config.max_topk
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state = await asyncio.to_thread(load_serving_state, config, metrics)
        state.batcher.start()
        app.state.serving = state
        try:
            yield
        finally:
            await state.batcher.stop()
            state.index.close()

    app = FastAPI(title="hdr retrieval server", version="1", lifespan=lifespan)
    install_error_handlers(app)
    metrics.registry.register(BatcherCollector(app))
    error_responses = {code: {"model": ErrorResponse} for code in (400, 401, 408, 413, 422, 503)}

    app.add_middleware(RequestGuard, config=config, metrics=metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)  # outermost: counts all

    @app.post("/retrieve", response_model=ScoredResponse | PlainResponse, responses=error_responses)
    async def retrieve(body: RetrieveBody, request: Request) -> Response:
        """Top-k passages per query: Search-R1's request and response format."""
        state: ServingState = app.state.serving
        name = body.retriever or config.default_retriever
        if name not in state.retrievers:
            raise HTTPException(
                400, f"unknown retriever; available: {', '.join(sorted(state.retrievers))}"
            )
        await emulator.charge(len(body.queries))
        if not body.queries:
            return Response(b'{"result":[]}', media_type="application/json")
        queries = body.queries
        if config.profile == "search-r1":
            cut = config.max_query_chars
            long = sum(len(query) > cut for query in queries)
            if long:
                metrics.truncated.inc(long)
                queries = [query[:cut] for query in queries]
        topk = body.topk or config.default_topk
        passages = await search_or_give_up(state, config, metrics, request, (queries, topk, name))
        if isinstance(passages, Response):
            return passages
        # the documents are JSON already (read in the search thread): joined, not re-encoded
        content = render_result(passages, body.return_scores)
        return Response(content, media_type="application/json")

    @app.get("/health", responses={503: {"model": HealthResponse}})
    async def health(response: Response) -> HealthResponse:
        """Liveness plus what is served; 503 with a reason once the batch worker gave up or a
        search has run past `search_stall_s`. Open even when a token is configured."""
        state: ServingState = app.state.serving
        manifest = state.index.manifest
        reason = state.batcher.unhealthy_reason()
        if reason is not None:
            response.status_code = 503
        return HealthResponse(
            status="ok" if reason is None else "unhealthy",
            reason=reason,
            documents=manifest.documents,
            encoder=manifest.encoder.name,
            index_type=manifest.index_factory,
            retrievers=sorted(state.retrievers),
            default_retriever=config.default_retriever,
            emulated_cost=emulator.report(),
        )

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of this app's counters, histograms and queue state."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
