"""Prompt text: the instruction, the compact variant for tiny models, the environment's messages.

Every string the model sees from the environment is a config value (`PromptConfig`), so a user
can supply the exact text a checkpoint was trained with. The default instruction says what
Search-R1's does (reason in <think>, search with <search> query </search>, results come back
in <information>, answer in <answer>), in hdr's own words; it goes through the tokenizer's
chat template when the tokenizer has one.

The `compact` variant is for the tiny CPU policy (docs/cpu-bed.md): the prompt is
`Question: {question}\\n<search>`, so the policy writes ` query </search>`; the environment's
information block ends in `<answer>`, so the policy writes ` title </answer>`. Those opening
tags are part of the context, not of what the policy wrote; `response_prefix` and
`observation_suffix` name them so the action parser can prepend them to the turn's text.

The observation format is fixed by docs/design.md (Search-R1's): `Doc {k}(Title: {first line of
contents}) {rest}`, one per line, inside `\\n\\n<information>...</information>\\n\\n`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from core.config import StrictModel

SEARCH_OPEN, SEARCH_CLOSE = "<search>", "</search>"
ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"
INFO_OPEN, INFO_CLOSE = "<information>", "</information>"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
TAGS = (SEARCH_OPEN, SEARCH_CLOSE, ANSWER_OPEN, ANSWER_CLOSE, INFO_OPEN, INFO_CLOSE)
TAGS += (THINK_OPEN, THINK_CLOSE)
STOP_STRINGS = (SEARCH_CLOSE, ANSWER_CLOSE)

INSTRUCT_TEMPLATE = (
    "Answer the question below. Reason step by step inside <think> and </think> each time you"
    " learn something new. When you lack a fact, look it up by writing <search> your query"
    " </search>; the search engine's results come back between <information> and"
    " </information>. You may search as often as you need. When you are sure, write only the"
    " final answer between <answer> and </answer>, for example <answer> Paris </answer>.\n"
    "Question: {question}\n"
)
INSTRUCT_INVALID = (
    "\nThat was not a valid action. To search, write a query between the tags <search> and"
    " </search>. To give the final answer, write it between the tags <answer> and </answer>."
    " Try again.\n"
)
COMPACT_TEMPLATE = "Question: {question}\n"
COMPACT_INVALID = "\nInvalid. Search: <search> query </search>. Answer: <answer> title </answer>\n"


class PromptConfig(StrictModel):
    """The text of the prompt and of the environment's messages."""

    template: str = Field(
        INSTRUCT_TEMPLATE, description="User message; `{question}` is replaced by the question."
    )
    chat_template: bool = Field(
        True, description="Wrap the message in the tokenizer's chat template when it has one."
    )
    response_prefix: str = Field(
        "", description="Text appended after the prompt that opens the policy's first turn."
    )
    observation_suffix: str = Field(
        "", description="Text appended after each information block, opening the next turn."
    )
    invalid_action_message: str = Field(
        INSTRUCT_INVALID, description="Appended (mask 0) after a turn with no valid action."
    )

    @model_validator(mode="after")
    def _template_has_question(self) -> PromptConfig:
        if "{question}" not in self.template:
            raise ValueError("template must contain {question}")
        return self

    @classmethod
    def preset(cls, name: Literal["instruct", "compact"]) -> PromptConfig:
        """The two built-in variants: `instruct` (default) and `compact` (tiny models)."""
        if name == "instruct":
            return cls()
        return cls(
            template=COMPACT_TEMPLATE,
            chat_template=False,
            response_prefix=SEARCH_OPEN,
            observation_suffix=ANSWER_OPEN,
            invalid_action_message=COMPACT_INVALID,
        )


def user_message(config: PromptConfig, question: str) -> str:
    return config.template.replace("{question}", question.strip())


def prompt_text(config: PromptConfig, question: str, tokenizer) -> str:
    """The full prompt as text, ready to tokenize with `add_special_tokens=False`.

    With a chat template: the rendered conversation with the generation prompt. Without:
    the tokenizer's BOS (if any) + the message. Then `response_prefix`.
    """
    message = user_message(config, question)
    if config.chat_template and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": message}], add_generation_prompt=True, tokenize=False
        )
    else:
        text = (tokenizer.bos_token or "") + message
    return text + config.response_prefix


def format_documents(contents: list[str], doc_words: int | None = None) -> str:
    """`Doc k(Title: first line) rest` per document, one per line (Search-R1's format).

    `doc_words` keeps only the first words of each document's text, for tiny models.
    """
    lines = []
    for k, content in enumerate(contents, start=1):
        title, _, text = content.partition("\n")
        text = " ".join(text.split())
        if doc_words is not None:
            text = " ".join(text.split()[:doc_words])
        lines.append(f"Doc {k}(Title: {title}) {text}")
    return "\n".join(lines)


def observation_parts(body: str, config: PromptConfig) -> tuple[str, str, str]:
    """The information block as (head, body, tail); the body alone is cut to fit a budget."""
    return f"\n\n{INFO_OPEN}", body, f"{INFO_CLOSE}\n\n{config.observation_suffix}"
