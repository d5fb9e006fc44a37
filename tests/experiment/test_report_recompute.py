"""`hdr report --from DIR` recomputes an experiment's tables from its committed per-question,
per-seed evaluation files and run metrics (tests/experiment/fixtures/report-sample)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "tests" / "experiment" / "fixtures" / "report-sample"


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
            # a ledger field added after the sample was made (cost_gate_tf_tokens) reads 0,
            # but the billed search calls: every call was billed before the split
            assert {k: mine[k] for k in theirs} == pytest.approx(theirs, nan_ok=True)
            added = mine.keys() - theirs.keys()
            assert mine["cost_billed_search_calls"] == mine["cost_search_calls"] > 0
            assert all(mine[k] == 0 for k in added - {"cost_billed_search_calls"})
    for mine, theirs in zip(got["contrasts"], made["contrasts"], strict=True):
        assert {k: mine[k] for k in theirs} == pytest.approx(theirs)
    # the ledger is real work, not zeros: larger arm rolled out 1.5x the fresh groups
    ledger = {a: got["arms"][a]["costs_per_seed"][0]["cost_fresh_groups"] for a in got["arms"]}
    assert ledger["on_policy_larger"] == 1.5 * ledger["on_policy"] > 0
    md = (tmp_path / "out" / "results.md").read_text()
    assert md in done.stdout and "Cost ledger per run" in md and "rho = 1000" in md
    assert "| **primary** | headroom_drift − on_policy |" in md
    # the charts are drawn again from the same files, the modelled-cost curve among them
    charts = json.loads((tmp_path / "out" / "charts" / "charts.json").read_text())["charts"]
    assert "contrasts_vs_modelled_cost.png" in charts and "heldout_vs_env_calls.png" in charts
    assert all((tmp_path / "out" / "charts" / name).stat().st_size > 1000 for name in charts)
    assert "(charts/contrasts_vs_modelled_cost.png)" in md


def test_a_folder_that_is_no_experiment_is_one_line_and_exit_2(tmp_path):
    done = hdr("report", "--from", str(tmp_path))
    assert done.returncode == 2 and "no experiment_config.json" in done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_an_export_holds_what_the_recompute_reads_and_recomputes_the_same(tmp_path):
    """`--export`: the evidence of every finished run (evaluations gzipped) in a new folder,
    from which `hdr report` makes the same numbers; a second export needs --force, and only
    replaces the export's own files."""
    export = tmp_path / "evidence"
    done = hdr("report", "--from", str(SAMPLE), "--export", str(export))
    assert done.returncode == 0, done.stderr[-2000:]
    gzipped = sorted(p.relative_to(export).as_posix() for p in export.rglob("*.json.gz"))
    assert "sft_start/eval.json.gz" in gzipped and len(gzipped) == 1 + len(
        list(SAMPLE.glob("runs/*/seed-*/heldout/eval.json"))
    )
    assert not list(export.rglob("eval.json"))
    again = hdr("report", "--from", str(export), "--out", str(tmp_path / "out"))
    assert again.returncode == 0, again.stderr[-2000:]
    got = json.loads((tmp_path / "out" / "results.json").read_text())
    made = json.loads((SAMPLE / "pipeline-results.json").read_text())
    for arm, numbers in made["arms"].items():
        assert got["arms"][arm]["per_seed"] == numbers["per_seed"]
    refused = hdr("report", "--from", str(SAMPLE), "--export", str(export))
    assert refused.returncode == 2 and "already holds an experiment" in refused.stderr
    (export / "notes.txt").write_text("mine")
    forced = hdr("report", "--from", str(SAMPLE), "--export", str(export), "--force")
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert (export / "notes.txt").read_text() == "mine"


def test_the_results_can_sit_beside_their_exported_evidence(tmp_path):
    """`--export D --out D`: one folder to commit holds the evidence and the verdict made from
    it, the same tables as a recompute from the folder itself; replacing both needs --force."""
    export = tmp_path / "evidence"
    done = hdr("report", "--from", str(SAMPLE), "--export", str(export), "--out", str(export))
    assert done.returncode == 0, done.stderr[-2000:]
    assert list(export.glob("runs/*/seed-*/heldout/eval.json.gz"))
    beside = (export / "results.md").read_text()
    assert "| **primary** | headroom_drift − on_policy |" in beside
    assert (export / "charts" / "charts.json").is_file()
    again = hdr("report", "--from", str(export), "--out", str(tmp_path / "out"))
    assert again.returncode == 0, again.stderr[-2000:]
    assert (tmp_path / "out" / "results.md").read_text() == beside
    refused = hdr("report", "--from", str(SAMPLE), "--export", str(export), "--out", str(export))
    assert refused.returncode == 2 and "already holds an experiment" in refused.stderr
    (export / "results.md").write_text("stale")
    forced = hdr(
        "report", "--from", str(SAMPLE), "--export", str(export), "--out", str(export), "--force"
    )
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert (export / "results.md").read_text() == beside


def test_an_export_that_git_would_leave_out_says_so(tmp_path):
    """An export is made to be committed: where the work tree's ignore rules skip its files
    (a `runs/` rule once swallowed a pilot's whole evidence), `hdr report --export` warns,
    naming the rule, and still writes every file."""
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    (tmp_path / ".gitignore").write_text("runs/\n")
    export = tmp_path / "docs" / "evidence"
    done = hdr("report", "--from", str(SAMPLE), "--export", str(export))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "warning: git ignores" in done.stderr and "runs/ (.gitignore:1)" in done.stderr
    assert list(export.glob("runs/*/seed-*/heldout/eval.json.gz"))
    (tmp_path / ".gitignore").write_text("/runs/\n")  # the root's runs only: nothing skipped
    again = hdr("report", "--from", str(SAMPLE), "--export", str(export), "--force")
    assert again.returncode == 0 and "warning" not in again.stderr, again.stderr[-2000:]


@pytest.mark.skipif(not (REPO / ".git").exists(), reason="not a git checkout")
def test_the_projects_own_ignore_rules_keep_exported_evidence(tmp_path):
    """docs/results/<experiment>/runs/... is committed evidence, not a run folder to ignore."""
    from experiment.recompute import ignored_by_git

    names = [Path("pilot/runs/on_policy/seed-1/heldout/eval.json.gz")]
    assert ignored_by_git(REPO / "docs" / "results", names) == []
    assert ignored_by_git(REPO, [Path("runs/pilot/experiment_config.json")]) != []


def test_the_pool_check_and_dose_screen_are_reported_from_the_runs_files(tmp_path):
    """The pool-size diagnostic on a tiny case: the sample's runs (2 seeds x 16 questions),
    declared after the fact as a pool check (`on_policy_larger` as the whole pool, `on_policy`
    as the small one) and a dose screen (1.5x at equal updates). results.json carries both
    gains and their difference, equal to the per-question files read directly."""
    import shutil

    import numpy as np

    from evaluation.evaluate import load_report, report_file

    sample = tmp_path / "sample"
    shutil.copytree(SAMPLE, sample)
    path = sample / "experiment_config.json"
    config = json.loads(path.read_text())
    config["pool_check"] = {"arm": "on_policy_larger", "pool_arm": "on_policy", "margin": 0.05}
    config["dose_screen"] = {
        "arm": "on_policy_larger", "reference": "on_policy", "dose_ratio": 1.5, "needed": 0.01
    }  # fmt: skip
    path.write_text(json.dumps(config))
    done = hdr("report", "--from", str(sample), "--out", str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads((tmp_path / "out" / "results.json").read_text())

    def scores(arm: str) -> np.ndarray:  # (seeds, questions) Mean@k, read from the files
        runs = [sample / "runs" / arm / f"seed-{s}" / "heldout" / "eval.json" for s in (1, 2)]
        return np.stack([load_report(report_file(r)).per_question("mean") for r in runs])

    start = load_report(report_file(sample / "sft_start" / "eval.json")).per_question("mean")
    larger, plain = scores("on_policy_larger"), scores("on_policy")
    check = got["pool_check"]
    assert check["seeds"] == [1, 2] and check["questions"] == 16
    assert check["full_gain"]["estimate"] == pytest.approx(float((larger - start).mean()))
    assert check["pool_gain"]["estimate"] == pytest.approx(float((plain - start).mean()))
    assert check["difference"]["estimate"] == pytest.approx(float((larger - plain).mean()))
    assert (
        check["difference"]["low"] < check["difference"]["estimate"] < check["difference"]["high"]
    )
    assert check["equivalence"]["margin"] == 0.05 and check["verdict"]
    screen = got["dose_screen"]
    assert screen["gain"]["estimate"] == pytest.approx(check["difference"]["estimate"])
    assert screen["projected_step"] == pytest.approx(screen["gain"]["estimate"])  # 1.5x of 1.5x
    md = (tmp_path / "out" / "results.md").read_text()
    assert "**Pool-size check (declared before the runs):" in md and "**Dose screen" in md


def test_before_any_run_finishes_the_evaluated_start_is_exported_alone(tmp_path):
    """A session may end before a run finishes: the start's evaluation is exported so the next
    one reuses it; a folder with neither is one line and exit 2."""
    source = tmp_path / "experiment"
    (source / "sft_start").mkdir(parents=True)
    for name in ("experiment_config.json", "sft_start/eval.json"):
        (source / name).write_bytes((SAMPLE / name).read_bytes())
    export = tmp_path / "evidence"
    done = hdr("report", "--from", str(source), "--export", str(export))
    assert done.returncode == 0, done.stderr[-2000:]
    assert "no run has finished yet" in done.stdout
    got = sorted(p.relative_to(export).as_posix() for p in export.rglob("*") if p.is_file())
    assert got == ["experiment_config.json", "sft_start/eval.json.gz"]
    (source / "sft_start" / "eval.json").unlink()
    empty = hdr("report", "--from", str(source), "--export", str(tmp_path / "other"))
    assert empty.returncode == 2 and "nor evaluated SFT start" in empty.stderr
    assert len(empty.stderr.strip().splitlines()) == 1
