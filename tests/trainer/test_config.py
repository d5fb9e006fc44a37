"""TrainConfig: the shipped YAML files load, unknown keys and arms are refused in one line."""

from pathlib import Path

import pytest

from core.config import load_config
from core.errors import UserError
from trainer.config import TrainConfig
from trainer.loop import sample_prompts
from trainer.run import lr_lambda

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def test_tiny_cpu_config_loads_with_notes_settings():
    cfg = load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml")
    assert (cfg.grpo.batch_prompts, cfg.grpo.group_size) == (16, 8)
    assert cfg.grpo.lr == pytest.approx(5e-5) and cfg.grpo.schedule == "constant"
    assert cfg.generation.backend == "hf" and cfg.model.device == "cpu"
    assert cfg.rollout.prompt.response_prefix == "<search>"
    assert cfg.grpo.fresh_rows == 128
    assert cfg.select_params.budget == cfg.replay.budget


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
        ["arm=on_policy", "grpo.batch_prompts=192"],
    )
    assert larger.grpo.batch_prompts == 192 and not larger.replays
    assert larger.select_params.budget == 0


def test_unknown_key_is_one_line_error():
    with pytest.raises(UserError, match=r"replay\.taux"):
        load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", ["replay.taux=0.1"])


def test_unknown_arm_lists_valid_names():
    with pytest.raises(UserError, match="headroom_drift_l1"):
        load_config(TrainConfig, CONFIGS / "tiny-cpu.yaml", ["arm=headroom-drift"])


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
