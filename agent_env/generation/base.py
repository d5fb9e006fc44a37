"""The generation interface the rollout loop calls, and the registry of backends.

A backend continues token-id contexts and reports, per sampled token, the log-prob under the
distribution it actually sampled from (after temperature and top-p). Generation stops at
`</search>`, `</answer>`, EOS or `max_tokens`; tokens after the stop are trimmed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import Field

from hdr.config import StrictModel
from hdr.registry import Registry


@dataclass(frozen=True)
class SamplingParams:
    """`temperature == 0` means greedy. `top_p == 1` keeps the whole distribution."""

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 128


@dataclass
class Completion:
    """What one context got: sampled ids (up to and including the stop), their log-probs,
    and whether it stopped on a stop string or EOS (False: ran into `max_tokens`)."""

    token_ids: list[int]
    logprobs: list[float]
    finished: bool


class Generator(Protocol):
    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """Continue each context; one Completion per context, in order."""
        ...

    def sync_weights(self, model) -> None:
        """Take the trainer's current weights (no-op when the module is shared)."""
        ...


class GenerationConfig(StrictModel):
    """How to build a generation backend."""

    backend: str = Field("hf", description="Registered backend name: hf, vllm or scripted.")
    device: str = Field("cpu", description="torch device for hf (cpu, cuda, cuda:1, ...).")
    dtype: Literal["float32", "bfloat16", "float16"] = Field(
        "float32", description="Weights' dtype; float32 keeps sampler and trainer log-probs equal."
    )
    max_batch: int | None = Field(
        None, ge=1, description="hf: split a turn's contexts into chunks of at most this many."
    )
    gpu_memory_utilization: float = Field(
        0.5, gt=0, le=1, description="vllm: share of GPU memory for weights and KV cache."
    )
    seed: int = Field(0, description="vllm: sampling seed.")


# name -> factory(*, config, model_dir, tokenizer, prompt, model=None) -> Generator
GENERATORS: Registry[Callable[..., Generator]] = Registry("generation backend")


def build_generator(config: GenerationConfig, *, model_dir, tokenizer, prompt, model=None):
    """Build the configured backend. `model` (hf) reuses an already loaded module, as the
    trainer does so generation sees its weights without a copy."""
    factory = GENERATORS.get(config.backend)
    return factory(
        config=config, model_dir=model_dir, tokenizer=tokenizer, prompt=prompt, model=model
    )
