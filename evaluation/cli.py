"""`hdr eval` and `hdr plot`: held-out evaluation and charts (`hdr experiment` and its
commands are `experiment/cli.py`).

`hdr/cli.py` calls `register(app)`. Heavy imports (torch, transformers, matplotlib) happen
inside the command bodies so `hdr --help` answers at once.
"""

from __future__ import annotations

from pathlib import Path

import typer

from core.options import (
    all_overrides,
    force_option,
    overrides_argument,
    register_config,
    server_option,
    server_overrides,
    set_option,
)

EVAL_EXAMPLES = """Examples (a retrieval server must be running, see `hdr serve`):

  hdr eval --model data/tiny-sft --data wiki-vital max_questions=200

  hdr eval --model runs/tiny-cpu/final --data nq_test.jsonl --data hotpotqa_test.parquet --k 5

The prompt and rollout settings come from the model (hdr_rollout.yaml, saved with every
model hdr writes) unless --train-config, --config or KEY=VALUE say otherwise.
"""
PLOT_EXAMPLE = """Example:

  hdr plot runs/tiny-cpu runs/recency --out runs/charts
"""


def eval_command(
    model: Path = typer.Option(..., "--model", help="Model directory (from_pretrained layout)."),
    data: list[str] = typer.Option(
        ..., "--data", help="wiki-vital, a FlashRAG .jsonl or a Search-R1 .parquet (repeatable)."
    ),
    k: int = typer.Option(None, "--k", min=1, help="Samples per question (default: config, 8)."),
    server: list[str] = server_option(),
    out: Path = typer.Option(
        None,
        "--out",
        help="Directory for eval.json / eval.md (default: runs/eval/<model dir name>).",
    ),
    config: Path = typer.Option(None, "--config", "-c", help="EvalConfig YAML."),
    train_config: Path = typer.Option(
        None,
        "--train-config",
        help="Take rollout, generation and retrieval settings from a training config (a run's"
        " config.yaml or configs/*.yaml); default: the run's config.yaml when --model is a"
        " run's final/ or checkpoint directory.",
    ),
    overrides: list[str] = overrides_argument("EvalConfig", "max_questions=200"),
    set_: list[str] = set_option(),
    force: bool = force_option(),
) -> None:
    """Mean@k, Best@k and greedy EM per dataset, with plain and size-weighted averages,
    through the full rollout loop. Writes eval.json and eval.md. Rerun the same command to
    resume an interrupted evaluation; on a finished one it says so and does nothing."""
    from evaluation.evaluate import eval_config_for, evaluate

    settings = [*server_overrides(server), *all_overrides(overrides, set_)]
    cfg = eval_config_for(model, config, train_config, settings)
    out_dir = out or default_eval_dir(model)
    report = evaluate(model, data, k, None, cfg, out_dir, force=force)
    if report.reused:
        typer.echo(f"already complete: see {out_dir / 'eval.md'} (--force evaluates again)")
        return
    typer.echo(report.markdown())
    typer.echo(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval.md'}")


def default_eval_dir(model: Path) -> Path:
    """runs/eval/<model>: under runs/, which git ignores, as it does data/ (a run's final/
    is named after its run)."""
    return Path("runs") / "eval" / (model.parent.name if model.name == "final" else model.name)


def plot_command(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories written by `hdr train`."),
    out: Path = typer.Option(Path("charts"), "--out", help="Directory for the PNG charts."),
    force: bool = force_option(),
) -> None:
    """PNG charts from run dirs: held-out reward against env calls and wall time, replay age,
    acceptance rate, replay count against stored headroom. One line per run (arm and seed);
    runs of one arm with different settings are labelled with them."""
    from evaluation.plots import plot_run_dirs

    for path in plot_run_dirs(run_dirs, out, force=force):
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add `eval` and `plot` to the root `hdr` app."""
    app.command("eval", epilog=EVAL_EXAMPLES)(eval_command)
    app.command("plot", epilog=PLOT_EXAMPLE)(plot_command)
    register_config("eval", "evaluation.evaluate:EvalConfig")
