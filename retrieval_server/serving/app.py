"""The FastAPI app: `POST /retrieve` (Search-R1 compatible), `GET /health`, `GET /metrics`.

`create_app(config)` builds an app whose heavy resources (FAISS index, BM25, encoder, corpus
offsets) are loaded in its lifespan, never at import. A request's queries go to the result cache
first (`retrieval_server.serving.answers`: hits, computations in flight, billed misses); misses
go through a `MicroBatcher`, which runs them in a worker thread, documents read from disk in
that thread too, so the event loop only parses, validates and batches; in proxy mode
(`config.upstream`) they are forwarded to the upstream instead (`retrieval_server.upstream`).
The request guards are `guards.py`, the error responses `errors.py`, what the lifespan opens
`state.py`.

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
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, HTTPException, Request, Response
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    generate_latest,
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
from retrieval_server.config import ServerConfig
from retrieval_server.fleet.cache import SharedCache
from retrieval_server.serving.answers import (
    Answered,
    join_answers,
)
from retrieval_server.serving.batching import Overloaded, SearchFailed
from retrieval_server.serving.errors import (
    error_response,
    install_error_handlers,
)
from retrieval_server.serving.guards import (
    RequestGuard,
    RequestMetricsMiddleware,
)
from retrieval_server.serving.metrics import BatcherCollector, CacheCollector, ServerMetrics
from retrieval_server.serving.query_log import QueryLog
from retrieval_server.serving.state import (
    ServingState,
    load_serving_state,
    open_redis,
    open_snapshot_state,
    open_upstream_state,
    recorded_snapshot,
)
from retrieval_server.snapshot.backend import SnapshotRecorder, snapshot_report
from retrieval_server.upstream.proxy import UpstreamError
from retrieval_server.upstream.spend import BudgetSpent, BudgetUnavailable

CLIENT_GONE = 499  # recorded in metrics for a client that left; nobody receives it
MAX_SCOPE_CHARS = 200  # of a client's X-HDR-Cache-Scope kept as sent; a longer one is hashed


def cache_scope(header: str) -> str:
    """A client's cache scope from its header: as sent, or, when longer than MAX_SCOPE_CHARS,
    its digest (never a cut, which would let two long names share one cache)."""
    if len(header) > MAX_SCOPE_CHARS:
        header = "sha256:" + hashlib.sha256(header.encode("latin-1")).hexdigest()
    return sys.intern(header)


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
