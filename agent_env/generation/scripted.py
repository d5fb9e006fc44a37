"""`scripted` backend: a deterministic policy for tests, reference figures and SFT targets.

First turn: search the question text verbatim. After an information block: answer the title
of Doc 1. In oracle mode (given question -> golden answers) it answers the golden title when
that title is among the retrieved documents and Doc 1's otherwise, which is the best a
policy that copies the question can do; the trainer's `hdr sft` uses it to make supervised
trajectories. Its log-probs are 0.0 (the action has probability 1 under this policy).

It reads the question and the documents back from the decoded context, so it works through
the same Generator interface, with the same prompt config, as a real model.
"""

from __future__ import annotations

import re

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
    before = before.rsplit("\n", 1)[-1]  # the question's own line is enough context
    after = after.split("\n", 1)[0] + ("\n" if "\n" in after else "")
    return re.compile(re.escape(before) + r"(.*?)" + re.escape(after), re.DOTALL)


def _strip_quotes(title: str) -> str:
    title = title.strip()
    if len(title) >= 2 and title[0] == title[-1] == '"':
        return title[1:-1]
    return title


def document_titles(context_text: str) -> list[str]:
    """Titles (quotes removed) of the documents in the last information block."""
    start = context_text.rfind(INFO_OPEN)
    if start < 0:
        return []
    end = context_text.find(INFO_CLOSE, start)
    block = context_text[start + len(INFO_OPEN) : end if end >= 0 else None]
    return [_strip_quotes(t) for t in _DOC.findall(block)]


class ScriptedGenerator:
    """Search the question, then answer Doc 1's title (or, with an oracle, the gold title)."""

    def __init__(
        self, tokenizer, prompt: PromptConfig, oracle: dict[str, list[str]] | None = None
    ) -> None:
        self.tokenizer = tokenizer
        self.prompt = prompt
        self.oracle = oracle
        self._question = _question_pattern(prompt.template)

    def sync_weights(self, model) -> None:
        """Nothing to sync: the policy has no weights."""

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        return [self._act(ctx, params) for ctx in contexts]

    def _act(self, context: list[int], params: SamplingParams) -> Completion:
        text = self.tokenizer.decode(context, skip_special_tokens=False)
        question_match = self._question.search(text)
        question = question_match.group(1).strip() if question_match else ""
        titles = document_titles(text)
        if titles:
            action = self._choose(question, titles)
            body, open_tag, close_tag = f" {action} ", ANSWER_OPEN, ANSWER_CLOSE
        else:
            body, open_tag, close_tag = f" {question} ", SEARCH_OPEN, SEARCH_CLOSE
        # The context may already hold the opening tag (compact prompt); don't repeat it.
        prefix = "" if text.endswith(open_tag) else open_tag
        ids = self.tokenizer.encode(prefix + body + close_tag, add_special_tokens=False)
        finished = len(ids) <= params.max_tokens
        ids = ids[: params.max_tokens]
        return Completion(ids, [0.0] * len(ids), finished=finished)

    def _choose(self, question: str, titles: list[str]) -> str:
        if self.oracle is not None:
            gold = {normalize_answer(a) for a in self.oracle.get(question, [])}
            for title in titles:
                if normalize_answer(title) in gold:
                    return title
        return titles[0]


@GENERATORS.register("scripted")
def build_scripted(*, config, model_dir, tokenizer, prompt, model=None) -> ScriptedGenerator:
    return ScriptedGenerator(tokenizer, prompt)
