"""Typed settings of a live web search backend (`hdr serve --web serper|serpapi`): which API,
where its key is read from, and the search settings that decide its answers.

This module imports nothing else of hdr's retrieval server, so `retrieval_server.upstream.config`
(whose `UpstreamConfig.web` section this is) can import it without a cycle.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from core.config import StrictModel

WebApiName = Literal["serper", "serpapi"]
# where each API answers, and the environment variable its users keep the key in (the name
# LangChain and the providers' own examples use)
DEFAULT_URLS: dict[str, str] = {
    "serper": "https://google.serper.dev/search",
    "serpapi": "https://serpapi.com/search.json",
}
DEFAULT_KEY_ENVS: dict[str, str] = {"serper": "SERPER_API_KEY", "serpapi": "SERPAPI_API_KEY"}
# answers of a live search change: cached this long unless cache.ttl_s says otherwise
DEFAULT_WEB_TTL_S = 86400.0


class WebSearchConfig(StrictModel):
    """A live web search API behind the cache, the budget and the fleet, in place of a
    Search-R1 server: each query is one billed call, its results mapped to Search-R1
    documents."""

    api: WebApiName = Field(description="Which API: serper (google.serper.dev) or serpapi.")
    key_env: str | None = Field(
        default=None,
        description="Environment variable holding the API key; None: the API's usual one "
        "(SERPER_API_KEY, SERPAPI_API_KEY). The key is sent to the API and never shown.",
    )
    country: str | None = Field(
        default=None, description="Google's `gl` (country of the search, e.g. us); None: the API's."
    )
    language: str | None = Field(
        default=None, description="Google's `hl` (interface language, e.g. en); None: the API's."
    )
    location: str | None = Field(
        default=None,
        description="Where the search is made from (e.g. 'Austin, Texas'); None: "
        "the API's default.",
    )

    @property
    def key_variable(self) -> str:
        """The environment variable the key is read from."""
        return self.key_env or DEFAULT_KEY_ENVS[self.api]

    def answer_settings(self) -> dict[str, Any]:
        """What of these settings decides the answers (part of the cache's fingerprint)."""
        return self.model_dump(exclude={"key_env"})
