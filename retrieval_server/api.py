"""Request and response models of `POST /retrieve`, shared by the server and its clients.

Wire format (Search-R1 compatible, see docs/retrieval.md):

    request   {"queries": [str], "topk": int | null, "return_scores": bool, "retriever": str | null}
    response  {"result": [[{"document": {"id", "contents", ...}, "score": float}, ...], ...]}
              or, without scores, {"result": [[{"id", "contents", ...}, ...], ...]}

`retriever` is hdr's addition (null: the server's default). Two response headers, also hdr's,
tell a client what its request cost without touching the body: `X-HDR-Billed-Queries` (queries
computed for it: by the index, or forwarded to an upstream) and `X-HDR-Cached-Queries` (queries
answered without a computation: from the cache, or by an identical query in flight). A client
may send `X-HDR-Cache-Scope: NAME`: its queries are then answered only from answers computed
for the same scope (a run's own repeats, never another run's).
`RetrieveRequest` is the wire shape a client sends; a server validates with
`profile_request_model(...)`, derived from its profile and limits. hdr's server always returns
`id`; `Document.id` is optional so that clients also read servers whose documents carry none
(Search-R1's BM25 index).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
    StringConstraints,
    create_model,
)

_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
BILLED_HEADER = "x-hdr-billed-queries"
CACHED_HEADER = "x-hdr-cached-queries"
SCOPE_HEADER = "x-hdr-cache-scope"  # a client's own cache (a training run's), sent by it


def without_lone_surrogates(text: str) -> str:
    """`text` with unpaired UTF-16 surrogates (legal as JSON escapes, not encodable in UTF-8)
    replaced by U+FFFD, so tokenizers and the response encoder never meet them."""
    return _LONE_SURROGATE.sub("\ufffd", text)


class RetrieveRequest(BaseModel):
    """Queries to search; one result list per query, in order."""

    model_config = ConfigDict(extra="ignore")

    queries: list[StrictStr] = Field(description="Search queries (may be empty).")
    topk: int | None = Field(
        default=None, ge=0, description="Passages per query; null or 0 means the server default."
    )
    return_scores: bool = Field(default=False, description="Wrap each passage with its score.")
    retriever: str | None = Field(
        default=None, description='"dense" or "bm25"; null means the server default.'
    )


class Document(BaseModel):
    """One corpus line; fields besides `id` and `contents` pass through unchanged."""

    model_config = ConfigDict(extra="allow")

    id: str | None = None
    contents: str


class ScoredDocument(BaseModel):
    document: Document
    score: float


class ScoredResponse(BaseModel):
    """`return_scores: true`: result[query][rank] = {document, score}."""

    result: list[list[ScoredDocument]]


class PlainResponse(BaseModel):
    """`return_scores: false`: result[query][rank] = document."""

    result: list[list[Document]]


class EmulatedCostReport(BaseModel):
    """`/health`'s account of the emulation: the settings and what they cost so far."""

    enabled: bool
    request_latency_ms: float
    query_latency_ms: float
    rate_limit_rps: float
    requests_charged: int
    seconds_waited: float


class SharedReport(BaseModel):
    """`/health`'s account of the cache shared by a fleet (`cache.backend: redis`)."""

    backend: Literal["redis"]
    url: str  # without its password
    reachable: bool  # false: serving from this replica's cache and searches alone
    reason: str | None  # why not, one line
    down_since: float | None  # unix time it stopped answering
    took_over: int  # queries computed here after another replica's lock went unanswered


class CacheReport(BaseModel):
    """`/health`'s account of the result cache (queries since start; see docs/retrieval.md)."""

    enabled: bool
    hits: int  # queries answered without a computation: the caches, or a served snapshot
    misses: int  # queries computed: the billed ones
    coalesced: int  # queries answered by a computation in flight (or a duplicate in a request)
    shared_hits: int = 0  # of the hits: found in the shared cache
    shared_waits: int = 0  # of the coalesced: computed by another replica meanwhile
    entries: int
    bytes: int
    max_bytes: int
    evictions: int
    expired: int
    loaded: int  # entries read from persist_path at start
    ttl_s: float | None
    fingerprint: str  # of the index and the settings that decide answers (part of every key)
    shared: SharedReport | None = None  # cache.backend redis only


class UpstreamReport(BaseModel):
    """`/health`'s account of proxy mode: what was forwarded and what it cost. `calls` and
    `spent` are the ledger's (since the spend file began, or the fleet's in Redis; this process
    alone without either); `requests` to `refused_unavailable` count this process's."""

    url: str  # without user, password or query values
    api: str = "search-r1"  # what it speaks: a Search-R1 server, or a web API (serper, serpapi)
    requests: int  # HTTP requests the upstream answered
    calls: int  # queries billed: answered, or sent and unanswered (upstream.bill_timeouts)
    committed_calls: int  # what the budget counts: billed, in flight, unsettled by a stopped server
    retries: int
    failures: int  # forwards that failed after their retries (answered 502/504)
    refused_over_budget: int  # requests answered 429
    refused_unavailable: int  # requests answered 503: the shared budget was unreachable
    price_per_call: float
    spent: float
    committed_spend: float
    max_calls: int | None
    max_spend: float | None
    ledger: Literal["memory", "file", "redis"]  # where the spend is kept
    refusing: str | None = None  # why every call is refused now (the fleet's budget lost), one line


class SnapshotReport(BaseModel):
    """`/health`'s account of a snapshot served (`--snapshot`) and of one recorded."""

    path: str | None  # the snapshot served; None: a live backend, recorded
    entries: int  # answers it holds now (grown by forwarded queries, or recorded ones)
    served: int  # queries answered from it
    missing: int  # queries refused as not in it (404)
    added: int  # queries fetched live and added (snapshot.on_miss forward)
    record_path: str | None  # where the recording is written; None: not recorded


class HealthResponse(BaseModel):
    status: Literal["ok", "unhealthy"]
    reason: str | None = None  # why unhealthy, one line; None when ok
    documents: int | None  # None: a proxy whose upstream does not say
    encoder: str | None
    index_type: str | None  # None: no dense index (BM25 only), or not known (proxy)
    retrievers: list[str]
    default_retriever: str | None  # None: a proxy leaves it to its upstream
    profile: Literal["search-r1", "strict"]
    max_query_chars: int  # queries are cut to it (search-r1) or refused past it (strict)
    emulated_cost: EmulatedCostReport
    cache: CacheReport
    upstream: UpstreamReport | None = None  # proxy mode only
    snapshot: SnapshotReport | None = None  # a snapshot served or recorded


class ErrorResponse(BaseModel):
    """Every 4xx and 503: `detail` is one readable line; `errors` lists validation failures
    (location, message, type; never the offending input)."""

    detail: str
    errors: list[dict[str, Any]] = []


Query = Annotated[StrictStr, AfterValidator(without_lone_surrogates)]


class StrictRetrieveRequest(RetrieveRequest):
    """The strict profile's base: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


def profile_request_model(
    profile: Literal["search-r1", "strict"], max_queries: int, max_query_chars: int, max_topk: int
) -> type[RetrieveRequest]:
    """The request model a server validates with; a violation is a 422 naming field and limit.

    search-r1: up to `max_queries` queries (zero included) of any length (the server truncates),
    topk 0 or null = default, unknown fields ignored. strict: 1..max_queries queries of at most
    `max_query_chars`, topk >= 1, unknown fields refused, and no type coerced: `"topk": true`
    or `"return_scores": "yes"` is a 422 (the search-r1 profile reads them as 1 and true, as
    FastAPI's lax models in Search-R1's own server do).
    """
    if profile == "strict":
        strict_query = Annotated[
            StrictStr,
            StringConstraints(max_length=max_query_chars),
            AfterValidator(without_lone_surrogates),
        ]
        return create_model(
            "StrictLimitedRequest",
            __base__=StrictRetrieveRequest,
            queries=(list[strict_query], Field(min_length=1, max_length=max_queries)),
            topk=(StrictInt | None, Field(default=None, ge=1, le=max_topk)),
            return_scores=(StrictBool, Field(default=False)),
        )
    return create_model(
        "SearchR1LimitedRequest",
        __base__=RetrieveRequest,
        queries=(list[Query], Field(max_length=max_queries)),
        topk=(int | None, Field(default=None, ge=0, le=max_topk)),
    )
