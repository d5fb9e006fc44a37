"""TrainConfig: the shipped YAML files load, unknown keys and replay rules are refused in one
line."""

from pathlib import Path

import pytest

from core.config import load_config
from core.errors import UserError
from trainer.config import TrainConfig
from trainer.fresh import sample_prompts
from trainer.run import lr_lambda

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_tiny_cpu_config_loads_with_notes_settings():
    cfg = load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml")
    assert (cfg.grpo.batch_prompts, cfg.grpo.group_size) == (16, 8)
    assert cfg.grpo.lr == pytest.approx(5e-5) and cfg.grpo.schedule == "constant"
    assert cfg.generation.backend == "hf" and cfg.model.device == "cpu"
    assert cfg.rollout.prompt.response_prefix == "<search>"
    assert cfg.grpo.fresh_rows == 128
    assert cfg.make_replay().params.budget == cfg.replay.budget


def test_search_r1_config_is_the_papers_setting():
    cfg = load_config(TrainConfig, CONFIGS / "search-r1-qwen2.5-3b.yaml")
    assert cfg.model.path == "Qwen/Qwen2.5-3B-Instruct"
    assert cfg.generation.backend == "vllm" and cfg.retrieval.retriever == "dense"
    assert (cfg.grpo.batch_prompts, cfg.replay.budget) == (128, 64)
    # sized for an 80 GB GPU (tests/trainer/test_memory_plan.py) and for its index
    assert cfg.generation.enable_sleep_mode and cfg.generation.max_model_len == 6144
    assert (cfg.retrieval.expect_encoder, cfg.retrieval.expect_documents) == (
        "e5-base-v2",
        21_015_324,
    )
    larger = load_config(
        TrainConfig,
        CONFIGS / "search-r1-qwen2.5-3b.yaml",
        ["replay.rule=on_policy", "grpo.batch_prompts=192"],
    )
    assert larger.grpo.batch_prompts == 192 and not larger.replays
    assert larger.make_replay().params.budget == 0


def test_unknown_key_is_one_line_error():
    with pytest.raises(UserError, match=r"replay\.taux"):
        load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", ["replay.taux=0.1"])


def test_an_unknown_replay_rule_is_one_line_listing_the_rules():
    with pytest.raises(UserError) as refused:
        load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", ["replay.rule=headroom-drift"])
    line = str(refused.value)
    assert "\n" not in line and "unknown replay rule 'headroom-drift'; valid: drift_only," in line


def test_an_experiment_arm_is_no_replay_rule_and_the_line_says_where_arms_are():
    """on_policy_larger is an arm of `hdr experiment` (on_policy at 1.5b), not a rule: the
    line lists the rules and points at the table of arms."""
    with pytest.raises(UserError) as refused:
        load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", ["replay.rule=on_policy_larger"])
    line = str(refused.value)
    assert "unknown replay rule 'on_policy_larger'; valid:" in line and "on_policy," in line
    assert line.endswith("docs/guide.md's table of arms says which)")


def test_an_empty_override_value_is_refused_not_read_as_none():
    with pytest.raises(UserError) as refused:
        load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", ["grpo.tis_cap="])
    assert str(refused.value) == (
        "grpo.tis_cap= has no value: give one, or write grpo.tis_cap=null for none (its default"
        " where that is none)"
    )
    assert (
        load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", ["grpo.tis_cap=null"]).grpo.tis_cap
        is None
    )


def test_warmup_then_constant_or_cosine():
    cfg = load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", ["grpo.warmup_steps=3", "steps=10"])
    f = lr_lambda(cfg)
    assert [f(i) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = lr_lambda(
        cfg.model_copy(update={"grpo": cfg.grpo.model_copy(update={"schedule": "cosine"})})
    )
    assert cos(3) == pytest.approx(1.0) and cos(10) == pytest.approx(0.0)


def test_prompt_sampler_is_a_pure_function_of_seed_and_step():
    examples = list(range(10))
    first = [sample_prompts(examples, 0, step, 4) for step in (1, 2, 3)]
    assert first == [sample_prompts(examples, 0, step, 4) for step in (1, 2, 3)]
    assert sorted(first[0] + first[1] + first[2][:2]) == examples  # an epoch covers all
    assert sample_prompts(examples, 1, 1, 4) != first[0]


RESULTS = CONFIGS.parent / "docs" / "results"
WRITTEN_BEFORE_THE_RENAME = RESULTS / "pilot-base" / "runs" / "on_policy_b4" / "seed-1"


@pytest.mark.parametrize(
    ("setting", "new_key"),
    [
        ("replay.gate_target=0.3", "replay.adaptive_gate.target"),
        ("async_rollout.adapt_rate=0.2", "async_rollout.adaptive_gate.rate"),
        ("arm=replay_recency", "replay.rule"),
    ],
)
def test_a_renamed_gate_key_is_answered_with_its_new_name_by_the_cli(setting, new_key, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "train", "--config", str(CONFIGS / "tiny-cpu.yaml"),
         setting],
        capture_output=True, text=True, cwd=tmp_path, timeout=300, check=False,
    )  # fmt: skip
    old, value = setting.split("=")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        f"hdr: error: config: {old} is now {new_key}: write {new_key}={value}"
    ]


def test_every_renamed_key_is_refused_in_a_users_config_and_moved_in_one_hdr_wrote():
    from core.config import build_config, move_renamed, read_config_file
    from trainer.config.history import RENAMED_KEYS
    from trainer.run import read_run_config

    for old, new in RENAMED_KEYS.items():
        value = {"arm": "drift_only"}.get(old, "drift_budget" if old.endswith("kind") else 0.25)
        with pytest.raises(UserError, match=rf"^config: {old} is now {new}: write {new}="):
            load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", [f"{old}={value}"])
        written: dict = {"model": {"path": "m"}}
        *parents, key = old.split(".")
        node = written
        for part in parents:
            node = node.setdefault(part, {})
        node[key] = value  # {"replay": {"gate_target": 0.25}}, {"arm": "drift_only"}, ...
        moved = build_config(TrainConfig, move_renamed(written, RENAMED_KEYS))
        found = moved
        for part in new.split("."):
            found = getattr(found, part)
        assert found == value
    # a run's config.yaml that an earlier hdr wrote (every key, the old names among them)
    path = WRITTEN_BEFORE_THE_RENAME / "config.yaml"
    written = read_config_file(path)
    assert written["replay"]["gate_target"] == 0.5 and "adaptive_gate" not in written["replay"]
    with pytest.raises(UserError, match=r"^config: arm is now replay\.rule: write replay\.rule="):
        load_config(TrainConfig, path)
    config = read_run_config(path, ["replay.adaptive_gate.rate=0.3"])
    assert config.replay.adaptive_gate.target == written["replay"]["gate_target"]
    assert config.replay.adaptive_gate.rate == 0.3  # overrides on top, as on resume
    assert config.async_rollout.adaptive_gate.rate == written["async_rollout"]["adapt_rate"]
    assert config.grpo.batch_prompts == written["grpo"]["batch_prompts"]
    assert config.replay.rule == written["arm"] == "on_policy"  # the top-level key of then
