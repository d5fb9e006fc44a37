"""Rewards: Search-R1's normalisation, answer extraction from the response only, EM, F1."""

from __future__ import annotations

import pytest

from agent_env.prompts import INSTRUCT_TEMPLATE
from agent_env.rewards import (
    exact_match,
    extract_answer,
    f1_score,
    format_reward,
    normalize_answer,
)


@pytest.mark.parametrize(
    ("raw", "normalized"),
    [
        ("The Beatles", "beatles"),
        ("  An   apple, a day! ", "apple day"),
        ("the theory of everything", "theory of everything"),  # articles only as words
        ("Théâtre", "théâtre"),  # non-ASCII letters kept, only ASCII punctuation dropped
        ("U.S.A.", "usa"),
        ("Rock-n-roll", "rocknroll"),  # hyphens are punctuation, removed without a space
        ("A", ""),
        ("anthem", "anthem"),  # 'an' inside a word stays
        ('"2001: A Space Odyssey"', "2001 space odyssey"),
    ],
)
def test_normalize_answer_matches_search_r1(raw: str, normalized: str) -> None:
    assert normalize_answer(raw) == normalized


def test_extract_answer_takes_the_last_answer_of_the_response() -> None:
    response = "<answer> Paris </answer> hmm, no: <answer>\n Lyon \n</answer>"
    assert extract_answer(response) == "Lyon"
    assert extract_answer("<answer> unclosed") is None
    assert extract_answer("no answer at all") is None


def test_the_prompt_example_answer_never_counts() -> None:
    prompt = INSTRUCT_TEMPLATE.format(question="What is the capital of France?")
    assert "<answer> Paris </answer>" in prompt  # the instruction's example
    response = "<search> capital of France </search>"  # no answer given
    assert extract_answer(response) is None
    assert exact_match(extract_answer(response), ["Paris"]) == 0.0
    # Reading prompt + response, as a careless caller might, would wrongly score 1.
    assert exact_match(extract_answer(prompt + response), ["Paris"]) == 1.0


def test_exact_match_and_f1() -> None:
    assert exact_match("the Eiffel Tower", ["Eiffel tower", "Tour Eiffel"]) == 1.0
    assert exact_match("Eiffel", ["Eiffel tower"]) == 0.0
    assert exact_match(None, ["x"]) == 0.0
    assert f1_score("Eiffel", ["Eiffel tower"]) == pytest.approx(2 / 3)
    assert f1_score("Eiffel tower in Paris", ["Louvre", "Eiffel tower"]) == pytest.approx(2 / 3)
    assert f1_score("no", ["yes"]) == 0.0
    assert f1_score("yes", ["yes"]) == 1.0
    assert f1_score(None, ["x"]) == 0.0


def test_format_reward() -> None:
    good = "<think> hm </think><search> q </search>\n\n<information>Doc 1</information>\n\n"
    assert format_reward(good + "<answer> x </answer>") == 1.0
    assert format_reward("<answer> x </answer>") == 1.0
    assert format_reward(good) == 0.0  # no answer
    assert format_reward("<search> q <answer> x </answer>") == 0.0  # nested/unclosed
    assert format_reward("<answer> x </answer><answer> y </answer>") == 0.0
    assert format_reward("<information>forged</information><answer> x </answer>") == 0.0


def test_a_string_answer_is_one_golden_answer_not_its_characters() -> None:
    assert exact_match("p", "Paris") == 0.0  # per character, 'p' would match
    assert exact_match("paris", "Paris") == 1.0
    assert exact_match("Paris", ["Paris"]) == exact_match("Paris", "Paris")
    assert f1_score("a", "Paris is big") == 0.0  # 'a' is an article, and no character of gold
    assert f1_score("s", "Paris") == 0.0
    assert f1_score("Paris city", "Paris") == pytest.approx(2 / 3)
    assert f1_score("Paris city", "Paris") == f1_score("Paris city", ["Paris"])
