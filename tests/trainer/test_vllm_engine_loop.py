"""The trainer driving the vllm backend, against tests/fakes/vllm (a recording stand-in for
vLLM 0.33's offline API): two torchrun-style processes each build their own engine on their
own GPU; a real training run puts the engine to sleep for scoring and the update and wakes it
through the weight sync; a rank's rollout shards go to the engine as one call per turn, every
trajectory with its own seed."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from conftest import TINY_CPU, tiny_overrides
from test_distributed import run_ranks

from trainer import distributed

FAKES = Path(__file__).resolve().parents[1] / "fakes"


def _build_on_rank(rank: int, world: int, port: int, out: str, model_dir: str) -> None:
    """What `setup_run` does under torchrun, up to the engine: join the group, build."""
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port), FAKE_VLLM_LOG=out, VLLM_ENABLE_V1_MULTIPROCESSING="1",
    )  # fmt: skip
    sys.path.insert(0, str(FAKES))
    from agent_env.generation import build_generator
    from agent_env.runner import load_tokenizer
    from trainer.config import TrainConfig

    config = TrainConfig.model_validate(
        {
            "model": {"path": model_dir},
            "grpo": {"batch_prompts": 4},
            "generation": {"backend": "vllm"},
            "distributed": {"rollout_shards": 2},
        }
    )
    dist, config = distributed.init_distributed(config)
    try:
        build_generator(
            config.generation,
            model_dir=model_dir,
            tokenizer=load_tokenizer(model_dir),
            prompt=config.rollout.prompt,
        )
    finally:
        distributed.shutdown(dist)


def test_each_rank_builds_its_own_engine_on_its_own_gpu(tiny_policy, tmp_path):
    run_ranks(_build_on_rank, tmp_path, str(tiny_policy))
    built = {}
    for path in tmp_path.glob("engine-rank*.json"):
        record = json.loads(path.read_text())
        built[int(record["env"]["RANK"])] = record
    assert sorted(built) == [0, 1]  # one engine per rank
    for rank, record in built.items():
        assert record["kwargs"]["distributed_executor_backend"] == "external_launcher"
        assert record["env"]["LOCAL_RANK"] == str(rank) and record["torch_world"] == 2
        assert record["device"] == f"cuda:{rank}"  # not every rank on cuda:0
        assert record["in_process"]


def test_training_sleeps_the_engine_for_scoring_and_update_and_wakes_it_to_sync(
    fake_vllm, tiny_policy, small_qa, retrieval_url, tmp_path
):
    from agent_env.rollout import turn_seed
    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import train_steps
    from trainer.run import StopSignals, setup_run

    steps = 2
    config = load_config(
        TrainConfig,
        TINY_CPU,
        tiny_overrides(
            retrieval_url, tiny_policy, small_qa, tmp_path / "run", f"steps={steps}",
            "generation.backend=vllm", "generation.enable_sleep_mode=true",
            "generation.max_model_len=512", "distributed.rollout_shards=2", "eval.every=0",
            "eval.at_start=false", "checkpoint.save_every=0",
        ),
    )  # fmt: skip
    run, start = setup_run(config)
    run.model.base_model.register_forward_pre_hook(lambda *_: fake_vllm.log("trainer forward"))
    try:
        train_steps(run, start, StopSignals())
    finally:
        distributed.shutdown(run.dist)
        run.client.close()
    kinds = [e[0] for e in fake_vllm.EVENTS]
    # built, then the setup's sync (a name mismatch would fail here, before any work)
    assert kinds[:4] == ["LLM", "apply_model", "load_weights", "reset_prefix_cache"]
    assert kinds.count("sleep") == steps
    asleep = False
    for event in fake_vllm.EVENTS:
        if event[0] == "sleep":
            asleep = True
        elif event == ("wake_up", ["weights"]):
            asleep = False
        assert not (asleep and event[0] == "generate"), "generated while asleep"
        assert not (not asleep and event[0] == "trainer forward"), "trained beside an awake engine"
    after_wake = [kinds[i + 1 : i + 5] for i, k in enumerate(kinds) if k == "wake_up"][::2]
    assert after_wake == [["apply_model", "load_weights", "wake_up", "reset_prefix_cache"]] * steps
    # one engine call per turn for both shards: b x G = 16 trajectories, 2 turns a step
    first_step = kinds.index("sleep")
    calls = [e for e in fake_vllm.EVENTS[:first_step] if e[0] == "generate"]
    assert [c[1] for c in calls] == [16, 16]
    bounds = distributed.shard_bounds(config.grpo.batch_prompts, 2)
    seeds = [
        turn_seed(seed, 0)  # turn 0 of each trajectory of shard 0, then of shard 1
        for shard, prompts in enumerate(bounds)
        for seed in distributed.trajectory_seeds(
            distributed.shard_seed(config.seed, 1, 0, shard), len(prompts) * 4
        )
    ]
    assert calls[0][2] == seeds and len(set(seeds)) == 16
