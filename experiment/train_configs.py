"""The `TrainConfig` of each run: the base YAML, the experiment's settings, then the arm's."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from core.errors import UserError
from experiment.arms import Arm
from experiment.config import ExperimentConfig


def base_train_config(
    cfg: ExperimentConfig,
    url: str,
    sft_dir: Path,
    out_dir: Path,
    seed: int,
    extra: Sequence[str] = (),
):
    """The TrainConfig every arm starts from: the base YAML + the experiment's settings."""
    from core.config import load_config
    from trainer.config import TrainConfig

    overrides = [
        f"seed={seed}",
        f"steps={cfg.steps}",
        f"out_dir={out_dir}",
        f"model.path={sft_dir}",
        f"retrieval.urls=[{json.dumps(url)}]",
        f"retrieval.retriever={cfg.retriever}",
        f"data.train={cfg.task}",
        f"data.train_split={cfg.train_split}",
        f"data.eval={cfg.task}",
        f"replay.tau_age={cfg.tau_age or max(1.0, cfg.steps / 4)}",
        f"grpo.batch_prompts={cfg.batch_prompts}",
        f"grpo.group_size={cfg.group_size}",
        f"grpo.lr={cfg.lr}",
        f"grpo.warmup_steps={min(3, cfg.steps - 1)}",
        f"replay.budget={cfg.replay_budget}",
        f"eval.every={cfg.eval_every}",
        f"eval.num_questions={cfg.eval_num_questions}",
        f"eval.k={cfg.eval_k}",
        "checkpoint.save_every=0",
        f"log.progress={str(cfg.progress).lower()}",
        *([f"replay.tau={cfg.tau}"] if cfg.tau is not None else []),
        *cfg.train_overrides,
        *extra,
    ]
    if not Path(cfg.base_config).is_file():
        raise UserError(f"base config not found: {cfg.base_config}")
    return load_config(TrainConfig, cfg.base_config, overrides)


def arm_train_config(
    cfg: ExperimentConfig, arm: Arm, url: str, sft_dir: Path, run_dir: Path, seed: int
):
    """`base_train_config` with the arm's replay rule, fresh batch and replay budget; the L1 arm
    gets `tau_l1` (sqrt of the L2 tau when unset)."""
    base = base_train_config(cfg, url, sft_dir, run_dir, seed)
    fresh = round(arm.fresh * cfg.batch_prompts)
    extra = [f"replay.rule={arm.rule}", f"grpo.batch_prompts={fresh}"]
    if not arm.replays:
        extra.append("replay.budget=0")
    if arm.rule == "headroom_drift_l1":
        extra.append(f"replay.tau={cfg.tau_l1 or math.sqrt(base.replay.tau)}")
    return base_train_config(cfg, url, sft_dir, run_dir, seed, [*extra, *arm.overrides])
