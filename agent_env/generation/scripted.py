"""`scripted` backend: a deterministic policy for tests, reference figures and SFT targets.

First turn: search the question text verbatim, or another `query_form` of it drawn from the
trajectory's seed (`QUERY_FORMS`: its words in a random order, a random subset of them in
order, either the question or such a subset, or its words from a random one on): a format
teacher that leaves which words come first open. With `searches=1` (default), after an
information block: answer the title of Doc 1. With `searches=n`, after each of the first n-1
blocks it searches Doc 1's title (the bridge hop of `wiki-bridge`), and after the n-th
it answers the first title of that block that it has not searched. In oracle mode (given
question -> golden answers) it answers the golden title when that title is among the
documents it retrieved, which is the best a policy that searches this way can do; the
trainer's `hdr sft` uses it to make supervised trajectories. Its log-probs are 0.0 (the
action has probability 1 under this policy).

Finish reasons: an action finishes "stop" (its closing tag), or "length" when cut by
`max_tokens`; a context in which it finds neither a question nor documents gets the
tokenizer's EOS ("eos"). `after_close` is text written after the closing tag, e.g. "\n\n",
which a byte-level BPE merges with the tag's `>` into one token (the stop "overhang" real
models produce).

It reads the question and the documents back from the decoded context, so it works through
the same Generator interface, with the same prompt config, as a real model.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable

from agent_env.generation.base import GENERATORS, Completion, SamplingParams
from agent_env.prompts import (
    ANSWER_CLOSE,
    ANSWER_OPEN,
    INFO_CLOSE,
    INFO_OPEN,
    SEARCH_CLOSE,
    SEARCH_OPEN,
    PromptConfig,
)
from agent_env.rewards import normalize_answer

_DOC = re.compile(r"^Doc \d+\(Title: (.*?)\) ", re.MULTILINE)


def _question_pattern(template: str) -> re.Pattern:
    before, _, after = template.partition("{question}")
    # the question's own line is enough context; where the question opens its line (a ChatML
    # turn: "<|im_start|>user\n{question}"), the line before it too
    lines = before.split("\n")
    before = lines[-1] if lines[-1] or len(lines) < 2 else lines[-2] + "\n"
    after = after.split("\n", 1)[0] + ("\n" if "\n" in after else "")
    return re.compile(re.escape(before) + r"(.*?)" + re.escape(after), re.DOTALL)


def _strip_quotes(title: str) -> str:
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        return title[1:-1]
    return title


def searched_queries(context_text: str) -> list[str]:
    """The queries of the searches so far (the opening tag may be the prompt's)."""
    return [q.strip() for q in re.findall(r"<search>(.*?)</search>", context_text, re.DOTALL)]


def all_document_titles(context_text: str) -> list[str]:
    """Titles of the documents of every information block, in order."""
    titles, start = [], context_text.find(INFO_OPEN)
    while start >= 0:
        end = context_text.find(INFO_CLOSE, start)
        titles += document_titles(context_text[: end if end >= 0 else None])
        start = context_text.find(INFO_OPEN, start + 1)
    return titles


def document_titles(context_text: str) -> list[str]:
    """Titles (quotes removed) of the documents in the last information block."""
    start = context_text.rfind(INFO_OPEN)
    if start < 0:
        return []
    end = context_text.find(INFO_CLOSE, start)
    block = context_text[start + len(INFO_OPEN) : end if end >= 0 else None]
    return [_strip_quotes(t) for t in _DOC.findall(block)]


def shuffled_words(text: str, rng: random.Random) -> str:
    """`text`'s whitespace-separated words in a random order."""
    words = text.split()
    rng.shuffle(words)
    return " ".join(words)


def subset_words(text: str, rng: random.Random) -> str:
    """A random subset of `text`'s whitespace-separated words in their order: each kept with
    probability 1/2, one at least (drawn again until one is)."""
    words = text.split()
    while words:
        kept = [w for w in words if rng.random() < 0.5]
        if kept:
            return " ".join(kept)
    return text


def suffix_words(text: str, rng: random.Random) -> str:
    """`text`'s words from a random one of them to the end: a plain copy from an offset (what a
    tiny policy learns), so under a query budget the choice left open is where to begin."""
    words = text.split()
    return " ".join(words[rng.randrange(len(words)) :]) if words else text


def verbatim_or_subset(text: str, rng: random.Random) -> str:
    """`text` itself or, with probability 1/2, `subset_words` of it: half the trajectories
    teach copying (and answering from what the copy retrieves) as the verbatim start does,
    the other half keep the first words of the search open."""
    return text if rng.random() < 0.5 else subset_words(text, rng)


QUERY_FORMS: dict[str, Callable[[str, random.Random], str]] = {
    "verbatim": lambda text, rng: text,
    "shuffled": shuffled_words,
    "subset": subset_words,
    "mixed": verbatim_or_subset,
    "suffix": suffix_words,
}
"""The scripted first search, from the question and the trajectory's own random stream (its
seed, or the question itself without one, so the scripted policy stays reproducible)."""


class ScriptedGenerator:
    """Search the question, then answer Doc 1's title (or, with an oracle, the gold title)."""

    def __init__(
        self,
        tokenizer,
        prompt: PromptConfig,
        oracle: dict[str, list[str]] | None = None,
        searches: int = 1,
        after_close: str = "",
        query_form: str = "verbatim",
    ) -> None:
        self.tokenizer = tokenizer
        self.query_form = QUERY_FORMS[query_form]
        self.prompt = prompt
        self.oracle = oracle
        self.searches = searches
        self.after_close = after_close
        self._question = _question_pattern(prompt.template)

    per_request_seeds = False  # deterministic: nothing is sampled

    def sync_weights(self, model) -> None:
        """Nothing to sync: the policy has no weights."""

    def sleep(self) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to let go."""

    def generate(
        self, contexts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Completion]:
        if seeds is None:
            seeds = [None] * len(contexts)
        return [self._act(ctx, params, seed) for ctx, seed in zip(contexts, seeds, strict=True)]

    def _act(self, context: list[int], params: SamplingParams, seed: int | None) -> Completion:
        text = self.tokenizer.decode(context, skip_special_tokens=False)
        question_match = self._question.search(text)
        question = question_match.group(1).strip() if question_match else ""
        titles = document_titles(text)
        blocks = text.count(INFO_OPEN)
        if not titles and not question:  # nothing to act on: end the sequence
            return Completion([self.tokenizer.eos_token_id], [0.0], "eos")
        if not titles:
            query = self.query_form(question, random.Random(question if seed is None else seed))
            body, open_tag, close_tag = f" {query} ", SEARCH_OPEN, SEARCH_CLOSE
        elif blocks < self.searches:
            body, open_tag, close_tag = f" {titles[0]} ", SEARCH_OPEN, SEARCH_CLOSE
        else:
            action = self._choose(question, titles, text)
            body, open_tag, close_tag = f" {action} ", ANSWER_OPEN, ANSWER_CLOSE
        # The context may already hold the opening tag (compact prompt); don't repeat it.
        prefix = "" if text.endswith(open_tag) else open_tag
        ids = self.tokenizer.encode(
            prefix + body + close_tag + self.after_close, add_special_tokens=False
        )
        if len(ids) > params.max_tokens:
            ids = ids[: params.max_tokens]
            return Completion(ids, [0.0] * len(ids), "length")
        return Completion(ids, [0.0] * len(ids), "stop", close_tag)

    def _choose(self, question: str, titles: list[str], text: str) -> str:
        if self.oracle is not None:
            gold = {normalize_answer(a) for a in self.oracle.get(question, [])}
            for title in all_document_titles(text):
                if normalize_answer(title) in gold:
                    return title
        searched = {normalize_answer(q) for q in searched_queries(text)[1:]}
        unsearched = [t for t in titles if normalize_answer(t) not in searched]
        return (unsearched or titles)[0]


@GENERATORS.register("scripted")
def build_scripted(*, config, model_dir, tokenizer, prompt, model=None) -> ScriptedGenerator:
    return ScriptedGenerator(tokenizer, prompt)
