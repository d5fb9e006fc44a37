"""Generation backends behind one interface: `hf` (CPU/GPU transformers), `vllm`, `scripted`.

Importing this package registers all three in `GENERATORS`; each backend module imports its
heavy dependency (torch, transformers, vLLM) only when a generator is built.
"""

from agent_env.generation import hf, scripted, vllm  # noqa: F401  (registration)
from agent_env.generation.base import (
    GENERATORS,
    Completion,
    GenerationConfig,
    Generator,
    SamplingParams,
    build_generator,
)

__all__ = [
    "GENERATORS",
    "Completion",
    "GenerationConfig",
    "Generator",
    "SamplingParams",
    "build_generator",
]
