"""hdr's server as veRL's search tool meets it, without veRL installed (its transformers pin
conflicts with hdr's).

`VerlSearchClient` behaves as the client of veRL's `SearchTool` does
(`verl/tools/utils/search_r1_like_utils.py`, identical in substance in the releases 0.4.0 to
0.7.1 that ship it; 0.8.0 and later no longer do), written here from reading that source:

- one POST per tool call to `retrieval_service_url` (the full `/retrieve` URL) with the JSON
  body `{"queries": [...], "topk": k, "return_scores": true}` as `json.dumps` writes it (ASCII,
  ", " and ": " separators), `Content-Type` and `Accept` application/json, a 30 s timeout;
- up to 10 attempts: HTTP 500/502/503/504, connection errors and timeouts are retried after
  1, 2, 3, ... s (attempt number; Retry-After is ignored); any other HTTP error, or a body that
  is not JSON, ends the call at once;
- each query's hits become `Doc n (Title: <first line of contents>)\\n<the other lines>`, joined
  by blank lines; queries are joined by `\\n---\\n`; the tool answers `{"result": <text>}`.

The delay is injectable so that the tests do not sleep 1 + 2 + 3 s; the injected sleeps record
what veRL would wait.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from servers import bind_loopback, running_server

from retrieval_server.serving.retrievers import RETRIEVERS, BM25Retriever

ATTEMPTS = 10  # veRL's MAX_RETRIES
RETRIED_STATUSES = (500, 502, 503, 504)
HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
TITLES = ["Batman", "Haiku", "Flamenco", "Great Wall of China"]


@dataclass
class VerlSearchClient:
    """veRL's search-tool client (see the module docstring); `outcomes` records each attempt's
    status code or "connection error" / "timeout", `delays` the waits it asked for."""

    url: str
    topk: int = 3
    timeout_s: float = 30.0
    sleep: Callable[[float], None] = time.sleep
    outcomes: list[int | str] = field(default_factory=list)
    delays: list[float] = field(default_factory=list)

    def call(self, queries: list[str]) -> tuple[dict | None, str | None]:
        """(the parsed answer, None) or (None, the last error) after the attempts ran out."""
        body = json.dumps({"queries": queries, "topk": self.topk, "return_scores": True})
        error = None
        for attempt in range(1, ATTEMPTS + 1):
            try:
                response = httpx.post(
                    self.url, content=body.encode(), headers=HEADERS, timeout=self.timeout_s
                )
            except (httpx.NetworkError, httpx.RemoteProtocolError) as err:
                self.outcomes.append("connection error")
                error = f"Connection Error: {err}"
            except httpx.TimeoutException as err:
                self.outcomes.append("timeout")
                error = f"Timeout Error: {err}"
            else:
                self.outcomes.append(response.status_code)
                if response.status_code in RETRIED_STATUSES:
                    error = f"Server Error ({response.status_code}) on attempt {attempt}"
                elif response.status_code >= 400:
                    return None, f"API Request Error: {response.status_code}"
                else:
                    try:
                        return response.json(), None
                    except ValueError as err:
                        return None, f"API Response JSON Decode Error: {err}"
            if attempt < ATTEMPTS:
                self.delays.append(float(attempt))
                self.sleep(float(attempt))
        return None, error

    def tool_text(self, queries: list[str]) -> str:
        """What the tool hands the model: `{"result": ...}` as JSON."""
        answer, error = self.call(queries)
        if error is not None:
            return json.dumps({"result": f"Search error: {error}"}, ensure_ascii=False)
        per_query = answer.get("result", []) if answer else []
        if not per_query:
            return json.dumps({"result": "No search results found."}, ensure_ascii=False)
        text = "\n---\n".join(passages_text(hits) for hits in per_query)
        return json.dumps({"result": text}, ensure_ascii=False)


def passages_text(hits: list[dict]) -> str:
    """One query's hits as veRL's tool writes them: title line, then the rest of `contents`."""
    parts = []
    for rank, hit in enumerate(hits, start=1):
        title, _, rest = hit["document"]["contents"].partition("\n")
        parts.append(f"Doc {rank} (Title: {title})\n{rest}\n\n")
    return "".join(parts).strip()


def metric(url: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} (\S+)$", httpx.get(f"{url}/metrics").text, re.M)
    return float(match.group(1)) if match else 0.0


def test_a_tool_call_answers_every_query_in_the_tools_format(retrieval_url: str) -> None:
    client = VerlSearchClient(f"{retrieval_url}/retrieve")
    result = json.loads(client.tool_text(TITLES))["result"]
    assert client.outcomes == [200]
    per_query = result.split("\n---\n")
    assert len(per_query) == len(TITLES)
    for title, text in zip(TITLES, per_query, strict=True):
        assert text.startswith(f'Doc 1 (Title: "{title}")\n')  # wiki-18's quoted titles
        assert re.findall(r"^Doc (\d) \(Title: ", text, re.M) == ["1", "2", "3"]


def test_the_tools_request_is_valid_under_the_strict_profile(small_index: Path) -> None:
    """The strict profile refuses unknown fields and non-JSON bodies: veRL's body passes it,
    and the answer reads the same as under the default profile."""
    with running_server(small_index, profile="strict") as strict:
        client = VerlSearchClient(f"{strict.url}/retrieve")
        answer, error = client.call(["Haiku ünïcode"])  # json.dumps escapes it to ASCII
        assert error is None and client.outcomes == [200]
        assert passages_text(answer["result"][0]).startswith('Doc 1 (Title: "Haiku")\n')


def test_a_topk_over_the_servers_max_fails_at_once_without_retries(retrieval_url: str) -> None:
    client = VerlSearchClient(f"{retrieval_url}/retrieve", topk=101)  # max_topk is 100
    answer, error = client.call(["Haiku"])
    assert answer is None and error == "API Request Error: 422"
    assert client.outcomes == [422] and client.delays == []


class SlowRetriever(BM25Retriever):
    """BM25 that takes 0.1 s a search, so concurrent tool calls overflow a small queue."""

    def search(self, queries: list[str], topk: int):
        time.sleep(0.1)
        return super().search(queries, topk)


def test_tool_calls_refused_by_the_bounded_queue_recover_by_their_retries(
    small_index: Path,
) -> None:
    """Six tool calls of four queries at once against a queue of four queries: all but one are
    answered 503 at first; veRL's linear retries (1, 2, ... s, Retry-After 7 ignored) bring
    every call its own passages."""
    RETRIEVERS.register("slow")(SlowRetriever)
    config = {"default_retriever": "slow", "max_queued_queries": 4, "retry_after_s": 7}
    try:
        with running_server(small_index, **config) as server:
            clients = [
                VerlSearchClient(f"{server.url}/retrieve", sleep=lambda s: time.sleep(s / 10))
                for _ in range(6)
            ]
            queries = [[f"{title} {i}" for title in TITLES] for i in range(len(clients))]
            start = threading.Barrier(len(clients))
            answers: list[tuple[dict | None, str | None]] = [(None, None)] * len(clients)

            def call(i: int) -> None:
                start.wait()
                answers[i] = clients[i].call(queries[i])

            threads = [threading.Thread(target=call, args=(i,)) for i in range(len(clients))]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(timeout=120)
            refused = sum(client.outcomes.count(503) for client in clients)
            assert refused >= len(clients) - 1
            assert metric(server.url, 'hdr_retrieval_rejected_total{reason="queue_full"}') == (
                refused
            )
    finally:
        RETRIEVERS.unregister("slow")
    for client, (answer, error) in zip(clients, answers, strict=True):
        assert error is None, client.outcomes
        assert client.outcomes[-1] == 200
        assert set(client.outcomes[:-1]) <= {503}
        assert client.delays == [float(n) for n in range(1, len(client.outcomes))]
        for hits in answer["result"]:
            assert passages_text(hits).startswith("Doc 1 (Title: ")
    titles = [passages_text(hits).split("\n")[0] for hits in answers[0][0]["result"]]
    assert titles == [f'Doc 1 (Title: "{title}")' for title in TITLES]


def test_a_tool_call_retries_through_a_server_that_is_still_starting(small_index: Path) -> None:
    """Connection refused twice, then the server is up (started during the second wait)."""
    probe = bind_loopback()
    port = probe.getsockname()[1]
    probe.close()
    with ExitStack() as stack:

        def wait_then_start(seconds: float) -> None:
            if seconds == 2:
                stack.enter_context(running_server(small_index, port=port))

        client = VerlSearchClient(f"http://127.0.0.1:{port}/retrieve", sleep=wait_then_start)
        answer, error = client.call(["Flamenco"])
    assert error is None
    assert client.outcomes == ["connection error", "connection error", 200]
    assert client.delays == [1.0, 2.0]
    assert passages_text(answer["result"][0]).startswith('Doc 1 (Title: "Flamenco")\n')
