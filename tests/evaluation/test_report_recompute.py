"""`hdr report --from DIR` recomputes an experiment's tables from its committed per-question,
per-seed evaluation files and run metrics (tests/evaluation/fixtures/report-sample)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "evaluation" / "fixtures" / "report-sample"


def hdr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "hdr.cli", *args], capture_output=True, text=True, cwd=REPO
    )


def test_the_tables_are_recomputed_as_the_experiment_made_them(tmp_path):
    done = hdr("report", "--from", str(SAMPLE), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads((tmp_path / "out" / "results.json").read_text())
    made = json.loads((SAMPLE / "pipeline-results.json").read_text())
    assert (
        list(got["arms"])
        == list(made["arms"])
        == ["on_policy", "on_policy_larger", "headroom_drift"]
    )
    for arm, numbers in made["arms"].items():
        assert got["arms"][arm]["per_seed"] == numbers["per_seed"]
        for mine, theirs in zip(
            got["arms"][arm]["costs_per_seed"], numbers["costs_per_seed"], strict=True
        ):
            # a ledger field added after the sample was made (cost_gate_tf_tokens) reads 0
            assert {k: mine[k] for k in theirs} == pytest.approx(theirs, nan_ok=True)
            assert all(mine[k] == 0 for k in mine.keys() - theirs.keys())
    for mine, theirs in zip(got["contrasts"], made["contrasts"], strict=True):
        assert {k: mine[k] for k in theirs} == pytest.approx(theirs)
    # the ledger is real work, not zeros: larger arm rolled out 1.5x the fresh groups
    ledger = {a: got["arms"][a]["costs_per_seed"][0]["cost_fresh_groups"] for a in got["arms"]}
    assert ledger["on_policy_larger"] == 1.5 * ledger["on_policy"] > 0
    md = (tmp_path / "out" / "results.md").read_text()
    assert md in done.stdout and "Cost ledger per run" in md and "rho = 1000" in md
    assert "| **primary** | headroom_drift − on_policy |" in md


def test_a_folder_that_is_no_experiment_is_one_line_and_exit_2(tmp_path):
    done = hdr("report", "--from", str(tmp_path))
    assert done.returncode == 2 and "no experiment_config.json" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
