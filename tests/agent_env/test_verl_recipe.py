"""The veRL recipe (`configs/verl/search-r1-qwen2.5-3b.yaml`) as veRL 0.9.1 loads it: composed
by its config loader (Hydra, as `python -m verl.trainer.main_ppo --config-path configs/verl
--config-name search-r1-qwen2.5-3b` does) and checked by what `main_ppo` runs before it starts
Ray. Training itself needs GPUs and the model's weights; neither is here."""

from __future__ import annotations

import os

import yaml
from real_verl import NEEDS_VERL, RECIPE, REPO, TOOL_YAML, compose_recipe

pytestmark = NEEDS_VERL


def leaf_keys(node: dict, prefix: str = "") -> list[str]:
    keys = []
    for key, value in node.items():
        path = f"{prefix}{key}"
        keys += leaf_keys(value, path + ".") if isinstance(value, dict) else [path]
    return keys


def test_the_recipe_composes_and_passes_main_ppos_checks() -> None:
    from verl.trainer.main_ppo import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config
    from verl.utils.import_utils import resolve_config_path

    config = compose_recipe()
    validate_config(config, need_reference_policy(config), need_critic(config))
    assert config.algorithm.adv_estimator == "grpo"
    assert config.actor_rollout_ref.model.path == "Qwen/Qwen2.5-3B-Instruct"
    assert need_reference_policy(config) and not need_critic(config)  # KL loss, no critic
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert rollout.multi_turn.enable and rollout.multi_turn.format == "hermes"
    assert rollout.agent.default_agent_loop == "tool_agent"
    assert (rollout.prompt_length, rollout.response_length) == (4096, 3000)  # from data.*
    cwd = os.getcwd()
    try:
        os.chdir(REPO)  # the recipe is run from the repository root
        assert resolve_config_path(rollout.multi_turn.tool_config_path) == str(TOOL_YAML)
    finally:
        os.chdir(cwd)
    assert config.data.train_files.endswith("searchR1_processed_direct/train.parquet")


def test_every_key_the_recipe_sets_is_one_of_verls() -> None:
    """Hydra merges unknown keys without a word, so a misspelt name would be ignored: each key
    the recipe sets must be in veRL's own `ppo_trainer` config."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    recipe = yaml.safe_load(RECIPE.read_text())
    del recipe["hydra"], recipe["defaults"]
    with initialize_config_module(config_module="verl.trainer.config", version_base=None):
        base = compose(config_name="ppo_trainer")  # veRL's own, nothing set

    def known(key: str) -> bool:  # present in veRL's config (a `???` value included)
        parent, _, name = key.rpartition(".")
        node = OmegaConf.select(base, parent) if parent else base
        return node is not None and name in list(node.keys())  # `in node` skips `???` values

    keys = leaf_keys(recipe)
    assert len(keys) > 40 and not [key for key in keys if not known(key)]
    assert not known("actor_rollout_ref.rollout.multi_turn.max_turns")  # the check can fail
