"""Typed configuration of the retrieval server (`ServerConfig`, validated at load); its encoder
runtime and dense search settings are the index's (`retrieval_server.index.config`).

Request limits, the compatibility profile and the overload policy (queue bound, deadline,
concurrency) live here and nowhere else: the API derives its request model from them, so the
limits a client hits are exactly the ones configured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr

from core.config import StrictModel
from retrieval_server.index.config import DenseSearchConfig, EncoderConfig
from retrieval_server.serving.cache import CacheConfig
from retrieval_server.serving.emulated_cost import EmulatedCostConfig
from retrieval_server.snapshot.config import SnapshotConfig
from retrieval_server.upstream.config import UpstreamConfig
from retrieval_server.web.config import DEFAULT_WEB_TTL_S


class ServerConfig(StrictModel):
    """What `create_app` needs: where the index is (or the upstream, in proxy mode), how
    requests are limited, batched and cached."""

    index_dir: Path | None = Field(
        default=None,
        description="Index directory written by `hdr index build`; None in proxy mode.",
    )
    upstream: UpstreamConfig | None = Field(
        default=None,
        description="Proxy mode (`hdr serve --upstream URL`): misses are forwarded to this "
        "Search-R1-compatible server instead of searched in an index.",
    )
    cache: CacheConfig = Field(
        default_factory=CacheConfig,
        description="The result cache and the coalescing of identical queries (on by default).",
    )
    snapshot: SnapshotConfig = Field(
        default_factory=SnapshotConfig,
        description="Serve a frozen snapshot offline (`--snapshot FILE`, exact), and record "
        "one (`--record-snapshot FILE`).",
    )
    corpus: Path | None = Field(
        default=None,
        description="Corpus JSONL; None means the path recorded in the index manifest.",
    )
    default_retriever: str = Field(
        default="dense", description="Retriever used when a request names none."
    )
    profile: Literal["search-r1", "strict"] = Field(
        default="search-r1",
        description="Request profile. search-r1 (default): accept everything Search-R1's trainer "
        "sends (empty `queries`, over-long queries truncated, topk 0 = default, unknown fields "
        "ignored). strict: refuse those with a 422.",
    )
    default_topk: int = Field(default=3, ge=1, description="Passages per query when topk is null.")
    max_topk: int = Field(default=100, ge=1, description="Largest topk a request may ask for.")
    max_queries: int | None = Field(
        default=None,
        ge=1,
        description="Most queries in one request; None: the profile's (16,384 search-r1, "
        "1,024 strict).",
    )
    max_query_chars: int = Field(
        default=2048,
        ge=1,
        description="Longest query, in characters: longer ones are cut to it and counted "
        "(search-r1) or refused (strict). 2,048 is beyond the 256 tokens MiniLM reads.",
    )
    max_body_bytes: int = Field(
        default=64 * 2**20,
        ge=1024,
        description="Largest request body; a longer one is a 413, refused before it is parsed.",
    )
    max_concurrent_requests: int = Field(
        default=512,
        ge=1,
        description="Requests searched or answered at once (their bodies received); more are "
        "answered 503 + Retry-After. A request whose body is still arriving holds none of "
        "these, only the bytes it has sent (`max_buffered_body_bytes`).",
    )
    max_buffered_body_bytes: int = Field(
        default=256 * 2**20,
        ge=1024,
        description="Bytes of request bodies held in memory at once, all requests together, "
        "counted as they arrive and released when the request is answered; a body whose next "
        "chunk would pass it is answered 503 + Retry-After and its connection closed. So memory "
        "in transit is bounded by the bytes actually buffered: a thousand stalled uploads of "
        "a few bytes each hold a few kilobytes, not a thousand `max_body_bytes`. At least "
        "`max_body_bytes`, so one largest body always fits an idle server.",
    )
    body_idle_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="Seconds a request body may go without a new byte; past them it is "
        "answered 408 and the connection closed (a stalled sender is cut quickly).",
    )
    body_read_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="Seconds a request may take to send its whole body (however steadily it "
        "trickles); past them it is answered 408 and the connection closed.",
    )
    batch_wait_ms: float = Field(
        default=0.0,
        ge=0.0,
        description="Extra wait (ms) of a micro-batch's first request for company; 0: search at "
        "once and batch only what queued up while the previous batch was searched.",
    )
    batch_settle_turns: int = Field(
        default=4,
        ge=0,
        description="Event-loop turns a micro-batch waits, at most, for requests that arrived "
        "but are still on their way to the queue (first in, first served: otherwise they wait "
        "a whole batch longer); a request takes two. 0: take a batch at once.",
    )
    max_batch_queries: int = Field(
        default=256,
        ge=1,
        description="Most queries encoded and searched together; a larger request is searched "
        "in slices of this size, taking turns with other requests.",
    )
    max_queued_queries: int = Field(
        default=32768,
        ge=1,
        description="Queries waiting or being searched, all requests together; a request that "
        "would exceed it gets 503 + Retry-After (one request is always admitted to an empty "
        "queue).",
    )
    request_deadline_s: float = Field(
        default=60.0,
        gt=0,
        description="A request not answered within this many seconds gets 503 and its "
        "unsearched queries are dropped.",
    )
    retry_after_s: int = Field(
        default=1, ge=1, description="Retry-After (seconds) sent with every 503."
    )
    search_stall_s: float = Field(
        default=120.0,
        gt=0,
        description="A batch search still running after this many seconds is taken as hung: "
        "/health answers 503 with the reason, so a supervisor restarts the server. A batch "
        "holds at most `max_batch_queries` queries, so a healthy search takes far less.",
    )
    worker_max_restarts: int = Field(
        default=5,
        ge=0,
        description="Batch-worker crashes tolerated within a minute; one more turns /health "
        "and /retrieve to 503 so an orchestrator restarts the server.",
    )
    head_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Seconds a connection may take to send a request's head (its request line "
        "and headers), from its first byte (or from the connection's opening); past them the "
        "connection is closed. A stalled head otherwise holds its socket for ever.",
    )
    max_connections: int | None = Field(
        default=None,
        ge=16,
        description="Most connections held open; a new one past it closes the oldest connection "
        "still waiting for a request head (then the longest idle one), so stalled connections "
        "can never keep a client out. None: the open-file limit (raised to its hard limit at "
        "start) less 256 for the index, logs and the listening socket.",
    )
    keep_alive_s: float = Field(
        default=20.0,
        gt=0,
        description="Idle keep-alive of an HTTP connection. Above common clients' own (httpx "
        "5 s, aiohttp 15 s, hdr's 2 s), so a client never reuses a connection the server is "
        "closing.",
    )
    retrievers: list[str] | None = Field(
        default=None,
        description="Retrievers to load and serve (dense, bm25); None: every one the index "
        "has. A dense-only server never reads BM25; a BM25-only one loads no encoder.",
    )
    encoder: EncoderConfig = Field(
        default_factory=EncoderConfig,
        description="How queries are encoded (backend, device, batch size).",
    )
    query_prefix: str | None = Field(
        default=None,
        description="Text put before each query; None: the prefix recorded in the manifest.",
    )
    dense: DenseSearchConfig = Field(
        default_factory=DenseSearchConfig,
        description="How the FAISS index is held (mmap, GPU) and searched (nprobe, efSearch).",
    )
    bm25_threads: int | None = Field(
        default=None, ge=1, description="Threads scoring a batch of BM25 queries; None: all cores."
    )
    emulated_cost: EmulatedCostConfig = Field(
        default_factory=EmulatedCostConfig,
        description="Emulated remote-API cost per /retrieve request (off by default), e.g. "
        "`hdr serve ... emulated_cost.request_latency_ms=200`.",
    )
    query_log: Path | None = Field(
        default=None,
        description="A new file to write each answered /retrieve request's queries and "
        "billed/cached counts to, one JSON line a request (what repeats; bench/search_cache.py "
        "reads it); None: no log.",
    )
    api_token: SecretStr | None = Field(
        default=None,
        description="Bearer token required on /retrieve and /metrics; None means open. "
        "`hdr serve` fills it from the HDR_API_TOKEN environment variable.",
    )

    def model_post_init(self, _context: object) -> None:
        self._check_what_is_served()
        web = self.upstream is not None and self.upstream.web is not None
        if web and "ttl_s" not in self.cache.model_fields_set:  # ttl_s=null: no expiry
            self.cache.ttl_s = DEFAULT_WEB_TTL_S  # the web changes
        if self.upstream is not None and self.upstream.worst_case_s() >= self.request_deadline_s:
            u = self.upstream
            raise ValueError(
                f"upstream.timeout_s {u.timeout_s:g} x {u.max_retries + 1} attempts plus backoffs"
                f" ({u.worst_case_s():g} s) reaches request_deadline_s {self.request_deadline_s:g}:"
                " a stalled upstream would end in the deadline's 503, never in a 504; lower"
                " upstream.timeout_s or upstream.max_retries, or raise request_deadline_s"
            )
        if self.upstream is not None:
            self._check_the_budget_is_kept(self.upstream)
        if self.default_topk > self.max_topk:
            raise ValueError(f"default_topk {self.default_topk} exceeds max_topk {self.max_topk}")
        if self.max_buffered_body_bytes < self.max_body_bytes:
            raise ValueError(
                f"max_buffered_body_bytes {self.max_buffered_body_bytes} is below max_body_bytes "
                f"{self.max_body_bytes}: a largest body could never be received"
            )

    def _check_what_is_served(self) -> None:
        """One source of answers: an index, an upstream (or web API), or a snapshot (with an
        upstream beside it only to fetch what it lacks)."""
        snapshot = self.snapshot
        if snapshot.path is None:
            if snapshot.on_miss == "forward":
                raise ValueError("snapshot.on_miss=forward needs a snapshot (snapshot.path)")
            if (self.index_dir is None) == (self.upstream is None):
                raise ValueError(
                    "give exactly one of index_dir (an index) and upstream (proxy mode)"
                )
            return
        if self.index_dir is not None:
            raise ValueError("a snapshot is served alone: drop index_dir")
        if snapshot.on_miss == "forward":
            if self.upstream is None:
                raise ValueError(
                    "snapshot.on_miss=forward needs a live backend to forward to (--web or "
                    "--upstream)"
                )
            if snapshot.record_path is None:
                raise ValueError(
                    "snapshot.on_miss=forward adds what it fetches to a new snapshot: give "
                    "snapshot.record_path=FILE (--record-snapshot FILE)"
                )
        elif self.upstream is not None:
            raise ValueError(
                "a snapshot with snapshot.on_miss=refuse never asks the live backend: drop it, "
                "or set snapshot.on_miss=forward"
            )
        if snapshot.record_path is not None and snapshot.record_path == snapshot.path:
            raise ValueError("snapshot.record_path is the served snapshot: record to a new file")

    def _check_the_budget_is_kept(self, upstream: UpstreamConfig) -> None:
        """A budget must survive a restart: kept in a spend file, or in the fleet's Redis with
        each replica's record of it in its spend file (which tells a restarted replica that
        the budget existed, should Redis lose it)."""
        if upstream.limited and upstream.spend_path is None:
            limit = "max_calls" if upstream.max_calls is not None else "max_spend"
            if self.cache.backend == "redis":
                raise ValueError(
                    f"upstream.{limit} needs upstream.spend_path=FILE beside cache.backend=redis"
                    " (this replica's record of the fleet's budget, so that a budget Redis"
                    " loses is refused, never started again from zero)"
                )
            raise ValueError(
                f"upstream.{limit} needs upstream.spend_path=FILE (the spend is kept there "
                "across restarts) or cache.backend=redis (the fleet's budget): a budget that a "
                "restart forgets is no budget"
            )

    @property
    def query_limit(self) -> int:
        """Most queries in one request: `max_queries`, or the profile's default."""
        if self.max_queries is not None:
            return self.max_queries
        return PROFILE_MAX_QUERIES[self.profile]


API_TOKEN_ENV = "HDR_API_TOKEN"
# A Search-R1 GRPO step (train batch 512 x 5 responses) sends 2,560 queries in one request;
# 16,384 leaves room for larger batches. strict keeps the earlier, tighter limit.
PROFILE_MAX_QUERIES = {"search-r1": 16384, "strict": 1024}
