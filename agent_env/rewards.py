"""Answer extraction and rewards, as Search-R1 scores its QA tasks.

The aggregates over `k` sampled responses per question live here too, so the trainer's
periodic evaluation and `evaluation` compute them alike: Mean@k (the mean correctness of the
samples) and Best@k (whether any sample is correct), averaged over questions.

`normalize_answer` is SQuAD's normalisation (lowercase, strip punctuation, drop the articles
a/an/the, collapse whitespace), which Search-R1 uses unchanged. `exact_match` and `f1_score`
take the best match over the golden answers and return floats in [0, 1]; a single string is
one golden answer (Search-R1 wraps it in a list), not a sequence of characters.

Departure from Search-R1: `extract_answer` reads the *response* only (everything after the
prompt), so the example answer in the instruction ("<answer> Beijing </answer>") can never
count; Search-R1 searches the decoded prompt+response and skips the first match when there
are several, which breaks whenever a prompt has no example. The rollout loop goes one step
further and takes the answer from the policy's own parsed action, so text the environment
appended (a correction message mentioning the tags) cannot be read as an answer either.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from typing import Any

import numpy as np

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(s: str) -> str:
    """Lowercase, drop punctuation, drop articles, collapse whitespace (SQuAD/Search-R1)."""
    s = s.lower()
    s = "".join(ch for ch in s if ch not in _PUNCT)
    s = _ARTICLES.sub(" ", s)
    return " ".join(s.split())


def extract_answer(response_text: str) -> str | None:
    """The text of the last `<answer>...</answer>` in the response, stripped; None if none.

    Pass the response only (what follows the prompt), never prompt+response.
    """
    matches = _ANSWER.findall(response_text)
    if not matches:
        return None
    return matches[-1].strip()


def golden_list(golden_answers: str | list[str]) -> list[str]:
    """The golden answers as a list: a single string is one answer (as Search-R1 wraps it),
    never a sequence of one-character answers."""
    return [golden_answers] if isinstance(golden_answers, str) else list(golden_answers)


def exact_match(prediction: str | None, golden_answers: str | list[str]) -> float:
    """1.0 when the normalised prediction equals any normalised golden answer, else 0.0."""
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golden_list(golden_answers)))


def _f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    common = Counter(pred_tokens) & Counter(gold_tokens)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision = same / len(pred_tokens)
    recall = same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str | None, golden_answers: str | list[str]) -> float:
    """Token-level F1 of the normalised strings, the best over the golden answers.

    As in SQuAD/FlashRAG, yes/no/noanswer only score when they match exactly.
    """
    if prediction is None:
        return 0.0
    pred = normalize_answer(prediction)
    best = 0.0
    for gold in golden_list(golden_answers):
        ngold = normalize_answer(gold)
        special = ("yes", "no", "noanswer")
        if (pred in special or ngold in special) and pred != ngold:
            continue
        best = max(best, _f1(pred.split(), ngold.split()))
    return best


_ACTION_TAGS = re.compile(r"</?(?:think|search|answer|information)>")


def format_reward(response_text: str) -> float:
    """1.0 when the response is well formed, else 0.0.

    Well formed: tags never nest and always close, every `<search>` block is followed by an
    `<information>` block, and the response ends with exactly one `<answer>` block (trailing
    whitespace and end-of-text markers aside). Pass the text with the turn's opening
    prefix (e.g. the compact prompt's trailing `<search>`) prepended.
    """
    open_tag: str | None = None
    last_closed: str | None = None
    answers = 0
    for match in _ACTION_TAGS.finditer(response_text):
        tag = match.group(0)
        name = tag.strip("</>")
        if not tag.startswith("</"):
            if open_tag is not None:
                return 0.0
            if name == "information" and last_closed != "search":
                return 0.0
            if name == "search" and last_closed == "search":
                return 0.0
            if answers:
                return 0.0
            open_tag = name
        else:
            if open_tag != name:
                return 0.0
            open_tag = None
            last_closed = name
            answers += name == "answer"
    return float(open_tag is None and answers == 1 and last_closed == "answer")


# --- aggregates over k samples per question ------------------------------------------------


def as_correct(correct: Any) -> np.ndarray:
    """`correct` as a `[Q, k]` float array of 0/1 (k >= 1 samples per question)."""
    arr = np.asarray(correct, dtype=np.float64)
    if arr.ndim != 2 or arr.shape[1] == 0:
        raise ValueError(f"correct must be [questions, k] with k >= 1, got shape {arr.shape}")
    return arr


def per_question_mean(correct: Any) -> np.ndarray:
    """`[Q, k]` -> `[Q]`: fraction of each question's k samples that are correct."""
    return as_correct(correct).mean(axis=1)


def per_question_best(correct: Any) -> np.ndarray:
    """`[Q, k]` -> `[Q]`: 1.0 where any of the k samples is correct."""
    return (as_correct(correct) > 0).any(axis=1).astype(np.float64)


def mean_at_k(correct: Any) -> float:
    """Mean@k of a `[Q, k]` 0/1 array: `mean_q mean_j correct[q, j]`. NaN with no questions."""
    arr = as_correct(correct)
    return float(arr.mean()) if arr.shape[0] else math.nan


def best_at_k(correct: Any) -> float:
    """Best@k of a `[Q, k]` 0/1 array: `mean_q max_j correct[q, j]`. NaN with no questions."""
    arr = as_correct(correct)
    return float(per_question_best(arr).mean()) if arr.shape[0] else math.nan


def greedy_em(correct: Any) -> float:
    """Exact match of one greedy response per question: `[Q]` 0/1 -> mean. NaN when empty."""
    arr = np.asarray(correct, dtype=np.float64).reshape(-1)
    return float(arr.mean()) if arr.size else math.nan
