"""What a live web search API is to hdr: how one query becomes one HTTP request, how its
answer becomes Search-R1 documents, and which of its error statuses mean a bad key, a spent
quota or a rate limit. One module per API (`serper`, `serpapi`) registers a `WebApi` in
`WEB_APIS`; `retrieval_server.web.backend` sends the requests through the proxy's machinery.

Documents are formatted as Search-R1's online search server formats them: `contents` is the
title in double quotes, a newline, then the snippet. The answer box and the knowledge graph,
where the API gives them, come first (as Search-R1 puts the answer box first), then the organic
results in the API's order, `topk` documents in all (Search-R1's server adds the boxes beyond
topk; a client asking for topk passages gets topk here). Each document's `id` is its link (a
box without one is named by its kind) and `source` says where on the results page it came
from; with `return_scores` a document's score is 1 / its rank, since the APIs give none.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import httpx
import orjson

from core.registry import Registry

if TYPE_CHECKING:
    from retrieval_server.web.config import WebSearchConfig

MAX_SNIPPET_CHARS = 4000  # an answer box may carry a whole table; an observation needs less


@dataclass(frozen=True)
class WebRequest:
    """One HTTP request to the API (its key inside: never logged or shown)."""

    method: str
    url: httpx.URL
    headers: dict[str, str]
    body: bytes | None = None


@dataclass(frozen=True)
class WebResult:
    """One entry of a results page: where it came from, its title, snippet and link."""

    source: str  # answer_box, knowledge_graph or organic
    title: str
    snippet: str
    link: str | None


class Refusal(enum.Enum):
    """What an API's error status means for hdr."""

    BAD_KEY = "bad key"  # 502 now, one line at start where the key can be checked for free
    QUOTA = "quota"  # the account's searches are spent: refused like the budget (429)
    RATE = "rate"  # too many requests now: retried, after Retry-After where it is given


class WebApi(Protocol):
    """An API's side of `retrieval_server.web.backend.WebBackend`."""

    name: str

    def request(
        self, url: httpx.URL, query: str, topk: int, key: str, settings: WebSearchConfig
    ) -> WebRequest:
        """The request that searches `query` for (at least) `topk` results."""
        ...

    def results(self, body: Any) -> list[WebResult] | None:
        """The entries of a 200 body, in the order they are served; None when the body is not
        a results page (answered 502, never cached)."""
        ...

    def refusal(self, status: int, message: str) -> Refusal | None:
        """What an error status (with its message) means; None: an ordinary failure."""
        ...

    def message(self, body: Any) -> str | None:
        """The human-readable message of an error body, where the API gives one."""
        ...

    def account_request(self, url: httpx.URL, key: str) -> WebRequest | None:
        """A request that checks the key without spending a search; None where the API has
        none (the key is then first checked by the first search)."""
        ...

    def searches_left(self, body: Any) -> int | None:
        """From the account request's 200 body: searches the account has left, if it says."""
        ...


WEB_APIS: Registry[WebApi] = Registry("web search API")


def text(value: Any) -> str:
    """A field of a results page as one line of text ('' when absent; lists joined)."""
    if isinstance(value, list):
        value = " ".join(text(item) for item in value)
    elif not isinstance(value, str):
        value = "" if value is None or isinstance(value, dict) else str(value)
    return " ".join(value.split())[:MAX_SNIPPET_CHARS]


def link_of(value: Any) -> str | None:
    return value if isinstance(value, str) and value else None


def documents(results: list[WebResult], topk: int) -> list[dict[str, Any]]:
    """The first `topk` entries as Search-R1 documents (`"Title"\\nsnippet`), boxes first."""
    boxes = [r for r in results if r.source != "organic"]
    organic = [r for r in results if r.source == "organic"]
    shown = (boxes + organic)[:topk]
    return [
        {
            "id": result.link or result.source,
            "contents": f'"{result.title}"\n{result.snippet}',
            "source": result.source,
        }
        for result in shown
    ]


def render_answer(results: list[WebResult], topk: int, return_scores: bool) -> bytes:
    """One query's answer, encoded as the response carries it."""
    docs = documents(results, topk)
    if return_scores:
        return orjson.dumps(
            [{"document": doc, "score": 1.0 / rank} for rank, doc in enumerate(docs, start=1)]
        )
    return orjson.dumps(docs)


def first_object(value: Any) -> dict[str, Any] | None:
    """A box the API gives as an object, or as a list of them (the first)."""
    if isinstance(value, list):
        value = next((item for item in value if isinstance(item, dict)), None)
    return value if isinstance(value, dict) and value else None


def box_result(source: str, box: dict[str, Any], text_fields: tuple[str, ...],
               link_fields: tuple[str, ...]) -> WebResult | None:  # fmt: skip
    """An answer box or knowledge graph as one entry: its title and the first of its text
    fields that holds text; None when it holds none."""
    snippet = next((t for field in text_fields if (t := text(box.get(field)))), "")
    if not snippet:
        return None
    title = text(box.get("title")) or source.replace("_", " ").capitalize()
    link = next((link for field in link_fields if (link := link_of(box.get(field)))), None)
    return WebResult(source, title, snippet, link)


def organic_results(entries: Any) -> list[WebResult] | None:
    """The organic results (a list of objects with title, link, snippet); None when the field
    is not a list."""
    if entries is None:
        return []
    if not isinstance(entries, list):
        return None
    found = []
    for entry in entries:
        if not isinstance(entry, dict):
            return None
        title, snippet = text(entry.get("title")), text(entry.get("snippet"))
        if title or snippet:
            found.append(WebResult("organic", title, snippet, link_of(entry.get("link"))))
    return found
