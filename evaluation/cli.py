"""`hdr eval`, `hdr plot` and `hdr experiment`: evaluation, charts and the replay experiment.

`hdr/cli.py` calls `register(app)`. Heavy imports (torch, transformers, matplotlib) happen
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
    from evaluation.evaluate import eval_config_for, evaluate

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
    from evaluation.plots import plot_run_dirs

    for path in plot_run_dirs(run_dirs, out):
        typer.echo(str(path))


def experiment_command(
    data: Path = typer.Option(Path("data"), "--data", help="Corpus, index, cached SFT start."),
    out: Path = typer.Option(None, "--out", help="Results dir (default runs/experiment)."),
    ablations: bool = typer.Option(
        False, "--ablations", help="headroom_only, drift_only, headroom_drift_l1 vs headroom_drift."
    ),
    quick: bool = typer.Option(False, "--quick", help="A few-minute version (pipeline check)."),
    bridge: bool = typer.Option(
        False,
        "--bridge",
        help="The multi-turn wiki-bridge task with an emulated search-API cost, 7 arms.",
    ),
    base_config: Path = typer.Option(
        Path("configs/tiny-cpu.yaml"), "--config", "-c", help="Base TrainConfig YAML."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="ExperimentConfig override key=value, e.g. --set seeds=[1,2,3]."
    ),
) -> None:
    """Train every arm with the same SFT start, seeds and held-out questions against a real
    `hdr serve`; write results.json, results.md and charts."""
    from evaluation.experiment import experiment_config, run_experiment

    default_out = Path("runs") / (
        ("bridge-" if bridge else "") + ("ablations" if ablations else "experiment")
    )
    cfg = experiment_config(
        quick=quick,
        ablations=ablations,
        bridge=bridge,
        overrides=overrides,
        data_dir=data,
        out_dir=out or default_out,
        base_config=base_config,
    )
    out_dir = run_experiment(cfg)
    typer.echo((out_dir / "results.md").read_text())
    typer.echo(f"results: {out_dir / 'results.md'}, {out_dir / 'results.json'}")
    typer.echo(f"charts: {out_dir / 'charts'}")


def demo_command(
    data: Path = typer.Option(Path("data"), "--data", help="Corpus, index, cached SFT start."),
    runs: Path = typer.Option(Path("runs"), "--runs", help="Where the demo's run goes."),
    overrides: list[str] = typer.Option(
        [], "--set", help="ExperimentConfig override key=value, e.g. --set steps=20."
    ),
) -> None:
    """The whole pipeline on the embedded defaults: corpus, index, server, SFT, a short
    headroom_drift run and its held-out evaluation beside the SFT start."""
    from evaluation.experiment import experiment_config, run_experiment

    cfg = experiment_config(demo=True, overrides=overrides, data_dir=data, out_dir=runs / "demo")
    out_dir = run_experiment(cfg)
    typer.echo((out_dir / "results.md").read_text())
    typer.echo(f"results: {out_dir / 'results.md'}, {out_dir / 'results.json'}")
    typer.echo(f"charts: {out_dir / 'charts'}")
    typer.echo(f"run (metrics.jsonl, eval.jsonl, TensorBoard tb/, final model): {out_dir / 'runs'}")


def register(app: typer.Typer) -> None:
    """Add `eval`, `plot`, `experiment` and `demo` to the root `hdr` app."""
    app.command("eval")(eval_command)
    app.command("plot")(plot_command)
    app.command("experiment")(experiment_command)
    app.command("demo")(demo_command)
