"""`hdr eval`, `hdr plot` and `hdr experiment`: evaluation, charts and the replay experiment.

`trainer/cli.py` calls `register(app)`. Heavy imports (torch, transformers, matplotlib) happen
inside the command bodies so `hdr --help` answers at once.
"""

from __future__ import annotations

from pathlib import Path

import typer


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
    app.command("plot")(plot_command)
