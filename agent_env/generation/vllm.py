"""`vllm` backend: vLLM's offline `LLM` engine, for GPU runs. Imported lazily; `gpu` extra.

Written against vLLM 0.10.2 up to (not including) 0.12, the range the `gpu` extra pins, and
NOT run in hdr's CPU test bed (no GPU there); its output parsing is tested on the CPU over
recorded output shapes (`completion_from_output`):
- contexts go in as `TokensPrompt(prompt_token_ids=...)`, so the engine continues exactly our
  ids; `stop=["</search>", "</answer>"]` with `include_stop_str_in_output=True`,
  `skip_special_tokens=False`; every EOS id hdr knows (model generation config + tokenizer)
  is passed as `stop_token_ids`, and the engine ignores the checkpoint's generation config
  (`generation_config="vllm"`) so its sampling defaults cannot leak in;
- finish reasons come from vLLM's own fields, never from text: `finish_reason == "length"`;
  `"stop"` with a string `stop_reason` is a stop string (the last token may overhang it:
  vLLM cuts the text, not the token ids); `"stop"` with `stop_reason` None or an EOS id is
  an EOS, whose id is the last of `token_ids`;
- `logprobs=0` returns the sampled token's log-prob; `logprobs_mode="processed_logprobs"`
  makes it the log-prob under the distribution sampled from (temperature and top-p applied
  only from vLLM 0.10.2; hence the lower bound). vLLM's default is the raw distribution;
- new weights: `sync_weights(model)` hands the trainer's state dict to the in-process model's
  `load_weights`, then resets the prefix cache (cached KV was computed with the old weights).
  That needs the engine in this process: `VLLM_ENABLE_V1_MULTIPROCESSING` is forced to 0
  before vLLM is imported (an inherited 1 would otherwise win), and right after the engine is
  built hdr checks that the model is reachable, failing with one line if not;
- the sampler is seeded with `generation.seed` (the run's seed by default); tensor parallel
  size is fixed at 1 (the config refuses more: the in-process model must be whole).
"""

from __future__ import annotations

import os

from agent_env.generation.base import GENERATORS, Completion, SamplingParams
from agent_env.prompts import STOP_STRINGS
from core.errors import UserError

VLLM_RANGE = (">=0.10.2", "<0.12")


def completion_from_output(sample, eos: set[int]) -> Completion:
    """One vLLM `CompletionOutput` (`token_ids`, `logprobs`: one {id: Logprob} per token,
    `finish_reason`, `stop_reason`) as a Completion with an explicit finish reason."""
    ids = list(sample.token_ids)
    steps = sample.logprobs or []
    if len(steps) != len(ids):
        raise ValueError(f"vLLM returned {len(ids)} tokens but {len(steps)} log-prob entries")
    logprobs = [step[tok].logprob for tok, step in zip(ids, steps, strict=True)]
    reason, stop = sample.finish_reason, sample.stop_reason
    if reason == "length":
        return Completion(ids, logprobs, "length")
    if reason != "stop":
        raise ValueError(f"vLLM request ended with finish_reason {reason!r}")
    if isinstance(stop, str):
        return Completion(ids, logprobs, "stop", stop)
    if not ids or ids[-1] not in eos or (stop is not None and stop != ids[-1]):
        raise ValueError(
            f"vLLM reported an EOS stop ({stop!r}) but the last token {ids[-1:]} is not an EOS id"
        )
    return Completion(ids, logprobs, "eos")


def sampling_kwargs(params: SamplingParams, eos: set[int]) -> dict:
    """Keyword arguments of vLLM's `SamplingParams` for one turn."""
    return dict(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=-1,
        max_tokens=params.max_tokens,
        stop=list(STOP_STRINGS),
        stop_token_ids=sorted(eos),
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        logprobs=0,
    )


def _driver_model(llm):
    """The torch module inside the in-process engine."""
    worker = llm.llm_engine.model_executor.driver_worker
    worker = getattr(worker, "worker", worker)  # V1 wraps the worker once more
    return worker.model_runner.model


class VLLMGenerator:
    """Batched generation with a vLLM `LLM` engine on the GPU."""

    def __init__(self, llm, eos: set[int]) -> None:
        self.llm = llm
        self.eos = eos

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        sampling = VSamplingParams(**sampling_kwargs(params, self.eos))
        prompts = [TokensPrompt(prompt_token_ids=list(ctx)) for ctx in contexts]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False)
        return [completion_from_output(out.outputs[0], self.eos) for out in outputs]

    def sync_weights(self, model) -> None:
        """Load the trainer's current weights into the engine and drop stale cached KV."""
        state = model.state_dict()
        _driver_model(self.llm).load_weights(weights=((k, v) for k, v in state.items()))
        self.llm.reset_prefix_cache()


def check_vllm_version(version: str) -> None:
    """Refuse, in one line, a vLLM outside the range this backend is written for."""
    from packaging.specifiers import SpecifierSet

    wanted = SpecifierSet(",".join(VLLM_RANGE))
    if version not in wanted:
        raise UserError(
            f"vLLM {version} is installed; the vllm backend is written for vllm{wanted}"
            " (pip install -e '.[gpu]')"
        )


@GENERATORS.register("vllm")
def build_vllm(*, config, model_dir, tokenizer, prompt, model=None) -> VLLMGenerator:
    import importlib.metadata

    from transformers import GenerationConfig as HFGenerationConfig

    # forced, not defaulted: an inherited 1 would put the engine in another process, and the
    # weight sync would fail only after a whole rollout and update
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        from vllm import LLM
    except ImportError:
        raise UserError("the vllm backend needs vLLM: pip install -e '.[gpu]'") from None
    check_vllm_version(importlib.metadata.version("vllm"))
    eos = {tokenizer.eos_token_id} - {None}
    try:
        named = HFGenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        eos |= {named} if isinstance(named, int) else set(named or [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS only
    llm = LLM(
        model=str(model_dir),
        dtype=config.dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed if config.seed is not None else 0,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
    )
    try:
        _driver_model(llm)
    except AttributeError:
        raise UserError(
            "vLLM built its engine out of process, so hdr cannot load new weights into it;"
            " unset VLLM_ENABLE_V1_MULTIPROCESSING or use a vLLM in the pinned range"
        ) from None
    return VLLMGenerator(llm, eos)
