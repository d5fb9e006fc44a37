"""The embedded corpus reader and the Search-R1 passage format."""

from __future__ import annotations

import json
from pathlib import Path

from corpora import SMALL_CORPUS_ARTICLES, WIKI18_SAMPLE

from retrieval_server.index.corpus import (
    article_contents,
    format_contents,
    iter_vital_articles,
    split_contents,
)


def test_format_and_split_are_inverse() -> None:
    contents = format_contents('"Heroes" (album)', "A 1977 album by David Bowie.")
    assert contents == '""Heroes" (album)"\nA 1977 album by David Bowie.'
    assert split_contents(contents) == ('"Heroes" (album)', "A 1977 album by David Bowie.")


def test_split_reads_real_search_r1_passages() -> None:
    first = json.loads(WIKI18_SAMPLE.read_text().splitlines()[0])
    title, text = split_contents(first["contents"])
    assert title == "Evan Morris"
    assert text.startswith("Evan Morris Evan L. Morris")


def test_vital_articles_come_in_package_order_with_text() -> None:
    articles = list(iter_vital_articles())
    assert len(articles) > 10_000
    assert articles[0].title == "20th-century classical music"
    assert all(article.title and article.extract for article in articles)
    assert len({article.title for article in articles}) == len(articles)


def test_article_contents_is_one_line_of_text_under_a_quoted_title() -> None:
    article = next(a for a in iter_vital_articles() if "\n" in a.extract)
    title, text = split_contents(article_contents(article))
    assert title == article.title
    assert "\n" not in text and "  " not in text


def test_small_corpus_numbers_lines_and_keeps_the_fixture_passages(small_corpus: Path) -> None:
    lines = [json.loads(line) for line in small_corpus.read_text().splitlines()]
    sample = [json.loads(line) for line in WIKI18_SAMPLE.read_text().splitlines()]
    assert len(lines) == len(sample) + SMALL_CORPUS_ARTICLES
    assert [line["id"] for line in lines] == [str(i) for i in range(len(lines))]
    assert [line["contents"] for line in lines[: len(sample)]] == [s["contents"] for s in sample]
    assert split_contents(lines[len(sample)]["contents"])[0] == "20th-century classical music"
