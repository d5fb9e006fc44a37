"""`hdr` subcommands of the trainer package: `sft`, `train`, `calibrate`, `plan-memory` and
`trl-train` (TRL's GRPOTrainer with hdr's rollout and replay). Heavy imports happen inside the
bodies."""

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

TRAIN_EXAMPLES = """Examples:

  hdr train --config configs/tiny-cpu.yaml

  hdr train --config configs/tiny-cpu.yaml replay.rule=replay_recency out_dir=runs/recency

  hdr train --resume runs/tiny-cpu    # continue a stopped run
"""
SFT_EXAMPLE = """Example (a retrieval server must be running, see `hdr serve`):

  hdr sft --config configs/tiny-cpu.yaml sft.epochs=4 model.path=data/tiny-sft-4
"""
CALIBRATE_EXAMPLE = """Example:

  hdr calibrate --config configs/tiny-cpu.yaml --steps 10 --taus 0.001,0.01,0.1
"""


def train_command(
    overrides: list[str] = overrides_argument("training config", "grpo.lr=3e-5 steps=40"),
    config: Path = typer.Option(None, "--config", "-c", help="Training config YAML."),
    resume: Path = typer.Option(
        None, "--resume", help="Continue from a run directory or one of its checkpoints."
    ),
    server: list[str] = server_option(),
    set_: list[str] = set_option(),
    force: bool = typer.Option(
        False, "--force", help="Start over a run in out_dir that has checkpoints or a final model."
    ),
) -> None:
    """GRPO with Headroom-Drift Replay (or another replay rule): writes a run directory. Ctrl-C (or
    SIGTERM) stops after the current step with a checkpoint that --resume continues."""
    from trainer.loop import train
    from trainer.run import load_train_config

    cfg = load_train_config(
        config, [*server_overrides(server), *all_overrides(overrides, set_)], resume
    )
    run_dir = train(cfg, resume=resume, force=force)
    typer.echo(str(run_dir))


def sft_command(
    overrides: list[str] = overrides_argument("training config", "sft.epochs=4"),
    config: Path = typer.Option(..., "--config", "-c", help="Training config YAML (sft section)."),
    server: list[str] = server_option(),
    set_: list[str] = set_option(),
    force: bool = force_option(),
) -> None:
    """Supervised warm start on scripted trajectories (search, then the gold title when
    retrieved, else Doc 1's), through the real rollout loop; saves with save_pretrained,
    together with the prompt and rollout settings `hdr rollout` and `hdr eval` then use."""
    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.tools.sft import run_sft

    settings = [*server_overrides(server), *all_overrides(overrides, set_)]
    out = run_sft(load_config(TrainConfig, config, settings), force=force)
    typer.echo(str(out))


def calibrate_command(
    overrides: list[str] = overrides_argument("training config", "replay.budget=4"),
    config: Path = typer.Option(..., "--config", "-c", help="Training config YAML."),
    taus: str = typer.Option(
        None, "--taus", help="Comma-separated taus; default: three log-spaced around replay.tau."
    ),
    steps: int = typer.Option(6, "--steps", min=1, help="Training steps per point."),
    out: Path = typer.Option(Path("runs/calibrate"), "--out", help="Directory for the runs."),
    server: list[str] = server_option(),
    set_: list[str] = set_option(),
    force: bool = force_option(),
) -> None:
    """Three-point log-spaced tau sweep: acceptance rate per point and a recommendation."""
    from core.config import load_config
    from core.errors import UserError
    from trainer.config import TrainConfig
    from trainer.tools.calibrate import calibrate

    cfg = load_config(
        TrainConfig, config, [*server_overrides(server), *all_overrides(overrides, set_)]
    )
    try:
        tau_list = [float(t) for t in taus.split(",")] if taus else None
    except ValueError:
        raise UserError(f"--taus must be comma-separated numbers, not {taus!r}") from None
    report = calibrate(cfg, out, steps=steps, taus=tau_list, force=force)
    typer.echo(report.table())


PLAN_MEMORY_EXAMPLE = """Examples:

  hdr plan-memory --config configs/search-r1-qwen2.5-3b.yaml --gpu-gb 80

  hdr plan-memory --config configs/search-r1-qwen2.5-3b.yaml --gpu-gb 80 --gpus 8 grpo.micro_batch=8

  hdr plan-memory --config configs/trl/qwen2.5-3b-8gpu.yaml --gpu-gb 80 --gpus 7
"""


def plan_memory_command(
    overrides: list[str] = overrides_argument("training config", "grpo.micro_batch=4"),
    config: Path = typer.Option(..., "--config", "-c", help="Training config YAML."),
    gpu_gb: float = typer.Option(
        ..., "--gpu-gb", min=1, help="Memory of one GPU in GiB (nvidia-smi's MiB / 1024)."
    ),
    gpus: int = typer.Option(1, "--gpus", min=1, help="GPUs, one training process each."),
    tflops: float = typer.Option(
        400.0, "--tflops", min=1, help="TRL configs: sustained bf16 TFLOP/s per GPU (step time)."
    ),
    set_: list[str] = set_option(),
) -> None:
    """The GPU memory one training process needs, by component and phase (rollout, scoring,
    update), from the config and the model's shape; refuses a config that cannot fit, naming
    the setting to turn. A TRL run config (`hdr trl-train`'s) is planned under ZeRO-3 over the
    --gpus training processes, with its step's compute."""
    from core.config import load_config
    from core.errors import UserError
    from trainer.config import TrainConfig
    from trainer.integrations.trl_memory import is_trl_config, plan_trl
    from trainer.tools.memory_plan import model_shape, plan_memory

    if is_trl_config(config):
        plan, steps = plan_trl(config, all_overrides(overrides, set_), gpu_gb, gpus, tflops)
        typer.echo(plan.table() + "\n\n" + steps)
        refusal = plan.refusal()
        if refusal is not None:
            raise UserError(f"{config} does not fit: {refusal}")
        return
    cfg = load_config(TrainConfig, config, all_overrides(overrides, set_))
    if cfg.distributed.rollout_shards % gpus:
        raise UserError(
            f"distributed.rollout_shards={cfg.distributed.rollout_shards} cannot be split over"
            f" {gpus} GPUs; set it to a multiple of {gpus}"
        )
    plan = plan_memory(cfg, model_shape(cfg.model.path), gpu_gb, gpus, name=str(config))
    typer.echo(plan.table())
    refusal = plan.refusal()
    if refusal is not None:
        raise UserError(f"{config} does not fit: {refusal}")


TRL_EXAMPLE = """Examples (the trl extra, pip install -e ".[trl]", and a running retrieval server):

  hdr trl-train --config configs/trl/tiny-cpu.yaml

  accelerate launch --config_file configs/trl/accelerate-zero3.yaml --num_processes 7 \\
    -m hdr trl-train --config configs/trl/qwen2.5-3b-8gpu.yaml
"""


def trl_train_command(
    overrides: list[str] = overrides_argument("TRL run config", "trl.learning_rate=1e-6"),
    config: Path = typer.Option(..., "--config", "-c", help="TRL run config YAML."),
    server: list[str] = server_option(),
    set_: list[str] = set_option(),
    resume: str | None = typer.Option(
        None, "--resume", help='A checkpoint directory of this run, or "last" (with its buffer).'
    ),
) -> None:
    """TRL's GRPOTrainer with hdr's Search-R1 rollout, exact-match reward and Headroom-Drift
    Replay (docs/integrations.md); prints TRL's output directory."""
    from core.config import load_config
    from trainer.integrations.trl_run import TRLRunConfig, train_trl

    settings = [*server_overrides(server), *all_overrides(overrides, set_)]
    typer.echo(str(train_trl(load_config(TRLRunConfig, config, settings), resume)))


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.command("sft", epilog=SFT_EXAMPLE)(sft_command)
    app.command("train", epilog=TRAIN_EXAMPLES)(train_command)
    app.command("calibrate", epilog=CALIBRATE_EXAMPLE)(calibrate_command)
    app.command("plan-memory", epilog=PLAN_MEMORY_EXAMPLE)(plan_memory_command)
    app.command("trl-train", epilog=TRL_EXAMPLE)(trl_train_command)
    for command in ("sft", "train", "calibrate", "plan-memory"):
        register_config(command, "trainer.config:TrainConfig")
    register_config("trl-train", "trainer.integrations.trl_run:TRLRunConfig")
