"""Proxy mode (`hdr serve --upstream URL`): the queries the cache cannot answer are forwarded to
another Search-R1-compatible server (a paid or remote search service, Search-R1's own server,
another `hdr serve`), with the same API, cache and coalescing in front.

Toward the upstream: at most `max_concurrency` requests in flight and `rate_limit_rps` started
per second (a request over the limit waits for its slot); a request carries at most
`max_batch_queries` queries (a larger set is split); 5xx, 429, timeouts and connection errors
are retried `max_retries` times with exponential backoff and full jitter. What still fails is
answered in one line: 504 when the upstream did not answer in time, 502 for anything else it
did (its status and one line of its detail), never a 500 of our own; a 400/413/422 of the
upstream is the client's request, passed on with its status.

The spend budget: every query forwarded and answered is one billed call at `price_per_call`;
past `max_calls` calls or `max_spend`, a request with a query to forward is refused with a 429
naming the budget that ran out, while queries the cache answers are still served. Calls are
reserved before forwarding, so concurrent requests cannot overspend, and returned if the
forward fails (a failed call is not counted as billed).

Whether caching the upstream's answers is exact depends on the upstream: a static index
(another `hdr serve`, Search-R1's server) answers a query the same way every time; a live web
search does not, and wants `cache.ttl_s`.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import sys
from dataclasses import dataclass
from typing import Any

import httpx
import orjson
from pydantic import Field, field_validator

from core.config import StrictModel
from core.errors import UserError
from retrieval_server.api import UpstreamReport
from retrieval_server.pacing import Pacer

RETRY_STATUSES = frozenset({429, 500, 502, 503, 504})
CLIENT_STATUSES = frozenset({400, 413, 422})  # the request's own fault: passed on as it is
DETAIL_CHARS = 200


class UpstreamConfig(StrictModel):
    """Where misses are forwarded in proxy mode, how hard, and how much may be spent."""

    url: str = Field(
        description="The upstream's base URL (http://host:port; a trailing /retrieve is dropped)."
    )
    timeout_s: float = Field(
        default=15.0, gt=0, description="Deadline of one attempt, connect to last byte."
    )
    max_retries: int = Field(
        default=2, ge=0, description="Retries after a 5xx, 429, timeout or connection error."
    )
    backoff_s: float = Field(default=0.25, ge=0, description="First backoff; doubles per retry.")
    backoff_max_s: float = Field(default=4.0, ge=0, description="Cap of one backoff.")
    max_concurrency: int = Field(
        default=16, ge=1, description="Requests in flight toward the upstream at once."
    )
    rate_limit_rps: float = Field(
        default=0.0, ge=0, description="Requests started toward the upstream per second; 0: none."
    )
    max_batch_queries: int = Field(
        default=256, ge=1, description="Most queries in one forwarded request (larger sets split)."
    )
    price_per_call: float = Field(
        default=0.0, ge=0, description="What one forwarded query costs (any currency unit)."
    )
    max_calls: int | None = Field(
        default=None, ge=0, description="Most queries forwarded, in all; None: no limit."
    )
    max_spend: float | None = Field(
        default=None, ge=0, description="Most spent (calls x price_per_call); None: no limit."
    )
    token_env: str = Field(
        default="HDR_UPSTREAM_TOKEN",
        description="Environment variable whose value, if set, is sent to the upstream as a "
        "Bearer token.",
    )

    @property
    def shown_url(self) -> str:
        """The URL as errors and /health show it: without a user or password it may carry."""
        return str(httpx.URL(self.url).copy_with(userinfo=b""))

    def worst_case_s(self) -> float:
        """The longest a forward can take: every attempt to its deadline, every backoff at its
        cap. Below the server's request deadline, a stalled upstream ends in a 504."""
        backoffs = sum(
            min(self.backoff_max_s, self.backoff_s * 2**retry) for retry in range(self.max_retries)
        )
        return self.timeout_s * (self.max_retries + 1) + backoffs

    @field_validator("url")
    @classmethod
    def _base_url(cls, url: str) -> str:
        url = url.strip()
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"upstream URL {url!r} must start with http:// or https://")
        return url.rstrip("/").removesuffix("/retrieve")


class UpstreamError(Exception):
    """The upstream could not answer: the status to answer with and its one-line detail."""

    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status = status
        self.detail = detail


class BudgetSpent(Exception):
    """A request needs calls the spend budget no longer allows (answered 429)."""


@dataclass
class UpstreamCounts:
    """Since start: forwarded requests and queries (billed calls), retries, final failures."""

    requests: int = 0
    calls: int = 0
    retries: int = 0
    failures: int = 0
    refused_over_budget: int = 0


class Budget:
    """Billed calls against `max_calls` and `max_spend`, reserved before a forward."""

    def __init__(self, config: UpstreamConfig, counts: UpstreamCounts) -> None:
        self.config = config
        self.counts = counts
        self.reserved = 0

    @property
    def spent(self) -> float:
        return self.counts.calls * self.config.price_per_call

    def reserve(self, calls: int) -> None:
        c = self.config
        wanted = self.counts.calls + self.reserved + calls
        if c.max_calls is not None and wanted > c.max_calls:
            self._refuse(f"upstream.max_calls {c.max_calls}", c.max_calls - wanted + calls, calls)
        if c.max_spend is not None and wanted > self.affordable_calls():
            left = self.affordable_calls() - self.counts.calls - self.reserved
            self._refuse(f"upstream.max_spend {c.max_spend:g}", left, calls)
        self.reserved += calls

    def affordable_calls(self) -> int:
        """How many calls `max_spend` buys at `price_per_call`, counted in whole calls so that a
        price like 0.1 buys 3 calls of 0.3, not 2 (0.1 x 3 > 0.3 in binary floats)."""
        c = self.config
        assert c.max_spend is not None
        if c.price_per_call <= 0:
            return sys.maxsize
        return math.floor(c.max_spend / c.price_per_call + 1e-9)

    def _refuse(self, budget: str, left: int, needed: int) -> None:
        self.counts.refused_over_budget += 1
        raise BudgetSpent(
            f"upstream budget spent: {budget} leaves {max(left, 0)} calls, this request needs "
            f"{needed} ({self.counts.calls} billed so far); cached queries are still answered"
        )

    def settle(self, reserved: int, billed: int) -> None:
        """Release a reservation; `billed` of it were answered and count as calls."""
        self.reserved -= reserved
        self.counts.calls += billed


class UpstreamBackend:
    """Forwards queries to the upstream (the `Backend` of `retrieval_server.answers`)."""

    def __init__(self, config: UpstreamConfig) -> None:
        self.config = config
        self.counts = UpstreamCounts()
        self.budget = Budget(config, self.counts)
        self.pacer = Pacer(config.rate_limit_rps)
        self.slots = asyncio.Semaphore(config.max_concurrency)
        self.rng = random.Random()
        token = os.environ.get(config.token_env)
        self.http = httpx.AsyncClient(
            headers={"Authorization": f"Bearer {token}"} if token else None,
            timeout=httpx.Timeout(config.timeout_s),
            limits=httpx.Limits(
                max_connections=config.max_concurrency,
                max_keepalive_connections=config.max_concurrency,
                keepalive_expiry=2.0,  # below the keep-alive of common servers (hdr's 20 s)
            ),
        )

    async def close(self) -> None:
        await self.http.aclose()

    async def describe(self) -> dict[str, Any]:
        """The upstream's /health as JSON ({} if it has none, as Search-R1's server); a
        refused connection is a UserError at start (a wrong URL, or the upstream is down)."""
        url = self.config.url
        try:
            response = await self.http.get(f"{url}/health", timeout=10)
        except httpx.HTTPError as err:
            raise UserError(
                f"upstream {self.config.shown_url} does not answer ({type(err).__name__}); start"
                " it first or correct --upstream"
            ) from None
        try:
            body = response.json() if response.status_code == 200 else {}
        except ValueError:
            body = {}
        return body if isinstance(body, dict) else {}

    async def compute(
        self, queries: list[str], topk: int, retriever: str, return_scores: bool
    ) -> list[bytes]:
        """Each query's answer (the upstream's result list, re-encoded compactly), in order."""
        self.budget.reserve(len(queries))
        size = self.config.max_batch_queries
        chunks = [queries[lo : lo + size] for lo in range(0, len(queries), size)]
        parts: list[list[bytes] | BaseException] = []
        try:
            parts = await asyncio.gather(
                *(self._forward(chunk, topk, retriever, return_scores) for chunk in chunks),
                return_exceptions=True,
            )
        finally:  # what the upstream answered is billed, even when another chunk failed
            answered = sum(len(part) for part in parts if isinstance(part, list))
            self.budget.settle(len(queries), answered)
        for part in parts:
            if isinstance(part, BaseException):
                raise part
        return [answer for part in parts for answer in part]  # type: ignore[union-attr]

    async def _forward(
        self, queries: list[str], topk: int, retriever: str, return_scores: bool
    ) -> list[bytes]:
        body: dict[str, Any] = {"queries": queries, "topk": topk, "return_scores": return_scores}
        if retriever:
            body["retriever"] = retriever
        content = await self._post(orjson.dumps(body))
        try:
            result = orjson.loads(content)["result"]
            if len(result) != len(queries) or not all(isinstance(r, list) for r in result):
                raise ValueError
            return [orjson.dumps(answer) for answer in result]
        except (ValueError, KeyError, TypeError):
            self.counts.failures += 1
            raise UpstreamError(
                502,
                f"upstream {self.config.shown_url} answered a body that is not a Search-R1 result "
                f"for {len(queries)} queries",
            ) from None

    async def _post(self, body: bytes) -> bytes:
        """The upstream's 200 body, after retries; UpstreamError when it does not come."""
        c = self.config
        url, shown = f"{c.url}/retrieve", f"{c.shown_url}/retrieve"
        failure = UpstreamError(502, "")
        for attempt in range(c.max_retries + 1):
            if attempt:
                self.counts.retries += 1
                cap = min(c.backoff_max_s, c.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(self.rng.uniform(0, cap))
            try:
                async with self.slots:
                    await self.pacer.wait()
                    response = await asyncio.wait_for(  # httpx's timeout is per read
                        self.http.post(
                            url, content=body, headers={"content-type": "application/json"}
                        ),
                        c.timeout_s,
                    )
            except (httpx.TimeoutException, asyncio.TimeoutError):
                failure = UpstreamError(
                    504, f"upstream {shown} did not answer within {c.timeout_s:g} s"
                )
                continue
            except httpx.HTTPError as err:
                failure = UpstreamError(502, f"upstream {shown} unreachable: {type(err).__name__}")
                continue
            self.counts.requests += 1
            status = response.status_code
            if status == 200:
                return response.content
            line = f"upstream {shown} answered HTTP {status}: {one_line(response)}"
            if status in CLIENT_STATUSES:
                raise UpstreamError(status, line)
            failure = UpstreamError(502, line)
            if status not in RETRY_STATUSES:
                break
        self.counts.failures += 1
        attempts = f" ({c.max_retries + 1} attempts)" if c.max_retries else ""
        raise UpstreamError(failure.status, failure.detail + attempts)

    def report(self) -> UpstreamReport:
        c = self.config
        return UpstreamReport(
            url=c.shown_url,
            requests=self.counts.requests,
            calls=self.counts.calls,
            retries=self.counts.retries,
            failures=self.counts.failures,
            refused_over_budget=self.counts.refused_over_budget,
            price_per_call=c.price_per_call,
            spent=self.budget.spent,
            max_calls=c.max_calls,
            max_spend=c.max_spend,
        )


def one_line(response: httpx.Response) -> str:
    """The upstream's error detail (its JSON `detail`, else its text) as one short line."""
    try:
        detail = response.json().get("detail")
    except (ValueError, AttributeError):
        detail = None
    text = detail if isinstance(detail, str) else response.text
    return " ".join(text.split())[:DETAIL_CHARS] or "(empty body)"
