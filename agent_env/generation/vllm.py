"""`vllm` backend: vLLM's offline `LLM` engine, for GPU runs. Imported lazily; `gpu` extra.

Written against vLLM's public API (v0.10+, V1 engine) and NOT run in hdr's CPU test bed:
- contexts go in as `TokensPrompt(prompt_token_ids=...)`, so the engine continues exactly our
  ids; `stop=["</search>", "</answer>"]` with `include_stop_str_in_output=True`,
  `skip_special_tokens=False` (the tags are special tokens in hdr's tokenizer);
- `logprobs=0` returns the sampled token's log-prob, and the engine is built with
  `logprobs_mode="processed_logprobs"` so that it is the log-prob under the distribution
  sampled from (after temperature/top-p), like the hf backend's; vLLM's default is the raw
  model distribution;
- `top_k=-1` (disabled; older releases' spelling, newer ones accept it too);
- new weights: `sync_weights(model)` hands the trainer's state dict to the worker's model
  `load_weights`, then resets the prefix cache (cached KV was computed with the old weights).
  That needs the engine in this process: `VLLM_ENABLE_V1_MULTIPROCESSING=0` is set before
  vLLM is imported.
"""

from __future__ import annotations

import os

from agent_env.generation.base import GENERATORS, Completion, SamplingParams
from agent_env.prompts import STOP_STRINGS


def _driver_model(llm):
    """The torch module inside the in-process engine (path differs across vLLM versions)."""
    worker = llm.llm_engine.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)  # V1 wraps the worker once more
    return worker.model_runner.model


class VLLMGenerator:
    """Batched generation with a vLLM `LLM` engine on the GPU."""

    def __init__(self, llm) -> None:
        self.llm = llm

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sampling = VSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=-1,
            max_tokens=params.max_tokens,
            stop=list(STOP_STRINGS),
            include_stop_str_in_output=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            logprobs=0,
        )
        prompts = [TokensPrompt(prompt_token_ids=list(ctx)) for ctx in contexts]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        completions = []
        for out in outputs:
            sample = out.outputs[0]
            ids = list(sample.token_ids)
            logprobs = [step[tok].logprob for tok, step in zip(ids, sample.logprobs, strict=True)]
            finished = sample.finish_reason == "stop"
            completions.append(Completion(ids, logprobs, finished=finished))
        return completions

    def sync_weights(self, model) -> None:
        """Load the trainer's current weights into the engine and drop stale cached KV."""
        state = model.state_dict()
        _driver_model(self.llm).load_weights(weights=((k, v) for k, v in state.items()))
        self.llm.reset_prefix_cache()


@GENERATORS.register("vllm")
def build_vllm(*, config, model_dir, tokenizer, prompt, model=None) -> VLLMGenerator:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    try:
        from vllm import LLM
    except ImportError:
        from hdr.errors import UserError

        raise UserError("the vllm backend needs vLLM: pip install -e '.[gpu]'") from None
    llm = LLM(
        model=str(model_dir),
        dtype=config.dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
    )
    return VLLMGenerator(llm)
