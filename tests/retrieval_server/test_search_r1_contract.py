"""Search-R1-shaped traffic against the default (search-r1) profile, as its published trainer
sends it: one request per turn with every active trajectory's query, `topk` 3, scores on, the
answer read as `result[i][j]["document"]["contents"]`; an empty `queries` on turns where no
trajectory searches; thousands of queries per request; model-written queries of any length.

Every request goes through `post`, which fails the test on any 5xx.
"""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import pytest

from retrieval_server.index.corpus import split_contents

TITLES = ["Batman", "Haiku", "Flamenco", "Great Wall of China", "Guitar", "Candide", "Dada"]


def post(url: str, body: object, timeout: float = 120) -> httpx.Response:
    response = httpx.post(f"{url}/retrieve", json=body, timeout=timeout)
    assert response.status_code < 500, response.text
    return response


def passages_to_string(result_of_one_query: list[dict]) -> str:
    """What Search-R1's rollout does with one query's scored result (`_passages2string`)."""
    text = ""
    for rank, item in enumerate(result_of_one_query):
        contents = item["document"]["contents"]
        title = contents.split("\n")[0]
        body = "\n".join(contents.split("\n")[1:])
        text += f"Doc {rank + 1}(Title: {title}) {body}\n"
    return text


def metric(url: str, name: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    match = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


@pytest.mark.parametrize("return_scores", [True, False])
def test_empty_queries_answer_an_empty_result(retrieval_url: str, return_scores: bool) -> None:
    response = post(retrieval_url, {"queries": [], "topk": 3, "return_scores": return_scores})
    assert response.status_code == 200
    assert response.json() == {"result": []}


def test_a_search_r1_turn_reads_contents_from_every_result(retrieval_url: str) -> None:
    body = {"queries": TITLES, "topk": 3, "return_scores": True}
    result = post(retrieval_url, body).json()["result"]
    assert len(result) == len(TITLES)
    for title, hits in zip(TITLES, result, strict=True):
        assert len(hits) == 3
        assert passages_to_string(hits).startswith(f'Doc 1(Title: "{title}") ')
        assert all(isinstance(hit["score"], float) for hit in hits)


def test_both_score_modes_return_the_same_documents(retrieval_url: str) -> None:
    body = {"queries": TITLES[:3], "topk": 2}
    scored = post(retrieval_url, {**body, "return_scores": True}).json()["result"]
    plain = post(retrieval_url, {**body, "return_scores": False}).json()["result"]
    assert plain == [[hit["document"] for hit in hits] for hits in scored]
    assert all(set(doc) == {"id", "contents"} for hits in plain for doc in hits)


@pytest.mark.parametrize("topk", [0, None])
def test_topk_zero_or_null_means_the_server_default(retrieval_url: str, topk) -> None:
    response = post(retrieval_url, {"queries": ["Batman"], "topk": topk, "return_scores": True})
    assert response.status_code == 200
    assert len(response.json()["result"][0]) == 3  # ServerConfig.default_topk


def test_unknown_fields_are_ignored(retrieval_url: str) -> None:
    body = {"queries": ["Haiku"], "topk": 1, "return_scores": True, "session_id": 7, "x": [None]}
    response = post(retrieval_url, body)
    assert response.status_code == 200
    assert split_contents(response.json()["result"][0][0]["document"]["contents"])[0] == "Haiku"


def test_a_10000_character_query_is_truncated_and_counted(retrieval_url: str) -> None:
    long_query = ("Great Wall of China fortifications " * 400)[:10_000]
    before = metric(retrieval_url, "hdr_retrieval_truncated_queries_total")
    body = {"queries": [long_query, "Batman", long_query], "topk": 3, "return_scores": True}
    response = post(retrieval_url, body)
    assert response.status_code == 200
    result = response.json()["result"]
    cut = post(retrieval_url, {**body, "queries": [long_query[:2048]]}).json()["result"][0]
    assert result[0] == result[2] == cut  # searched as its first max_query_chars characters
    assert split_contents(result[0][0]["document"]["contents"])[0] == "Great Wall of China"
    assert metric(retrieval_url, "hdr_retrieval_truncated_queries_total") - before == 2


def test_lone_surrogates_in_a_query_are_searched(retrieval_url: str) -> None:
    content = '{"queries": ["Batman \\udf55", "\\ud800"], "topk": 1}'
    headers = {"content-type": "application/json"}
    response = httpx.post(f"{retrieval_url}/retrieve", content=content, headers=headers)
    assert response.status_code == 200
    assert len(response.json()["result"]) == 2


def test_2560_queries_in_one_request_do_not_block_a_small_one(small_index: Path) -> None:
    """A Search-R1 GRPO step (512 prompts x 5) in one request, searched in slices of 256 that
    take turns with other requests: a small request sent meanwhile is answered first."""
    from servers import running_server

    queries = [f"{TITLES[i % len(TITLES)]} {i}" for i in range(2560)]
    order: list[str] = []

    async def send(client: httpx.AsyncClient, name: str, body: dict, delay: float) -> dict:
        await asyncio.sleep(delay)
        response = await client.post("/retrieve", json=body)
        assert response.status_code == 200, response.text
        order.append(name)
        return response.json()

    async def both(url: str) -> tuple[dict, dict]:
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            big = {"queries": queries, "topk": 3, "return_scores": True}
            small = {"queries": ["Haiku"], "topk": 1}
            return await asyncio.gather(
                send(client, "big", big, 0.0), send(client, "small", small, 0.3)
            )

    with running_server(small_index, max_batch_queries=256) as server:
        big, small = asyncio.run(both(server.url))
        searches = httpx.get(f"{server.url}/metrics").text
    assert len(big["result"]) == 2560 and all(len(hits) == 3 for hits in big["result"])
    firsts = [split_contents(hits[0]["document"]["contents"])[0] for hits in big["result"][:7]]
    assert firsts == TITLES
    assert split_contents(small["result"][0][0]["contents"])[0] == "Haiku"
    assert order == ["small", "big"]
    count = re.search(r'hdr_retrieval_batch_queries_count\{retriever="dense"\} (\S+)', searches)
    assert float(count.group(1)) >= 10  # 2,560 / 256 slices, plus the small request


@pytest.mark.slow
def test_16384_queries_in_one_request_are_accepted(retrieval_url: str) -> None:
    """The default profile's per-request limit (BM25 to keep it short; about 20 s loaded)."""
    queries = [f"{TITLES[i % len(TITLES)]} {i}" for i in range(16384)]
    body = {"queries": queries, "topk": 1, "retriever": "bm25"}
    response = post(retrieval_url, body, timeout=600)
    assert response.status_code == 200
    result = response.json()["result"]
    assert len(result) == 16384
    assert split_contents(result[16383][0]["contents"])[0] == TITLES[16383 % len(TITLES)]
    too_many = post(retrieval_url, {**body, "queries": [*queries, "one more"]})
    assert too_many.status_code == 422
    assert too_many.json()["detail"].startswith("queries: List should have at most 16384 items")
