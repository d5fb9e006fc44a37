"""Live web search as a backend of `hdr serve` (`--web serper|serpapi`), against fake APIs on
127.0.0.1 (real uvicorn) that answer in each API's documented shapes and errors: results mapped
to Search-R1 documents (boxes first), each distinct query one billed call behind the cache,
a refused key one line (at start where it can be checked, a 502 later), a spent quota refused
like the budget, a 429's Retry-After honoured, and the key never shown."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from fake_web_search import fake_web_search
from redis_servers import redis_server
from servers import free_port, running_server, serve_process

from retrieval_server.web.base import WEB_APIS, documents

KEY_ENV = {"serper": "SERPER_API_KEY", "serpapi": "SERPAPI_API_KEY"}


def post(url: str, queries: list[str], **extra: object) -> httpx.Response:
    body = {"queries": queries, "topk": 3, "return_scores": True, **extra}
    return httpx.post(f"{url}/retrieve", json=body, timeout=60)


def web(fake, **settings: object) -> dict:
    """The upstream section of a server in front of `fake`."""
    return {"url": fake.url, "web": {"api": fake.api}, "max_retries": 1, "backoff_s": 0.0,
            **settings}  # fmt: skip


@pytest.mark.parametrize("api", ["serper", "serpapi"])
def test_a_results_page_becomes_search_r1_documents_boxes_first(api: str) -> None:
    with fake_web_search(api) as fake:
        page = fake.results("who wrote hamlet", 3)
    results = WEB_APIS.get(api).results(page)
    docs = documents(results, topk=3)
    assert [doc["source"] for doc in docs] == ["answer_box", "knowledge_graph", "organic"]
    assert docs[0]["contents"] == '"who wrote hamlet?"\nThe answer to who wrote hamlet'
    assert docs[1] == {"id": "https://example.org/kg", "source": "knowledge_graph",
                       "contents": '"Who Wrote Hamlet"\nwho wrote hamlet: a person.'}  # fmt: skip
    assert docs[2]["id"] == "https://example.org/who_wrote_hamlet/1"
    assert docs[2]["contents"] == (
        '"who wrote hamlet - page 1"\nAbout who wrote hamlet, result 1 (generation 1).'
    )
    plain = documents(WEB_APIS.get(api).results(fake.results("paris", 5)), topk=5)
    assert [doc["source"] for doc in plain] == ["organic"] * 5


def test_results_pages_that_are_not_are_told_apart() -> None:
    serper, serpapi = WEB_APIS.get("serper"), WEB_APIS.get("serpapi")
    assert serper.results({"message": "Unauthorized.", "statusCode": 403}) is None
    assert serper.results({"searchParameters": {"q": "x"}}) == []  # no results: empty
    assert serper.results({"organic": "not a list"}) is None
    failed = {"search_metadata": {"status": "Error"}, "error": "Something went wrong."}
    empty = {"search_metadata": {"status": "Success"}, "error": "Google hasn't returned any"}
    assert serpapi.results(failed) is None and serpapi.results(empty) == []
    assert serpapi.results([1, 2]) is None


@pytest.mark.parametrize("api", ["serper", "serpapi"])
def test_each_distinct_query_is_one_billed_call_and_answers_expire(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_web_search(api) as fake:
        monkeypatch.setenv(KEY_ENV[api], fake.key)
        upstream = web(fake, price_per_call=0.005)
        with running_server(None, upstream=upstream) as proxy:
            first = post(proxy.url, ["who wrote hamlet", "paris", "paris"])
            second = post(proxy.url, ["paris", "rome"], return_scores=False)
            third = post(proxy.url, ["paris", "who wrote hamlet"])
            health = httpx.get(f"{proxy.url}/health").json()
    assert [r.status_code for r in (first, second, third)] == [200, 200, 200]
    billed = [int(r.headers["x-hdr-billed-queries"]) for r in (first, second, third)]
    assert billed == [2, 2, 0]  # paris with and without scores are two answers
    assert sorted(fake.queries) == ["paris", "paris", "rome", "who wrote hamlet"]
    assert fake.keys == [fake.key] * 4
    assert third.json()["result"][0] == first.json()["result"][1]
    assert [doc["source"] for doc in second.json()["result"][0]] == ["organic"] * 3
    assert health["upstream"]["calls"] == 4 and health["upstream"]["api"] == api
    assert health["upstream"]["spent"] == pytest.approx(4 * 0.005)
    assert health["cache"]["ttl_s"] == 86400.0  # on by default: the web changes


def test_serpapi_search_without_results_is_an_empty_answer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with fake_web_search("serpapi") as fake:
        monkeypatch.setenv("SERPAPI_API_KEY", fake.key)
        with running_server(None, upstream=web(fake)) as proxy:
            response = post(proxy.url, ["nothing at all"])
    assert response.status_code == 200 and response.json() == {"result": [[]]}


def test_a_refused_key_is_a_502_naming_its_variable_and_the_key_is_never_shown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    wrong = "wrong-key-9876543210"
    with fake_web_search("serper") as fake:
        monkeypatch.setenv("SERPER_API_KEY", wrong)
        with running_server(None, upstream=web(fake)) as proxy:
            refused = post(proxy.url, ["paris"])
            # an API that echoes the request in its error: the key is masked there too
            fake.key = wrong
            fake.status, fake.body = 500, {"message": f"internal error for key {wrong}"}
            echoed = post(proxy.url, ["rome"])
            health = httpx.get(f"{proxy.url}/health").text
            metrics = httpx.get(f"{proxy.url}/metrics").text
    detail = refused.json()["detail"]
    assert refused.status_code == 502 and "\n" not in detail
    assert "serper refused the API key in $SERPER_API_KEY" in detail
    assert "Unauthorized." in detail
    assert fake.searches == 1 + 2  # the refused key not retried; the 500 retried once
    assert echoed.status_code == 502 and "***" in echoed.json()["detail"]
    for shown in (detail, echoed.text, health, metrics):
        assert wrong not in shown


def test_a_missing_or_refused_key_stops_hdr_serve_at_start_in_one_line() -> None:
    with fake_web_search("serpapi") as fake:
        hdr = str(Path(sys.executable).with_name("hdr"))
        command = [hdr, "serve", "--web", "serpapi", "--upstream", fake.url,
                   "--port", str(free_port())]  # fmt: skip
        env_base = {
            name: value for name, value in os.environ.items() if name not in KEY_ENV.values()
        }
        missing = subprocess.run(command, capture_output=True, text=True, env=env_base)
        wrong = "wrong-key-9876543210"
        refused = subprocess.run(
            command, capture_output=True, text=True, env={**env_base, "SERPAPI_API_KEY": wrong}
        )
    assert missing.returncode == 2 and "$SERPAPI_API_KEY, which is not set" in missing.stderr
    assert refused.returncode == 2
    lines = [line for line in refused.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "serpapi refused the API key in $SERPAPI_API_KEY" in lines[0]
    assert "Traceback" not in refused.stderr and wrong not in refused.stderr + refused.stdout
    assert fake.searches == 0  # checked on the free account page, no search spent


@pytest.mark.parametrize("api", ["serper", "serpapi"])
def test_a_spent_quota_is_refused_like_the_budget_and_cached_queries_are_served(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_web_search(api, searches_left=1) as fake:
        monkeypatch.setenv(KEY_ENV[api], fake.key)
        with running_server(None, upstream=web(fake, max_retries=2)) as proxy:
            paid = post(proxy.url, ["paris"])
            refused = post(proxy.url, ["rome"])
            cached = post(proxy.url, ["paris"])
            upstream = httpx.get(f"{proxy.url}/health").json()["upstream"]
    assert paid.status_code == 200 and cached.status_code == 200
    detail = refused.json()["detail"]
    assert refused.status_code == 429 and "\n" not in detail
    assert f"{api} quota spent" in detail and "cached queries are still answered" in detail
    assert fake.searches == 2  # the quota's refusal is not retried
    assert upstream["calls"] == 1 and upstream["refused_over_budget"] == 1


@pytest.mark.parametrize("api", ["serper", "serpapi"])
def test_a_rate_limit_is_retried_after_its_retry_after(
    api: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_web_search(api, rate_limited=1, retry_after="1") as fake:
        monkeypatch.setenv(KEY_ENV[api], fake.key)
        upstream = web(fake, max_retries=2, backoff_max_s=2.0)
        with running_server(None, upstream=upstream) as proxy:
            answered = post(proxy.url, ["paris"])
            fake.rate_limited, fake.retry_after = 1, "30"  # longer than backoff_max_s
            told = post(proxy.url, ["rome"])
            upstream_report = httpx.get(f"{proxy.url}/health").json()["upstream"]
    assert answered.status_code == 200 and fake.queries[:2] == ["paris", "paris"]
    assert told.status_code == 503 and "Retry-After" in told.json()["detail"]
    assert "30 s" in told.json()["detail"]
    assert fake.queries[2:] == ["rome"]  # not retried: the wait is longer than allowed
    assert upstream_report["calls"] == 1  # the 429s were not billed


def test_two_replicas_on_redis_pay_for_a_query_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with fake_web_search("serper") as fake, redis_server(tmp_path / "redis") as redis:
        monkeypatch.setenv("SERPER_API_KEY", fake.key)
        fleet = {"backend": "redis", "redis_url": redis.url}
        with (
            running_server(None, upstream=web(fake), cache=fleet) as one,
            running_server(None, upstream=web(fake), cache=fleet) as two,
        ):
            first = post(one.url, ["paris", "rome"])
            second = post(two.url, ["rome", "paris"])
    assert [int(r.headers["x-hdr-billed-queries"]) for r in (first, second)] == [2, 0]
    assert fake.searches == 2
    assert second.json()["result"] == first.json()["result"][::-1]


def test_hdr_serve_web_process_says_what_it_serves() -> None:
    with fake_web_search("serper") as fake:
        env = {"SERPER_API_KEY": fake.key}
        with serve_process(None, "upstream.web.api=serper", upstream=fake.url, env=env) as server:
            answered = post(server.url, ["paris"])
            server.stop()
    assert answered.status_code == 200
    assert "serper web search at" in server.output and fake.key not in server.output


def test_a_web_api_needs_no_url_and_its_answers_expire_unless_told() -> None:
    from retrieval_server.config import ServerConfig

    serpapi = ServerConfig(upstream={"web": {"api": "serpapi"}})
    assert serpapi.upstream.url == "https://serpapi.com/search.json"
    assert serpapi.cache.ttl_s == 86400.0
    kept = ServerConfig(upstream={"web": {"api": "serper"}}, cache={"ttl_s": None})
    assert kept.upstream.url == "https://google.serper.dev/search" and kept.cache.ttl_s is None
    proxy = ServerConfig(upstream={"url": "http://127.0.0.1:9"})
    assert proxy.cache.ttl_s is None  # a Search-R1 upstream: as before
