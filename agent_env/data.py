"""QA data: FlashRAG JSONL, Search-R1 parquet, and the embedded `wiki-vital` task.

`wiki-vital` is built from the embedded corpus (English Wikipedia vital-article summaries):
the question is an article's short description ("1968 film by Stanley Kubrick"), the answer
its title. Descriptions that several articles share ("Country in Europe") are dropped, since
they have no single answer, and so are empty ones. The split is by a hash of the title
(md5 mod 10 == 0 is test, about 10%), so it never changes when articles are added or reordered.
The training questions split once more, by the same hash, into `sft` (seven eighths) and
`rl` (one eighth), so a supervised start, RL and the test can use disjoint questions; `train`
is both. (A tiny policy needs most of the questions to learn to copy one into its search: on
three quarters the start had not begun to copy after 6 epochs.)
Example ids are the article's position in the package file (= its corpus line id as written
by `hdr index prepare-wiki`), prefixed with the data source as every QAExample id is.

`wiki-bridge` is the multi-turn embedded task, bridge questions that need two searches. A
bridge article A (unique non-empty description, title at least two characters) is *named*
by exactly one other article B: A's title occurs, as whole words, in B's summary and in no
other summary. The question gives A only by its description ("Which article mentions:
Buddhist temple complex in Cambodia"), the answer is B's title ("Suryavarman II"). So a
policy must first search the description to learn A's title, then search that title to find
the one article naming it. Pairs where the question shares a word (4+ letters) with B's
title are dropped, since one search could then find B directly. The split is by a hash of
A's title, as wiki-vital's; ids are `wiki-bridge/{A's file position}`.

Search-R1's parquet files carry the whole instruction prompt rather than the question; the
loader takes the `question` column when the file has one (Search-R1's own scripts keep it)
and otherwise the text after the last "Question:" of the user message.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import Field

from core.config import StrictModel
from core.errors import UserError, warn

WIKI_VITAL = "wiki-vital"
WIKI_BRIDGE = "wiki-bridge"
BRIDGE_TEMPLATE = "Which article mentions: {description}"
_SPLIT_NAMES = {"train", "dev", "test", "val", "valid", "validation"}


@dataclass(frozen=True)
class QAExample:
    """One question. `id` is unique across datasets: `"{data_source}/{id}"`."""

    id: str
    question: str
    golden_answers: list[str] = field(hash=False)
    data_source: str


def _flashrag_source(path: Path) -> str:
    return path.parent.name if path.stem in _SPLIT_NAMES else path.stem


def load_flashrag_jsonl(path: str | Path, data_source: str | None = None) -> list[QAExample]:
    """FlashRAG JSONL: one `{"id", "question", "golden_answers"}` object per line.

    `data_source` defaults to the dataset's directory name for `nq/test.jsonl`-style paths,
    else to the file stem.
    """
    path = Path(path)
    if not path.is_file():
        raise UserError(f"dataset file not found: {path}")
    source = data_source or _flashrag_source(path)
    examples = []
    empty_gold: list[int] = []  # line numbers of questions no answer can match
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise UserError(f"{path}:{n}: not a FlashRAG QA line: not JSON ({err})") from None
            if not isinstance(row, dict):
                raise UserError(f"{path}:{n}: not a FlashRAG QA line: not a JSON object")
            missing = [key for key in ("question", "golden_answers") if key not in row]
            if missing:
                raise UserError(
                    f"{path}:{n}: not a FlashRAG QA line: missing key {', '.join(missing)}"
                    f" (found: {', '.join(row) or 'none'})"
                )
            answers = row["golden_answers"]
            if not isinstance(answers, str | list):
                raise UserError(
                    f"{path}:{n}: golden_answers must be a list of strings, not"
                    f" {type(answers).__name__}"
                )
            answers = [answers] if isinstance(answers, str) else [str(a) for a in answers]
            if not [a for a in answers if a.strip()]:
                empty_gold.append(n)
            examples.append(
                QAExample(
                    id=f"{source}/{row.get('id', n - 1)}",
                    question=str(row["question"]),
                    golden_answers=answers,
                    data_source=source,
                )
            )
    if empty_gold:
        warn(
            f"{path}: {len(empty_gold)} of {len(examples)} questions have no golden answer"
            f" (an empty golden_answers; first on line {empty_gold[0]}): no response can be"
            " scored correct on them"
        )
    return examples


_QUESTION = re.compile(r"Question:\s*(.*?)\s*$", re.DOTALL)


def _question_from_prompt(prompt) -> str:
    messages = list(prompt)
    content = messages[-1]["content"] if messages else ""
    idx = content.rfind("Question:")
    if idx < 0:
        raise ValueError("prompt has no 'Question:'")
    return _QUESTION.match(content[idx:]).group(1)


def load_searchr1_parquet(path: str | Path) -> list[QAExample]:
    """Search-R1 parquet: `prompt` (chat messages), `reward_model.ground_truth.target`,
    `data_source`; optional `id`, `question`, `extra_info.index`."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise UserError(f"dataset file not found: {path}")
    rows = pq.read_table(path).to_pylist()
    examples = []
    for n, row in enumerate(rows):
        try:
            source = str(row["data_source"])
            question = row.get("question") or _question_from_prompt(row["prompt"])
            target = row["reward_model"]["ground_truth"]["target"]
            index = row.get("id")
            if index is None:
                index = (row.get("extra_info") or {}).get("index", n)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise UserError(f"{path}: row {n} is not a Search-R1 QA row ({err})") from None
        examples.append(
            QAExample(
                id=f"{source}/{index}",
                question=str(question).strip(),
                golden_answers=[target] if isinstance(target, str) else [str(t) for t in target],
                data_source=source,
            )
        )
    return examples


def is_test_title(title: str) -> bool:
    """The wiki-vital split: md5 of the title, as an integer, mod 10 == 0 is test."""
    return int(hashlib.md5(title.encode("utf-8")).hexdigest(), 16) % 10 == 0


SPLITS = ("all", "train", "sft", "rl", "test")


def split_of(title: str) -> str:
    """The finest split a title falls in: `test` (md5 mod 10 == 0, as `is_test_title`), else
    `rl` when the quotient's remainder mod 8 is 0 (an eighth of the training questions), else
    `sft`."""
    digest = int(hashlib.md5(title.encode("utf-8")).hexdigest(), 16)
    if digest % 10 == 0:
        return "test"
    return "rl" if (digest // 10) % 8 == 0 else "sft"


def in_split(title: str, split: str) -> bool:
    """Whether a title belongs to `split` (one of `SPLITS`; `train` is `sft` + `rl`)."""
    if split not in SPLITS:
        raise UserError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    finest = split_of(title)
    return split == "all" or finest == split or (split == "train" and finest != "test")


def wiki_vital_examples(split: str = "test") -> list[QAExample]:
    """The embedded task: description -> title, unique non-empty descriptions only."""
    from retrieval_server.index.corpus import iter_vital_articles

    if split not in SPLITS:
        raise UserError(f"unknown wiki-vital split {split!r}; valid: {', '.join(SPLITS)}")
    articles = list(iter_vital_articles())
    counts = Counter(a.description.strip() for a in articles)
    examples = []
    for i, article in enumerate(articles):
        question = article.description.strip()
        if not question or counts[question] > 1:
            continue
        if not in_split(article.title, split):
            continue
        examples.append(
            QAExample(
                id=f"{WIKI_VITAL}/{i}",
                question=question,
                golden_answers=[article.title],
                data_source=WIKI_VITAL,
            )
        )
    return examples


_WORD = re.compile(r"\w+")


def _content_words(text: str) -> set[str]:
    """Lower-cased 5-letter stems of the words of 4+ letters ("elephants" ~ "Elephant")."""
    return {w.lower()[:5] for w in _WORD.findall(text) if len(w) >= 4}


def bridge_pairs(articles: list) -> list[tuple[int, int]]:
    """(bridge A, answer B) article positions: B's summary is the only one naming A's title
    (whole words, case-sensitive), A's description is unique, non-empty and shares no word of
    4+ letters with B's title. In A's file order; deterministic."""
    by_word: dict[str, set[int]] = {}
    for i, article in enumerate(articles):
        for word in set(_WORD.findall(article.extract)):
            by_word.setdefault(word, set()).add(i)
    descriptions = Counter(a.description.strip() for a in articles)
    pairs = []
    for i, a in enumerate(articles):
        description, words = a.description.strip(), _WORD.findall(a.title)
        if not description or descriptions[description] > 1 or len(a.title) < 2 or not words:
            continue
        postings = sorted((by_word.get(w, set()) for w in words), key=len)  # smallest first
        candidates = set(postings[0]).intersection(*postings[1:]) - {i}
        named = re.compile(r"(?<!\w)" + re.escape(a.title) + r"(?!\w)")
        namers = [j for j in sorted(candidates) if named.search(articles[j].extract)]
        if len(namers) != 1:
            continue
        question = BRIDGE_TEMPLATE.format(description=description)
        if _content_words(question) & _content_words(articles[namers[0]].title):
            continue
        pairs.append((i, namers[0]))
    return pairs


def wiki_bridge_examples(split: str = "test", limit: int | None = None) -> list[QAExample]:
    """The multi-turn embedded task (see the module docstring); `limit`: only the first
    `limit` articles of the corpus take part (the tests' small index holds only those)."""
    import itertools

    from retrieval_server.index.corpus import iter_vital_articles

    if split not in SPLITS:
        raise UserError(f"unknown wiki-bridge split {split!r}; valid: {', '.join(SPLITS)}")
    articles = list(itertools.islice(iter_vital_articles(), limit))
    examples = []
    for i, j in bridge_pairs(articles):
        bridge = articles[i]
        if not in_split(bridge.title, split):
            continue
        examples.append(
            QAExample(
                id=f"{WIKI_BRIDGE}/{i}",
                question=BRIDGE_TEMPLATE.format(description=bridge.description.strip()),
                golden_answers=[articles[j].title],
                data_source=WIKI_BRIDGE,
            )
        )
    return examples


POOL_SEED = 10_009  # the pool's own seed: the same questions whatever the run's seed


def question_pool(examples: list[QAExample], size: int | None) -> list[QAExample]:
    """A fixed subset of `size` questions (the first of a permutation under `POOL_SEED`, in
    their original order), or all of them when `size` is None or not smaller. Runs of any
    seed draw their prompts from the same pool, so a small pool is seen many times over; a
    smaller pool lies inside a larger one."""
    if size is None or size >= len(examples):
        return examples
    import numpy as np

    chosen = np.random.default_rng(POOL_SEED).permutation(len(examples))[:size]
    return [examples[int(i)] for i in sorted(chosen)]


def load_task(spec: str, split: str = "test") -> list[QAExample]:
    """`wiki-vital` or `wiki-bridge` (with `split`), or a path: `.jsonl` (FlashRAG) or
    `.parquet` (Search-R1)."""
    if spec == WIKI_VITAL:
        return wiki_vital_examples(split)
    if spec == WIKI_BRIDGE:
        return wiki_bridge_examples(split)
    path = Path(spec)
    if path.suffix == ".jsonl":
        return load_flashrag_jsonl(path)
    if path.suffix == ".parquet":
        return load_searchr1_parquet(path)
    raise UserError(
        f"unknown task {spec!r}; give {WIKI_VITAL}, {WIKI_BRIDGE}, a .jsonl or a .parquet file"
    )


HELDOUT_SEED = 10_007  # mixed with the run's seed: the held-out subset's own stream


def heldout_subset(examples: list[QAExample], seed: int, size: int) -> list[QAExample]:
    """A fixed held-out subset: the first `size` of a seeded shuffle."""
    import numpy as np

    perm = np.random.default_rng([seed, HELDOUT_SEED]).permutation(len(examples))
    return [examples[int(i)] for i in perm[:size]]


class DataConfig(StrictModel):
    """Where training and held-out questions come from (`load_task` specs)."""

    train: str = Field("wiki-vital", description="Training task: `wiki-vital` or a data file.")
    train_split: str = Field("train", description="Split of the training task.")
    eval: str = Field("wiki-vital", description="Held-out task for the periodic evaluation.")
    eval_split: str = Field("test", description="Split of the held-out task.")
    train_questions: int | None = Field(
        None,
        ge=1,
        description="RL pool size: train on only this many of the training questions, a fixed"
        " subset that is the same for every run seed (`question_pool`); None: all."
        " The pool-size diagnostic trains on 32 to ask whether distinct questions matter.",
    )


def load_questions(
    data: DataConfig, seed: int, heldout: int
) -> tuple[list[QAExample], list[QAExample]]:
    """A run's training questions (its pool, `data.train_questions`) and the fixed held-out
    subset of `heldout` questions, read (and checked) before any model is loaded: a missing
    data file fails at once, not minutes in."""
    train = question_pool(load_task(data.train, data.train_split), data.train_questions)
    if not train:
        raise UserError(f"training task {data.train!r} has no questions")
    return train, heldout_subset(load_task(data.eval, data.eval_split), seed, heldout)
