"""The primitive's example in docs/integrations.md runs as written (it cannot rot): stored
groups, a scan, a drift gate, on plain tensors."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SECTION = "## The replay primitive in another trainer"


def doc_example() -> str:
    text = (REPO / "docs" / "integrations.md").read_text()
    section = text[text.index(SECTION) :]
    return re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)


def test_the_documented_example_runs_and_gates_by_drift():
    code = doc_example()
    assert "from trainer.primitive import GroupReplay" in code
    assert 30 <= len(code.splitlines()) <= 40
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split(":")[0] for line in lines] == [f"step {k}" for k in range(1, 6)]
    scanned = [int(re.search(r"scanned (\d+)", line).group(1)) for line in lines]
    replayed = [len(re.findall(r"'s\d+/\d+'", line)) for line in lines]
    assert scanned[0] == 0 and replayed[0] == 0  # nothing stored before step 1's ingress
    assert all(r == 2 for r in replayed[1:])  # the budget
    assert any(s > r for s, r in zip(scanned, replayed, strict=True))  # the gate refused some
