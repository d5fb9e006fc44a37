"""`vllm` backend: vLLM's offline `LLM` engine, for GPU runs. Imported lazily; `gpu` extra.

Written against vLLM 0.33 (the `gpu` extra pins vllm 0.33.0 with the torch 2.14.0 and
transformers 5.20.2 that release requires) and checked call by call against that release's
source. It has NOT run on a GPU: no GPU was available where hdr was built. On the CPU its
output parsing is tested over recorded output shapes (`completion_from_output`), and its
construction and every engine call through a fake `vllm` package that records what it
receives (tests/fakes/vllm):
- contexts go in as `TokensPrompt(prompt_token_ids=...)`, so the engine continues exactly our
  ids; `stop=["</search>", "</answer>"]` with `include_stop_str_in_output=True`,
  `skip_special_tokens=False`; every EOS id hdr knows (model generation config + tokenizer)
  is passed as `stop_token_ids`, and the engine ignores the checkpoint's generation config
  (`generation_config="vllm"`) so its sampling defaults cannot leak in;
- finish reasons come from vLLM's own fields, never from text: `"stop"` with a string
  `stop_reason` is a stop string (the last token may overhang it: vLLM cuts the text, not
  the token ids); `"stop"` with `stop_reason` None or an EOS id is an EOS, whose id is the
  last of `token_ids`; `"length"` is the token limit, except when the last token is an EOS
  id: an EOS sampled as the last allowed token is an EOS. (vLLM 0.11's `check_stop` tested
  the limit before the stop ids and said "length"; 0.33 tests the stop ids first. hdr does
  not depend on the order.) A context already at `max_model_len` is not sent: it comes back
  as "length" with no tokens (vLLM would refuse the request);
- `logprobs=0` returns the sampled token's log-prob; `logprobs_mode="processed_logprobs"`
  makes it the log-prob under the distribution sampled from (after temperature and top-p);
- per-request seeds: given `seeds` (one per context) each request samples from its own
  seeded generator (`SamplingParams.seed`), so a context's tokens do not depend on which
  contexts share the call (up to the batch's float rounding);
- placement: under torchrun (WORLD_SIZE > 1) every rank builds its own engine with
  `distributed_executor_backend="external_launcher"`, which takes its device from the rank's
  LOCAL_RANK (TRL's colocate mode does the same); without it every rank's engine would take
  cuda:0;
- sleep mode (`generation.enable_sleep_mode`): `sleep()` frees the engine's weights and KV
  cache while the trainer scores and updates (`LLM.sleep(level)`); `sync_weights` wakes the
  weights, loads the trainer's, checks them, then wakes the KV cache (`LLM.wake_up(tags)`);
- new weights: `sync_weights(model)` hands the trainer's state dict to the in-process model's
  `load_weights` (through `LLM.apply_model`), refuses in one line unless the names it loaded
  cover every parameter of the engine's model (a name mismatch would leave the engine
  sampling from stale weights), then resets the prefix cache (cached KV was computed with
  the old weights). That needs the engine in this process: `VLLM_ENABLE_V1_MULTIPROCESSING` is
  forced to 0 before vLLM is imported (an inherited 1 would otherwise win), and right after
  the engine is built hdr checks that it runs in this process, failing with one line if not;
- the sampler is seeded with `generation.seed` (the run's seed by default); tensor parallel
  size is fixed at 1 (the config refuses more: the in-process model must be whole).
"""

from __future__ import annotations

import os

from agent_env.generation.base import GENERATORS, Completion, SamplingParams
from agent_env.prompts import STOP_STRINGS
from core.errors import UserError

VLLM_RANGE = (">=0.33.0", "<0.34")


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
        ended_by_eos = bool(ids) and ids[-1] in eos  # the EOS was the last allowed token
        return Completion(ids, logprobs, "eos" if ended_by_eos else "length")
    if reason != "stop":
        raise ValueError(f"vLLM request ended with finish_reason {reason!r}")
    if isinstance(stop, str):
        return Completion(ids, logprobs, "stop", stop)
    if not ids or ids[-1] not in eos or (stop is not None and stop != ids[-1]):
        raise ValueError(
            f"vLLM reported an EOS stop ({stop!r}) but the last token {ids[-1:]} is not an EOS id"
        )
    return Completion(ids, logprobs, "eos")


def sampling_kwargs(params: SamplingParams, eos: set[int], seed: int | None = None) -> dict:
    """Keyword arguments of vLLM's `SamplingParams` for one turn (one request with `seed`)."""
    return dict(
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=0,  # 0: the whole vocabulary
        max_tokens=params.max_tokens,
        stop=list(STOP_STRINGS),
        stop_token_ids=sorted(eos),
        include_stop_str_in_output=True,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        logprobs=0,
        seed=seed,
    )


def engine_kwargs(config, model_dir, world: int) -> dict:
    """Keyword arguments of vLLM's `LLM` for this process; `world`: torchrun's WORLD_SIZE."""
    kwargs = dict(
        model=str(model_dir),
        dtype=config.dtype,
        gpu_memory_utilization=config.gpu_memory_utilization,
        seed=config.seed if config.seed is not None else 0,
        tensor_parallel_size=config.tensor_parallel_size,
        enable_prefix_caching=True,
        logprobs_mode="processed_logprobs",
        generation_config="vllm",
        enable_sleep_mode=config.enable_sleep_mode,
    )
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.max_num_seqs is not None:
        kwargs["max_num_seqs"] = config.max_num_seqs
    if world > 1:  # one engine per rank, on cuda:LOCAL_RANK
        kwargs["distributed_executor_backend"] = "external_launcher"
    return kwargs


def check_weight_coverage(loaded: set[str], expected: set[str]) -> None:
    """Refuse, in one line, a weight sync that left some of the engine's parameters as they
    were (`expected`: the engine model's parameter names; `loaded`: what `load_weights`
    reported)."""
    missing = sorted(expected - loaded)
    if missing:
        shown = ", ".join(missing[:4]) + (", ..." if len(missing) > 4 else "")
        raise UserError(
            f"the weight sync loaded {len(expected) - len(missing)} of {len(expected)} parameters"
            f" of vLLM's model; not loaded: {shown}. The engine would go on sampling from stale"
            " weights: the trainer's state-dict names do not map onto this model's in vLLM"
        )


def _load_into(state: dict):
    """The function `LLM.apply_model` runs on the engine's model: load `state`, return
    (names loaded, names of every parameter)."""

    def load(model) -> tuple[set[str], set[str]]:
        loaded = model.load_weights(weights=((k, v) for k, v in state.items()))
        return set(loaded), {name for name, _ in model.named_parameters()}

    return load


class VLLMGenerator:
    """Batched generation with a vLLM `LLM` engine on the GPU."""

    per_request_seeds = True

    def __init__(self, llm, eos: set[int], sleep_level: int | None = None) -> None:
        self.llm = llm
        self.eos = eos
        self.sleep_level = sleep_level  # None: no sleep mode
        self.max_model_len = llm.model_config.max_model_len
        self.asleep = False

    def generate(
        self, contexts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Completion]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        if self.asleep:
            raise RuntimeError("the vLLM engine is asleep; sync_weights wakes it")
        if seeds is not None and len(seeds) != len(contexts):
            raise ValueError(f"{len(seeds)} seeds for {len(contexts)} contexts")
        sent = [k for k, ctx in enumerate(contexts) if len(ctx) < self.max_model_len]
        if seeds is None:
            sampling = VSamplingParams(**sampling_kwargs(params, self.eos))
        else:
            sampling = [
                VSamplingParams(**sampling_kwargs(params, self.eos, seeds[k])) for k in sent
            ]
        prompts = [TokensPrompt(prompt_token_ids=list(contexts[k])) for k in sent]
        outputs = self.llm.generate(prompts, sampling, use_tqdm=False) if sent else []
        out = [Completion([], [], "length") for _ in contexts]  # full: no room for a token
        for k, request in zip(sent, outputs, strict=True):
            out[k] = completion_from_output(request.outputs[0], self.eos)
        return out

    def sleep(self) -> None:
        """Free the engine's weights and KV cache (sleep mode only) until `sync_weights`."""
        if self.sleep_level is not None and not self.asleep:
            self.llm.sleep(level=self.sleep_level)
            self.asleep = True

    def sync_weights(self, model) -> None:
        """Load the trainer's current weights into the engine (waking its weights first when
        asleep), check every parameter was loaded, wake the KV cache, drop stale cached KV."""
        import torch

        if self.asleep:
            torch.cuda.empty_cache()  # the trainer's freed blocks go back for the engine's wake
            self.llm.wake_up(tags=["weights"])
        state = model.state_dict()
        loaded, expected = self.llm.apply_model(_load_into(state))[0]
        check_weight_coverage(loaded, expected)
        if self.asleep:
            self.llm.wake_up(tags=["kv_cache"])
            self.asleep = False
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


def launched_world_size() -> int:
    """torchrun's WORLD_SIZE (1 in a plain run)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


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
    world = launched_world_size()
    if world > 1 and not {"RANK", "LOCAL_RANK"} <= os.environ.keys():
        raise UserError(
            f"WORLD_SIZE is {world} but RANK or LOCAL_RANK is unset: launch several processes"
            " with torchrun, which sets all three (each rank's engine takes cuda:LOCAL_RANK)"
        )
    eos = {tokenizer.eos_token_id} - {None}
    try:
        named = HFGenerationConfig.from_pretrained(str(model_dir)).eos_token_id
        eos |= {named} if isinstance(named, int) else set(named or [])
    except OSError:
        pass  # no generation_config.json: the tokenizer's EOS only
    llm = LLM(**engine_kwargs(config, model_dir, world))
    if getattr(llm.llm_engine, "model_executor", None) is None:
        raise UserError(
            "vLLM built its engine out of process, so hdr cannot load new weights into it;"
            " unset VLLM_ENABLE_V1_MULTIPROCESSING or use a vLLM in the pinned range"
        )
    return VLLMGenerator(llm, eos, config.sleep_level if config.enable_sleep_mode else None)
