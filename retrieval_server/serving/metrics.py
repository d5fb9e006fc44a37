"""The server's Prometheus metrics, in a registry of its own per app (so several apps can live
in one process): request counters and the server-side latency histogram, and collectors that
read the batcher's queue, the result cache and the upstream when /metrics is scraped."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from fastapi import FastAPI

    from retrieval_server.fleet.link import RedisLink
    from retrieval_server.serving.answers import Answers
    from retrieval_server.serving.batching import MicroBatcher
    from retrieval_server.upstream.proxy import UpstreamBackend

# about 1.6x apart from 0.5 ms to 30 s, so a quantile read from them is within that factor
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0015, 0.0025, 0.004, 0.006, 0.01, 0.015, 0.025, 0.04,
                     0.06, 0.1, 0.15, 0.25, 0.4, 0.6, 1, 1.5, 2.5, 4, 6, 10, 15, 30)  # fmt: skip


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
            "The server's latency by endpoint: from a request's arrival to its response sent.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS_S,
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
        self.connections = Gauge(
            "hdr_retrieval_connections", "HTTP connections held open.", registry=self.registry
        )
        self.connections_cut = Counter(
            "hdr_retrieval_connections_cut",
            "Connections the server closed: head_timeout (no request head within "
            "head_timeout_s), evicted_stalled / evicted_idle (to make room past "
            "max_connections), refused (past max_connections, every connection busy).",
            ["reason"],
            registry=self.registry,
        )

    def connection_event(self, event: str) -> None:
        """What the guarded protocol reports (retrieval_server.serving.connections)."""
        if event == "opened":
            self.connections.inc()
        elif event == "closed":
            self.connections.dec()
        else:
            self.connections_cut.labels(event).inc()

    def observe_batch(self, retriever: str, queries: int) -> None:
        self.queries.labels(retriever).inc(queries)
        self.batch_queries.labels(retriever).observe(queries)


class ScrapedState(Protocol):
    """What the collectors read of the app's loaded state (app.ServingState has it)."""

    answers: Answers
    batcher: MicroBatcher | None
    upstream: UpstreamBackend | None
    redis: RedisLink | None


def serving_state(app: FastAPI) -> ScrapedState | None:
    """The app's loaded state (None before its lifespan has loaded it)."""
    return getattr(app.state, "serving", None)


class BatcherCollector:
    """Reads the batcher's queue and supervision state when /metrics is scraped."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self) -> Iterator[Any]:
        state = serving_state(self.app)
        if state is None or state.batcher is None:
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
            "hdr_retrieval_fifo_misses",
            "Requests that reached the queue after a batch that started after they arrived had "
            "left without them (they wait a whole batch longer).",
            value=batcher.counts.fifo_misses,
        )
        yield CounterMetricFamily(
            "hdr_retrieval_batches",
            "Micro-batches taken from the queue.",
            value=batcher.batches_started,
        )
        yield CounterMetricFamily(
            "hdr_retrieval_failed_searches",
            "Requests whose search raised (each retried alone first); answered 503.",
            value=batcher.counts.failed_requests,
        )


class CacheCollector:
    """Reads the result cache's and the upstream's counts when /metrics is scraped."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app

    def collect(self) -> Iterator[Any]:
        state = serving_state(self.app)
        if state is None:
            return
        cache = state.answers.cache
        if cache is not None:
            stats = cache.stats
            queries = CounterMetricFamily(
                "hdr_retrieval_cache_queries",
                "Queries by how they were answered: hit (the cache), coalesced (a computation "
                "in flight, or a duplicate in the request), miss (computed: billed).",
                labels=["outcome"],
            )
            outcomes = {"hit": stats.hits, "miss": stats.misses, "coalesced": stats.coalesced}
            for outcome, count in outcomes.items():
                queries.add_metric([outcome], count)
            yield queries
            yield CounterMetricFamily(
                "hdr_retrieval_cache_evictions",
                "Entries evicted to stay within max_bytes.",
                value=stats.evictions,
            )
            yield GaugeMetricFamily(
                "hdr_retrieval_cache_bytes", "Bytes the cache holds.", value=cache.bytes
            )
            yield GaugeMetricFamily(
                "hdr_retrieval_cache_max_bytes",
                "The cache's bound in bytes.",
                value=cache.max_bytes,
            )
            yield GaugeMetricFamily(
                "hdr_retrieval_cache_entries", "Answers cached.", value=len(cache)
            )
        shared = state.answers.shared
        if cache is not None and shared is not None:
            yield CounterMetricFamily(
                "hdr_retrieval_cache_shared_hits",
                "Of the hits: answers found in the fleet's shared cache (another replica's).",
                value=cache.stats.shared_hits,
            )
            yield CounterMetricFamily(
                "hdr_retrieval_cache_shared_waits",
                "Of the coalesced: answers another replica computed while this one waited.",
                value=cache.stats.shared_waits,
            )
            yield CounterMetricFamily(
                "hdr_retrieval_cache_shared_took_over",
                "Queries computed here after another replica's lock went without an answer.",
                value=shared.took_over,
            )
        if state.redis is not None:
            yield GaugeMetricFamily(
                "hdr_retrieval_redis_reachable",
                "1 while the fleet's Redis answers (0: this replica serves alone, and a budget "
                "kept there refuses misses).",
                value=state.redis.reachable,
            )
        if state.upstream is not None:
            yield from upstream_metrics(state.upstream)


def upstream_metrics(upstream: UpstreamBackend) -> Iterator[Any]:
    """The spend (the ledger's totals as last seen: the spend file's or the fleet's, across
    restarts) and this process's forwarding counts."""
    counts, totals, config = upstream.counts, upstream.ledger.totals(), upstream.config
    yield CounterMetricFamily(
        "hdr_retrieval_upstream_calls",
        "Queries billed by the upstream (answered, or sent and unanswered with "
        "upstream.bill_timeouts), in the ledger: since the spend file began, or the fleet's.",
        value=totals.calls,
    )
    yield GaugeMetricFamily(
        "hdr_retrieval_upstream_committed_calls",
        "What the budget counts: billed calls, calls in flight, and calls a stopped server "
        "left unsettled.",
        value=totals.committed_calls,
    )
    yield CounterMetricFamily(
        "hdr_retrieval_upstream_requests",
        "HTTP requests the upstream answered (this process).",
        value=counts.requests,
    )
    yield CounterMetricFamily(
        "hdr_retrieval_upstream_retries", "Forwards retried.", value=counts.retries
    )
    yield CounterMetricFamily(
        "hdr_retrieval_upstream_failures",
        "Forwards that failed after their retries (answered 502 or 504).",
        value=counts.failures,
    )
    yield CounterMetricFamily(
        "hdr_retrieval_upstream_over_budget",
        "Requests answered 429: the spend budget had run out.",
        value=counts.refused_over_budget,
    )
    yield CounterMetricFamily(
        "hdr_retrieval_upstream_budget_unavailable",
        "Requests answered 503: the budget could not be checked (its Redis unreachable, its "
        "spend file not writable).",
        value=counts.refused_unavailable,
    )
    yield GaugeMetricFamily(
        "hdr_retrieval_upstream_spent",
        "Billed calls x price_per_call, in the ledger.",
        value=totals.spent,
    )
    yield GaugeMetricFamily(
        "hdr_retrieval_upstream_committed_spend",
        "The spend the budget counts (billed, in flight, unsettled).",
        value=totals.committed_spend,
    )
    if config.max_calls is not None:
        yield GaugeMetricFamily(
            "hdr_retrieval_upstream_max_calls", "upstream.max_calls.", value=config.max_calls
        )
    if config.max_spend is not None:
        yield GaugeMetricFamily(
            "hdr_retrieval_upstream_max_spend", "upstream.max_spend.", value=config.max_spend
        )
