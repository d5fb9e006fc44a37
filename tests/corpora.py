"""Test corpora: the wiki-18 sample and how the small corpus is made.

`fixtures/wiki18_sample.jsonl` holds ten real passages of Search-R1's wiki-18 corpus, in its
format, kept in the repository so a clone tests on its own.

Import as `from corpora import ...` (pytest puts `tests/` on sys.path).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent / "fixtures"
WIKI18_SAMPLE = FIXTURES / "wiki18_sample.jsonl"  # 10 real Search-R1 passages, ids "0".."9"
SMALL_CORPUS_ARTICLES = 300


def write_small_corpus(path: Path, articles: int = SMALL_CORPUS_ARTICLES) -> Path:
    """The wiki-18 sample (lines 0-9) then the first `articles` vital articles, package order."""
    from retrieval_server.index.corpus import article_contents, iter_vital_articles, write_corpus

    sample = [json.loads(line)["contents"] for line in WIKI18_SAMPLE.read_text().splitlines()]
    vital = itertools.islice(iter_vital_articles(), articles)
    write_corpus(path, [*sample, *(article_contents(article) for article in vital)])
    return path


def write_small_qa(path: Path, articles: int = SMALL_CORPUS_ARTICLES) -> Path:
    """FlashRAG JSONL of the small corpus's vital articles: description -> title (descriptions
    that several articles share are left out)."""
    from collections import Counter

    from retrieval_server.index.corpus import iter_vital_articles

    found = list(itertools.islice(iter_vital_articles(), articles))
    counts = Counter(a.description.strip() for a in found)
    with path.open("w") as f:
        for i, a in enumerate(found):
            q = a.description.strip()
            if q and counts[q] == 1:
                f.write(json.dumps({"id": str(i), "question": q, "golden_answers": [a.title]}))
                f.write("\n")
    return path
