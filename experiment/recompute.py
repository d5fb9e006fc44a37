"""`hdr report --from DIR`: every table of an experiment recomputed from its committed files.

DIR holds what `hdr experiment` wrote and a reader needs: `experiment_config.json`, and per
run `runs/<arm>/seed-<n>/` with `config.yaml` (the run's resolved TrainConfig), `metrics.jsonl`
(the cost ledger), `eval.jsonl` (the in-training curve) and `heldout/eval.json` (per
question and sample, which answers were correct); optionally `sft_start/eval.json`. Models,
checkpoints and TensorBoard files are not needed. `hdr report --from RUN --export DIR` copies
exactly those files of every finished run (the evaluation files gzipped, `eval.json.gz`, which
the recompute reads alike), a few MB for a whole experiment, to commit beside its results.
The summary is recomputed with the same code as the experiment's (`summarize`,
`results_markdown`), so the tables, contrasts, precondition and matched-cost rows come out as
the experiment's own results.md and results.json do, less the machine and server records;
with `--out` the charts are drawn again too.
"""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from core.errors import UserError
from evaluation.evaluate import GZIPPED, load_report, report_file
from experiment.config import ExperimentConfig
from experiment.config_history import read_as_today
from experiment.fingerprint import HASH_FILE
from experiment.report import results_markdown
from experiment.runs import RunResult
from experiment.summary import ExperimentSummary, summarize

# what a finished run keeps for the recompute (beside the top-level config and SFT evaluation)
RUN_EVIDENCE = ("config.yaml", "metrics.jsonl", "eval.jsonl", "heldout/eval.json")
# copied too where a run has it (fingerprint.HASH_FILE): the hash `hdr experiment` checks to
# take an exported run as finished in another session (runs.carried); the recompute needs it not
RUN_HASH = HASH_FILE
# copied too where a run has it: the groups that left its buffer, for the mechanism views
RUN_GROUPS = "groups.jsonl"


def read_config(root: Path) -> ExperimentConfig:
    path = root / "experiment_config.json"
    if not path.is_file():
        raise UserError(f"{root}: no experiment_config.json (is it an `hdr experiment` out dir?)")
    written: dict[str, Any] = json.loads(path.read_text())
    return ExperimentConfig.model_validate(read_as_today(written))  # older keys moved


def read_runs(root: Path, cfg: ExperimentConfig) -> list[RunResult]:
    """Every `runs/<arm>/seed-<n>` with a held-out evaluation, as the experiment had them, in
    the config's arm order (the tables' order), then by seed."""
    import yaml

    from evaluation.plots import read_jsonl

    results = []
    for run_dir in finished_runs(root):
        path = report_file(run_dir / "heldout" / "eval.json")
        for needed in ("config.yaml", "metrics.jsonl"):
            if not (run_dir / needed).is_file():
                raise UserError(f"{run_dir}: no {needed}; the recompute needs it")
        grpo = yaml.safe_load((run_dir / "config.yaml").read_text())["grpo"]
        results.append(
            RunResult(
                arm=run_dir.parent.name,
                seed=int(run_dir.name.removeprefix("seed-")),
                run_dir=run_dir,
                report=load_report(path),
                metrics=read_jsonl(run_dir / "metrics.jsonl"),
                rollouts_per_step=int(grpo["batch_prompts"]) * int(grpo["group_size"]),
            )
        )
    if not results:
        raise UserError(f"{root}: no runs/*/seed-*/heldout/eval.json to recompute from")
    order = {name: i for i, name in enumerate(cfg.arms)}
    return sorted(results, key=lambda r: (order.get(r.arm, len(order)), r.arm, r.seed))


def finished_runs(root: Path) -> list[Path]:
    """`runs/<arm>/seed-<n>` folders holding a held-out evaluation (plain or gzipped)."""
    return sorted(
        run for run in root.glob("runs/*/seed-*") if report_file(run / "heldout" / "eval.json")
    )


def recompute(
    root: str | Path, charts_dir: Path | None = None, replace_charts: bool = False
) -> tuple[ExperimentSummary, ExperimentConfig, str]:
    """The summary, the config and results.md of the experiment files under `root`; with
    `charts_dir` (a new folder, or earlier charts with `replace_charts`) the experiment's
    charts too, drawn from the same files and linked from results.md."""
    from evaluation.plots import load_run, plot_runs

    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--from {root}: not a folder")
    cfg = read_config(root)
    start = report_file(root / "sft_start" / "eval.json")
    sft_report = load_report(start) if start is not None else None
    runs = read_runs(root, cfg)
    summary = summarize(runs, cfg.references, sft_report, cfg)
    charts = None
    if charts_dir is not None:
        loaded = [load_run(r.run_dir, label=r.arm) for r in runs]
        modelled = (summary.modelled_cost, cfg.cost_model)
        charts = plot_runs(loaded, charts_dir, force=replace_charts, modelled_cost=modelled)
    return summary, cfg, results_markdown(summary, cfg, charts)


def export_evidence(root: str | Path, dest: Path) -> list[Path]:
    """Copy into `dest` (staged, then swapped in whole) what the recompute reads of the
    experiment at `root`: its config, its SFT start's evaluation and `RUN_EVIDENCE` of each
    finished run, the evaluation files gzipped (deterministically: no timestamp inside). Before
    any run has finished, the start's evaluation alone (which `hdr experiment` then reuses
    from a copy of the export instead of evaluating the start again).
    Returns the files written, relative to `dest`."""
    from core.paths import staging_dir, swap_in

    root = Path(root)
    read_config(root)  # an experiment, or one line saying it is not
    runs = finished_runs(root)
    start = report_file(root / "sft_start" / "eval.json")
    if not runs and start is None:
        raise UserError(
            f"{root}: no finished run (runs/*/seed-*/heldout/eval.json) nor evaluated SFT start"
            " (sft_start/eval.json) to export"
        )
    sources = [root / "experiment_config.json", *([start] if start else [])]
    for run_dir in runs:
        for name in RUN_EVIDENCE:
            found = report_file(run_dir / name) if name.endswith("eval.json") else None
            found = found or run_dir / name
            if not found.is_file():
                raise UserError(f"{run_dir}: no {name}; the recompute needs it")
            sources.append(found)
        sources += [run_dir / name for name in (RUN_HASH, RUN_GROUPS) if (run_dir / name).is_file()]
    staged = staging_dir(dest)
    written = []
    for source in sources:
        relative = source.relative_to(root)
        if source.name == "eval.json":
            relative = relative.with_name(source.name + GZIPPED)
        target = staged / relative
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.name == "eval.json":
            target.write_bytes(gzip.compress(source.read_bytes(), mtime=0))
        else:
            shutil.copyfile(source, target)
        written.append(relative)
    # an earlier export's files that this one lacks go; nothing else in `dest` is touched
    patterns = ["experiment_config.json", f"sft_start/eval.json{GZIPPED}"] + [
        f"runs/*/seed-*/{name}{GZIPPED if name.endswith('eval.json') else ''}"
        for name in (*RUN_EVIDENCE, RUN_HASH, RUN_GROUPS)
    ]
    previous = sorted(
        {p.relative_to(dest).as_posix() for pattern in patterns for p in dest.glob(pattern)}
    )
    swap_in(staged, dest, previous)
    return written


def ignored_by_git(dest: Path, written: list[Path]) -> list[str]:
    """The exported files (relative to `dest`) that the git work tree holding `dest` ignores,
    each with the rule that ignores it ("runs/ (.gitignore:8): runs/a/seed-1/config.yaml"):
    files an export meant for committing would silently leave out. Empty outside a work tree
    or without git."""
    paths = "".join(f"{dest / name}\n" for name in written)
    try:
        found = subprocess.run(
            ["git", "-C", str(dest), "check-ignore", "--verbose", "--stdin"],
            input=paths, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return []
    if found.returncode not in (0, 1):  # 128: not in a work tree
        return []
    ignored = []
    for line in found.stdout.splitlines():  # "<source>:<line>:<pattern>\t<path>"
        rule, _, path = line.partition("\t")
        source, number, pattern = rule.split(":", 2)
        relative = Path(path).resolve().relative_to(dest.resolve()).as_posix()
        ignored.append(f"{pattern} ({Path(source).name}:{number}): {relative}")
    return ignored
