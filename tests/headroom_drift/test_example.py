"""The primitive's example in docs/integrations.md runs as written (it cannot rot): a plain
PyTorch GRPO loop, not hdr's, in which stored groups are re-scored, gated by drift and trained
on beside the fresh ones, and the policy learns."""

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


def test_the_documented_loop_learns_with_gated_replay():
    code = doc_example()
    assert "from headroom_drift import" in code and "trainer" not in code
    assert len(code.splitlines()) < 40
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    rows = [re.fullmatch(r"step (\d+): reward ([\d.]+), scanned (\d+), replayed (\d+)", line)
            for line in done.stdout.splitlines()]  # fmt: skip
    assert all(rows) and [int(r[1]) for r in rows] == list(range(1, 41))
    reward, scanned, replayed = ([float(r[k]) for r in rows] for k in (2, 3, 4))
    assert replayed[0] == 0  # nothing stored before step 1's ingress
    assert sum(replayed) >= 20 and max(replayed) == 2  # replay happens, within the budget
    assert any(s > r for s, r in zip(scanned, replayed, strict=True))  # the gate refused some
    assert sum(reward[-5:]) / 5 > sum(reward[:5]) / 5 + 0.3  # the policy learnt the task
