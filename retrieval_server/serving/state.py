"""What the app's lifespan opens and its handlers use (`ServingState`): the index with its
retrievers and batcher, or the upstream, or a snapshot, with the answers' cache (and the
fleet's, in Redis) in front."""

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Any

from core.errors import UserError
from core.fingerprint import digest
from retrieval_server.config import ServerConfig
from retrieval_server.fleet.cache import SharedCache
from retrieval_server.fleet.ledger import RedisLedger
from retrieval_server.fleet.link import RedisLink
from retrieval_server.index.files import DocumentStore, IndexManifest, LoadedIndex, load_index
from retrieval_server.serving.answers import (
    Answers,
    BatcherBackend,
)
from retrieval_server.serving.batching import MicroBatcher, Passage
from retrieval_server.serving.cache import ResultCache, open_persisted
from retrieval_server.serving.emulated_cost import CostEmulator
from retrieval_server.serving.metrics import ServerMetrics
from retrieval_server.serving.query_log import QueryLog
from retrieval_server.serving.retrievers import (
    Hit,
    Retriever,
    available_retrievers,
    make_retrievers,
)
from retrieval_server.snapshot.backend import SnapshotBackend, SnapshotRecorder, open_snapshot
from retrieval_server.snapshot.file import Snapshot
from retrieval_server.upstream.proxy import (
    UpstreamBackend,
    default_ledger,
    upstream_description,
)
from retrieval_server.upstream.spend import MemoryLedger
from retrieval_server.web.backend import upstream_backend

FINGERPRINT_DIGITS = 16  # of the answers' fingerprint (hex): part of every cache key


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
