"""Property-based: generated malformed requests never get a 5xx or a dropped connection.

Hypothesis generates bodies of every kind a broken or hostile client might send: arbitrary JSON
values (arrays, scalars, nested objects), near-valid requests with wrong types, huge or negative
`topk`, extra fields whose names hold lone surrogates, strings with lone surrogates and control
characters, bytes that are not UTF-8, truncated JSON, and odd content types. Each is POSTed to a
real server on the small index, over one keep-alive connection, and must be answered with a
4xx or a well-formed 200; a 5xx or a reset connection fails the test. Both profiles are covered;
the default profile gets at least 1,000 requests.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SENT = {"search-r1": 0, "strict": 0}
DEFAULT_PROFILE_EXAMPLES = 1000
STRICT_PROFILE_EXAMPLES = 300

# Text with the characters that broke servers before: lone surrogates, NUL, controls, non-BMP.
nasty_text = st.text(
    alphabet=st.one_of(
        st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF),
        st.characters(codec="utf-8"),
        st.sampled_from(["\x00", "\n", '"', "\\", "\U0001f600", "\ufffd"]),
    ),
    max_size=40,
)
json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False),
    nasty_text,
)
json_values = st.recursive(
    json_scalars,
    lambda children: st.one_of(
        st.lists(children, max_size=4), st.dictionaries(nasty_text, children, max_size=4)
    ),
    max_leaves=12,
)
near_valid = st.fixed_dictionaries(
    {},
    optional={
        "queries": st.one_of(
            st.lists(nasty_text, max_size=5), st.lists(json_values, max_size=3), json_values
        ),
        "topk": st.one_of(st.integers(min_value=-5, max_value=2**40), json_values),
        "return_scores": st.one_of(st.booleans(), json_values),
        "retriever": st.one_of(st.sampled_from(["dense", "bm25", "splade", ""]), json_values),
        "\udf55": json_values,
        "extra": json_values,
    },
)


def encode(value: object) -> bytes:
    """JSON as a client library writes it: lone surrogates become \\udXXX escapes."""
    return json.dumps(value, ensure_ascii=True).encode()


bodies = st.one_of(
    near_valid.map(encode),
    json_values.map(encode),
    st.binary(max_size=200),  # mostly not UTF-8, mostly not JSON
    near_valid.map(encode).flatmap(lambda b: st.integers(0, len(b)).map(lambda n: b[:n])),
    st.builds(lambda s: b'{"queries": ["' + s + b'"]}', st.binary(max_size=30)),
)
content_types = st.sampled_from(
    ["application/json", "application/json", "text/plain", "", "application/x-www-form-urlencoded"]
)


def check(client: httpx.Client, body: bytes, content_type: str) -> None:
    headers = {"content-type": content_type} if content_type else {}
    response = client.post("/retrieve", content=body, headers=headers)  # a reset raises here
    assert response.status_code < 500, (body, response.status_code, response.text)
    assert 200 <= response.status_code < 500
    answer = response.json()
    if response.status_code == 200:
        queries = json.loads(body)["queries"]
        assert isinstance(answer["result"], list) and len(answer["result"]) == len(queries)
    else:
        assert isinstance(answer["detail"], str) and "\n" not in answer["detail"]


@pytest.fixture(scope="module")
def strict_client(small_index: Path) -> Iterator[httpx.Client]:
    from servers import running_server

    with (
        running_server(small_index, profile="strict", default_retriever="bm25") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        yield client


@pytest.fixture(scope="module")
def default_client(small_index: Path) -> Iterator[httpx.Client]:
    """The default profile; BM25 by default, so the valid requests among the generated ones
    cost little (a request may still name dense)."""
    from servers import running_server

    with (
        running_server(small_index, default_retriever="bm25") as server,
        httpx.Client(base_url=server.url, timeout=60) as client,
    ):
        yield client


def budget(examples: int) -> settings:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    )


@budget(DEFAULT_PROFILE_EXAMPLES)
@given(body=bodies, content_type=content_types)
def test_default_profile_answers_every_malformed_request_with_4xx_or_200(
    default_client: httpx.Client, body: bytes, content_type: str
) -> None:
    SENT["search-r1"] += 1
    check(default_client, body, content_type)


@budget(STRICT_PROFILE_EXAMPLES)
@given(body=bodies, content_type=content_types)
def test_strict_profile_answers_every_malformed_request_with_4xx_or_200(
    strict_client: httpx.Client, body: bytes, content_type: str
) -> None:
    SENT["strict"] += 1
    check(strict_client, body, content_type)


def test_the_suite_sent_at_least_1000_requests(default_client: httpx.Client) -> None:
    assert SENT["search-r1"] >= DEFAULT_PROFILE_EXAMPLES, SENT
    metrics = default_client.get("/metrics").text
    assert 'status="5' not in metrics  # not one 5xx on this server


def test_strict_profile_refuses_a_value_of_another_type_that_search_r1_coerces(
    strict_client: httpx.Client, default_client: httpx.Client
) -> None:
    """`"topk": true` is read as 1 by Search-R1's lax models (and the default profile, to
    stay compatible); profile=strict refuses it, as it refuses every wrong type."""
    for body in ({"queries": ["a"], "topk": True}, {"queries": ["a"], "return_scores": "yes"},
                 {"queries": ["a"], "topk": "3"}):  # fmt: skip
        refused = strict_client.post("/retrieve", json=body)
        assert refused.status_code == 422, (body, refused.text)
        assert "\n" not in refused.json()["detail"]
        assert default_client.post("/retrieve", json=body).status_code == 200
    served = strict_client.post("/retrieve", json={"queries": ["Great Wall"], "topk": 2})
    assert served.status_code == 200 and len(served.json()["result"][0]) == 2
