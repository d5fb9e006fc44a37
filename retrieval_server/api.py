"""Request and response models of `POST /retrieve`, shared by the server and its clients.

Wire format (Search-R1 compatible, see docs/retrieval.md):

    request   {"queries": [str], "topk": int | null, "return_scores": bool, "retriever": str | null}
    response  {"result": [[{"document": {"id", "contents", ...}, "score": float}, ...], ...]}
              or, without scores, {"result": [[{"id", "contents", ...}, ...], ...]}

`retriever` is hdr's addition (null: the server's default). `RetrieveRequest` is the wire shape
a client sends; a server validates with `profile_request_model(...)`, derived from its profile
and limits. hdr's server always returns `id`; `Document.id` is optional so that clients also read
servers whose documents carry none (Search-R1's BM25 index).
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


class HealthResponse(BaseModel):
    status: Literal["ok", "unhealthy"]
    reason: str | None = None  # why unhealthy, one line; None when ok
    documents: int
    encoder: str
    index_type: str | None  # None: no dense index (BM25 only)
    retrievers: list[str]
    default_retriever: str
    emulated_cost: EmulatedCostReport


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
