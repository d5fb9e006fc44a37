"""POST /retrieve against a real server: relevance, response schema, limits, bad input.

Every request goes through `post`, which fails the test on any 5xx.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from retrieval_server.api import PlainResponse, ScoredResponse
from retrieval_server.index.corpus import split_contents

# query -> title of the article that must come first (wiki-18 sample and vital articles)
KNOWN_ARTICLES = {
    "Evan Morris lobbyist for Genentech": "Evan Morris",
    "Horatio Hale ethnologist and philologist": "Horatio Hale",
    "Great Wall of China fortifications": "Great Wall of China",
    "Crime and Punishment, the novel by Dostoevsky": "Crime and Punishment",
    "Brandenburg Concertos by Bach": "Brandenburg Concertos",
    "Acropolis of Athens": "Acropolis of Athens",
    "Japanese haiku poetry": "Haiku",
}


def post(url: str, body: object = None, content: str | None = None, **kwargs) -> httpx.Response:
    """POST to /retrieve; a 5xx fails the test whatever the test expects."""
    if content is not None:
        kwargs.setdefault("headers", {"content-type": "application/json"})
        response = httpx.post(f"{url}/retrieve", content=content, timeout=60, **kwargs)
    else:
        response = httpx.post(f"{url}/retrieve", json=body, timeout=60, **kwargs)
    assert response.status_code < 500, response.text
    return response


def titles(documents: list[dict]) -> list[str]:
    return [split_contents(document["contents"])[0] for document in documents]


@pytest.mark.parametrize("retriever", ["dense", "bm25"])
def test_query_naming_an_article_returns_it_first(retrieval_url: str, retriever: str) -> None:
    queries = list(KNOWN_ARTICLES)
    response = post(retrieval_url, {"queries": queries, "topk": 3, "retriever": retriever})
    assert response.status_code == 200
    result = response.json()["result"]
    assert [titles(documents)[0] for documents in result] == list(KNOWN_ARTICLES.values())


def test_dense_is_the_server_default(retrieval_url: str) -> None:
    body = {"queries": ["box-shaped bellows-driven free reed instrument"], "return_scores": True}
    default = post(retrieval_url, body).json()
    dense = post(retrieval_url, {**body, "retriever": "dense"}).json()
    bm25 = post(retrieval_url, {**body, "retriever": "bm25"}).json()
    assert default == dense != bm25
    assert titles([hit["document"] for hit in default["result"][0]])[0] == "Accordion"


def test_scored_response_schema(retrieval_url: str) -> None:
    queries = ["Acropolis of Athens", "Batman"]
    response = post(retrieval_url, {"queries": queries, "topk": 5, "return_scores": True})
    assert response.status_code == 200
    body = response.json()
    parsed = ScoredResponse.model_validate(body)
    assert len(parsed.result) == 2
    for hits in body["result"]:
        assert len(hits) == 5
        assert set(hits[0]) == {"document", "score"}
        assert set(hits[0]["document"]) == {"id", "contents"}
        scores = [hit["score"] for hit in hits]
        assert scores == sorted(scores, reverse=True)
        assert all(-1.0 <= score <= 1.0 + 1e-6 for score in scores)  # cosine of unit vectors
        assert all(hit["document"]["contents"].startswith('"') for hit in hits)


def test_plain_response_schema_and_default_topk(retrieval_url: str) -> None:
    response = post(retrieval_url, {"queries": ["Batman"], "topk": None, "return_scores": False})
    assert response.status_code == 200
    body = response.json()
    PlainResponse.model_validate(body)
    assert len(body["result"][0]) == 3  # ServerConfig.default_topk
    assert set(body["result"][0][0]) == {"id", "contents"}
    assert titles(body["result"][0])[0] == "Batman"


def test_plain_and_scored_modes_return_the_same_documents(retrieval_url: str) -> None:
    body = {"queries": ["Gothic architecture", "Flamenco"], "topk": 4}
    plain = post(retrieval_url, {**body, "return_scores": False}).json()["result"]
    scored = post(retrieval_url, {**body, "return_scores": True}).json()["result"]
    assert plain == [[hit["document"] for hit in hits] for hits in scored]


def test_search_r1_client_code_works_unchanged(retrieval_url: str) -> None:
    """What Search-R1's `_batch_search` + `_passages2string` do with the response."""
    payload = {"queries": ["Euclid's Elements"], "topk": 3, "return_scores": True}
    result = httpx.post(f"{retrieval_url}/retrieve", json=payload, timeout=60).json()["result"]
    contents = result[0][0]["document"]["contents"]
    title, text = contents.split("\n")[0], "\n".join(contents.split("\n")[1:])
    assert title == '"Euclid\'s Elements"' and text


def test_bm25_query_of_stopwords_or_unknown_words_gets_no_passages(retrieval_url: str) -> None:
    queries = ["the of and is", "", "zzqxv plorbtastic", "Batman"]
    response = post(retrieval_url, {"queries": queries, "retriever": "bm25"})
    assert response.status_code == 200
    result = response.json()["result"]
    assert result[:3] == [[], [], []]
    assert titles(result[3])[0] == "Batman"


def test_dense_answers_an_empty_query(retrieval_url: str) -> None:
    response = post(retrieval_url, {"queries": [""], "topk": 2})
    assert response.status_code == 200
    assert len(response.json()["result"][0]) == 2


@pytest.fixture(scope="module")
def limited_url(small_index: Path) -> Iterator[str]:
    """A strict-profile server with small, non-default limits, to show the limits come from
    ServerConfig. (The default search-r1 profile accepts more: tests/retrieval_server/
    test_search_r1_contract.py.)"""
    from servers import running_server

    with running_server(
        small_index, profile="strict", max_queries=4, max_topk=5, max_query_chars=40
    ) as server:
        yield server.url


OK_QUERY = "Great Wall of China"
BAD_REQUESTS = {
    "malformed JSON": (400, '{"queries": ["a"', "malformed JSON"),
    "not an object": (422, "[]", "valid dictionary"),
    "queries missing": (422, '{"topk": 3}', "queries: Field required"),
    "queries not a list": (422, '{"queries": "Batman"}', "queries: Input should be a valid list"),
    "empty queries": (422, '{"queries": []}', "queries: List should have at least 1 item"),
    "non-string query": (422, '{"queries": ["a", 7]}', "queries.1: Input should be a valid string"),
    "null query": (422, '{"queries": [null]}', "queries.0: Input should be a valid string"),
    "too many queries": (422, '{"queries": ["a","b","c","d","e"]}', "at most 4 items"),
    "topk zero": (422, '{"queries": ["a"], "topk": 0}', "topk: Input should be greater than"),
    "topk negative": (422, '{"queries": ["a"], "topk": -3}', "topk: Input should be greater"),
    "topk above max": (422, '{"queries": ["a"], "topk": 6}', "topk: Input should be less than"),
    "topk not a number": (422, '{"queries": ["a"], "topk": "x"}', "topk: Input should be"),
    "query too long": (422, '{"queries": ["' + "x" * 41 + '"]}', "at most 40 characters"),
    "unknown field": (422, '{"queries": ["a"], "k": 3}', "k: Extra inputs are not permitted"),
    "unknown retriever": (400, '{"queries": ["a"], "retriever": "splade"}', "unknown retriever"),
    "return_scores not bool": (422, '{"queries": ["a"], "return_scores": "maybe"}', "bool"),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_every_limit_and_bad_input_is_a_4xx_with_a_message(limited_url: str, case: str) -> None:
    status, body, message = BAD_REQUESTS[case]
    response = post(limited_url, content=body)
    assert response.status_code == status, response.text
    detail = response.json()["detail"]
    assert isinstance(detail, str) and message in detail


def test_requests_at_the_limits_are_served(limited_url: str) -> None:
    queries = [OK_QUERY, "x" * 40, "Batman", "Haiku"]
    response = post(limited_url, {"queries": queries, "topk": 5})
    assert response.status_code == 200
    assert [len(hits) for hits in response.json()["result"]] == [5, 5, 5, 5]


def test_wrong_method_path_and_content_type_are_4xx(limited_url: str) -> None:
    assert httpx.get(f"{limited_url}/retrieve").status_code == 405
    assert httpx.post(f"{limited_url}/search", json={"queries": ["a"]}).status_code == 404
    form = httpx.post(f"{limited_url}/retrieve", data={"queries": "a"})
    assert form.status_code == 422 and form.json()["detail"]


def test_metrics_count_requests_errors_and_batches_without_any_5xx(limited_url: str) -> None:
    post(limited_url, {"queries": [OK_QUERY, "Batman"]})
    post(limited_url, content='{"queries": []}')
    text = httpx.get(f"{limited_url}/metrics").text
    assert 'hdr_retrieval_requests_total{endpoint="/retrieve",status="200"}' in text
    assert 'hdr_retrieval_errors_total{endpoint="/retrieve",status="422"}' in text
    assert 'hdr_retrieval_batch_queries_count{retriever="dense"}' in text
    assert 'hdr_retrieval_request_seconds_bucket{endpoint="/retrieve"' in text
    assert 'status="5' not in text
