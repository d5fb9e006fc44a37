"""The /retrieve body is joined from pre-encoded passage JSON (`render_query`, `join_answers`):
it must parse to exactly what encoding the parsed documents would give, for every kind of
corpus line."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

from retrieval_server.index.files import DocumentStore
from retrieval_server.serving.answers import Passage, join_answers, render_query
from retrieval_server.serving.state import fetch_passages

LINES = [
    '{"id": "0", "contents": "plain"}',
    '{"id": 7, "contents": "an integer id", "title": "T"}',  # id re-encoded as a string
    '{"contents": "accents \\u00e9 and \u00e9 raw", "id": "x", "extra": [1, 2.5, null]}',
    '{"id": "s", "contents": "a lone surrogate \\ud800 escape"}',  # orjson refuses it
]


def store_for(tmp_path: Path) -> DocumentStore:
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(line + "\n" for line in LINES), encoding="utf-8")
    sizes = [len((line + "\n").encode()) for line in LINES]
    return DocumentStore(corpus, np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64))


def render_result(passages: list[list[Passage]], with_scores: bool) -> bytes:
    return join_answers([render_query(query, with_scores) for query in passages])


def expected_document(line: str) -> dict:
    record = json.loads(line)
    return {**record, "id": str(record["id"])}


def test_rendered_result_parses_to_the_documents_and_scores(tmp_path: Path) -> None:
    store = store_for(tmp_path)
    hits = [[(1, 0.5), (0, 0.25)], [], [(2, 1e-05), (3, -0.75)]]
    passages = fetch_passages(store, hits)
    scored = json.loads(render_result(passages, with_scores=True))
    assert scored == {
        "result": [
            [{"document": expected_document(LINES[row]), "score": score} for row, score in query]
            for query in hits
        ]
    }
    plain = json.loads(render_result(passages, with_scores=False))
    assert plain == {"result": [[expected_document(LINES[row]) for row, _ in q] for q in hits]}
    assert json.loads(render_result([], with_scores=True)) == {"result": []}
    store.close()


def test_a_non_finite_score_is_null(tmp_path: Path) -> None:
    store = store_for(tmp_path)
    body = json.loads(render_result(fetch_passages(store, [[(0, math.nan)]]), True))
    assert body["result"][0][0]["score"] is None
    store.close()
