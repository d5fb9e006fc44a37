"""Emulated remote-API cost of the searches `POST /retrieve` computes: latency per call and per
query, a rate limit.

A local BM25 or FAISS search answers in milliseconds, so on a laptop the environment is a
small share of a training step. A hosted search API (or a web search tool) costs far more per
call. These options make the local server cost what such an API would, so an experiment can
run in the regime where environment interaction dominates, and say so: every setting and the
time spent waiting on it are reported in `/health`.

- `request_latency_ms`: added once to every call (network round trip, queueing);
- `query_latency_ms`: added per query of the call (an API that bills and answers per query);
- `rate_limit_rps`: at most this many calls start per second; a call over the limit waits for
  its slot (as a client that honours `Retry-After` would), it is never refused.

A call is what a request sends to the backend: its billed queries, those the result cache
could not answer (`retrieval_server.serving.answers`). Queries answered from the cache cost nothing,
as they would in front of a real API; a request answered wholly from it makes no call.

All are off (0) by default. The delays are `asyncio.sleep`, so a waiting request holds no
worker and other requests proceed.
"""

from __future__ import annotations

import time

from pydantic import Field

from core.config import StrictModel
from retrieval_server.api import EmulatedCostReport
from retrieval_server.pacing import Pacer


class EmulatedCostConfig(StrictModel):
    """What one call to the backend (a request's billed queries) costs on top of the real
    search (all 0: off)."""

    request_latency_ms: float = Field(
        0.0, ge=0, description="Added to every call, i.e. every request with a billed query (ms)."
    )
    query_latency_ms: float = Field(0.0, ge=0, description="Added per billed query (ms).")
    rate_limit_rps: float = Field(
        0.0, ge=0, description="Most calls started per second; 0: no limit."
    )

    @property
    def enabled(self) -> bool:
        return bool(self.request_latency_ms or self.query_latency_ms or self.rate_limit_rps)

    def delay_s(self, queries: int) -> float:
        """The fixed latency of a call carrying `queries` queries, in seconds."""
        return (self.request_latency_ms + self.query_latency_ms * queries) / 1000.0


class CostEmulator:
    """Charges each call its emulated cost by sleeping; keeps the totals for `/health`."""

    def __init__(self, config: EmulatedCostConfig) -> None:
        self.config = config
        self.pacer = Pacer(config.rate_limit_rps)
        self._requests = 0
        self._waited = 0.0

    async def charge(self, queries: int) -> float:
        """Wait for the call's rate-limit slot, then its latency; returns seconds waited."""
        if not self.config.enabled:
            return 0.0
        started = time.monotonic()
        await self.pacer.wait(self.config.delay_s(queries))
        waited = time.monotonic() - started
        self._requests += 1
        self._waited += waited
        return waited

    def report(self) -> EmulatedCostReport:
        return EmulatedCostReport(
            enabled=self.config.enabled,
            request_latency_ms=self.config.request_latency_ms,
            query_latency_ms=self.config.query_latency_ms,
            rate_limit_rps=self.config.rate_limit_rps,
            requests_charged=self._requests,
            seconds_waited=round(self._waited, 6),
        )
