"""The FastAPI app: `POST /retrieve` (Search-R1 compatible), `GET /health`, `GET /metrics`.

`create_app(config)` builds an app whose heavy resources (FAISS index, BM25, encoder, corpus
offsets) are loaded in its lifespan, never at import. A request's queries go to the result cache
first (`retrieval_server.answers`: hits, computations in flight, billed misses); misses go through
a `MicroBatcher`, which runs them in a worker thread, documents read from disk in that thread too,
so the event loop only parses, validates and batches; in proxy mode (`config.upstream`) they are
forwarded to the upstream instead (`retrieval_server.upstream`).

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
import hashlib
import hmac
import json
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from core.errors import UserError
from core.fingerprint import digest
from retrieval_server.answers import (
    Answered,
    Answers,
    BatcherBackend,
    join_answers,
)
from retrieval_server.api import (
    BILLED_HEADER,
    CACHED_HEADER,
    SCOPE_HEADER,
    CacheReport,
    ErrorResponse,
    HealthResponse,
    PlainResponse,
    ScoredResponse,
    SharedReport,
    profile_request_model,
)
from retrieval_server.batching import MicroBatcher, Overloaded, Passage, SearchFailed
from retrieval_server.cache import ResultCache, open_persisted
from retrieval_server.config import ServerConfig
from retrieval_server.connections import ARRIVAL
from retrieval_server.emulated_cost import CostEmulator
from retrieval_server.fleet.cache import SharedCache
from retrieval_server.fleet.ledger import RedisLedger
from retrieval_server.fleet.link import RedisLink
from retrieval_server.index.files import DocumentStore, IndexManifest, LoadedIndex, load_index
from retrieval_server.metrics import BatcherCollector, CacheCollector, ServerMetrics
from retrieval_server.query_log import QueryLog
from retrieval_server.retrievers import Hit, Retriever, available_retrievers, make_retrievers
from retrieval_server.snapshot import (
    Snapshot,
    SnapshotBackend,
    SnapshotRecorder,
    open_snapshot,
    snapshot_report,
)
from retrieval_server.upstream.proxy import (
    UpstreamBackend,
    UpstreamError,
    default_ledger,
    upstream_description,
)
from retrieval_server.upstream.spend import BudgetSpent, BudgetUnavailable, MemoryLedger
from retrieval_server.web.backend import upstream_backend

KNOWN_PATHS = {"/retrieve", "/health", "/metrics"}
UNLIMITED_PATHS = {"/health", "/metrics"}  # answered even at the concurrency limit
OPEN_PATHS = {"/health"}  # no token needed (orchestrator health checks)
MAX_LOC_CHARS = 64  # a validation error names the field, cut to this; input is never echoed
CLIENT_GONE = 499  # recorded in metrics for a client that left; nobody receives it
FINGERPRINT_DIGITS = 16  # of the answers' fingerprint (hex): part of every cache key
MAX_SCOPE_CHARS = 200  # of a client's X-HDR-Cache-Scope kept as sent; a longer one is hashed


def cache_scope(header: str) -> str:
    """A client's cache scope from its header: as sent, or, when longer than MAX_SCOPE_CHARS,
    its digest (never a cut, which would let two long names share one cache)."""
    if len(header) > MAX_SCOPE_CHARS:
        header = "sha256:" + hashlib.sha256(header.encode("latin-1")).hexdigest()
    return sys.intern(header)


@dataclass
class ServingState:
    """What the lifespan loads and the handlers use: an index searched through the batcher,
    or (proxy mode) an upstream, with the answers' cache in front of either."""

    answers: Answers
    fingerprint: str
    index: LoadedIndex | None = None
    retrievers: dict[str, Retriever] | None = None
    batcher: MicroBatcher | None = None
    upstream: UpstreamBackend | None = None
    upstream_health: dict[str, Any] | None = None  # the upstream's /health at start
    query_log: QueryLog | None = None
    redis: RedisLink | None = None  # cache.backend redis: the fleet's cache (and budget)
    snapshot: SnapshotBackend | None = None  # --snapshot: the answers come from it
    recorder: SnapshotRecorder | None = None  # --record-snapshot: what clients received

    def unhealthy_reason(self) -> str | None:
        return None if self.batcher is None else self.batcher.unhealthy_reason()

    def arriving(self) -> contextlib.AbstractContextManager[None]:
        """A request on its way to the batcher's queue (first in, first served)."""
        return contextlib.nullcontext() if self.batcher is None else self.batcher.arriving()


def fetch_passages(store: DocumentStore, hits: list[list[Hit]]) -> list[list[Passage]]:
    """The hit rows' documents as response JSON (the corpus line's own bytes where its id is a
    string): result[query][rank]. Runs in the search thread, after the search."""
    return [[(store.get_json(row), score) for row, score in query_hits] for query_hits in hits]


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


# --- the app -----------------------------------------------------------------------------


def load_serving_state(
    config: ServerConfig, metrics: ServerMetrics, redis: RedisLink | None = None
) -> ServingState:
    """Load the index and every retriever it supports (the default must be among them), and
    the answers' cache in front of the batcher (the fleet's behind it, given `redis`)."""
    assert config.index_dir is not None
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
        settle_turns=config.batch_settle_turns,
        max_restarts=config.worker_max_restarts,
        stall_after_s=config.search_stall_s,
        on_batch=metrics.observe_batch,
        fetch=lambda hits: fetch_passages(index.documents, hits),
    )
    fingerprint = index_fingerprint(index.manifest, config)
    try:
        answers = make_answers(BatcherBackend(batcher), config, fingerprint, redis=redis)
    except BaseException:
        index.close()
        raise
    return ServingState(
        answers=answers,
        fingerprint=fingerprint,
        index=index,
        retrievers=retrievers,
        batcher=batcher,
        redis=redis,
    )


def index_fingerprint(manifest: IndexManifest, config: ServerConfig) -> str:
    """What, besides a query's key, decides its answer: the index as built (its manifest, but
    not where its corpus lies) and the serving settings that change results."""
    dense = config.dense
    return digest(
        {
            "manifest": manifest.model_dump(mode="json", exclude={"corpus_path"}),
            "query_prefix": config.query_prefix,
            "encoder": config.encoder.model_dump(include={"backend", "device", "fp16"}),
            "dense": dense.model_dump(
                include={"nprobe", "ef_search", "refine_k_factor", "exact_k_factor"}
            ),
            "gpu": dense.gpus is not None,  # float16 vectors
        },
        length=FINGERPRINT_DIGITS,
    )


def make_answers(
    backend,
    config: ServerConfig,
    fingerprint: str,
    description: dict[str, Any] | None = None,
    redis: RedisLink | None = None,
) -> Answers:
    """The cache (persisted answers of the same fingerprint loaded) in front of `backend`,
    the fleet's shared cache behind it when `redis` is given."""
    settings = config.cache
    cache = shared = None
    if settings.enabled:
        cache = ResultCache(
            settings.max_bytes, fingerprint, settings.ttl_s, description=description
        )
        open_persisted(cache, settings.persist_path)
        if redis is not None:
            shared = SharedCache(redis, settings, fingerprint, cache)
    return Answers(backend, cache, CostEmulator(config.emulated_cost), shared)


def open_redis(config: ServerConfig) -> RedisLink | None:
    """The link to the fleet's Redis (cache.backend redis), or None: also when nothing would
    use it (an index server with its cache disabled; a proxy keeps its budget there)."""
    if config.cache.backend != "redis" or not (config.cache.enabled or config.upstream):
        return None
    if config.upstream is not None and config.upstream.limited:
        consequence = (
            "serving from this replica's cache; the upstream budget refuses misses (503)"
            " until it is back"
        )
    else:
        consequence = "serving from this replica's cache and its own searches"
    return RedisLink(config.cache, consequence)


async def open_upstream_state(config: ServerConfig, redis: RedisLink | None) -> ServingState:
    """Proxy mode: the upstream (asked for its /health, so what decides its answers becomes
    part of our fingerprint) with the answers' cache in front, and the spend's ledger (the
    fleet's, in Redis, with cache.backend redis)."""
    assert config.upstream is not None
    ledger: MemoryLedger | RedisLedger | None = None
    upstream = None
    try:
        if redis is not None:
            ledger = RedisLedger(redis, config.cache, config.upstream)
            await ledger.start()
        else:
            ledger = await asyncio.to_thread(default_ledger, config.upstream)
        upstream = upstream_backend(config.upstream, ledger)
        health = await upstream.describe()
        description = upstream_description(config.upstream, health)
        fingerprint = digest(description, length=FINGERPRINT_DIGITS)
        backend = snapshot = None
        if config.snapshot.path is not None:  # the snapshot answers; the upstream what it lacks
            backend = snapshot = await open_snapshot(config.snapshot, upstream)
            fingerprint = snapshot.fingerprint(FINGERPRINT_DIGITS)
        answers = await asyncio.to_thread(
            make_answers, backend or upstream, config, fingerprint, description, redis
        )
    except BaseException:
        if upstream is not None:
            await upstream.close()
        elif ledger is not None:  # its spend file's lock is let go
            await ledger.close()
        raise
    return ServingState(
        answers=answers,
        fingerprint=fingerprint,
        upstream=upstream,
        upstream_health=health,
        redis=redis,
        snapshot=snapshot,
    )


async def open_snapshot_state(config: ServerConfig, redis: RedisLink | None) -> ServingState:
    """A snapshot served alone (offline): its answers, the cache in front."""
    snapshot = await open_snapshot(config.snapshot, None)
    fingerprint = snapshot.fingerprint(FINGERPRINT_DIGITS)
    answers = await asyncio.to_thread(make_answers, snapshot, config, fingerprint, None, redis)
    return ServingState(answers=answers, fingerprint=fingerprint, redis=redis, snapshot=snapshot)


def recorded_snapshot(state: ServingState, config: ServerConfig) -> Snapshot:
    """What `--record-snapshot` writes: the served snapshot, growing; else a new one, named
    after the backend its answers come from."""
    if state.snapshot is not None:
        return state.snapshot.snapshot
    if config.upstream is not None:
        return Snapshot(upstream_description(config.upstream, state.upstream_health or {}))
    return Snapshot({"index_fingerprint": state.fingerprint})


async def client_gone(request: Request) -> None:
    """Returns once the client has disconnected (call it after the body was read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def answer_or_give_up(
    state: ServingState,
    config: ServerConfig,
    metrics: ServerMetrics,
    request: Request,
    args: tuple[list[str], int, str, bool, str],
) -> Answered | Response:
    """The request's answers, or the response for a request that could not be answered: 503
    when refused, failed or past its deadline; 429 past the upstream's budget; 502/504 when
    the upstream failed; a response nobody reads when the client left."""
    retry = {"Retry-After": str(config.retry_after_s)}
    search = asyncio.ensure_future(state.answers.get(*args))
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
    except BudgetSpent as err:
        return error_response(429, str(err))
    except BudgetUnavailable as err:
        return error_response(503, str(err), retry)
    except UpstreamError as err:
        return error_response(err.status, err.detail)


def create_app(config: ServerConfig) -> FastAPI:
    """The retrieval service for one index (or one upstream); resources load when the app
    starts."""
    metrics = ServerMetrics()
    RetrieveBody = profile_request_model(
        config.profile, config.query_limit, config.max_query_chars, config.max_topk
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = open_redis(config)
        try:
            if redis is not None:
                await redis.check()  # unreachable: the replica starts alone, and says so
            if config.upstream is not None:
                state = await open_upstream_state(config, redis)
            elif config.snapshot.path is not None:
                state = await open_snapshot_state(config, redis)
            else:
                state = await asyncio.to_thread(load_serving_state, config, metrics, redis)
        except BaseException:
            if redis is not None:
                await redis.close()
            raise
        if config.query_log is not None or config.snapshot.record_path is not None:
            try:
                if config.query_log is not None:
                    state.query_log = QueryLog(config.query_log)
                if (path := config.snapshot.record_path) is not None:
                    recorder = SnapshotRecorder(
                        path, recorded_snapshot(state, config), config.snapshot.flush_s
                    )
                    await recorder.start()
                    state.recorder = recorder
            except BaseException:
                await close_serving_state(state, config)
                raise
        if state.batcher is not None:
            state.batcher.start()
        app.state.serving = state
        try:
            yield
        finally:
            await close_serving_state(state, config)

    app = FastAPI(title="hdr retrieval server", version="1", lifespan=lifespan)
    app.state.metrics = metrics  # the server's connection guard reports into them
    install_error_handlers(app)
    metrics.registry.register(BatcherCollector(app))
    metrics.registry.register(CacheCollector(app))
    error_responses = {
        code: {"model": ErrorResponse} for code in (400, 401, 408, 413, 422, 429, 502, 503, 504)
    }

    app.add_middleware(RequestGuard, config=config, metrics=metrics)
    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)  # outermost: counts all

    @app.post("/retrieve", response_model=ScoredResponse | PlainResponse, responses=error_responses)
    async def retrieve(body: RetrieveBody, request: Request) -> Response:
        """Top-k passages per query: Search-R1's request and response format. The headers
        `X-HDR-Billed-Queries` and `X-HDR-Cached-Queries` say how many of the queries were
        computed for this request and how many were answered without a computation."""
        state: ServingState = app.state.serving
        name = body.retriever or config.default_retriever
        if state.retrievers is not None and name not in state.retrievers:
            raise HTTPException(
                400, f"unknown retriever; available: {', '.join(sorted(state.retrievers))}"
            )
        if state.index is None:
            name = body.retriever or ""  # "": the upstream's own default (or the snapshot's)
        queries = body.queries
        if config.profile == "search-r1":
            cut = config.max_query_chars
            long = sum(len(query) > cut for query in queries)
            if long:
                metrics.truncated.inc(long)
                queries = [query[:cut] for query in queries]
        topk = body.topk or config.default_topk
        answered = Answered([], billed=0)
        if queries:
            scope = cache_scope(request.headers.get(SCOPE_HEADER, ""))
            args = (queries, topk, name, body.return_scores, scope)
            with state.arriving():
                outcome = await answer_or_give_up(state, config, metrics, request, args)
            if isinstance(outcome, Response):
                return outcome
            answered = outcome
            if state.query_log is not None:
                state.query_log.write(*args, answered.billed, answered.cached)
            if state.recorder is not None:
                state.recorder.record(queries, topk, name, body.return_scores, answered.answers)
        # the answers are JSON already (encoded once, when computed): joined, not re-encoded
        headers = {BILLED_HEADER: str(answered.billed), CACHED_HEADER: str(answered.cached)}
        return Response(join_answers(answered.answers), media_type="application/json",
                        headers=headers)  # fmt: skip

    @app.get("/health", responses={503: {"model": HealthResponse}})
    async def health(response: Response) -> HealthResponse:
        """Liveness plus what is served and what the cache saved; 503 with a reason once the
        batch worker gave up or a search has run past `search_stall_s`. Open even when a token
        is configured."""
        state: ServingState = app.state.serving
        reason = state.unhealthy_reason()
        if reason is not None:
            response.status_code = 503
        if state.redis is not None and not state.redis.reachable:
            await state.redis.check()  # say whether it is back (at most every redis_retry_s)
        upstream = None
        if state.upstream is not None:
            upstream = state.upstream.report(await state.upstream.ledger.refresh())
        return HealthResponse(
            status="ok" if reason is None else "unhealthy",
            reason=reason,
            **served_index(state, config),
            profile=config.profile,
            max_query_chars=config.max_query_chars,
            emulated_cost=state.answers.emulator.report(),
            cache=cache_report(state, config),
            upstream=upstream,
            snapshot=snapshot_report(state.snapshot, state.recorder),
        )

    @app.get("/metrics", response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of this app's counters, histograms and queue state."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


async def close_serving_state(state: ServingState, config: ServerConfig) -> None:
    """Stop the batcher (or let the upstream's forwards in flight end, and close its client
    and its ledger), close the index and Redis, save the cache if it persists."""
    if state.batcher is not None:
        await state.batcher.stop()
    if state.upstream is not None:
        await state.answers.drain(config.upstream.worst_case_s())
        await state.upstream.close()
    if state.answers.shared is not None:
        await state.answers.shared.close()
    if state.redis is not None:
        await state.redis.close()
    if state.index is not None:
        state.index.close()
    if state.query_log is not None:
        state.query_log.close()
    if state.recorder is not None:  # after the drain: forwards that finished are recorded
        await state.recorder.close()
    cache, path = state.answers.cache, config.cache.persist_path
    if cache is not None and path is not None and not cache.keeps_foreign_file:
        await asyncio.to_thread(cache.save, path)


def served_index(state: ServingState, config: ServerConfig) -> dict[str, Any]:
    """/health's description of the index: the loaded one, or what the upstream reports."""
    if state.index is not None:
        manifest = state.index.manifest
        return {
            "documents": manifest.documents,
            "encoder": manifest.encoder.name,
            "index_type": manifest.index_factory,
            "retrievers": sorted(state.retrievers or {}),
            "default_retriever": config.default_retriever,
        }
    upstream = state.upstream_health or {}
    return {
        "documents": upstream.get("documents"),
        "encoder": upstream.get("encoder"),
        "index_type": upstream.get("index_type"),
        "retrievers": upstream.get("retrievers") or [],
        "default_retriever": upstream.get("default_retriever"),
    }


def cache_report(state: ServingState, config: ServerConfig) -> CacheReport:
    cache = state.answers.cache
    if cache is None:
        return CacheReport(enabled=False, hits=0, misses=0, coalesced=0, entries=0, bytes=0,
                           max_bytes=0, evictions=0, expired=0, loaded=0, ttl_s=None,
                           fingerprint=state.fingerprint)  # fmt: skip
    stats = cache.stats
    shared = state.answers.shared
    return CacheReport(
        enabled=True,
        hits=stats.hits,
        misses=stats.misses,
        coalesced=stats.coalesced,
        shared_hits=stats.shared_hits,
        shared_waits=stats.shared_waits,
        shared=None if shared is None else shared_report(shared),
        entries=len(cache),
        bytes=cache.bytes,
        max_bytes=cache.max_bytes,
        evictions=stats.evictions,
        expired=stats.expired,
        loaded=stats.loaded,
        ttl_s=cache.ttl_s,
        fingerprint=state.fingerprint,
    )


def shared_report(shared: SharedCache) -> SharedReport:
    link = shared.link
    return SharedReport(
        backend="redis",
        url=link.shown_url,
        reachable=link.reachable,
        reason=link.reason,
        down_since=link.down_since,
        took_over=shared.took_over,
    )
