"""The docs stay a reference a newcomer can read: the pages under docs/ (the dated notebook in
docs/notebook/ left out) hold at most 2,500 lines in all and README.md at most 90, no reference
page dates a measurement (what was measured when belongs in the notebook), and every relative
link in the README, the reference and the notebook reaches a file and, into a page, a heading."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
NOTEBOOK = DOCS / "notebook"
DOCS_LINES = 2500
README_LINES = 90
DATE = re.compile(r"\b20\d\d-[01]\d-[0-3]\d\b")


def reference_pages() -> list[Path]:
    return sorted(DOCS.glob("*.md"))  # one level: the notebook's pages are not the reference


def line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_the_reference_fits_its_budget() -> None:
    pages = {page.name: line_count(page) for page in reference_pages()}
    assert {"design.md", "results.md", "trainer.md", "retrieval.md"} <= set(pages)
    assert sum(pages.values()) <= DOCS_LINES, pages


def test_the_readme_fits_its_budget() -> None:
    assert line_count(REPO / "README.md") <= README_LINES


def test_the_notebook_is_linked_from_the_reference_and_left_out_of_its_count() -> None:
    assert (NOTEBOOK / "README.md").is_file()
    assert "notebook/" in (REPO / "README.md").read_text()
    assert all(page.parent == DOCS for page in reference_pages())


def test_no_reference_page_dates_a_measurement() -> None:
    dated = [
        f"{page.name}:{number}"
        for page in [REPO / "README.md", *reference_pages()]
        for number, line in enumerate(page.read_text().splitlines(), start=1)
        if DATE.search(line)
    ]
    assert dated == []


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.replace("`", "").strip().lower()).replace(" ", "-")


def unfenced(path: Path) -> str:
    return re.sub(r"```.*?```", "", path.read_text(), flags=re.S)


def prose(path: Path) -> str:
    """The page without its fenced blocks and inline code, where brackets are not links."""
    return re.sub(r"`[^`]*`", "", unfenced(path))


def broken_links(pages: list[Path]) -> list[str]:
    """One line for each relative link of `pages` that reaches no file, or no heading of the
    page it names."""
    bad = []
    for page in pages:
        for match in re.finditer(r"\]\(([^)\s]+)\)", prose(page)):
            target = match.group(1)
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                bad.append(f"{page.name}: {target}: no such file")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", unfenced(dest), re.M)
                if anchor not in {slug(h) for h in headings}:
                    bad.append(f"{page.name}: {target}: no such heading")
    return bad


def test_every_link_of_the_docs_reaches_its_page_and_heading() -> None:
    pages = [REPO / "README.md", *reference_pages(), *sorted(NOTEBOOK.glob("*.md"))]
    assert len(pages) > 10
    assert broken_links(pages) == []


def notebook_entries() -> list[tuple[str, str, str]]:
    """(page, heading, the line after it) of every entry (a `## ` heading) of the notebook."""
    entries = []
    for page in sorted(NOTEBOOK.glob("*.md")):
        if page.name != "README.md":
            for match in re.finditer(r"^## (.+)\n\n(.*)$", unfenced(page), re.M):
                entries.append((page.name, match.group(1), match.group(2)))
    return entries


def test_every_notebook_entry_is_dated_and_in_the_notebooks_index() -> None:
    entries = notebook_entries()
    assert len(entries) > 20
    undated = [f"{page}: {heading}" for page, heading, after in entries
               if not re.match(r"\*Written 20\d\d-\d\d-\d\d", after)]  # fmt: skip
    assert undated == []
    index = (NOTEBOOK / "README.md").read_text()
    missing = [f"{page}: {heading}" for page, heading, _ in entries
               if f"]({page}#{slug(heading)})" not in index]  # fmt: skip
    assert missing == []


def test_the_link_check_finds_a_missing_page_and_a_missing_heading(tmp_path: Path) -> None:
    """The checker itself."""
    (tmp_path / "a.md").write_text(
        "# A page\n\nSee [b](b.md#the-part), [gone](gone.md), [b's top](b.md#b-page), "
        "[here](#a-page), [away](https://example.org/x) and `[not](a-link.md)`.\n"
    )
    (tmp_path / "b.md").write_text("# B page\n\n## Another part\n")
    assert broken_links([tmp_path / "a.md"]) == [
        "a.md: b.md#the-part: no such heading",
        "a.md: gone.md: no such file",
    ]


def test_the_date_rule_finds_a_dated_line() -> None:
    assert DATE.search("Measured 2026-12-03 on 2 cores") and not DATE.search("lr 2e-3, 12 steps")
