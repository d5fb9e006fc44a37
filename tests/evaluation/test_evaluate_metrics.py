"""Evaluation arithmetic against values computed by hand."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest

from agent_env.rewards import (
    best_at_k,
    greedy_em,
    mean_at_k,
    per_question_best,
    per_question_mean,
)
from core.paths import write_json_atomic, write_text_atomic
from evaluation.metrics import (
    DatasetScore,
    average_scores,
    canonical_dataset,
    dataset_order,
    markdown_table,
    mean_spread,
    paired_difference,
    recognize_dataset,
    score_dataset,
)


def test_mean_and_best_at_k_by_hand():
    correct = [
        [1, 0, 0, 1],  # 2/4 right, best 1
        [0, 0, 0, 0],  # 0/4, best 0
        [1, 1, 1, 1],  # 4/4, best 1
    ]
    assert mean_at_k(correct) == pytest.approx((0.5 + 0.0 + 1.0) / 3)
    assert best_at_k(correct) == pytest.approx(2 / 3)
    assert per_question_mean(correct).tolist() == [0.5, 0.0, 1.0]
    assert per_question_best(correct).tolist() == [1.0, 0.0, 1.0]


def test_k_equals_one_makes_mean_and_best_the_same():
    correct = [[1], [0], [0], [1], [1]]
    assert mean_at_k(correct) == pytest.approx(0.6)
    assert best_at_k(correct) == pytest.approx(0.6)


def test_all_wrong_and_all_right():
    assert mean_at_k(np.zeros((4, 8))) == 0.0
    assert best_at_k(np.zeros((4, 8))) == 0.0
    assert mean_at_k(np.ones((2, 3), dtype=bool)) == 1.0
    assert greedy_em([0, 0, 0]) == 0.0
    assert greedy_em([1, 0, 1, 1]) == pytest.approx(0.75)


def test_bad_shapes_are_refused_and_empty_is_nan():
    with pytest.raises(ValueError):
        mean_at_k([1, 0, 1])  # not [Q, k]
    with pytest.raises(ValueError):
        best_at_k(np.zeros((3, 0)))
    assert math.isnan(mean_at_k(np.zeros((0, 4))))
    assert math.isnan(greedy_em([]))
    with pytest.raises(ValueError):
        score_dataset("nq", [[1, 0]], greedy=[1, 0])


def test_plain_and_weighted_average_over_datasets():
    a = score_dataset("nq", [[1, 1], [0, 1]], greedy=[1, 0])  # mean .75, best 1, greedy .5
    b = score_dataset("bamboogle", [[0, 0], [0, 0], [0, 0], [1, 0]], greedy=[0, 0, 0, 1])
    # b: mean 1/8, best 1/4, greedy 1/4
    assert (a.num_questions, a.k, a.mean_at_k, a.best_at_k) == (2, 2, 0.75, 1.0)
    avg = average_scores([a, b])
    assert avg.mean_at_k == pytest.approx((0.75 + 0.125) / 2)
    assert avg.best_at_k == pytest.approx((1.0 + 0.25) / 2)
    assert avg.greedy_em == pytest.approx((0.5 + 0.25) / 2)
    # weighted = pooled over all 6 questions
    assert avg.weighted_mean_at_k == pytest.approx((0.75 * 2 + 0.125 * 4) / 6)
    assert avg.weighted_best_at_k == pytest.approx(3 / 6)
    assert avg.weighted_greedy_em == pytest.approx(2 / 6)
    assert avg.num_questions == 6


def test_average_without_greedy_leaves_greedy_empty():
    a = DatasetScore("nq", 2, 1, 0.5, 0.5, None)
    avg = average_scores([a])
    assert avg.greedy_em is None and avg.weighted_greedy_em is None
    assert avg.mean_at_k == 0.5


def test_paired_difference_one_seed():
    a = [1.0, 0.5, 0.0, 1.0]
    b = [0.0, 0.5, 0.0, 0.5]
    d = np.array([1.0, 0.0, 0.0, 0.5])
    res = paired_difference(a, b)
    assert res.diff == pytest.approx(d.mean())
    assert res.se == pytest.approx(d.std(ddof=1) / 2.0)
    assert res.num_questions == 4
    assert res.per_seed == [pytest.approx(0.375)]
    assert res.seed_std == 0.0


def test_paired_difference_over_seeds():
    a = [[1, 1, 0], [1, 0, 0]]  # seed means 2/3, 1/3
    b = [[0, 1, 0], [0, 0, 0]]  # seed means 1/3, 0
    res = paired_difference(a, b)
    # seed-averaged per question: a = [1, .5, 0], b = [0, .5, 0] -> d = [1, 0, 0]
    assert res.diff == pytest.approx(1 / 3)
    assert res.se == pytest.approx(np.std([1, 0, 0], ddof=1) / math.sqrt(3))
    assert res.per_seed == [pytest.approx(1 / 3), pytest.approx(1 / 3)]
    assert res.seed_std == pytest.approx(0.0)


def test_paired_difference_needs_the_same_questions():
    with pytest.raises(ValueError):
        paired_difference([1, 0], [1, 0, 1])


def test_identical_arms_differ_by_zero():
    a = np.random.default_rng(0).integers(0, 2, size=(2, 50))
    res = paired_difference(a, a)
    assert res.diff == 0.0 and res.se == 0.0


def test_mean_spread():
    s = mean_spread([0.2, 0.4, 0.9])
    assert s.mean == pytest.approx(0.5)
    assert s.std == pytest.approx(np.std([0.2, 0.4, 0.9], ddof=1))
    assert (s.min, s.max, s.n) == (0.2, 0.9, 3)
    assert mean_spread([0.3]).std == 0.0


@pytest.mark.parametrize(
    ("data_source", "path", "expected"),
    [
        ("nq", None, "nq"),
        ("natural_questions", None, "nq"),
        ("TriviaQA", None, "triviaqa"),
        (None, "data/flashrag/2wikimultihopqa/dev.jsonl", "2wikimultihopqa"),
        (None, "data/hotpotqa/test.jsonl", "hotpotqa"),
        (None, "searchr1/musique_test.parquet", "musique"),
        (None, "eval/popqa.parquet", "popqa"),
        (None, "x/Bamboogle-test.jsonl", "bamboogle"),
        ("wiki_vital", None, "wiki-vital"),
        (None, "wiki-vital", "wiki-vital"),
        ("unknown-ds", "a/b.jsonl", "unknown-ds"),
        (None, "a/mydata.jsonl", "mydata"),
        ("bogus", "data/nq/test.jsonl", "nq"),
    ],
)
def test_recognize_dataset(data_source, path, expected):
    assert recognize_dataset(data_source, path) == expected


def test_canonical_names_and_order():
    assert canonical_dataset("2WikiMultihopQA") == "2wikimultihopqa"
    assert canonical_dataset("squad") is None
    assert dataset_order(["zeta", "bamboogle", "wiki-vital", "nq", "alpha"]) == [
        "nq",
        "bamboogle",
        "wiki-vital",
        "alpha",
        "zeta",
    ]


def test_markdown_table():
    text = markdown_table(["arm", "Mean@4", "n", "note"], [["a|b", 0.12345, 3, None]], digits=3)
    lines = text.splitlines()
    assert lines[0] == "| arm | Mean@4 | n | note |"
    assert lines[1] == "| --- | ---: | ---: | --- |"
    assert lines[2] == "| a\\|b | 0.123 | 3 | – |"
    with pytest.raises(ValueError):
        markdown_table(["a", "b"], [[1]])


def test_atomic_json_write_replaces_whole_file(tmp_path):
    path = tmp_path / "sub" / "result.json"
    write_json_atomic(path, {"x": 1, "nan": float("nan"), "arr": np.arange(3)})
    assert json.loads(path.read_text()) == {"x": 1, "nan": None, "arr": [0, 1, 2]}
    write_json_atomic(path, {"x": 2})
    assert json.loads(path.read_text()) == {"x": 2}
    assert os.listdir(path.parent) == ["result.json"]  # no temp file left behind


def test_atomic_write_failure_keeps_old_content_and_no_temp(tmp_path):
    path = tmp_path / "r.json"
    write_text_atomic(path, "old")

    with pytest.raises(UnicodeEncodeError):  # fails halfway through writing the temp file
        write_text_atomic(path, "new" + "\ud800")
    assert path.read_text() == "old"
    assert os.listdir(tmp_path) == ["r.json"]
