"""`hdr train` with `generation.backend=vllm` on the real vLLM engine (tests/real_vllm.py), with
Headroom-Drift Replay on, against a real retrieval server: one process, and (slow) torchrun
with 2 processes, one engine per rank through `external_launcher` on gloo.

The policy is a chain bed (Qwen2.5's tokenizer) whose chain tokens have a logit of 12 over a
151,936-id vocabulary (probability ~0.5-0.7 each), so a group's responses differ: some close
`</search>` and `</answer>`, some do not, and the format reward varies inside groups, which
gives replay groups to store and select. Every weight sync is checked by the engine's own
log-probs of fixed tokens (the backend refuses a stale engine), and the step's sampler/trainer
log-prob gap is logged as with hf.

The last two tests are what the CPU build cannot show, against tests/fakes/vllm (a recording
stand-in for vLLM 0.31 on CUDA): each torchrun rank's engine on its own GPU, and a training
run that puts the engine to sleep for scoring and the update and wakes it through the sync.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TINY_CPU, tiny_overrides
from real_vllm import build_bed, build_chain_bed, device, real_engine
from test_distributed import run_ranks

from trainer import distributed, fresh

STEPS = 3
JOB_TIMEOUT_S = 900  # a hang guard for a loaded 2-core machine
CHAINS = [(">", " Paris </search>\n\n"), (" Lyon", "</answer>")]


def env() -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",
        "VLLM_CPU_KVCACHE_SPACE": "1",
    }


@pytest.fixture(scope="module")
def policy(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("vllm-train")
    return build_chain_bed(build_bed(root / "qwen"), root / "chain", CHAINS, logit=12.0)


def train_args(url: str, policy: Path, qa: Path, out: Path, *extra: str) -> list[str]:
    on = device()
    return [
        "train",
        "--config",
        str(TINY_CPU),
        *tiny_overrides(
            url, policy, qa, out, f"steps={STEPS}",
            "generation.backend=vllm", "generation.dtype=float32",
            "generation.enforce_eager=true", "generation.max_model_len=1024",
            "generation.gpu_memory_utilization=0.2", f"model.device={on}",
            "rollout.prompt.observation_suffix=<answer> Lyon", "rollout.max_tokens_per_turn=12",
            "eval.every=0", "eval.at_start=false", "checkpoint.save_every=0",
            "log.tensorboard=false", *extra,
        ),
    ]  # fmt: skip


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def hdr(*args: str) -> list[str]:
    return [sys.executable, "-m", "hdr.cli", *args]


@pytest.fixture(scope="module")
def one(policy, small_qa, retrieval_url, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("vllm-one") / "run"
    args = train_args(retrieval_url, policy, small_qa, out, "distributed.rollout_shards=2")
    subprocess.run(hdr(*args), env=env(), check=True, timeout=JOB_TIMEOUT_S)
    return out


@real_engine
def test_training_on_the_engine_runs_with_replay_and_a_small_gap(one):
    logged = rows(one)
    assert [r["step"] for r in logged] == list(range(1, STEPS + 1))
    assert (one / "final").is_dir()
    for r in logged:
        # fp32 engine against fp32 teacher forcing, after a sync every step
        assert r["logprob_gap_mean"] is not None and r["logprob_gap_mean"] <= 1e-4, r
        assert r["world_size"] == 1
    rewards = [r["reward_mean"] for r in logged]
    assert any(0 < x < 1.5 for x in rewards), rewards  # a mix: some formats closed, some not
    assert any(r["replayed_group_ids"] for r in logged), "nothing was replayed: nothing shown"


@real_engine
@pytest.mark.slow  # about a minute: its own engine in a worker process (make test-slow)
def test_a_rollout_worker_with_its_own_engine_samples_from_each_published_version(
    one, policy, small_qa, retrieval_url, tmp_path
):
    """Asynchronous rollout with one worker holding its own engine, queue bound 0: the run
    `one` made with the engine in the trainer's process, token for token (the worker rolls its
    shards out together, each trajectory under its own seed, as the trainer does). Each step's
    rollout comes from the weights the trainer published after the step before: the engine's
    log-probs of the tokens it sampled match the trainer's teacher forcing of them at that
    version (the step's sampler/trainer gap), and the weights moved far more than that between
    versions, so an engine left on old weights would show."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env.generation.vllm import SYNC_PROBE_TEXT, teacher_forced_logprobs

    out = tmp_path / "worker"
    args = train_args(retrieval_url, policy, small_qa, out, "distributed.rollout_shards=2",
                      "async_rollout.workers=1", "async_rollout.max_lag=0")  # fmt: skip
    subprocess.run(hdr(*args), env=env(), check=True, timeout=JOB_TIMEOUT_S)
    single, worker = rows(one), rows(out)
    assert [r["step"] for r in worker] == list(range(1, STEPS + 1))
    for a, b in zip(single, worker, strict=True):
        assert b["rollout_lags"] == [0, 0, 0, 0]  # every group from the newest version
        assert a["fresh_tokens"] == b["fresh_tokens"]  # the same sampled trajectories
        assert a["cost_generated_tokens"] == b["cost_generated_tokens"]
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-9)
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-5)
        assert b["logprob_gap_mean"] <= 1e-4, b  # sampled by the published weights
        assert b["worker_engine_sync_gap"] <= 1e-3  # the backend's own check, in the worker
    tokenizer = AutoTokenizer.from_pretrained(str(policy))
    probe = tokenizer.encode(SYNC_PROBE_TEXT, add_special_tokens=False)
    start = teacher_forced_logprobs(AutoModelForCausalLM.from_pretrained(str(policy)), probe)
    final = teacher_forced_logprobs(AutoModelForCausalLM.from_pretrained(str(out / "final")), probe)
    assert float((final - start).abs().mean()) > 1e-2  # the versions differ, visibly


@real_engine
@pytest.mark.slow
def test_two_processes_one_engine_each_replay_as_one(
    one, policy, small_qa, retrieval_url, tmp_path
):
    """torchrun, 2 ranks on gloo, each with its own engine (`external_launcher`, which joins
    the trainer's process group): the same prompts, trajectories and replay selection as the
    single process (per-request seeds make a trajectory independent of the rank that samples
    it); the ranks' agreement on each step's selection is checked by the run itself."""
    out = tmp_path / "two"
    args = train_args(retrieval_url, policy, small_qa, out, "distributed.rollout_shards=2")
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    subprocess.run([*run, "-m", "hdr.cli", *args], env=env(), check=True, timeout=JOB_TIMEOUT_S)
    single, double = rows(one), rows(out)
    assert [r["world_size"] for r in double] == [2] * STEPS
    for a, b in zip(single, double, strict=True):
        assert a["fresh_group_ids"] == b["fresh_group_ids"]
        assert a["replayed_group_ids"] == b["replayed_group_ids"]
        assert a["fresh_tokens"] == b["fresh_tokens"]  # the same sampled trajectories
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-9)
    assert any(r["replayed_group_ids"] for r in double)


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


# --- what the CPU build cannot show: CUDA placement and sleep mode (tests/fakes/vllm) ----


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
    # built, then the setup's sync and its check (a stale engine would fail here, before work)
    assert kinds[:5] == [
        "LLM",
        "collective_rpc",
        "reload_weights",
        "reset_prefix_cache",
        "prompt_logprobs",
    ]
    assert kinds.count("sleep") == steps
    asleep, previous = False, None
    for event in fake_vllm.EVENTS:
        if event[0] == "sleep":
            asleep = True
        elif event == ("wake_up", ["weights"]):
            asleep = False
        assert not (asleep and event[0] == "generate"), "generated while asleep"
        # the one forward beside the awake engine: the sync check's teacher forcing of the
        # probe (one short row), right after the engine scored the same tokens
        if event[0] == "trainer forward" and not asleep:
            assert previous == "prompt_logprobs", "trained beside an awake engine"
        previous = event[0]
    after_wake = [kinds[i + 1 : i + 6] for i, k in enumerate(kinds) if k == "wake_up"][::2]
    assert (
        after_wake
        == [
            ["collective_rpc", "reload_weights", "wake_up", "reset_prefix_cache", "prompt_logprobs"]
        ]
        * steps
    )
    # one engine call per turn for both shards: b x G = 16 trajectories, 2 turns a step
    first_step = kinds.index("sleep")
    calls = [e for e in fake_vllm.EVENTS[:first_step] if e[0] == "generate"]
    assert [c[1] for c in calls] == [16, 16]
    bounds = fresh.shard_bounds(config.grpo.batch_prompts, 2)
    seeds = [
        turn_seed(seed, 0)  # turn 0 of each trajectory of shard 0, then of shard 1
        for shard, prompts in enumerate(bounds)
        for seed in fresh.trajectory_seeds(
            fresh.shard_seed(config.seed, 1, 0, shard), len(prompts) * 4
        )
    ]
    assert calls[0][2] == seeds and len(set(seeds)) == 16
