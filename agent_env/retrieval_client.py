"""HTTP client of the retrieval server: async, pooled, with deadlines, retries, failover, a
circuit breaker and an outage grace period.

One call = one turn's queries. Each query is first cut to `max_query_chars` (counted), as the
server's encoder would cut it anyway. The queries are split into chunks, one batched
`POST /retrieve` per chunk, sent concurrently, with `return_scores: true` (the one mode every
Search-R1-contract server answers correctly). `routing` decides which URL a query goes to:

- `rotate` (the default): at most `len(urls)` contiguous chunks (or chunks of
  `max_batch_queries`), sent to the URLs in rotation: the load spreads evenly, and each
  replica's cache sees a share of every query;
- `hash`: each query to the URL that ranks first for it by rendezvous hashing (the highest
  hash of URL and query), so every client that lists the same URLs sends a query to the same
  replica and the replicas' caches partition the queries instead of each holding them all
  (without Redis: `cache.backend: redis` shares one cache whatever the routing); a chunk that
  fails goes on to its queries' second-ranked URL, so a replica's queries spread over the
  others when it is down. Clients other than hdr's (a load balancer, veRL's tool) do not hash.

What can happen to a chunk:

- connection error, attempt deadline (`timeout_s`, connect to last byte), 5xx or 429: retried
  with exponential backoff and full jitter, each retry on the next URL. A URL that refused a
  connection is skipped for `breaker_s` while another URL is up (a short circuit breaker).
- its retries run out and no URL answers `/health`: an outage. The client pauses, polls
  `/health` with backoff for up to `outage_grace_s`, and then retries the chunk afresh, so a
  restart of the retrieval service loses nothing. Past the grace it raises
  `RetrievalUnavailable` (a `UserError`: one line, the run stops).
- its retries run out while some URL is healthy: those queries failed (None).
- a 4xx caused by its queries (413, or a 400/422 that names `queries`): the chunk is bisected
  until the offending queries are alone; only they fail (None), counted as refused.
- 401/403/404, or a 400/422 about anything else (topk, retriever): our configuration is wrong;
  `UserError` with the server's one-line detail.
- a 200 whose body does not parse (or has the wrong number of results): those queries failed.

One chunk's failure never discards another chunk's results: `search_each` returns per query a
document list or None (the rollout marks only those trajectories failed); `search` raises
`RetrievalFailed` if any query failed. Documents without `id` are accepted.

The rollout loop is synchronous (generation blocks), so the client owns a private event loop
on a daemon thread and `search()` blocks on it. That keeps one `httpx.AsyncClient` and its
connection pool alive across turns and training steps. Pooled connections idle for
`keepalive_s` are dropped, below the server's keep-alive, so the client never reuses a
connection the server is closing. Departure from Search-R1's client: it had no timeout, retry,
failover or truncation.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import logging
import os
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx
from pydantic import Field, ValidationError, field_validator

from core.config import StrictModel
from core.errors import UserError
from retrieval_server.api import (
    BILLED_HEADER,
    CACHED_HEADER,
    SCOPE_HEADER,
    Document,
    PlainResponse,
    RetrieveRequest,
    ScoredResponse,
)

log = logging.getLogger(__name__)
FATAL_STATUSES = (401, 403, 404)
RETRY_STATUSES = (429, 500, 502, 503, 504)
DOWN_STATUSES = (502, 503, 504)  # a /health answer that means "not serving"
HEALTH_TIMEOUT_S = 5.0


class RetrievalFailed(RuntimeError):
    """Some queries could not be searched (after retries), though a server is up."""


class RetrievalUnavailable(UserError):
    """No retrieval server answered for longer than the outage grace period."""


class RetrievalConfig(StrictModel):
    """Where and how to call the retrieval server."""

    urls: list[str] = Field(
        ["http://127.0.0.1:8000"],
        min_length=1,
        description="Server base URLs (http://host:port; a bare URL is a list of one, and a"
        " trailing /retrieve, as Search-R1's configs write it, is dropped); batches rotate.",
    )
    topk: int = Field(3, ge=1, description="Documents per query.")
    retriever: Literal["dense", "bm25"] | None = Field(
        None, description="Retriever to ask for; None: the server's default."
    )
    routing: Literal["rotate", "hash"] = Field(
        "rotate",
        description="rotate: each call's queries split over the URLs in turn. hash: each query "
        "to the URL rendezvous hashing ranks first for it (the next one if it fails), so "
        "several URLs' caches partition the queries instead of duplicating them.",
    )
    timeout_s: float = Field(
        90.0,
        gt=0,
        description="Deadline of one HTTP attempt, connect to last byte (above the server's "
        "60 s request deadline, so an overloaded server answers 503 first).",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="Connect timeout of one attempt.")
    max_retries: int = Field(4, ge=0, description="Retries per chunk after the first attempt.")
    backoff_s: float = Field(0.25, ge=0, description="First backoff; doubles per retry.")
    backoff_max_s: float = Field(8.0, ge=0, description="Cap of one backoff before jitter.")
    max_batch_queries: int | None = Field(
        512, ge=1, description="Most queries per HTTP request; None: split only across URLs."
    )
    max_query_chars: int | None = Field(
        2048,
        ge=1,
        description="Queries are cut to this many characters before sending (counted), as the "
        "server's search-r1 profile cuts them; None: send them whole.",
    )
    breaker_s: float = Field(
        5.0,
        ge=0,
        description="A URL that refused a connection is skipped this long while another is up.",
    )
    outage_grace_s: float = Field(
        300.0,
        ge=0,
        description="When no URL answers, poll /health this long (with backoff) before giving "
        "up; the rollout pauses meanwhile and continues with nothing lost.",
    )
    keepalive_s: float = Field(
        2.0,
        gt=0,
        description="Idle pooled connections close after this; keep it below the server's "
        "keep-alive (20 s for hdr serve).",
    )
    token_env: str = Field(
        "HDR_API_TOKEN", description="Env variable whose value, if set, is sent as Bearer token."
    )
    max_connections: int = Field(32, ge=1, description="Connection pool size.")
    expect_encoder: str | None = Field(
        None,
        description="The encoder every server's index must be built with, as its /health"
        " reports it (compared by the name's last path part: e5-base-v2 matches"
        " /data/e5-base-v2); None: not checked.",
    )
    expect_documents: int | None = Field(
        None, ge=1, description="The passages every server must serve (/health); None: any."
    )

    @field_validator("urls", mode="before")
    @classmethod
    def _one_url_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("urls")
    @classmethod
    def _base_urls(cls, urls: list[str]) -> list[str]:
        return [base_url(url) for url in urls]


def base_url(url: str) -> str:
    """A server's base URL from what a user writes: `http://host:port`, with or without a
    trailing slash or `/retrieve`. A URL without a scheme is refused, naming the fix (httpx
    would otherwise fail as if no server answered)."""
    url = url.strip()
    if "://" not in url:
        raise ValueError(f"retrieval URL {url!r} has no scheme: write http://{url}")
    scheme = url.split("://", 1)[0]
    if scheme not in ("http", "https"):
        raise ValueError(f"retrieval URL {url!r}: the scheme must be http or https")
    return url.rstrip("/").removesuffix("/retrieve")


@dataclass
class ClientStats:
    """Counters since the client was made (read them as deltas around a rollout)."""

    calls: int = 0  # search() calls (one per turn with searches)
    requests: int = 0  # batched HTTP requests that succeeded: the env calls
    attempts: int = 0  # HTTP attempts, failed ones included
    retries: int = 0
    failures: int = 0  # chunks whose retries ran out while a server was up
    queries: int = 0
    # of the queries answered: computed for us (by the index, or an upstream's paid call) and
    # answered without a computation (the server's cache, or an identical query in flight),
    # as hdr serve's X-HDR-Billed-Queries / X-HDR-Cached-Queries say; a server without those
    # headers (Search-R1's) computed every query, so all count as billed
    billed_queries: int = 0
    cached_queries: int = 0
    passages: int = 0  # documents returned over all queries
    failed_queries: int = 0  # queries answered None (refused, retries out, bad response)
    truncated_queries: int = 0  # cut to max_query_chars before sending
    refused_queries: int = 0  # a content-caused 4xx, isolated by bisection
    bad_responses: int = 0  # 200s whose body did not parse
    outages: int = 0  # times no URL answered and the client paused
    outage_s: float = 0.0  # time spent paused
    latency_s: float = 0.0  # wall time spent inside search()
    request_latencies: list[float] = field(default_factory=list)
    max_in_flight: int = 0  # most concurrent requests seen


class _Refused(Exception):
    """A 4xx caused by the queries of the request."""


class _Unreachable(Exception):
    """Retries ran out on connection errors, deadlines, 5xx or 429."""


def rotation(first: int, n: int) -> tuple[int, ...]:
    """URL indices from `first` on, in turn."""
    return tuple((first + k) % n for k in range(n))


def rendezvous(urls: list[str], query: str) -> tuple[int, ...]:
    """URL indices by rendezvous (highest random weight) hashing: the highest hash of URL
    and query first. Each query has one owner that every client listing the same URLs agrees
    on, and when a URL goes, only its queries move, spread over the others."""

    def weight(i: int) -> int:
        digest = hashlib.blake2b(f"{urls[i]}\n{query}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big")

    return tuple(sorted(range(len(urls)), key=weight, reverse=True))


def _chunks(n: int, parts: int, size: int | None) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges covering n items: `parts` near-equal ones, at most `size`."""
    if size is not None:
        parts = max(parts, -(-n // size))
    parts = max(1, min(parts, n))
    bounds = [round(i * n / parts) for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts)]


class RetrievalClient:
    """`search_each(queries) -> [documents | None]` and `search(queries)`, blocking; the
    `asearch_each` coroutine does the work."""

    def __init__(
        self, config: RetrievalConfig, seed: int | None = None, cache_scope: str | None = None
    ) -> None:
        self.config = config
        self.cache_scope = cache_scope  # sent as X-HDR-Cache-Scope: the server's cache for it
        self.stats = ClientStats()
        self._rng = random.Random(seed)
        self._next_url = 0
        self._in_flight = 0
        self._broken_until: dict[str, float] = {}  # URL -> monotonic time its breaker closes
        self._recovery: asyncio.Task[None] | None = None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._http = self._run(self._make_client())

    async def _make_client(self) -> httpx.AsyncClient:
        c = self.config
        token = os.environ.get(c.token_env)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if self.cache_scope is not None:
            headers[SCOPE_HEADER] = self.cache_scope
        return httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(c.timeout_s, connect=c.connect_timeout_s),
            limits=httpx.Limits(
                max_connections=c.max_connections,
                max_keepalive_connections=c.max_connections,
                keepalive_expiry=c.keepalive_s,
            ),
        )

    def _run(self, coro):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            # wake every 0.1 s rather than block until done: a Ctrl-C the kernel hands to
            # another thread (the loop's) does not interrupt this thread's wait, and Python
            # raises KeyboardInterrupt only here, in the main thread, when it next runs
            while not future.done():
                concurrent.futures.wait([future], timeout=0.1)
            return future.result()
        except BaseException as err:
            # Ctrl-C (or any exit) in the waiting thread: cancel the search in the loop's
            # thread too, and wait until its tasks have ended, so none is left pending or
            # with an unretrieved error when the interpreter destroys the loop (an ordinary
            # error leaves other threads' searches on the shared loop alone)
            future.cancel()
            if not isinstance(err, Exception):
                self._cancel_all_tasks()
            raise

    def _cancel_all_tasks(self, timeout_s: float = 2.0) -> None:
        async def cancel_all() -> None:
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # retrieves their errors

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(cancel_all(), self._loop).result(timeout_s)

    def search(self, queries: list[str]) -> list[list[Document]]:
        """Documents for each query, in order; raises RetrievalFailed if any query failed."""
        results = self.search_each(queries)
        failed = sum(result is None for result in results)
        if failed:
            raise RetrievalFailed(f"{failed} of {len(queries)} queries could not be searched")
        return results  # type: ignore[return-value]

    def search_each(self, queries: list[str]) -> list[list[Document] | None]:
        """Documents for each query, in order, or None for a query that failed."""
        return self._run(self.asearch_each(queries))

    async def search_each_from_loop(self, queries: list[str]) -> list[list[Document] | None]:
        """`search_each` awaited from another event loop (an async caller such as veRL's
        agent loop): the search runs on the client's own loop, which owns the pool."""
        future = asyncio.run_coroutine_threadsafe(self.asearch_each(queries), self._loop)
        return await asyncio.wrap_future(future)

    async def asearch_each(self, queries: list[str]) -> list[list[Document] | None]:
        if not queries:
            return []
        start = time.perf_counter()
        limit = self.config.max_query_chars
        if limit is not None:
            self.stats.truncated_queries += sum(len(query) > limit for query in queries)
            queries = [query[:limit] for query in queries]
        chunks = self._route(queries)
        try:
            parts = await asyncio.gather(
                *(self._search_chunk([queries[i] for i in at], route) for at, route in chunks)
            )
        finally:
            self.stats.calls += 1
            self.stats.queries += len(queries)
            self.stats.latency_s += time.perf_counter() - start
        results: list[list[Document] | None] = [None] * len(queries)
        for (at, _), part in zip(chunks, parts, strict=True):
            for i, docs in zip(at, part, strict=True):
                results[i] = docs
        self.stats.passages += sum(len(docs) for docs in results if docs is not None)
        self.stats.failed_queries += sum(docs is None for docs in results)
        return results

    def _route(self, queries: list[str]) -> list[tuple[list[int], tuple[int, ...]]]:
        """The call's chunks: (positions of its queries, the URLs to try, in order)."""
        c, n = self.config, len(self.config.urls)
        if c.routing == "rotate":
            ranges = _chunks(len(queries), n, c.max_batch_queries)
            first = self._next_url
            self._next_url = (first + len(ranges)) % n
            return [
                (list(range(lo, hi)), rotation(first + i, n)) for i, (lo, hi) in enumerate(ranges)
            ]
        by_route: dict[tuple[int, ...], list[int]] = {}
        for i, query in enumerate(queries):
            # by its first two URLs (then the rest in turn): at most n x (n - 1) chunks
            head = rendezvous(c.urls, query)[:2]
            route = head + tuple(j for j in rotation(head[-1], n) if j not in head)
            by_route.setdefault(route, []).append(i)
        size = c.max_batch_queries or len(queries)
        return [
            (at[lo : lo + size], route)
            for route, at in by_route.items()
            for lo in range(0, len(at), size)
        ]

    async def _search_chunk(self, queries: list[str], route: tuple[int, ...]):
        """One chunk's results; waits out an outage, bisects a content refusal."""
        while True:
            try:
                return await self._post_with_retries(queries, route)
            except _Refused as err:
                if len(queries) == 1:
                    self.stats.refused_queries += 1
                    log.warning("retrieval refused a query: %s", err)
                    return [None]
                mid = len(queries) // 2
                # rotation: the halves to two URLs; hashing: both to the queries' own
                other = route if self.config.routing == "hash" else route[1:] + route[:1]
                left, right = await asyncio.gather(
                    self._search_chunk(queries[:mid], route),
                    self._search_chunk(queries[mid:], other),
                )
                return left + right
            except _Unreachable as err:
                if await self._any_healthy():
                    self.stats.failures += 1
                    log.warning("retrieval failed for %d queries: %s", len(queries), err)
                    return [None] * len(queries)
                await self._wait_for_recovery(str(err))

    async def _post_with_retries(
        self, queries: list[str], route: tuple[int, ...]
    ) -> list[list[Document]]:
        c = self.config
        body = RetrieveRequest(
            queries=queries, topk=c.topk, return_scores=True, retriever=c.retriever
        ).model_dump(exclude_none=True)
        last_error, wait_floor = "", 0.0
        for attempt in range(c.max_retries + 1):
            base = self._pick_url(route, attempt)
            url = base + "/retrieve"
            if attempt:
                self.stats.retries += 1
                cap = min(c.backoff_max_s, c.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(
                    max(wait_floor * self._rng.uniform(1.0, 1.5), self._rng.uniform(0, cap))
                )
            self.stats.attempts += 1
            self._in_flight += 1
            self.stats.max_in_flight = max(self.stats.max_in_flight, self._in_flight)
            sent = time.perf_counter()
            try:
                response = await asyncio.wait_for(self._http.post(url, json=body), c.timeout_s)
            except (httpx.TransportError, asyncio.TimeoutError) as err:
                if isinstance(err, (httpx.ConnectError, httpx.ConnectTimeout)):
                    self._broken_until[base] = time.monotonic() + c.breaker_s
                last_error = f"{url}: {type(err).__name__}"
                continue
            finally:
                self._in_flight -= 1
            self._broken_until.pop(base, None)
            status = response.status_code
            if status in RETRY_STATUSES:
                last_error = f"{url}: HTTP {status}: {_detail(response)}"
                wait_floor = _retry_after(response, c.backoff_max_s)
                continue
            if status in FATAL_STATUSES or (400 <= status < 500 and not _about_queries(response)):
                raise UserError(f"retrieval server refused the request: {_status_line(response)}")
            if 400 <= status < 500:
                raise _Refused(_status_line(response))
            result = _parse_result(response, len(queries))
            if result is None:
                self.stats.bad_responses += 1
                log.warning("retrieval answered a body that does not parse (%s)", url)
                return [None] * len(queries)  # type: ignore[list-item]
            self.stats.requests += 1
            self.stats.request_latencies.append(time.perf_counter() - sent)
            billed, cached = _ledger(response, len(queries))
            self.stats.billed_queries += billed
            self.stats.cached_queries += cached
            return result
        raise _Unreachable(f"after {c.max_retries + 1} attempts: {last_error}")

    def _pick_url(self, route: tuple[int, ...], attempt: int) -> str:
        """The URL of `route` for this attempt (the first, then the next on each retry),
        skipping any whose breaker is open while another's is closed; if all are open, the one
        that closes first."""
        urls = [url.rstrip("/") for url in self.config.urls]
        now = time.monotonic()
        order = [urls[route[(attempt + k) % len(route)]] for k in range(len(route))]
        for url in order:
            if self._broken_until.get(url, 0.0) <= now:
                return url
        return min(order, key=lambda url: self._broken_until[url])

    async def _health(self, base: str) -> bool:
        """Whether `base` answers: hdr's /health says 200 (503 once unhealthy); a server
        without /health (Search-R1's) answers 404 or 501, which also means it is up."""
        try:
            response = await self._http.get(base + "/health", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return False
        return response.status_code not in DOWN_STATUSES

    async def _any_healthy(self) -> bool:
        urls = [url.rstrip("/") for url in self.config.urls]
        return any(await asyncio.gather(*(self._health(url) for url in urls)))

    def require_reachable(self) -> None:
        """Fail at once, in one line, when no URL answers before a job starts: a server that
        was never started is a setup mistake; the outage grace is for restarts mid-run."""
        if not self._run(self._any_healthy()):
            raise RetrievalUnavailable(
                f"no retrieval server answers at {', '.join(self.config.urls)}; start one with "
                "`hdr serve --index DIR` (or `make serve`) or point retrieval.urls at it"
            )

    def require_expected_index(self) -> None:
        """Refuse, in one line, a server whose index is not the one the config expects
        (`expect_encoder`, `expect_documents`): training against another corpus or encoder
        would run to the end and mean nothing."""
        c = self.config
        if c.expect_encoder is None and c.expect_documents is None:
            return
        wanted = {"encoder": c.expect_encoder, "documents": c.expect_documents}
        for base in (url.rstrip("/") for url in c.urls):
            served = self._run(self._served(base))
            if not served:
                raise UserError(
                    f"retrieval server {base} reports no index on /health, so"
                    " retrieval.expect_encoder / expect_documents cannot be checked; set them"
                    " to null to train against it unchecked"
                )
            if not expected_index(served, c.expect_encoder, c.expect_documents):
                found = ", ".join(f"{key} {value}" for key, value in served.items())
                want = ", ".join(f"{k} {v}" for k, v in wanted.items() if v is not None)
                raise UserError(
                    f"retrieval server {base} serves {found}, but the config expects {want}"
                    " (retrieval.expect_encoder / expect_documents): serve the index the"
                    " config is for, or change those settings"
                )

    async def _served(self, base: str) -> dict[str, Any]:
        """The encoder and passage count a server's /health reports ({} if it has none)."""
        try:
            response = await self._http.get(base + "/health", timeout=HEALTH_TIMEOUT_S)
            body = response.json()
        except (httpx.HTTPError, ValueError):
            return {}
        if not isinstance(body, dict) or "encoder" not in body or "documents" not in body:
            return {}
        return {"encoder": body["encoder"], "documents": body["documents"]}

    async def _wait_for_recovery(self, reason: str) -> None:
        """Pause until some URL is healthy again; one shared wait for all chunks."""
        if self._recovery is None or self._recovery.done():
            self._recovery = asyncio.ensure_future(self._poll_health(reason))
        await asyncio.shield(self._recovery)

    async def _poll_health(self, reason: str) -> None:
        c = self.config
        started = time.monotonic()
        self.stats.outages += 1
        log.warning(
            "retrieval unreachable (%s); pausing up to %.0f s for it to come back", reason,
            c.outage_grace_s,
        )  # fmt: skip
        delay = max(c.backoff_s, 0.1)
        try:
            while True:
                if await self._any_healthy():
                    self._broken_until.clear()
                    log.warning("retrieval is back after %.1f s", time.monotonic() - started)
                    return
                left = c.outage_grace_s - (time.monotonic() - started)
                if left <= 0:
                    raise RetrievalUnavailable(
                        f"no retrieval server answered for {c.outage_grace_s:g} s "
                        f"(retrieval.outage_grace_s) at {', '.join(c.urls)}; last error: {reason}"
                    )
                await asyncio.sleep(min(delay * self._rng.uniform(0.5, 1.0), left))
                delay = min(delay * 2, max(c.backoff_max_s, 0.1))
        finally:
            self.stats.outage_s += time.monotonic() - started

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


def expected_index(served: dict[str, Any], encoder: str | None, documents: int | None) -> bool:
    """Whether a server's /health `served` (encoder, documents) is what is expected (None:
    anything); encoders compare by the last part of their name or path."""
    if documents is not None and served["documents"] != documents:
        return False
    if encoder is None:
        return True
    name = str(served["encoder"]).rstrip("/").rsplit("/", 1)[-1]
    return name == encoder.rstrip("/").rsplit("/", 1)[-1]


def connect(
    config: RetrievalConfig, seed: int | None = None, cache_scope: str | None = None
) -> RetrievalClient:
    """A client whose servers answer now (`require_reachable`) and serve the expected index
    (`require_expected_index`); closed again if not. `cache_scope` names the client's own
    cache on hdr's server (a training run's: its repeats are cached, no other run's)."""
    client = RetrievalClient(config, seed=seed, cache_scope=cache_scope)
    try:
        client.require_reachable()
        client.require_expected_index()
    except BaseException:
        client.close()
        raise
    return client


def _parse_result(response: httpx.Response, expected: int) -> list[list[Document]] | None:
    """Documents per query from a scored or plain answer; None if it does not parse or has
    the wrong number of results."""
    try:
        scored = ScoredResponse.model_validate_json(response.content).result
        result = [[item.document for item in hits] for hits in scored]
    except ValidationError:
        try:
            result = PlainResponse.model_validate_json(response.content).result
        except ValidationError:
            return None
    return result if len(result) == expected else None


def _ledger(response: httpx.Response, queries: int) -> tuple[int, int]:
    """(billed, cached) queries of an answered request, from hdr serve's headers; all billed
    when the server sends none (or nonsense)."""
    try:
        billed = int(response.headers[BILLED_HEADER])
        cached = int(response.headers[CACHED_HEADER])
    except (KeyError, ValueError):
        return queries, 0
    if billed < 0 or cached < 0 or billed + cached != queries:
        return queries, 0
    return billed, cached


def _error_body(response: httpx.Response) -> dict:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _about_queries(response: httpx.Response) -> bool:
    """Whether a 4xx was caused by the queries (so other queries may succeed alone): a 413, or
    a validation error located in `queries` (hdr's `errors` or FastAPI's list `detail`)."""
    if response.status_code == 413:
        return True
    body = _error_body(response)
    errors = body.get("errors") or body.get("detail")
    if not isinstance(errors, list):
        return False
    return any(
        isinstance(error, dict) and "queries" in [str(part) for part in error.get("loc", [])]
        for error in errors
    )


def _detail(response: httpx.Response) -> str:
    detail = _error_body(response).get("detail")
    if isinstance(detail, str):
        return detail[:200]
    return response.text[:200].replace("\n", " ")


def _status_line(response: httpx.Response) -> str:
    return f"HTTP {response.status_code}: {_detail(response)}"


def _retry_after(response: httpx.Response, cap: float) -> float:
    """The server's Retry-After in seconds (capped), or 0."""
    try:
        return min(float(response.headers.get("retry-after", 0)), cap)
    except ValueError:
        return 0.0
