"""Stand-ins for the paid web search APIs, for tests and bench/web_search.py: a real uvicorn
server on 127.0.0.1 that answers as Serper (`POST /search`, key in `X-API-KEY`) or SerpApi
(`GET /search.json?...&api_key=`, `GET /account.json`) answer in their public documentation:
the same fields, the same error statuses and bodies. It counts what it receives, and misbehaves
when told: a key it refuses, a spent quota, rate limits with Retry-After, a body it chooses, a
latency. Its answers name their `generation`, so a test can make "the web" change.

    with fake_web_search("serper", key="k-123") as api:
        ... hdr serve --web serper --upstream {api.url} with SERPER_API_KEY=k-123 ...
        assert api.searches == 3

Import it as `from fake_web_search import fake_web_search` (pytest puts this folder on
sys.path).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

START_TIMEOUT_S = 30.0


@dataclass
class FakeWebSearch:
    """What the fake has received, and how it behaves (change it while it runs)."""

    api: str  # serper or serpapi
    key: str = "fake-key-0123456789"
    url: str = ""  # the search endpoint
    generation: int = 1  # named in every snippet: bump it and "the web" has changed
    latency_s: float = 0.0  # before each search answer
    searches_left: int | None = None  # the account's quota (None: unlimited)
    rate_limited: int = 0  # answer this many searches 429 first
    retry_after: str | None = None  # the Retry-After of those 429s
    status: int | None = None  # answer every search with this status and `body`
    body: Any = None
    searches: int = 0  # search requests received (any outcome)
    answered: int = 0  # searches answered 200 (what a real API bills)
    queries: list[str] = field(default_factory=list)  # as received, in order
    keys: list[str | None] = field(default_factory=list)  # the key each search carried
    lock: threading.Lock = field(default_factory=threading.Lock)

    def results(self, query: str, num: int) -> dict[str, Any]:
        """A results page for `query` in the API's own shape: an answer box and a knowledge
        graph for queries that start with "who", then `num` organic results."""
        organic = [
            {
                "position": rank,
                "title": f"{query} - page {rank}",
                "link": f"https://example.org/{query.replace(' ', '_')}/{rank}",
                "snippet": f"About {query}, result {rank} (generation {self.generation}).",
            }
            for rank in range(1, num + 1)
        ]
        boxed = query.lower().startswith("who")
        if self.api == "serper":
            page: dict[str, Any] = {"searchParameters": {"q": query, "num": num}}
            if boxed:
                page["answerBox"] = {"title": f"{query}?", "answer": f"The answer to {query}",
                                     "link": "https://example.org/answer"}  # fmt: skip
                page["knowledgeGraph"] = {"title": query.title(), "type": "Person",
                                          "description": f"{query}: a person.",
                                          "descriptionLink": "https://example.org/kg"}  # fmt: skip
            page["organic"] = organic
            return page
        page = {"search_metadata": {"status": "Success"},
                "search_parameters": {"engine": "google", "q": query}}  # fmt: skip
        if query == "nothing at all":
            page["error"] = "Google hasn't returned any results for this query."
            return page
        if boxed:
            page["answer_box"] = [{"type": "organic_result", "title": f"{query}?",
                                   "snippet": f"The answer to {query}",
                                   "link": "https://example.org/answer"}]  # fmt: skip
            page["knowledge_graph"] = {"title": query.title(), "description": f"{query}: a person.",
                                       "source": {"name": "Wikipedia",
                                                  "link": "https://example.org/kg"}}  # fmt: skip
        page["organic_results"] = organic
        return page

    def refused_key(self) -> JSONResponse:
        if self.api == "serper":
            return JSONResponse({"message": "Unauthorized.", "statusCode": 403}, 403)
        return JSONResponse(
            {"error": "Invalid API key. Your API key should be here: "
                      "https://serpapi.com/manage-api-key"}, 401)  # fmt: skip

    def spent_quota(self) -> JSONResponse:
        if self.api == "serper":
            return JSONResponse({"message": "Not enough credits", "statusCode": 400}, 400)
        return JSONResponse({"error": "Your account has run out of searches."}, 429)

    def too_many(self) -> JSONResponse:
        headers = {"Retry-After": self.retry_after} if self.retry_after is not None else None
        body = (
            {"message": "Too many requests", "statusCode": 429}
            if self.api == "serper"
            else {"error": "You have exceeded the hourly throughput limit."}
        )
        return JSONResponse(body, 429, headers=headers)

    def search(self, key: str | None, query: str, num: int) -> JSONResponse:
        """The answer to one search request, at once."""
        with self.lock:
            self.searches += 1
            self.queries.append(query)
            self.keys.append(key)
            if key != self.key:
                return self.refused_key()
            if self.status is not None:
                return JSONResponse(self.body, self.status)
            if self.rate_limited > 0:
                self.rate_limited -= 1
                return self.too_many()
            if self.searches_left is not None:
                if self.searches_left <= 0:
                    return self.spent_quota()
                self.searches_left -= 1
            self.answered += 1
        return JSONResponse(self.results(query, num))

    async def answer(self, key: str | None, query: str, num: int) -> JSONResponse:
        """`search`, an answered one after `latency_s` (awaited: calls in flight overlap)."""
        response = self.search(key, query, num)
        if response.status_code == 200 and self.latency_s:
            await asyncio.sleep(self.latency_s)
        return response

    def app(self) -> Starlette:
        async def serper_search(request: Request) -> JSONResponse:
            body = await request.json()
            key = request.headers.get("x-api-key")
            return await self.answer(key, body["q"], int(body.get("num", 10)))

        async def serpapi_search(request: Request) -> JSONResponse:
            params = request.query_params
            if params.get("engine") != "google" or "q" not in params:
                return JSONResponse({"error": "Missing query `q` parameter."}, 400)
            num = int(params.get("num", 10))
            return await self.answer(params.get("api_key"), params["q"], num)

        async def serpapi_account(request: Request) -> JSONResponse:
            if request.query_params.get("api_key") != self.key:
                return self.refused_key()
            left = 10**6 if self.searches_left is None else self.searches_left
            return JSONResponse({"plan_name": "Fake Plan", "total_searches_left": left})

        routes = (
            [Route("/search", serper_search, methods=["POST"])]
            if self.api == "serper"
            else [
                Route("/search.json", serpapi_search, methods=["GET"]),
                Route("/account.json", serpapi_account, methods=["GET"]),
            ]
        )
        return Starlette(routes=routes)


@contextmanager
def fake_web_search(api: str, **behaviour: Any) -> Iterator[FakeWebSearch]:
    """A `FakeWebSearch` of `api` (serper, serpapi) served by uvicorn on a free 127.0.0.1 port
    until the block ends."""
    import uvicorn
    from servers import bind_loopback

    fake = FakeWebSearch(api, **behaviour)
    sock = bind_loopback()
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(fake.app(), log_level="warning", lifespan="off"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"fake-{api}-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            raise RuntimeError(f"the fake {api} did not start")
        time.sleep(0.02)
    fake.url = f"http://127.0.0.1:{port}/search" + (".json" if api == "serpapi" else "")
    try:
        yield fake
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
