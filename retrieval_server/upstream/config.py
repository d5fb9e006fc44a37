"""Proxy mode's settings (`UpstreamConfig`, the `upstream` section of `ServerConfig`): where
the queries the cache cannot answer are forwarded, how hard, and how much may be spent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from pydantic import Field, field_validator, model_validator

from core.config import StrictModel
from retrieval_server.url_secrets import show_url
from retrieval_server.web.config import DEFAULT_URLS, WebSearchConfig


class UpstreamConfig(StrictModel):
    """Where misses are forwarded in proxy mode, how hard, and how much may be spent."""

    url: str = Field(
        description="The upstream's base URL (http://host:port[/path][?query]; a trailing "
        "/retrieve is dropped, a query string is kept on every request and never shown)."
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
    max_response_bytes: int = Field(
        default=64 * 2**20,
        ge=1024,
        description="Most bytes of one upstream answer read; a longer one is a 502 (and billed, "
        "if it was a 200: the upstream answered).",
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
    bill_timeouts: bool = Field(
        default=True,
        description="A forward that was sent and got no answer (its attempt timed out, or its "
        "connection was lost after sending) counts as billed, each attempt again: an API bills "
        "the requests it received, whether or not their answers reached you. false: only "
        "answered calls are billed (for an upstream known to bill only what it answers).",
    )
    spend_path: Path | None = Field(
        default=None,
        description="File the spend is kept in across restarts (written before every call is "
        "sent, whole, never half-written); with cache.backend=redis, this replica's record of "
        "the fleet's budget (which budget it is, so one Redis lost is refused, never started "
        "again). Needed with max_calls or max_spend.",
    )
    token_env: str = Field(
        default="HDR_UPSTREAM_TOKEN",
        description="Environment variable whose value, if set, is sent to the upstream as a "
        "Bearer token.",
    )
    web: WebSearchConfig | None = Field(
        default=None,
        description="A live web search API (`hdr serve --web serper|serpapi`) instead of a "
        "Search-R1 server: each query one call, its results mapped to Search-R1 documents "
        "(retrieval_server.web); `url` defaults to the API's own.",
    )

    @model_validator(mode="before")
    @classmethod
    def _web_url(cls, data: Any) -> Any:
        """A web API's URL, where none is given, is the API's own."""
        if isinstance(data, dict) and data.get("url") is None and isinstance(data.get("web"), dict):
            api = data["web"].get("api")
            if api in DEFAULT_URLS:
                data = {**data, "url": DEFAULT_URLS[api]}
        return data

    @property
    def limited(self) -> bool:
        """Whether a budget is set (max_calls or max_spend)."""
        return self.max_calls is not None or self.max_spend is not None

    @property
    def shown_url(self) -> str:
        """The URL as logs, errors, /health and /metrics show it: without the user and
        password it may carry, its query string's values masked."""
        return show_url(self.url)

    def endpoint(self, path: str) -> httpx.URL:
        """`path` (/retrieve, /health) under the base URL, its query string kept."""
        url = httpx.URL(self.url)
        return url.copy_with(path=url.path.rstrip("/") + path)

    def shown_endpoint(self, path: str) -> str:
        """`endpoint(path)` as it is shown (no user, password or query values)."""
        return show_url(str(self.endpoint(path)))

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
            raise ValueError(f"upstream URL {show_url(url)!r} must start with http:// or https://")
        try:
            parsed = httpx.URL(url)
        except httpx.InvalidURL as err:
            raise ValueError(f"upstream URL {show_url(url)!r} is not a URL: {err}") from None
        path = parsed.path.rstrip("/").removesuffix("/retrieve").rstrip("/")
        return str(parsed.copy_with(path=path, fragment=None))
