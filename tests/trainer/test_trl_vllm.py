"""TRL's own vLLM generation on the real CPU engine (tests/real_vllm.py): `ReplayGRPOTrainer`
with `use_vllm=True, vllm_mode="colocate"` builds its engine through TRL 1.16 (TRL's
`LLM(...)` settings: external launcher, processed log-probs, vLLM's own dtype choice, bf16
on the CPU), generates every rollout through hdr's vLLM backend over that engine, and trains
2 steps with Headroom-Drift Replay, TRL's weight sync going through vLLM's in-place reload
(`route_colocate_sync`). TRL's own sync cannot run on the CPU build: a strict expected failure
names the call.

The policy is the chain bed of tests/trainer/test_vllm_engine_loop.py (chain tokens at logit 12
over Qwen2.5's 151,936 ids), so responses differ within a group; the reward is test_trl's
(F1 + format + a length term that varies on an untrained policy).
"""

from __future__ import annotations

import math
import os

import pytest
from real_vllm import build_bed, build_chain_bed, engine_start_beside_numba, real_engine

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from test_trl import G, RecordingSession, make_trainer

from trainer.config import ReplayConfig
from trainer.integrations.trl import TRLReplayConfig

CHAINS = [(">", " Paris </search>\n\n"), (" Lyon", "</answer>")]


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    root = tmp_path_factory.mktemp("trl-vllm")
    return build_chain_bed(build_bed(root / "qwen"), root / "chain", CHAINS, logit=12.0)


@pytest.fixture(scope="module")
def trained(policy, retrieval_url, small_qa, tmp_path_factory):
    """Two steps of TRL with its colocated vLLM engine and replay (one group a step, step 2
    replaying step 1's: tau infinite), and the trainer kept for the checks."""
    replay = TRLReplayConfig(replay=ReplayConfig(budget=2, capacity=8, tau=math.inf))
    with engine_start_beside_numba():  # the session's retrieval server imported numba
        trainer = make_trainer(
            policy, retrieval_url, small_qa, tmp_path_factory.mktemp("trl-vllm-run"), replay,
            use_vllm=True, vllm_mode="colocate", vllm_gpu_memory_utilization=0.2,
            vllm_max_model_length=1024, learning_rate=0.05, max_steps=2,
            per_device_train_batch_size=G,
        )  # fmt: skip
    trainer.train()
    yield trainer
    trainer.rollout_func.client.close()
    let_the_engine_go(trainer)


LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module", autouse=True)
def launch_environment():
    """TRL's colocate mode writes torchrun's variables into this process's environment (its
    engine's external launcher reads them); later tests' subprocesses must not inherit them."""
    before = {k: os.environ.get(k) for k in LAUNCH_VARIABLES}
    yield
    for key, value in before.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def let_the_engine_go(trainer) -> None:
    """Free the engine's KV cache and the world-of-one process group vLLM's launcher made."""
    import gc

    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    trainer.vllm_generation.llm = None
    gc.collect()
    cleanup_dist_env_and_memory()


@real_engine
def test_trl_colocated_vllm_trains_with_replay_on_the_cpu_engine(trained, policy):
    import torch
    from transformers import AutoModelForCausalLM

    from agent_env.generation.vllm import VLLMGenerator, teacher_forced_logprobs

    trainer = trained
    history = trainer.replay.history
    assert [h["step"] for h in history] == [1, 2]
    assert history[0]["replayed"] == [] and history[1]["replayed"] == history[0]["fresh"]
    assert history[1]["trained_rows"] == 2 * G  # the fresh group and the replayed one
    # the rollouts came from TRL's engine, through hdr's backend, with the sampler's log-probs
    trajectories = [t for group in trainer.rollout_func.last.groups for t in group]
    assert all(t.sampler_logprobs and max(t.sampler_logprobs) <= 0 for t in trajectories)
    assert len({tuple(t.response_ids) for t in trajectories}) > 1
    # TRL logged its vLLM importance-sampling metrics: the sampler's log-probs reached its loss
    assert any(k.startswith("sampling/") for h in trainer.state.log_history for k in h)
    # the engine follows the trainer: its log-probs of fixed tokens are the trained model's
    # (within the bf16 engine's tolerance) and farther from the starting policy's
    tokenizer = trainer.processing_class
    probe = tokenizer.encode("Question: where?\n<search> Paris </search>\n\n<answer> Lyon</answer>")
    trainer.vllm_generation.sync_weights()  # the last step's update, pushed as TRL would
    engine = VLLMGenerator(trainer.vllm_generation.llm, set(), probe=probe, dtype="bfloat16")
    gap_now = engine.check_weights(trainer.model)  # one line if the engine is stale
    start = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32)
    served = torch.tensor(engine.prompt_logprobs(probe))
    gap_start = float((served - teacher_forced_logprobs(start, probe)).abs().mean())
    assert gap_now < gap_start / 2


@real_engine
@pytest.mark.xfail(
    strict=True,
    raises=AttributeError,
    reason="TRL's colocate sync calls llm_engine.model_executor.driver_worker.model_runner"
    ".model.load_weights, which vLLM's CPU build refuses ('Parameter' object has no attribute"
    " 'weight_loader': its linear layers are repacked for oneDNN)",
)
def test_trl_own_colocate_weight_sync_on_the_cpu_engine(trained):
    from trl.generation.vllm_generation import VLLMGeneration

    VLLMGeneration.sync_weights(trained.vllm_generation)  # TRL's, not the routed one


@real_engine
def test_the_server_request_leaves_no_sampling_field_to_the_checkpoint():
    """TRL server mode: vLLM's server fills every sampling field a request leaves out from the
    model's generation_config.json (`trl vllm-serve` does not pass `--generation-config
    vllm`). Read by vLLM's own request model with Qwen2.5-Instruct's shipped defaults, hdr's
    request gives exactly the sampling parameters hdr's in-process engine uses (whose log-probs
    equal teacher forcing at the temperature); the same request without the neutral fields
    would sample with a repetition penalty of 1.05 and top-k 20."""
    from types import SimpleNamespace

    from vllm import SamplingParams as EngineParams
    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    from agent_env.generation.base import SamplingParams
    from agent_env.generation.vllm import sampling_kwargs
    from trainer.integrations.trl_vllm import NEUTRAL_SAMPLING, VLLMServerGenerator

    qwen_defaults = {"repetition_penalty": 1.05, "temperature": 0.7, "top_p": 0.8, "top_k": 20}
    session = RecordingSession([])
    client = SimpleNamespace(model="qwen", base_url="http://vllm:8001", session=session)
    params = SamplingParams(temperature=0.9, top_p=1.0, max_tokens=7)
    VLLMServerGenerator(client, eos={2}).generate([[1, 2, 3]], params)
    [(_, body)] = session.posts
    filled = CompletionRequest.model_validate(body)._DEFAULT_SAMPLING_PARAMS  # a private attr
    assert set(filled) <= set(body)
    fields = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
              "presence_penalty", "frequency_penalty")  # fmt: skip

    def read(request: dict):
        served = CompletionRequest.model_validate(request).to_sampling_params(7, qwen_defaults)
        return {name: getattr(served, name) for name in fields}

    in_process = EngineParams(**sampling_kwargs(params, {2}))
    assert read(body) == {name: getattr(in_process, name) for name in fields}
    assert read(body)["temperature"] == 0.9 and read(body)["repetition_penalty"] == 1.0
    bare = {k: v for k, v in body.items() if k not in NEUTRAL_SAMPLING}
    assert read(bare)["repetition_penalty"] == 1.05 and read(bare)["top_k"] == 20
