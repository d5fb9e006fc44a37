"""`hdr` subcommands of the trainer package: `sft`, `train`, `calibrate`. Heavy imports happen
inside the bodies."""

from __future__ import annotations

from pathlib import Path

import typer


def train_command(
    overrides: list[str] = typer.Argument(None, help="Dotted overrides: grpo.lr=3e-5 ..."),
    config: Path = typer.Option(None, "--config", "-c", help="Training config YAML."),
    resume: Path = typer.Option(
        None, "--resume", help="Continue from a run directory or one of its checkpoints."
    ),
) -> None:
    """GRPO with Headroom-Drift Replay (or another arm): writes a run directory."""
    from trainer.loop import load_train_config, train

    cfg = load_train_config(config, list(overrides or []), resume)
    run_dir = train(cfg, resume=resume)
    typer.echo(str(run_dir))


def sft_command(
    overrides: list[str] = typer.Argument(None, help="Dotted overrides: sft.epochs=8 ..."),
    config: Path = typer.Option(..., "--config", "-c", help="Training config YAML (sft section)."),
) -> None:
    """Supervised warm start on scripted trajectories (search, then the gold title when
    retrieved, else Doc 1's), through the real rollout loop; saves with save_pretrained."""
    from hdr.config import load_config
    from trainer.config import TrainConfig
    from trainer.sft import run_sft

    out = run_sft(load_config(TrainConfig, config, list(overrides or [])))
    typer.echo(str(out))


def calibrate_command(
    overrides: list[str] = typer.Argument(None, help="Dotted overrides of the train config."),
    config: Path = typer.Option(..., "--config", "-c", help="Training config YAML."),
    taus: str = typer.Option(
        None, "--taus", help="Comma-separated taus; default: three log-spaced around replay.tau."
    ),
    steps: int = typer.Option(6, "--steps", help="Training steps per point."),
    out: Path = typer.Option(Path("runs/calibrate"), "--out", help="Directory for the runs."),
) -> None:
    """Three-point log-spaced tau sweep: acceptance rate per point and a recommendation."""
    from hdr.config import load_config
    from trainer.calibrate import calibrate
    from trainer.config import TrainConfig

    cfg = load_config(TrainConfig, config, list(overrides or []))
    tau_list = [float(t) for t in taus.split(",")] if taus else None
    report = calibrate(cfg, out, steps=steps, taus=tau_list)
    typer.echo(report.table())


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.command("sft")(sft_command)
    app.command("train")(train_command)
    app.command("calibrate")(calibrate_command)
