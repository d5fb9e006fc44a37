"""hdr `Generator`s over the vLLM engines TRL's `GRPOTrainer` owns (`use_vllm=True`).

NOT RUN: hdr's test bed has no GPU and no vLLM; these are written against TRL 1.16's
`VLLMGeneration` (its `llm` in colocate mode, its `vllm_client` on the main process in server
mode) and vLLM's OpenAI-compatible `/v1/completions` (what `trl vllm-serve` runs since TRL
1.x: `vllm serve` with weight transfer). Weight sync stays TRL's: `GRPOTrainer._generate`
pushes the new weights before it calls the rollout function.

- colocate: each process has its own engine (`distributed_executor_backend=
  "external_launcher"`), driven by hdr's own vLLM backend (`VLLMGenerator`), which reads
  finish reasons from vLLM's fields;
- server: one engine behind HTTP, reached from the main process only. `VLLMClient.generate`
  drops `finish_reason` and `stop_reason`, so this adapter posts the same request itself
  through the client's session and keeps them; the rollout function runs every process's
  prompts on the main process in this mode (trainer/integrations/trl.py).
"""

from __future__ import annotations

from types import SimpleNamespace

from agent_env.generation.base import Completion, SamplingParams
from agent_env.generation.vllm import VLLMGenerator, completion_from_output, sampling_kwargs


def colocate_generator(trainer, eos: set[int]) -> VLLMGenerator:
    """hdr's vLLM backend over the engine TRL built in this process (`vllm_mode="colocate"`)."""
    return VLLMGenerator(trainer.vllm_generation.llm, eos)


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
