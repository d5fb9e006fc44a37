"""The runs' training settings are TrainConfig keys under the experiment's `train`: merged
section by section across the layers, laid over the base config, the old flat keys refused in
one line naming their new spelling, and an experiment_config.json hdr wrote with them read as
today's."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from core.config import load_config
from core.errors import UserError
from experiment.config import ExperimentConfig, experiment_config, read_preset
from experiment.config_history import EXPERIMENT_RENAMED, read_as_today
from experiment.train_configs import arm_train_config, shared_train_config

REPO = Path(__file__).resolve().parents[2]
HDR = str(Path(sys.executable).with_name("hdr"))
URL = "http://127.0.0.1:9"
SAMPLE = REPO / "tests/experiment/fixtures/report-sample/experiment_config.json"
COMPARISON = REPO / "docs/results/smollm2-replay/experiment_config.json"


def test_train_is_merged_section_by_section_across_every_layer(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("train:\n  grpo: {lr: 1.0e-4}\n  replay: {capacity: 16}\n")
    cfg = experiment_config(
        "bridge",
        mine,
        train={"replay": {"tau": 0.05}},
        overrides=["train.grpo.group_size=3", "train.rollout.max_turns=3"],
    )
    train = shared_train_config(cfg)
    assert (train.grpo.lr, train.grpo.group_size, train.grpo.batch_prompts) == (1e-4, 3, 8)
    assert (train.replay.capacity, train.replay.tau) == (16, 0.05)  # the file's and the field's
    assert train.steps == 40 and train.rollout.prompt.observation_suffix == ""  # bridge's kept
    assert train.rollout.max_turns == 3  # the override, over bridge's 2
    assert train.eval.k == 4  # main's, which bridge does not set
    quick = shared_train_config(experiment_config("bridge", mine, quick=True))
    assert (quick.steps, quick.grpo.lr, quick.replay.capacity) == (3, 1e-4, 16)


@pytest.mark.parametrize("old", sorted(EXPERIMENT_RENAMED))
def test_an_old_flat_key_in_a_preset_is_one_line_naming_its_train_key(tmp_path, old):
    bad = tmp_path / "old.yaml"
    bad.write_text(f"{old}: 7\n")
    with pytest.raises(UserError) as err:
        experiment_config(bad)
    line = str(err.value)
    new = EXPERIMENT_RENAMED[old]
    assert "\n" not in line and str(bad) in line
    assert f"{old} is now {new}: write {new}=7" in line


def test_old_keys_given_as_overrides_or_a_pilot_bed_are_refused_naming_train(tmp_path):
    with pytest.raises(
        UserError, match=r"^config: lr is now train.grpo.lr: write train.grpo.lr=0.0001$"
    ):
        experiment_config(overrides=["lr=0.0001"])
    expected = (
        "train_overrides is now train (TrainConfig keys): write train.rollout.max_turns=2"
        " train.replay.capacity=8"
    )
    with pytest.raises(UserError, match=re.escape(expected)):
        experiment_config(overrides=["train_overrides=[rollout.max_turns=2, replay.capacity=8]"])
    pilot = read_preset("pilot-dose-response")
    pilot["precondition"]["beds"][1]["overrides"] = ["steps=240"]  # `longer` as once written
    mine = tmp_path / "pilot.yaml"
    mine.write_text(yaml.safe_dump(pilot))
    experiment_config(mine)  # the bed is not run: nothing refused
    with pytest.raises(UserError, match=r"steps is now train\.steps: write train\.steps=240"):
        experiment_config(mine, overrides=["pilot_bed=longer"])


def test_hdr_experiment_refuses_an_old_key_in_one_line_before_anything_runs(tmp_path):
    cmd = [HDR, "experiment", "--data-dir", str(tmp_path / "data"), "--out", str(tmp_path / "o")]
    done = subprocess.run([*cmd, "steps=60"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "hdr: error: config: steps is now train.steps: write train.steps=60"
    ]
    assert not (tmp_path / "o").exists() and not (tmp_path / "data").exists()


def test_a_training_key_the_experiment_sets_for_each_run_is_refused_under_train():
    with pytest.raises(UserError, match=r"train.replay.budget is the experiment's: .*replay_ratio"):
        experiment_config(overrides=["train.replay.budget=3"])
    with pytest.raises(UserError, match=r"train.seed is the experiment's: .*seeds"):
        experiment_config(train={"seed": 4})


def test_a_bad_key_or_value_under_train_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  grpo: {lrr: 1.0e-4}\n")
    with pytest.raises(UserError) as err:
        experiment_config(bad)
    line = str(err.value)
    assert (
        str(bad) in line
        and "unknown config key train.grpo.lrr; did you mean train.grpo.lr?" in line
    )
    with pytest.raises(UserError, match=r"^train \(over configs/tiny-cpu.yaml\): config key steps"):
        experiment_config(overrides=["train.steps=many"])


def test_an_old_experiment_config_json_is_read_as_todays():
    written = json.loads(SAMPLE.read_text())
    assert "steps" in written and "train" not in written  # written before `train` existed
    cfg = ExperimentConfig.model_validate(read_as_today(written))
    assert cfg.train == {
        "steps": 3,
        "grpo": {"batch_prompts": 4, "group_size": 3, "lr": 5e-05},
        "eval": {"every": 1, "num_questions": 4, "k": 2},
        "retrieval": {"retriever": "bm25"},
        "data": {"train_split": "train"},
        "rollout": {"max_tokens_per_turn": 16},
        "replay": {"store_zero_advantage": True},
    }  # tau and tau_age were None ("the base config's"): not set
    assert cfg.final_k == written["final_k"] and cfg.arms == written["arms"]


def test_the_running_comparisons_recorded_settings_train_as_its_rewritten_preset(tmp_path):
    """docs/results/smollm2-replay's experiment_config.json (old keys) and today's preset give
    every arm the same TrainConfig: the comparison goes on with the same runs."""
    then = ExperimentConfig.model_validate(read_as_today(json.loads(COMPARISON.read_text())))
    now = experiment_config(
        "smollm2-replay-comparison", data_dir=then.data_dir, out_dir=then.out_dir
    )
    assert (now.arms, now.seeds) == (then.arms, then.seeds)
    for name in now.arms:
        run_dir = tmp_path / name
        args = (URL, tmp_path / "sft", run_dir, 3)
        made = arm_train_config(then, then.arm(name), *args).model_dump(mode="json")
        assert arm_train_config(now, now.arm(name), *args).model_dump(mode="json") == made


def test_a_presets_arm_is_its_base_config_with_the_settings_spelt_out(tmp_path):
    """What smollm2-replay-comparison trains headroom_drift with, written as `hdr train` would
    be given it: the base config and explicit overrides."""
    from trainer.config import TrainConfig

    cfg = experiment_config("smollm2-replay-comparison")
    sft, run_dir = tmp_path / "sft", tmp_path / "run"
    got = arm_train_config(cfg, cfg.arm("headroom_drift"), URL, sft, run_dir, 2)
    spelt = [
        "seed=2",
        "steps=80",
        f"out_dir={run_dir}",
        f"model.path={sft}",
        f'retrieval.urls=["{URL}"]',
        "data.train=wiki-vital",
        "data.train_split=rl",
        "data.eval=wiki-vital",
        "grpo.batch_prompts=8",
        "grpo.group_size=5",
        "grpo.lr=6.0e-5",
        "grpo.warmup_steps=3",
        "replay.budget=4",  # round(0.5 x 8)
        "replay.tau=0.03",
        "replay.tau_age=20.0",  # steps / 4
        "replay.capacity=32",
        "replay.survey=newest",
        "eval.every=40",
        "eval.num_questions=100",
        "eval.k=2",
        "checkpoint.save_every=10",
        "log.progress=true",
    ]  # the base config's replay rule is headroom_drift's
    explicit = load_config(TrainConfig, REPO / "configs/smollm2-cpu.yaml", spelt)
    assert got.model_dump(mode="json") == explicit.model_dump(mode="json")


def test_an_option_spelt_like_a_training_setting_is_answered_with_its_train_key():
    """`hdr experiment --steps 60` (an option, not a setting) names train.steps, the key it
    takes; keys the experiment refuses under `train` are not offered."""
    import hdr.cli  # noqa: F401  (registers every command's config)
    from core.options import keys_like_option

    assert keys_like_option("experiment", "--steps") == ["train.steps"]
    assert keys_like_option("experiment", "--lr")[0] == "train.grpo.lr"
    assert keys_like_option("experiment", "--out-dir") == ["out_dir"]  # not train.out_dir


def test_a_training_value_the_base_config_leaves_out_is_the_training_configs_default():
    """b and steps are read from base_config + train, else from TrainConfig's own defaults
    (whose required `model` has no default to build a whole TrainConfig from)."""
    from experiment.train_configs import _laid
    from trainer.config import GRPOConfig, TrainConfig

    assert _laid({}, "steps") == TrainConfig.model_fields["steps"].default
    assert _laid({}, "grpo.batch_prompts") == GRPOConfig().batch_prompts
    assert _laid({"grpo": {"batch_prompts": 3}}, "grpo.batch_prompts") == 3
