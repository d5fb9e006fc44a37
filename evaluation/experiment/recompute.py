"""`hdr report --from DIR`: every table of an experiment recomputed from its committed files.

DIR holds what `hdr experiment` wrote and a reader needs: `experiment_config.json`, and per
run `runs/<arm>/seed-<n>/` with `config.yaml` (the run's resolved TrainConfig), `metrics.jsonl`
(the cost ledger), `eval.jsonl` (the in-training curve) and `heldout/eval.json` (per
question and sample, which answers were correct); optionally `sft_start/eval.json`. Models,
checkpoints and TensorBoard files are not needed. The summary is recomputed with the same
code as the experiment's (`summarize`, `results_markdown`), so the tables, contrasts,
precondition and matched-cost rows come out as the experiment's own results.md and
results.json do, less the machine and server records and the charts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from core.errors import UserError
from evaluation.experiment.config import ExperimentConfig
from evaluation.experiment.report import results_markdown
from evaluation.experiment.runs import RunResult
from evaluation.experiment.summary import ExperimentSummary, summarize

# keys an older experiment_config.json may hold that no longer exist (dropped, not errors)
RETIRED_KEYS = ("bootstrap_resamples",)


def read_config(root: Path) -> ExperimentConfig:
    path = root / "experiment_config.json"
    if not path.is_file():
        raise UserError(f"{root}: no experiment_config.json (is it an `hdr experiment` out dir?)")
    data: dict[str, Any] = json.loads(path.read_text())
    for key in RETIRED_KEYS:
        data.pop(key, None)
    return ExperimentConfig.model_validate(data)


def read_runs(root: Path, cfg: ExperimentConfig) -> list[RunResult]:
    """Every `runs/<arm>/seed-<n>` with a held-out evaluation, as the experiment had them, in
    the config's arm order (the tables' order), then by seed."""
    import yaml

    from evaluation.evaluate import load_report
    from evaluation.plots import read_jsonl

    results = []
    for path in sorted(root.glob("runs/*/seed-*/heldout/eval.json")):
        run_dir = path.parents[1]
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


def recompute(root: str | Path) -> tuple[ExperimentSummary, ExperimentConfig, str]:
    """The summary, the config and results.md of the experiment files under `root`."""
    from evaluation.evaluate import load_report

    root = Path(root)
    if not root.is_dir():
        raise UserError(f"--from {root}: not a folder")
    cfg = read_config(root)
    start = root / "sft_start" / "eval.json"
    sft_report = load_report(start) if start.is_file() else None
    summary = summarize(read_runs(root, cfg), cfg.references, sft_report, cfg)
    return summary, cfg, results_markdown(summary, cfg)
