"""SerpApi (serpapi.com): Google results as JSON.

From SerpApi's public documentation: `GET https://serpapi.com/search.json?engine=google&q=...
&api_key=...` (and `gl`, `hl`, `location`; `num` only past the default page of 10, topk is
cut here); the answer holds `organic_results` (title, link, snippet, position), and where
Google shows them `answer_box` (an object, or a list of them: title, answer, snippet or
result, link) and `knowledge_graph` (title, description, website, source.link). Errors carry
`{"error": message}`: 401 for a key it does not know, 403 for an account without the right,
429 for both the hourly throughput limit and an account that "has run out of searches" (told
apart by the message). A 200 may carry `error` too: with `search_metadata.status` "Success" it
is a search without results (an empty answer), otherwise a failed search (502). The Account
API (`/account.json?api_key=...`, free, not counted) checks the key at start and says how
many searches are left.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from retrieval_server.web.base import (
    WEB_APIS,
    Refusal,
    WebRequest,
    WebResult,
    box_result,
    first_object,
    organic_results,
)

if TYPE_CHECKING:
    from retrieval_server.web.config import WebSearchConfig

QUOTA_WORDS = "run out of searches"
PAGE_RESULTS = 10


class SerpApi:
    name = "serpapi"

    def request(
        self, url: httpx.URL, query: str, topk: int, key: str, settings: WebSearchConfig
    ) -> WebRequest:
        params = {"engine": "google", "q": query}
        if topk > PAGE_RESULTS:  # a page of 10 is the default (and the price of one search)
            params["num"] = str(topk)
        for field, value in (("gl", settings.country), ("hl", settings.language),
                             ("location", settings.location)):  # fmt: skip
            if value is not None:
                params[field] = value
        params["api_key"] = key
        return WebRequest("GET", url.copy_merge_params(params), {})

    def results(self, body: Any) -> list[WebResult] | None:
        if not isinstance(body, dict):
            return None
        if "error" in body and not body.get("organic_results"):
            metadata = body.get("search_metadata")
            status = metadata.get("status") if isinstance(metadata, dict) else None
            return [] if status == "Success" else None  # no results, or a failed search
        if "organic_results" not in body and "search_metadata" not in body:
            return None
        organic = organic_results(body.get("organic_results"))
        if organic is None:
            return None
        found = []
        if (box := first_object(body.get("answer_box"))) is not None:
            found.append(box_result("answer_box", box, ("answer", "snippet", "result"),
                                    ("link",)))  # fmt: skip
        if (graph := first_object(body.get("knowledge_graph"))) is not None:
            source = graph.get("source")
            if isinstance(source, dict) and "link" not in graph:
                graph = {**graph, "source_link": source.get("link")}
            found.append(box_result("knowledge_graph", graph, ("description",),
                                    ("website", "source_link")))  # fmt: skip
        return [entry for entry in found if entry is not None] + organic

    def refusal(self, status: int, message: str) -> Refusal | None:
        if status in (401, 403):
            return Refusal.BAD_KEY
        if status == 429:
            return Refusal.QUOTA if QUOTA_WORDS in message.lower() else Refusal.RATE
        return None

    def message(self, body: Any) -> str | None:
        error = body.get("error") if isinstance(body, dict) else None
        return error if isinstance(error, str) else None

    def account_request(self, url: httpx.URL, key: str) -> WebRequest | None:
        path = url.path.rsplit("/", 1)[0] + "/account.json"
        return WebRequest("GET", url.copy_with(path=path, query=None, params={"api_key": key}), {})

    def searches_left(self, body: Any) -> int | None:
        left = body.get("total_searches_left") if isinstance(body, dict) else None
        return left if isinstance(left, int) and not isinstance(left, bool) else None


WEB_APIS.register("serpapi")(SerpApi())
