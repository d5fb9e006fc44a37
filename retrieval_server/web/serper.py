"""Serper (google.serper.dev): Google results as JSON.

From Serper's public documentation: `POST https://google.serper.dev/search` with the key in the
`X-API-KEY` header and a JSON body `{"q": query, "num": results, "gl": country, "hl":
language, "location": place}` (`num` is sent only past the default page of 10; topk is cut
here); the answer holds `organic` (title, link, snippet, position), and where Google shows them
`answerBox` (title, answer or snippet, link) and `knowledgeGraph` (title, description,
descriptionLink or website). Serper publishes no table of error statuses; its users report
401/403 with `{"message": ..., "statusCode": ...}` for a key it refuses, 429 for too many
requests, and 400 (or 402) naming credits for an account whose credits are spent, and that is
what is mapped here. Serper offers no free way to check a key, so a bad key shows at the first
search.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx
import orjson

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

PAGE_RESULTS = 10
RESULT_FIELDS = ("organic", "answerBox", "knowledgeGraph", "searchParameters")


class Serper:
    name = "serper"

    def request(
        self, url: httpx.URL, query: str, topk: int, key: str, settings: WebSearchConfig
    ) -> WebRequest:
        body: dict[str, Any] = {"q": query}
        if topk > PAGE_RESULTS:  # a page of 10 is the default (and the price of one search)
            body["num"] = topk
        for field, value in (("gl", settings.country), ("hl", settings.language),
                             ("location", settings.location)):  # fmt: skip
            if value is not None:
                body[field] = value
        headers = {"X-API-KEY": key, "content-type": "application/json"}
        return WebRequest("POST", url, headers, orjson.dumps(body))

    def results(self, body: Any) -> list[WebResult] | None:
        if not isinstance(body, dict) or not any(field in body for field in RESULT_FIELDS):
            return None
        organic = organic_results(body.get("organic"))
        if organic is None:
            return None
        found = []
        if (box := first_object(body.get("answerBox"))) is not None:
            found.append(box_result("answer_box", box, ("answer", "snippet"), ("link",)))
        if (graph := first_object(body.get("knowledgeGraph"))) is not None:
            found.append(box_result("knowledge_graph", graph, ("description",),
                                    ("descriptionLink", "website")))  # fmt: skip
        return [entry for entry in found if entry is not None] + organic

    def refusal(self, status: int, message: str) -> Refusal | None:
        if status in (401, 403):
            return Refusal.BAD_KEY
        if status == 429:
            return Refusal.RATE
        if status in (400, 402) and "credit" in message.lower():
            return Refusal.QUOTA
        return None

    def message(self, body: Any) -> str | None:
        message = body.get("message") if isinstance(body, dict) else None
        return message if isinstance(message, str) else None

    def account_request(self, url: httpx.URL, key: str) -> WebRequest | None:
        return None

    def searches_left(self, body: Any) -> int | None:
        return None


WEB_APIS.register("serper")(Serper())
