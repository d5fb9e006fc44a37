"""`WebBackend`: a live web search API in the place of proxy mode's upstream.

It is `retrieval_server.upstream.proxy.UpstreamBackend` with the upstream's wire format swapped:
every query is one request to the API (one billed call, reserved in the same ledger before it is
sent), built and read by the API's module (`retrieval_server.web.serper`, `.serpapi`), so the
cache, the coalescing, the spend budget, the rate limit, the retries and the fleet's Redis apply
unchanged. What differs:

- the key comes from the API's environment variable (`upstream.web.key_env`); a missing key is
  one line at start, and so is a key the API refuses where it can be checked for free
  (SerpApi's Account API); it is sent in the API's own way (a header, a query parameter) and is
  a secret like the proxy's: masked in every error, never in logs, /health or /metrics;
- the API's error statuses are mapped: a refused key is a 502 naming the variable, a spent
  quota is refused like the budget (429, cached queries still answered), a rate limit is
  retried (after its Retry-After); neither is billed, and neither is retried;
- a 200 is billed even when the API says the search failed (SerpApi does not count those):
  hdr would rather over-count a call than under-count one.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import httpx

from core.errors import UserError
from retrieval_server.upstream.proxy import (
    CLIENT_STATUSES,
    DETAIL_CHARS,
    ERROR_JSON_BYTES,
    HEALTH_TIMEOUT_S,
    Outgoing,
    UpstreamBackend,
    UpstreamError,
    _Unsent,
    one_line,
    parse_json,
)
from retrieval_server.upstream.spend import BudgetSpent
from retrieval_server.web.base import WEB_APIS, Refusal, render_answer

if TYPE_CHECKING:
    from retrieval_server.upstream.config import UpstreamConfig
    from retrieval_server.upstream.spend import MemoryLedger

log = logging.getLogger(__name__)


class WebBackend(UpstreamBackend):
    """Queries answered by a live web search API, one request each."""

    def __init__(self, config: UpstreamConfig, ledger: MemoryLedger | None = None) -> None:
        assert config.web is not None
        self.web = config.web
        self.api = WEB_APIS.get(config.web.api)
        super().__init__(config, ledger)
        self.queries_per_request = 1
        self.key = self.credential() or ""
        encoded = quote(self.key, safe="")
        if encoded != self.key:  # an API that echoes its request shows the key encoded
            self.secrets = sorted({*self.secrets, encoded}, key=len, reverse=True)

    @property
    def name(self) -> str:
        return self.api.name

    def credential(self) -> str | None:
        variable = self.config.web.key_variable  # type: ignore[union-attr]
        key = os.environ.get(variable, "").strip()
        if not key:
            raise UserError(
                f"--web {self.config.web.api} needs its API key in ${variable}, which is not "  # type: ignore[union-attr]
                "set (upstream.web.key_env names another variable)"
            )
        return key

    def auth_headers(self, token: str | None) -> dict[str, str] | None:
        return None  # the key travels in each request, as the API wants it

    async def describe(self) -> dict[str, Any]:
        """Checks the key where the API can without spending a search (one line at start if
        it is refused, or the API cannot be reached); a web API has no /health: {}."""
        request = self.api.account_request(httpx.URL(self.config.url), self.key)
        if request is None:
            return {}
        shown, variable = self.config.shown_url, self.web.key_variable
        try:
            status, content, _ = await asyncio.wait_for(
                self._send(request.method, request.url, request.body, request.headers),
                HEALTH_TIMEOUT_S,
            )
        except (httpx.HTTPError, asyncio.TimeoutError, _Unsent) as err:
            reason = str(err) if isinstance(err, _Unsent) else type(err).__name__
            raise UserError(
                f"{self.name} at {shown} does not answer ({reason}); check the network, or "
                "upstream.url"
            ) from None
        except UpstreamError:
            return {}  # an account page past max_response_bytes: nothing to learn from it
        body = parse_json(content)
        if self.api.refusal(status, self.message(content)) is Refusal.BAD_KEY:
            raise UserError(
                f"{self.name} refused the API key in ${variable} (HTTP {status}: "
                f"{self.message(content)}); set a valid key"
            )
        if status == 200 and self.api.searches_left(body) == 0:
            log.warning(
                "%s: the account behind $%s has no searches left; only cached queries will "
                "be answered",
                self.name,
                variable,
            )
        return {}

    def message(self, content: bytes) -> str:
        """An error body's message (the API's own field, else its text), one line, masked."""
        body = parse_json(content) if len(content) <= ERROR_JSON_BYTES else None
        found = self.api.message(body)
        if found is None:
            return one_line(content, self.masked)
        return self.masked(" ".join(found.split()))[:DETAIL_CHARS] or "(empty message)"

    def refused(self, status: int, content: bytes) -> Exception | None:
        message = self.message(content)
        kind = self.api.refusal(status, message)
        variable = self.web.key_variable
        if kind is Refusal.BAD_KEY:
            self.counts.failures += 1
            return UpstreamError(
                502,
                f"{self.name} refused the API key in ${variable} (HTTP {status}: {message}); "
                "set a valid key and restart",
            )
        if kind is Refusal.QUOTA:
            self.counts.refused_over_budget += 1
            return BudgetSpent(
                f"{self.name} quota spent: the account behind ${variable} has no searches left "
                f"(HTTP {status}: {message}); cached queries are still answered"
            )
        if status in CLIENT_STATUSES:  # the request hdr built (its settings), not the client's
            self.counts.failures += 1
            return UpstreamError(502, f"{self.name} answered HTTP {status}: {message}")
        return None

    async def _forward(
        self,
        queries: list[str],
        topk: int,
        retriever: str,
        return_scores: bool,
        started: list[bool],
        chunk: int,
    ) -> list[bytes]:
        """One query's answer: its request, sent through the proxy's retries and ledger."""
        started[chunk] = True
        (query,) = queries
        request = self.api.request(httpx.URL(self.config.url), query, topk, self.key, self.web)
        outgoing = Outgoing(
            request.method, request.url, self.config.shown_url, request.body, request.headers
        )
        content = await self._post(outgoing, 1)
        results = self.api.results(parse_json(content))
        if results is None:
            self.counts.failures += 1
            raise UpstreamError(
                502,
                f"{self.name} at {self.config.shown_url} answered a body that is not a results "
                f"page ({self.message(content)})",
            )
        return [render_answer(results, topk, return_scores)]


def upstream_backend(config: UpstreamConfig, ledger: MemoryLedger | None) -> UpstreamBackend:
    """The backend of `config`: a web search API (`upstream.web`), else a Search-R1 upstream."""
    if config.web is not None:
        return WebBackend(config, ledger)
    return UpstreamBackend(config, ledger)
