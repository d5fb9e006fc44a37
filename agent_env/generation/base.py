"""The generation interface the rollout loop calls, and the registry of backends.

A backend continues token-id contexts and reports, per sampled token, the log-prob under the
distribution it actually sampled from (after temperature and top-p), and, per completion,
WHY it ended (`finish_reason`):

- `"eos"`: the model sampled an end-of-sequence id; it is the last of `token_ids` (a policy
  token: it was sampled);
- `"stop"`: a stop string (`</search>`, `</answer>`) was completed; `stop_string` names it.
  The last token may carry characters after it (byte-level BPE writes `>\\n\\n` as one token:
  the "overhang"); those characters stay in the completion, as the sampler produced them;
- `"length"`: `max_tokens` ran out first.

The rollout reads the reason; it never infers EOS from the decoded text. Nothing after a
completion's own finish is returned (no padding, no tokens sampled after a stop).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import Field, field_validator

from core.config import StrictModel
from core.registry import Registry

FinishReason = Literal["eos", "stop", "length"]


@dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` means greedy. `top_p == 1` keeps the whole distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128


@dataclass
class Completion:
    """What one context got: sampled ids up to and including the one that finished it, their
    log-probs, why it finished, and the stop string matched (only for `"stop"`)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_string: str | None = None

    def __post_init__(self) -> None:
        if (self.finish_reason == "stop") != (self.stop_string is not None):
            raise ValueError("a completion names its stop string exactly when it stopped on one")
        if self.finish_reason == "eos" and not self.token_ids:
            raise ValueError("an eos completion ends with the sampled EOS id")

    @property
    def finished(self) -> bool:
        """Ended by the policy (EOS or a stop string), not by the token limit."""
        return self.finish_reason != "length"


class Generator(Protocol):
    per_request_seeds: bool
    """Whether `generate` samples each context from its own `seeds` entry, so what a context
    gets does not depend on which contexts share the call (vllm). Backends that sample from
    torch's global RNG (hf) ignore `seeds`."""

    def generate(
        self, contexts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Completion]:
        """Continue each context; one Completion per context, in order."""
        ...

    def sleep(self) -> None:
        """Free the GPU memory generation holds until the next `sync_weights` (vllm's sleep
        mode, while the trainer scores and updates); a no-op for backends that hold none."""
        ...

    def sync_weights(self, model) -> None:
        """Take the trainer's current weights (no-op when the module is shared); wakes a
        sleeping engine."""
        ...

    def close(self) -> None:
        """Let go of what the backend holds for itself (vllm: its engine and KV cache, which a
        later engine in this process is sized against); a no-op for the others."""
        ...


class GenerationConfig(StrictModel):
    """How to build a generation backend."""

    backend: str = Field("hf", description="Registered backend name: hf, vllm or scripted.")
    device: str = Field("cpu", description="torch device for hf (cpu, cuda, cuda:1, ...).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32",
        description="Compute dtype. hf with its own model: the weights' dtype; hf sharing the"
        " trainer's float32 module: bfloat16/float16 run under torch.autocast; vllm: the"
        " engine's dtype. float32 keeps sampler and trainer log-probs equal.",
    )
    max_batch: int | None = Field(
        None, ge=1, description="hf: split a turn's contexts into chunks of at most this many."
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vllm: share of GPU memory for weights and KV cache."
    )
    kv_cache_gib: float | None = Field(
        None,
        gt=0,
        description="vllm: the KV cache's size in GiB, instead of `gpu_memory_utilization`'s"
        " share. On the CPU that share is of the machine's memory less everything this"
        " process holds (the trainer's model and optimizer included), so a process that"
        " already trains leaves an engine little or nothing; a size holds anywhere (vLLM's"
        " VLLM_CPU_KVCACHE_SPACE, in GiB, overrides both on the CPU).",
    )
    seed: int | None = Field(
        None, description="vllm: sampling seed; None: the run's seed (hdr train), else 0."
    )
    max_model_len: int | None = Field(
        None,
        ge=16,
        description="vllm: the longest context (prompt + response so far + the turn) the"
        " engine accepts and sizes its KV cache for; None: the model's own (32,768 for"
        " Qwen2.5, far more than a rollout needs). A context at the limit comes back as"
        " 'length' with no tokens.",
    )
    enforce_eager: bool = Field(
        False,
        description="vllm: run the model eagerly (no torch.compile, no CUDA graphs): the"
        " engine starts in seconds and decodes slower. The CPU tests set it.",
    )
    max_num_seqs: int | None = Field(
        None, ge=1, description="vllm: most sequences decoded at once; None: vLLM's default."
    )
    enable_sleep_mode: bool = Field(
        False,
        description="vllm: free the engine's GPU memory (weights and KV cache) while the"
        " trainer scores and updates, and wake it for the weight sync (vLLM's sleep mode).",
    )
    sleep_level: Literal[1, 2] = Field(
        2,
        description="vllm with enable_sleep_mode: 1 moves the engine's weights to CPU memory"
        " while asleep; 2 discards them (the weight sync after each update reloads every one).",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="vllm: GPUs per engine. Only 1: the weight sync loads the trainer's state"
        " dict into the in-process model, which holds the whole model only at 1.",
    )

    @field_validator("tensor_parallel_size")
    @classmethod
    def _single_gpu_engine(cls, v: int) -> int:
        if v > 1:
            raise ValueError(
                "tensor_parallel_size > 1 is not supported: hdr syncs weights into the vLLM"
                " model held in this process, which is whole only at tensor_parallel_size 1"
            )
        return v


# name -> factory(*, config, model_dir, tokenizer, prompt, model=None) -> Generator
GENERATORS: Registry[Callable[..., Generator]] = Registry("generation backend")


def build_generator(config: GenerationConfig, *, model_dir, tokenizer, prompt, model=None):
    """Build the configured backend. `model` (hf) reuses an already loaded module, as the
    trainer does so generation sees its weights without a copy."""
    factory = GENERATORS.get(config.backend)
    return factory(
        config=config, model_dir=model_dir, tokenizer=tokenizer, prompt=prompt, model=model
    )
