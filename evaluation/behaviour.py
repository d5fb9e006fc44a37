"""What a policy does, beside whether its answer is right: the numbers that say what RL taught.

A score says how often a policy is right; these say how. Per sampled response, `observe`
keeps seven small integers (`Behaviour`), and `summarize_behaviour` turns a set of them into:

- format: the share of responses whose every action parsed and that answered, searches per
  response, and policy tokens per response (what the policy wrote, observations left out);
- reading: where the first search put the gold article (rank 1, rank 2 or 3, not retrieved)
  and the exact match within each case. Right at rank 2-3 is the share a policy that always
  answers Doc 1 gets 0 of: only reading the documents gets it. `answered_doc1` is the share
  of answers that are Doc 1's title;
- searching: words of the first search that reached the retriever (after
  `rollout.max_query_words`), the share of those that are words of the question (1.0 for a
  policy that copies), and the share of first searches that retrieved the gold at all.

Titles are compared after SQuAD normalisation (`agent_env.rewards.normalize_answer`), so "The
Beatles" answered for `"The Beatles"` counts as Doc 1; a search's words (split at whitespace,
as the query budget counts them) in lower case with the punctuation at their ends stripped.
"""

from __future__ import annotations

import string
from collections.abc import Sequence
from dataclasses import astuple, dataclass

from agent_env.generation.scripted import document_titles, searched_queries
from agent_env.rewards import exact_match, normalize_answer
from agent_env.rollout import RolloutConfig, Trajectory, budget_query, response_text

NOT_RETRIEVED = 0
NO_SEARCH = -1

# the summary's keys as the evaluation's table heads them
SUMMARY_COLUMNS = {
    "valid_format": "valid format",
    "searches_per_response": "searches",
    "policy_tokens_mean": "policy tokens",
    "query_words_mean": "query words",
    "query_words_in_question": "words from the question",
    "gold_rank1": "gold at rank 1",
    "gold_rank23": "gold at rank 2-3",
    "em_given_gold_rank1": "EM | rank 1",
    "em_given_gold_rank23": "EM | rank 2-3",
    "answered_doc1": "answered Doc 1",
}


@dataclass(frozen=True)
class Behaviour:
    """One response, as integers (stored per sample in eval.json's `behaviour`)."""

    valid: int  # 1: every action parsed and the response answered
    searches: int
    policy_tokens: int
    gold_rank: int  # the gold's 1-based rank in the first search's documents; 0 absent; -1 none
    answer_rank: int  # the rank of the document whose title the answer is; 0 none; -1 none
    query_words: int  # words of the first search that reached the retriever
    query_words_in_question: int  # of those, words of the question

    def as_row(self) -> list[int]:
        return list(astuple(self))


def _rank(title: str | None, titles: list[str]) -> int:
    """1-based rank of `title` among `titles` (normalised), 0 when absent."""
    if title is None:
        return NOT_RETRIEVED
    wanted = normalize_answer(title)
    for rank, candidate in enumerate(titles, start=1):
        if normalize_answer(candidate) == wanted:
            return rank
    return NOT_RETRIEVED


def _word(word: str) -> str:
    """A word as compared with the question's: lower case, punctuation stripped at its ends."""
    return word.lower().strip(string.punctuation)


def observe(traj: Trajectory, tokenizer, config: RolloutConfig) -> Behaviour:
    """The behaviour record of one response."""
    queries = searched_queries(response_text(traj, tokenizer, config))
    titles = document_titles(traj.observations[0]) if traj.observations else None
    if titles is None:
        gold_rank = answer_rank = NO_SEARCH
    else:
        gold_rank = max(
            (_rank(gold, titles) for gold in traj.example.golden_answers),
            key=lambda r: (r > 0, -r),
            default=NOT_RETRIEVED,
        )
        answer_rank = _rank(traj.answer, titles)
    sent = budget_query(queries[0], config.max_query_words).split() if queries else []
    question = {_word(w) for w in traj.example.question.split()}
    in_question = sum(_word(w) in question for w in sent)
    return Behaviour(
        valid=int(traj.answer is not None and all(traj.valid_actions)),
        searches=traj.searches,
        policy_tokens=sum(traj.loss_mask),
        gold_rank=gold_rank,
        answer_rank=answer_rank,
        query_words=len(sent),
        query_words_in_question=in_question,
    )


def correct(traj: Trajectory) -> int:
    return int(exact_match(traj.answer, traj.example.golden_answers) == 1.0)


def _share(num: float, den: float) -> float | None:
    return round(num / den, 4) if den else None


def summarize_behaviour(rows: Sequence[Sequence[int]], right: Sequence[int]) -> dict:
    """The summary of `rows` (`Behaviour.as_row()` each) whose exact match is `right` (0/1
    each, same order); shares are of all responses unless named `_given_`."""
    n = len(rows)
    b = [Behaviour(*row) for row in rows]
    cases = {
        "rank1": [i for i, x in enumerate(b) if x.gold_rank == 1],
        "rank23": [i for i, x in enumerate(b) if x.gold_rank in (2, 3)],
        "absent": [i for i, x in enumerate(b) if x.gold_rank == NOT_RETRIEVED],
    }
    searched = [x for x in b if x.gold_rank != NO_SEARCH]
    words = sum(x.query_words for x in searched)
    out = {
        "responses": n,
        "valid_format": _share(sum(x.valid for x in b), n),
        "searches_per_response": _share(sum(x.searches for x in b), n),
        "policy_tokens_mean": _share(sum(x.policy_tokens for x in b), n),
        "searched": _share(len(searched), n),
        "query_words_mean": _share(words, len(searched)),
        "query_words_in_question": _share(sum(x.query_words_in_question for x in searched), words),
        "answered_doc1": _share(sum(x.answer_rank == 1 for x in b), n),
    }
    for case, idx in cases.items():
        out[f"gold_{case}"] = _share(len(idx), n)
        out[f"em_given_gold_{case}"] = _share(sum(right[i] for i in idx), len(idx))
    return out
