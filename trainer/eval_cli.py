"""`hdr eval`, `hdr plot` and `hdr experiment`: evaluation, charts and the replay experiment.

`trainer/cli.py` calls `register(app)`. Heavy imports (torch, transformers, matplotlib) happen
inside the command bodies so `hdr --help` answers at once.
"""

from __future__ import annotations

from pathlib import Path

import typer


def eval_command(
    model: Path = typer.Option(..., "--model", help="Model directory (from_pretrained layout)."),
    data: list[str] = typer.Option(
        ..., "--data", help="wiki-vital, a FlashRAG .jsonl or a Search-R1 .parquet (repeatable)."
    ),
    more_data: list[str] = typer.Argument(None, help="More data files, as for --data."),
    k: int = typer.Option(None, "--k", min=1, help="Samples per question (default: config, 8)."),
    server: list[str] = typer.Option(
        None, "--server", help="Retrieval server URL (repeatable; default: the config's)."
    ),
    out: Path = typer.Option(
        None, "--out", help="Directory for eval.json / eval.md (default: eval/<model dir name>)."
    ),
    config: Path = typer.Option(None, "--config", "-c", help="EvalConfig YAML."),
    train_config: Path = typer.Option(
        None,
        "--train-config",
        help="Take rollout, generation and retrieval settings from a training config (a run's"
        " config.yaml or configs/*.yaml); default: the run's config.yaml when --model is a"
        " run's final/ or checkpoint directory.",
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="EvalConfig override key=value, e.g. --set max_questions=200."
    ),
) -> None:
    """Mean@k, Best@k and greedy EM per dataset, with plain and size-weighted averages,
    through the full rollout loop. Writes eval.json and eval.md; rerun to resume."""
    from trainer.evaluate import eval_config_for, evaluate

    cfg = eval_config_for(model, config, train_config, overrides)
    out_dir = out or Path("eval") / (model.parent.name if model.name == "final" else model.name)
    report = evaluate(model, [*data, *(more_data or [])], k, server or None, cfg, out_dir)
    typer.echo(report.markdown())
    typer.echo(f"wrote {out_dir / 'eval.json'} and {out_dir / 'eval.md'}")


def plot_command(
    run_dirs: list[Path] = typer.Argument(..., help="Run directories written by `hdr train`."),
    out: Path = typer.Option(Path("charts"), "--out", help="Directory for the PNG charts."),
) -> None:
    """PNG charts from run dirs: held-out reward against env calls and wall time, replay age,
    acceptance rate, replay count against stored headroom. One line per arm."""
    from trainer.plots import plot_run_dirs

    for path in plot_run_dirs(run_dirs, out):
        typer.echo(str(path))


def register(app: typer.Typer) -> None:
    """Add `eval`, `plot` and `experiment` to the root `hdr` app."""
    app.command("eval")(eval_command)
    app.command("plot")(plot_command)
