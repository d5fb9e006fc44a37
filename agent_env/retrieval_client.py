"""HTTP client of the retrieval server: async, pooled, with timeouts, retries and failover.

One call = one turn's queries. They are split into at most `len(urls)` contiguous chunks (or
chunks of `max_batch_queries`), one batched `POST /retrieve` per chunk, sent concurrently to
the URLs in rotation. A chunk that fails with a connection error, a timeout or a 5xx is
retried with exponential backoff and full jitter, each retry on the next URL; when its
attempts run out the call raises `RetrievalFailed` (the rollout marks the trajectories
failed; it never substitutes empty information). A 4xx is our request's fault and is
reported at once as a `UserError` with the server's one-line detail.

The rollout loop is synchronous (generation blocks), so the client owns a private event loop
on a daemon thread and `search()` blocks on it. That keeps one `httpx.AsyncClient` and its
connection pool alive across turns and training steps, where `asyncio.run` per call would
rebuild it. Departure from Search-R1's client: it had no timeout, retry or failover.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Literal

import httpx
from pydantic import Field

from hdr.config import StrictModel
from hdr.errors import UserError
from retrieval_server.api import Document, PlainResponse, RetrieveRequest


class RetrievalFailed(RuntimeError):
    """The server could not be reached (or kept failing) after every retry."""


class RetrievalConfig(StrictModel):
    """Where and how to call the retrieval server."""

    urls: list[str] = Field(
        ["http://127.0.0.1:8000"], min_length=1, description="Server base URLs; batches rotate."
    )
    topk: int = Field(3, ge=1, description="Documents per query.")
    retriever: Literal["dense", "bm25"] | None = Field(
        None, description="Retriever to ask for; None: the server's default."
    )
    timeout_s: float = Field(30.0, gt=0, description="Read/write timeout of one request.")
    connect_timeout_s: float = Field(5.0, gt=0, description="Connect timeout of one request.")
    max_retries: int = Field(4, ge=0, description="Retries per chunk after the first attempt.")
    backoff_s: float = Field(0.25, ge=0, description="First backoff; doubles per retry.")
    backoff_max_s: float = Field(8.0, ge=0, description="Cap of one backoff before jitter.")
    max_batch_queries: int | None = Field(
        512, ge=1, description="Most queries per HTTP request; None: split only across URLs."
    )
    token_env: str = Field(
        "HDR_API_TOKEN", description="Env variable whose value, if set, is sent as Bearer token."
    )
    max_connections: int = Field(32, ge=1, description="Connection pool size.")


@dataclass
class ClientStats:
    """Counters since the client was made (read them as deltas around a rollout)."""

    calls: int = 0  # search() calls (one per turn with searches)
    requests: int = 0  # batched HTTP requests that succeeded: the env calls
    attempts: int = 0  # HTTP attempts, failed ones included
    retries: int = 0
    failures: int = 0  # chunks that ran out of retries
    queries: int = 0
    passages: int = 0  # documents returned over all queries
    latency_s: float = 0.0  # wall time spent inside search()
    request_latencies: list[float] = field(default_factory=list)
    max_in_flight: int = 0  # most concurrent requests seen


def _chunks(n: int, parts: int, size: int | None) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering n items: `parts` near-equal ones, at most `size`."""
    if size is not None:
        parts = max(parts, -(-n // size))
    parts = max(1, min(parts, n))
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


class RetrievalClient:
    """`search(queries) -> list[list[Document]]`, blocking; `asearch` is the coroutine."""

    def __init__(self, config: RetrievalConfig, seed: int | None = None) -> None:
        self.config = config
        self.stats = ClientStats()
        self._rng = random.Random(seed)
        self._next_url = 0
        self._in_flight = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._http = self._run(self._make_client())

    async def _make_client(self) -> httpx.AsyncClient:
        c = self.config
        token = os.environ.get(c.token_env)
        return httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"} if token else None,
            timeout=httpx.Timeout(c.timeout_s, connect=c.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=c.max_connections, max_keepalive_connections=c.max_connections
            ),
        )

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def search(self, queries: list[str]) -> list[list[Document]]:
        """Documents for each query, in order; raises RetrievalFailed when retries run out."""
        return self._run(self.asearch(queries))

    async def asearch(self, queries: list[str]) -> list[list[Document]]:
        if not queries:
            return []
        start = time.perf_counter()
        ranges = _chunks(len(queries), len(self.config.urls), self.config.max_batch_queries)
        first_url = self._next_url
        self._next_url = (self._next_url + len(ranges)) % len(self.config.urls)
        try:
            parts = await asyncio.gather(
                *(
                    self._post_with_retries(queries[lo:hi], first_url + i)
                    for i, (lo, hi) in enumerate(ranges)
                )
            )
        finally:
            self.stats.calls += 1
            self.stats.queries += len(queries)
            self.stats.latency_s += time.perf_counter() - start
        results = [docs for part in parts for docs in part]
        self.stats.passages += sum(len(docs) for docs in results)
        return results

    async def _post_with_retries(self, queries: list[str], url_index: int):
        c = self.config
        request = RetrieveRequest(queries=queries, topk=c.topk, retriever=c.retriever)
        body = request.model_dump(exclude_none=True)
        last_error = ""
        for attempt in range(c.max_retries + 1):
            url = c.urls[(url_index + attempt) % len(c.urls)].rstrip("/") + "/retrieve"
            if attempt:
                self.stats.retries += 1
                cap = min(c.backoff_max_s, c.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(self._rng.uniform(0, cap))
            self.stats.attempts += 1
            self._in_flight += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, self._in_flight)
            sent = time.perf_counter()
            try:
                response = await self._http.post(url, json=body)
            except httpx.TransportError as err:  # connection errors and timeouts
                last_error = f"{url}: {type(err).__name__}: {err}"
                continue
            finally:
                self._in_flight -= 1
            if response.status_code >= 500:
                last_error = f"{url}: HTTP {response.status_code}"
                continue
            if response.status_code >= 400:
                raise UserError(f"retrieval server refused the request: {_detail(response)}")
            self.stats.requests += 1
            self.stats.request_latencies.append(time.perf_counter() - sent)
            result = PlainResponse.model_validate_json(response.content).result
            if len(result) != len(queries):
                raise RetrievalFailed(f"{url}: {len(result)} results for {len(queries)} queries")
            return result
        self.stats.failures += 1
        raise RetrievalFailed(f"retrieval failed after {c.max_retries + 1} attempts: {last_error}")

    def close(self) -> None:
        """Close the connection pool and stop the loop thread."""
        if self._loop.is_closed():
            return
        self._run(self._http.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()

    def __enter__(self) -> RetrievalClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _detail(response: httpx.Response) -> str:
    try:
        return f"HTTP {response.status_code}: {response.json()['detail']}"
    except Exception:
        return f"HTTP {response.status_code}: {response.text[:200]}"
