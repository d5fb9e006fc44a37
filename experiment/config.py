"""The experiment's typed config and its presets, YAML files under `configs/experiments/`.

A preset is a YAML mapping of `ExperimentConfig` keys, validated on its own (an unknown key
is one line naming the file). `experiment_config` layers `main.yaml` (the main comparison),
then each named preset in order (a later one replaces the keys it sets), then the quick
overlay of the task with `quick`, then explicit fields, then `KEY=VALUE` overrides. A preset
is named by its file stem (`bridge`) or given as a path to any YAML file.

The runs' training settings are TrainConfig keys under `train`, spelt as in configs/*.yaml
(`train.grpo.lr=1e-4`), merged section by section across the layers and laid over
`base_config`; the experiment reads b and steps from that result (`train_configs`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from core.config import (
    StrictModel,
    build_config,
    format_validation_error,
    lookup,
    merge_settings,
    read_config_file,
)
from core.errors import UserError
from evaluation.costs import MEASURED_HERE, CostModel
from experiment.arms import ARMS, Arm
from experiment.config_history import old_key_named, train_key_meant
from experiment.decision import DecisionRule
from experiment.diagnostics import DoseScreen, PoolCheck
from experiment.precondition import Precondition
from models.tiny import TinyPolicyConfig

PRESETS_DIR = Path(__file__).resolve().parents[1] / "configs" / "experiments"
MAIN_PRESET = "main"

SET_BY_THE_EXPERIMENT = {
    "seed": "each run's is one of `seeds`",
    "out_dir": "each run's folder is under out_dir (--out)",
    "model.path": "each run starts from the SFT start (init_model, sft_*)",
    "retrieval.urls": "the runs talk to the server the experiment starts",
    "data.train": "it is the experiment's `task`",
    "data.eval": "it is the experiment's `task`",
    "replay.budget": "r = round(replay_ratio x b); set replay_ratio",
    "log.progress": "set progress",
}
"""TrainConfig keys the experiment sets for every run from settings of its own."""


class Contrast(StrictModel):
    """A comparison declared before the runs: `arm` minus `reference` on one held-out metric,
    paired by seed and question."""

    arm: str = Field(description="The arm (or variant) under test.")
    reference: str = Field(description="The arm (or variant) it is compared with.")
    metric: Literal["mean_at_k", "best_at_k", "greedy_em"] = Field(
        "mean_at_k", description="The held-out metric of the final evaluation."
    )
    alternative: Literal["two-sided", "greater"] = Field(
        "two-sided",
        description="The test: two-sided, or one-sided `greater` (H0: arm - reference <= 0),"
        " declared before the runs; the interval shown stays two-sided.",
    )
    primary: bool = Field(
        False,
        description="A pre-declared primary contrast, tested at `alpha` on its own; all the"
        " others are Holm-corrected together.",
    )
    equivalence_margin: float | None = Field(
        None,
        gt=0,
        description='Declared before the runs: the two arms "match" only when two one-sided'
        " tests (TOST, at `alpha`) put the difference inside +-margin. None: no equivalence"
        " claim can be made.",
    )


class ArmVariant(StrictModel):
    """A registered arm trained with extra overrides under a name of its own (an lr = 0
    control, the drift gate at another tau)."""

    name: str = Field(description="The variant's name in `arms`, `references`, `contrasts`.")
    arm: str = Field(description="The registered arm it varies.")
    overrides: list[str] = Field(description="Dotted TrainConfig overrides, after the arm's.")


class ExperimentConfig(StrictModel):
    """The experiment's knobs; the YAML files under `configs/experiments/` are presets of these."""

    base_config: str = Field("configs/tiny-cpu.yaml", description="TrainConfig YAML of every arm.")
    task: str = Field(
        "wiki-vital", description="Training and held-out task: wiki-vital or wiki-bridge."
    )
    data_dir: str = Field("data", description="Corpus, index and the cached SFT start.")
    out_dir: str = Field("runs/experiment", description="Runs, evaluations, results, charts.")
    arms: list[str] = Field(
        [
            "on_policy",
            "on_policy_larger",
            "on_policy_filtered",
            "replay_recency",
            "headroom_drift",
            "replay_freshness_per",
            "replay_zero_variance_swap",
        ],
        description="Arms to train, in table order.",
    )
    references: list[str] = Field(
        ["on_policy_larger", "replay_recency"],
        description="Arms every other arm is compared with (paired).",
    )
    seeds: list[int] = Field([1, 2], min_length=1, description="Training seeds of every arm.")
    train: dict[str, Any] = Field(
        {},
        description="TrainConfig keys (as in configs/*.yaml) laid over `base_config` for every"
        " run and the SFT start: steps, grpo.batch_prompts (b), grpo.lr, replay.tau, eval.*,"
        " rollout.*, ...; deep-merged across presets (train.grpo.lr=1e-4 keeps the rest)."
        " Unset: replay.tau_age steps / 4 (the published 500 steps is a quarter of a 2,000-step"
        " run), grpo.warmup_steps min(3, steps - 1), checkpoint.save_every 0.",
        # `hdr experiment --lr` is answered with train.grpo.lr, not with a key it refuses
        json_schema_extra={
            "keys_of": "trainer.config:TrainConfig",
            "except": list(SET_BY_THE_EXPERIMENT),
        },
    )
    replay_ratio: float = Field(0.5, gt=0, description="r = round(ratio * b) replayed groups.")
    tau_l1: float | None = Field(
        None,
        gt=0,
        description="L1 gate of headroom_drift_l1, from its own `hdr calibrate` sweep; None:"
        " sqrt of the L2 replay.tau, an upper bound by Jensen and so a looser gate than L2's.",
    )
    sft_split: str | None = Field(
        None, description="The split the SFT start is trained on; None: RL's data.train_split."
    )
    final_questions: int | None = Field(
        500,
        ge=1,
        description="Final held-out questions (a fixed set); None: the whole test split.",
    )
    final_k: int = Field(5, ge=1, description="Samples per question in the final evaluation.")
    final_eval_seed: Literal["fixed", "per_run"] = Field(
        "fixed",
        description="The final evaluation's sampling seed: fixed (0 for every run, so its"
        " sampling noise is shared across runs) or per_run (each arm x seed its own draws).",
    )
    variants: list[ArmVariant] = Field(
        [], description="Arms with extra overrides under names of their own."
    )
    contrasts: list[Contrast] = Field(
        [],
        description="Comparisons declared before the runs (`primary` ones tested alone, the"
        " others Holm-corrected); results.json reports each under `contrasts`.",
    )
    alpha: float = Field(0.05, gt=0, lt=1, description="Two-sided level of every contrast.")
    power: float = Field(0.8, gt=0, lt=1, description="Power at which the MDE is reported.")
    budget_fractions: list[float] = Field(
        [0.25, 0.5, 0.75, 1.0],
        description="Quality at matched cost: budgets at these fractions of the smallest"
        " total any arm reached on each cost axis, read off each run's in-training curve.",
    )
    precondition: Precondition | None = Field(
        None,
        description="The dose-response gate (experiment/precondition.py): does the"
        " 1.5x fresh step gain >= ratio x the planned comparison's MDE? Reported in"
        " results.json as `precondition`, beside the contrasts.",
    )
    pool_check: PoolCheck | None = Field(
        None,
        description="The pool-size check of a candidate bed (experiment/diagnostics.py):"
        " the gains of one arm on the whole RL pool and on a small one, and whether they match"
        " within a declared margin. Reported in results.json as `pool_check`.",
    )
    dose_screen: DoseScreen | None = Field(
        None,
        description="The dose screen of a candidate bed: a low against a high number of fresh"
        " prompts a step, projected to the pilot's 1.5x step by log-dose arithmetic. Reported"
        " in results.json as `dose_screen`.",
    )
    decision: DecisionRule | None = Field(
        None,
        description="The replay comparison's decision rule (experiment/decision.py): which"
        " arms answer its three questions, and the margin of its equivalence claims. Reported"
        " in results.md above the contrasts.",
    )
    pilot_bed: str | None = Field(
        None,
        description="Run this bed of `precondition.beds`: its overrides are laid over the"
        " settings so far (None: the preset as written, the first bed of the search).",
    )
    cost_model: CostModel = Field(
        default_factory=lambda: MEASURED_HERE.model_copy(),
        description="Prices of the ledgered work for quality at matched modelled cost"
        " (evaluation/costs.py; default: measured on this machine).",
    )
    env_ratios: list[float] = Field(
        [10.0, 100.0, 1000.0, 10000.0, 100000.0],
        description="rho = a / c values (a search call in teacher-forced tokens) at which"
        " quality at matched modelled cost is read; measured here rho is about 6, a paid web"
        " search against a 3B policy on a GPU about 3e5 (evaluation/costs.py).",
    )
    policy: TinyPolicyConfig = Field(
        default_factory=TinyPolicyConfig,
        description="The tiny policy the SFT start is trained from (built once under the data"
        " dir; the demo's is smaller than the default).",
    )
    init_model: str | None = Field(
        None,
        description="A pretrained model the SFT start is trained from instead of the tiny"
        " `policy`: a folder under the data dir, e.g. `smollm2` (SmolLM2-135M-Instruct,"
        " converted there from its wheel on first use).",
    )
    sft_epochs: int | None = Field(None, ge=1, description="SFT epochs; None: base config's.")
    sft_max_examples: int | None = Field(None, ge=1, description="SFT questions; None: all.")
    sft_overrides: list[str] = Field(
        [], description="Extra `sft.*` overrides of the SFT start (part of its cache name)."
    )
    sft_from_task: str | None = Field(
        None,
        description="Fine-tune the SFT start from this task's default SFT start (built first"
        " when missing) instead of from the bare policy: a curriculum. wiki-bridge has 972"
        " training questions, too few to learn copying from scratch; wiki-vital's start"
        " already copies a description into a search and a title into an answer.",
    )
    corpus_limit: int | None = Field(None, ge=1, description="Index only the first N articles.")
    server_overrides: list[str] = Field(
        [],
        description="`hdr serve --set` settings, e.g. emulated_cost.request_latency_ms=500;"
        " the server's /health (emulated cost included) goes into results.json.",
    )
    schedule: Literal["interleaved", "by_arm"] = Field(
        "interleaved",
        description="interleaved: runs ordered seed by seed, every arm of a seed in turn, so"
        " with `jobs` runs at once every arm meets the same machine load; by_arm: arm by arm.",
    )
    jobs: int = Field(
        2, ge=1, description="Runs trained at once, each in its own process with cpu/jobs threads."
    )
    progress: bool = Field(True, description="Progress bars on stderr (only with jobs=1).")

    @model_validator(mode="before")
    @classmethod
    def _old_keys_named(cls, data: Any) -> Any:
        """An old flat training key (`steps`, `lr`, `train_overrides`, ...), or an unknown key
        close to one, is answered with its spelling under `train`."""
        old = old_key_named(data) or train_key_meant(data, cls.model_fields)
        if old is not None:
            raise ValueError(old)
        return data

    @field_validator("train")
    @classmethod
    def _experiments_own_keys_refused(cls, train: dict[str, Any]) -> dict[str, Any]:
        """A training key the experiment sets for each run is refused, naming its own key: laid
        over it, it would be overwritten silently."""
        for key, own in SET_BY_THE_EXPERIMENT.items():
            if lookup(train, key) is not None:
                raise ValueError(f"train.{key} is the experiment's: {own}")
        return train

    def arm(self, name: str) -> Arm:
        """The registered arm or variant called `name` (a variant: its arm with its overrides
        added); an unknown name is one line listing the valid ones."""
        for variant in self.variants:
            if variant.name == name:
                base = ARMS.get(variant.arm)
                return replace(base, name=name, overrides=(*base.overrides, *variant.overrides))
        if name not in ARMS:
            valid = [*ARMS.names(), *(v.name for v in self.variants)]
            raise UserError(f"unknown experiment arm {name!r}; valid: {', '.join(valid)}")
        return ARMS.get(name)


# ----------------------------------------------------------------------------- presets


def preset_names() -> list[str]:
    """The presets shipped under `configs/experiments/`, by name."""
    return sorted(p.stem for p in PRESETS_DIR.glob("*.yaml"))


def preset_path(preset: str | Path) -> Path:
    """A preset's file: a name (`bridge`) under `configs/experiments/`, or a YAML path."""
    text = str(preset)
    if text.endswith((".yaml", ".yml")) or "/" in text:
        return Path(preset)
    path = PRESETS_DIR / f"{text}.yaml"
    if not path.is_file():
        raise UserError(
            f"unknown experiment preset {text!r}; valid: {', '.join(preset_names())}"
            " (or the path of a YAML file)"
        )
    return path


def read_preset(preset: str | Path) -> dict[str, Any]:
    """The settings a preset file holds, checked against `ExperimentConfig` on their own: an
    unknown key (under `train` too) or a bad value is one UserError line naming the file."""
    from experiment.train_configs import unknown_train_key

    path = preset_path(preset)
    data = read_config_file(path)
    try:
        ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(
            f"preset {path}: {format_validation_error(err, ExperimentConfig)}"
        ) from None
    unknown = unknown_train_key(data.get("train", {}))
    if unknown is not None:
        raise UserError(f"preset {path}: {unknown}")
    return data


def lay_over(data: dict[str, Any], layer: dict[str, Any]) -> None:
    """`layer`'s settings over `data` (in place): each key replaces the one below it, except
    `train`, merged section by section (a preset setting train.grpo.lr keeps the
    train.grpo.batch_prompts of the ones below)."""
    for key, value in layer.items():
        if key == "train" and isinstance(value, dict) and isinstance(data.get(key), dict):
            data[key] = merge_settings(data[key], value)
        else:
            data[key] = value


def quick_overlay(data: dict[str, Any]) -> str:
    """The quick overlay for the settings so far: `quick-bridge` on the bridge task, whose
    articles span the whole corpus (so its index stays whole) and whose turns it keeps."""
    task = ExperimentConfig.model_validate(data).task
    return "quick-bridge" if task == "wiki-bridge" else "quick"


def experiment_config(
    *presets: str | Path,
    quick: bool = False,
    overrides: Sequence[str] = (),
    **fields: Any,
) -> ExperimentConfig:
    """`main`, then `presets` in order, then the task's quick overlay with `quick`, then
    explicit fields, then `k=v` overrides; unknown keys, presets and arms are UserErrors."""
    from experiment.train_configs import shared_train_config

    data: dict[str, Any] = {}
    for preset in [MAIN_PRESET, *presets]:
        lay_over(data, read_preset(preset))
    if quick:
        lay_over(data, read_preset(quick_overlay(data)))
    lay_over(data, {k: str(v) if isinstance(v, Path) else v for k, v in fields.items()})
    cfg = build_config(ExperimentConfig, data, overrides)
    if cfg.pilot_bed is not None:
        beds = {b.name: b for b in (cfg.precondition.beds if cfg.precondition else [])}
        if cfg.pilot_bed not in beds:
            raise UserError(
                f"unknown pilot_bed {cfg.pilot_bed!r}; declared beds: {', '.join(beds) or 'none'}"
            )
        cfg = build_config(ExperimentConfig, data, [*beds[cfg.pilot_bed].overrides, *overrides])
    named = [*cfg.arms, *cfg.references]
    named += [name for c in cfg.contrasts for name in (c.arm, c.reference)]
    for name in named:
        cfg.arm(name)  # UserError listing the valid arms on a typo
    missing = [r for r in cfg.references if r not in cfg.arms]
    if missing:
        raise UserError(f"reference arms {missing} are not among the arms {cfg.arms}")
    declared = {
        "precondition": cfg.precondition and [cfg.precondition.arm, cfg.precondition.reference],
        "pool check": cfg.pool_check and [cfg.pool_check.arm, cfg.pool_check.pool_arm],
        "dose screen": cfg.dose_screen and [cfg.dose_screen.arm, cfg.dose_screen.reference],
    }
    for what, named in declared.items():
        missing = [n for n in named or [] if n not in cfg.arms]
        if missing:
            raise UserError(f"the {what} names arms {missing} not among {cfg.arms}")
    missing = [n for c in cfg.contrasts for n in (c.arm, c.reference) if n not in cfg.arms]
    if missing:
        raise UserError(f"contrasts name arms {missing} that are not among the arms {cfg.arms}")
    shared_train_config(cfg)  # `train` over the base config: a bad key or value is one line now
    return cfg
