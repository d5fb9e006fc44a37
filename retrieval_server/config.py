"""Typed configuration of the retrieval server (one `ServerConfig`, validated at load).

Request limits live here and nowhere else: the API derives its request model from them, so
the limits a client hits are exactly the ones configured.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr

from hdr.config import StrictModel
from retrieval_server.emulated_cost import EmulatedCostConfig


class ServerConfig(StrictModel):
    """What `create_app` needs: where the index is, how requests are limited and batched."""

    index_dir: Path = Field(description="Index directory written by `hdr index build`.")
    corpus: Path | None = Field(
        default=None,
        description="Corpus JSONL; None means the path recorded in the index manifest.",
    )
    default_retriever: str = Field(
        default="dense", description="Retriever used when a request names none."
    )
    default_topk: int = Field(default=3, ge=1, description="Passages per query when topk is null.")
    max_topk: int = Field(default=100, ge=1, description="Largest topk a request may ask for.")
    max_queries: int = Field(default=1024, ge=1, description="Most queries in one request.")
    max_query_chars: int = Field(default=2048, ge=1, description="Longest query, in characters.")
    batch_wait_ms: float = Field(
        default=0.0,
        ge=0.0,
        description="Extra wait (ms) of a micro-batch's first request for company; 0: search at "
        "once and batch only what queued up while the previous batch was searched.",
    )
    max_batch_queries: int = Field(
        default=256, ge=1, description="Most queries encoded and searched together."
    )
    hnsw_ef_search: int = Field(
        default=128, ge=1, description="HNSW search breadth (only for index_type hnsw)."
    )
    emulated_cost: EmulatedCostConfig = Field(
        default_factory=EmulatedCostConfig,
        description="Emulated remote-API cost per /retrieve request (off by default), e.g. "
        "`--set emulated_cost.request_latency_ms=200`.",
    )
    api_token: SecretStr | None = Field(
        default=None,
        description="Bearer token required on /retrieve and /metrics; None means open. "
        "`hdr serve` fills it from the HDR_API_TOKEN environment variable.",
    )

    def model_post_init(self, _context: object) -> None:
        if self.default_topk > self.max_topk:
            raise ValueError(f"default_topk {self.default_topk} exceeds max_topk {self.max_topk}")


API_TOKEN_ENV = "HDR_API_TOKEN"
