"""The FastAPI app: `POST /retrieve` (Search-R1 compatible), `GET /health`, `GET /metrics`.

`create_app(config)` builds an app whose heavy resources (FAISS index, BM25, encoder, corpus
offsets) are loaded in its lifespan, never at import. Searches go through a `MicroBatcher`, which
runs them in a worker thread; documents are read from disk in a thread too, so the event loop only
parses, validates and batches. Every bad input is a 4xx whose `detail` is one readable line.
Prometheus metrics use a registry owned by the app, so several apps can live in one process.
"""

# No `from __future__ import annotations`: FastAPI must see the request model created in
# `create_app` as a real annotation, not as a string to resolve in module globals.

import asyncio
import hmac
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hdr.errors import UserError
from retrieval_server.api import (
    Document,
    ErrorResponse,
    HealthResponse,
    PlainResponse,
    ScoredDocument,
    ScoredResponse,
    limited_request_model,
)
from retrieval_server.batching import MicroBatcher
from retrieval_server.config import ServerConfig
from retrieval_server.emulated_cost import CostEmulator
from retrieval_server.index import DocumentStore, LoadedIndex, load_index
from retrieval_server.retrievers import Hit, Retriever, available_retrievers, make_retrievers

KNOWN_PATHS = {"/retrieve", "/health", "/metrics"}


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

    def observe_batch(self, retriever: str, queries: int) -> None:
        self.queries.labels(retriever).inc(queries)
        self.batch_queries.labels(retriever).observe(queries)


@dataclass
class ServingState:
    """What the lifespan loads and the handlers use."""

    index: LoadedIndex
    retrievers: dict[str, Retriever]
    batcher: MicroBatcher


def fetch_documents(store: DocumentStore, hits: list[list[Hit]]) -> list[list[ScoredDocument]]:
    """Read the hit rows from the corpus: result[query][rank]."""
    result = []
    for query_hits in hits:
        documents = []
        for row, score in query_hits:
            record = store.get(row)
            record["id"] = str(record["id"])
            documents.append(ScoredDocument(document=Document(**record), score=score))
        result.append(documents)
    return result


def validation_message(exc: RequestValidationError) -> str:
    """One line from the first validation error: 'queries.3: String should have at most ...'."""
    first = exc.errors()[0]
    if first.get("type") == "json_invalid":
        position = first.get("loc", ("body", "?"))[-1]
        reason = first.get("ctx", {}).get("error", "not valid JSON")
        return f"malformed JSON body at character {position}: {reason}"
    where = ".".join(str(part) for part in first.get("loc", ()) if part != "body")
    more = f" (and {len(exc.errors()) - 1} more)" if len(exc.errors()) > 1 else ""
    return f"{where or 'request'}: {first.get('msg', 'invalid')}{more}"


def install_error_handlers(app: FastAPI) -> None:
    """Errors as `ErrorResponse`: malformed JSON is a 400, other invalid input a 422."""

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, exc: RequestValidationError) -> JSONResponse:
        status = 400 if any(e.get("type") == "json_invalid" for e in exc.errors()) else 422
        body = ErrorResponse(
            detail=validation_message(exc),
            errors=jsonable_encoder(exc.errors(), custom_encoder={Exception: str}),
        )
        return JSONResponse(body.model_dump(), status_code=status)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        body = ErrorResponse(detail=str(exc.detail))
        return JSONResponse(body.model_dump(), status_code=exc.status_code, headers=exc.headers)


def bearer_auth(config: ServerConfig):
    """A dependency that demands `Authorization: Bearer <token>` when a token is configured."""
    expected = config.api_token.get_secret_value().encode() if config.api_token else None
    scheme = HTTPBearer(auto_error=False)

    async def check(credentials: HTTPAuthorizationCredentials | None = Depends(scheme)) -> None:
        if expected is None:
            return
        given = credentials.credentials.encode() if credentials is not None else b""
        if not hmac.compare_digest(given, expected):
            raise HTTPException(
                401, "missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
            )

    return check


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


def load_serving_state(config: ServerConfig, metrics: ServerMetrics) -> ServingState:
    """Load the index and every retriever it supports; the default must be among them."""
    index = load_index(config.index_dir, config.corpus, config.hnsw_ef_search)
    names = available_retrievers(index)
    if config.default_retriever not in names:
        index.close()
        raise UserError(
            f"default retriever {config.default_retriever!r} is not available for index "
            f"{config.index_dir}; available: {', '.join(names)}"
        )
    retrievers = make_retrievers(index, names)
    batcher = MicroBatcher(
        retrievers, config.batch_wait_ms, config.max_batch_queries, metrics.observe_batch
    )
    return ServingState(index=index, retrievers=retrievers, batcher=batcher)


def create_app(config: ServerConfig) -> FastAPI:
    """The retrieval service for one index; resources load when the app starts."""
    metrics = ServerMetrics()
    emulator = CostEmulator(config.emulated_cost)
    auth = bearer_auth(config)
    RetrieveBody = limited_request_model(
        config.max_queries, config.max_query_chars, config.max_topk
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
    error_responses = {
        400: {"model": ErrorResponse},
        401: {"model": ErrorResponse},
        422: {"model": ErrorResponse},
    }

    app.add_middleware(RequestMetricsMiddleware, metrics=metrics)

    @app.post("/retrieve", dependencies=[Depends(auth)], responses=error_responses)
    async def retrieve(request: RetrieveBody) -> ScoredResponse | PlainResponse:
        """Top-k passages per query: Search-R1's request and response format."""
        state: ServingState = app.state.serving
        name = request.retriever or config.default_retriever
        if name not in state.retrievers:
            raise HTTPException(
                400, f"unknown retriever {name!r}; available: {', '.join(sorted(state.retrievers))}"
            )
        topk = request.topk or config.default_topk
        await emulator.charge(len(request.queries))
        hits = await state.batcher.search(request.queries, topk, name)
        scored = await asyncio.to_thread(fetch_documents, state.index.documents, hits)
        if request.return_scores:
            return ScoredResponse(result=scored)
        return PlainResponse(result=[[item.document for item in query] for query in scored])

    @app.get("/health")
    async def health() -> HealthResponse:
        """Liveness plus what is served; open even when a token is configured."""
        state: ServingState = app.state.serving
        manifest = state.index.manifest
        return HealthResponse(
            status="ok",
            documents=manifest.documents,
            encoder=manifest.encoder,
            index_type=manifest.index_type,
            retrievers=sorted(state.retrievers),
            default_retriever=config.default_retriever,
            emulated_cost=emulator.report(),
        )

    @app.get("/metrics", dependencies=[Depends(auth)], response_class=Response)
    async def prometheus_metrics() -> Response:
        """Prometheus text exposition of this app's counters and histograms."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
