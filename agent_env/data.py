"""QA data: FlashRAG JSONL, Search-R1 parquet, and the embedded `wiki-vital` task.

`wiki-vital` is built from the embedded corpus (English Wikipedia vital-article summaries):
the question is an article's short description ("1968 film by Stanley Kubrick"), the answer
its title. Descriptions that several articles share ("Country in Europe") are dropped, since
they have no single answer, and so are empty ones. The split is by a hash of the title
(md5 mod 10 == 0 is test, about 10%), so it never changes when articles are added or reordered.
Example ids are the article's position in the package file (= its corpus line id as written
by `hdr index prepare-wiki`), prefixed with the data source as every QAExample id is.

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

from hdr.errors import UserError

WIKI_VITAL = "wiki-vital"
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
    with path.open() as f:
        for n, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                answers = row["golden_answers"]
                examples.append(
                    QAExample(
                        id=f"{source}/{row.get('id', n - 1)}",
                        question=str(row["question"]),
                        golden_answers=[answers] if isinstance(answers, str) else list(answers),
                        data_source=source,
                    )
                )
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise UserError(f"{path}:{n}: not a FlashRAG QA line ({err})") from None
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


def wiki_vital_examples(split: str = "test") -> list[QAExample]:
    """The embedded task: description -> title, unique non-empty descriptions only."""
    from retrieval_server.corpus import iter_vital_articles

    if split not in ("train", "test", "all"):
        raise UserError(f"unknown wiki-vital split {split!r}; valid: all, test, train")
    articles = list(iter_vital_articles())
    counts = Counter(a.description.strip() for a in articles)
    examples = []
    for i, article in enumerate(articles):
        question = article.description.strip()
        if not question or counts[question] > 1:
            continue
        if split != "all" and is_test_title(article.title) != (split == "test"):
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


def load_task(spec: str, split: str = "test") -> list[QAExample]:
    """`wiki-vital` (with `split`), or a path: `.jsonl` (FlashRAG) or `.parquet` (Search-R1)."""
    if spec == WIKI_VITAL:
        return wiki_vital_examples(split)
    path = Path(spec)
    if path.suffix == ".jsonl":
        return load_flashrag_jsonl(path)
    if path.suffix == ".parquet":
        return load_searchr1_parquet(path)
    raise UserError(f"unknown task {spec!r}; give {WIKI_VITAL}, a .jsonl or a .parquet file")
