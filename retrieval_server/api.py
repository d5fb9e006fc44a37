"""Request and response models of `POST /retrieve`, shared by the server and its clients.

Wire format (Search-R1 compatible, see DESIGN.md):

    request   {"queries": [str], "topk": int | null, "return_scores": bool, "retriever": str | null}
    response  {"result": [[{"document": {"id", "contents", ...}, "score": float}, ...], ...]}
              or, without scores, {"result": [[{"id", "contents", ...}, ...], ...]}

`retriever` is hdr's addition (null: the server's default). `RetrieveRequest` checks only the
structure; a server derives `limited_request_model(...)` from its configured limits.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, StrictStr, create_model


class RetrieveRequest(BaseModel):
    """Queries to search; one result list per query, in order."""

    model_config = ConfigDict(extra="forbid")

    queries: list[StrictStr] = Field(min_length=1, description="Search queries.")
    topk: int | None = Field(
        default=None, ge=1, description="Passages per query; null means the server default."
    )
    return_scores: bool = Field(default=False, description="Wrap each passage with its score.")
    retriever: str | None = Field(
        default=None, description='"dense" or "bm25"; null means the server default.'
    )


class Document(BaseModel):
    """One corpus line; fields besides `id` and `contents` pass through unchanged."""

    model_config = ConfigDict(extra="allow")

    id: str
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
    status: str
    documents: int
    encoder: str
    index_type: str
    retrievers: list[str]
    default_retriever: str
    emulated_cost: EmulatedCostReport


class ErrorResponse(BaseModel):
    """Every 4xx: `detail` is one readable line; `errors` lists validation failures, if any."""

    detail: str
    errors: list[dict[str, Any]] = []


def limited_request_model(
    max_queries: int, max_query_chars: int, max_topk: int
) -> type[RetrieveRequest]:
    """`RetrieveRequest` with upper limits: a violation is a 422 naming the field and the limit."""
    limited_query = Annotated[StrictStr, Field(max_length=max_query_chars)]
    return create_model(
        "LimitedRetrieveRequest",
        __base__=RetrieveRequest,
        queries=(list[limited_query], Field(min_length=1, max_length=max_queries)),
        topk=(int | None, Field(default=None, ge=1, le=max_topk)),
    )
