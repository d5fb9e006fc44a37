"""The repository stands on its own: no file points outside it to the project's notes."""

from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_no_file_refers_to_shared_notes_outside_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "README.md" in files and "docs/design.md" in files and "docs/cpu-bed.md" in files
    outside = "../" + "shared"  # spelled in two parts so this file does not match itself
    offenders = [
        name
        for name in files
        if (REPO / name).is_file()
        and outside in (REPO / name).read_bytes().decode("utf-8", errors="ignore")
    ]
    assert offenders == []
