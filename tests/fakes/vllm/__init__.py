"""A stand-in for vLLM 0.33.0's offline API, for testing hdr's vllm backend on a CPU.

It records how each engine is built and every call it receives (`EVENTS`, and one JSON file
per engine under $FAKE_VLLM_LOG), and answers with scripted completions. Where vLLM 0.33
would refuse something, it refuses too, so a test fails where a GPU run would:
- keyword arguments are checked against the names vLLM 0.33.0's `LLM.__init__` /
  `EngineArgs` and `SamplingParams` define (the subset hdr may pass, read from that
  release's source);
- placement follows 0.33's executors: `distributed_executor_backend="external_launcher"`
  takes cuda:$LOCAL_RANK (and turns V1 multiprocessing off); otherwise the uniprocess
  executor takes cuda:0; with VLLM_ENABLE_V1_MULTIPROCESSING=1 the engine is out of process
  (`llm_engine` has no `model_executor`; `OUT_OF_PROCESS` forces that);
- a prompt as long as `max_model_len` is refused; `sleep` without `enable_sleep_mode` is
  refused; generating while asleep is refused (the scheduler is paused: vLLM would wait);
  `apply_model` with the weights asleep is refused (level 2 discarded them);
- the model's parameters are vLLM's names for the model directory's weights (q/k/v fused
  into `qkv_proj`, gate/up into `gate_up_proj`, a tied `lm_head` left out), and
  `load_weights` returns the names it loaded; names in `DROPPED` are skipped, to stand for a
  checkpoint whose names do not map.

`responder(prompt_ids, sampling)` makes each completion: (token_ids, finish_reason,
stop_reason); set `LLM.responder` to replay recorded shapes. The default acts like a
Search-R1 policy: search, then answer, each closed by its stop string.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

__version__ = "0.33.0"

LLM_ARGS = {  # vllm 0.33.0: LLM.__init__ parameters and the EngineArgs fields hdr passes
    "model", "tokenizer", "tensor_parallel_size", "dtype", "seed", "gpu_memory_utilization",
    "enforce_eager", "kv_cache_memory_bytes", "enable_prefix_caching", "max_model_len",
    "max_num_seqs", "logprobs_mode", "generation_config", "enable_sleep_mode",
    "distributed_executor_backend", "max_num_batched_tokens",
}  # fmt: skip
SAMPLING_ARGS = {  # vllm 0.33.0: SamplingParams fields hdr may set
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "max_tokens", "min_tokens", "logprobs", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize",
}  # fmt: skip
LOGPROBS_MODES = {"raw_logits", "raw_logprobs", "processed_logits", "processed_logprobs"}

EVENTS: list[tuple] = []  # every call of every engine of this process, in order
DROPPED: set[str] = set()  # vLLM parameter names load_weights skips (a mismatch)
OUT_OF_PROCESS = False  # True: the engine core runs in another process whatever the env says


def log(*event) -> None:
    EVENTS.append(event)


class SamplingParams:
    def __init__(self, **kwargs) -> None:
        unknown = set(kwargs) - SAMPLING_ARGS
        if unknown:
            raise TypeError(f"SamplingParams got unexpected arguments {sorted(unknown)}")
        if kwargs.get("top_k", 0) < -1:
            raise ValueError("top_k must be 0 (disable), or at least 1")
        self.__dict__.update({"seed": None, "max_tokens": 16, "logprobs": None, **kwargs})


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


VLLM_NAMES = [(r"\.(q|k|v)_proj\.", ".qkv_proj."), (r"\.(gate|up)_proj\.", ".gate_up_proj.")]


def vllm_name(hf_name: str) -> str:
    for pattern, fused in VLLM_NAMES:
        hf_name = re.sub(pattern, fused, hf_name)
    return hf_name


class FakeModel:
    """vLLM's view of the model in `model_dir`: its parameter names, and `load_weights`."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.config = AutoConfig.from_pretrained(model_dir)
        with torch.device("meta"):
            hf = AutoModelForCausalLM.from_config(self.config)
        self.params = {vllm_name(name): p for name, p in hf.named_parameters()}  # tied: once

    def named_parameters(self):
        return iter(self.params.items())

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            target = vllm_name(name)
            if target in DROPPED or target not in self.params:
                continue  # vLLM skips what it has no parameter for (a tied lm_head)
            if tensor.dim() != self.params[target].dim():
                raise ValueError(f"{name} has {tensor.dim()} dimensions, {target} another count")
            loaded.add(target)
        log("load_weights", len(loaded))
        return loaded


def scripted_search_r1(tokenizer):
    """The default responder: search, then (once information came back) answer."""

    def respond(prompt_ids: list[int], sampling: SamplingParams):
        text = tokenizer.decode(prompt_ids, skip_special_tokens=False)
        tag = "answer" if "<information>" in text else "search"
        body = (" x " if tag == "answer" else " a query ") + f"</{tag}>"
        if not text.rstrip().endswith(f"<{tag}>"):
            body = f"<{tag}>" + body
        ids = tokenizer.encode(body, add_special_tokens=False)
        if len(ids) > sampling.max_tokens:
            return ids[: sampling.max_tokens], "length", None
        return ids, "stop", f"</{tag}>"

    return respond


class LLM:
    responder = None  # (prompt_ids, sampling) -> (token_ids, finish_reason, stop_reason)

    def __init__(self, model: str, **kwargs) -> None:
        import torch.distributed as dist
        from transformers import AutoTokenizer

        unknown = set(kwargs) - LLM_ARGS
        if unknown:
            raise TypeError(f"LLM got unexpected arguments {sorted(unknown)}")
        if kwargs.get("logprobs_mode", "raw_logprobs") not in LOGPROBS_MODES:
            raise ValueError(f"unknown logprobs_mode {kwargs['logprobs_mode']}")
        backend = kwargs.get("distributed_executor_backend")
        if backend == "external_launcher":  # ExecutorWithExternalLauncher
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            device = f"cuda:{int(os.environ['LOCAL_RANK'])}"
        else:  # UniProcExecutor: device "cuda" without an index is local rank 0
            device = "cuda:0"
        in_process = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") == "0"
        in_process = in_process and not OUT_OF_PROCESS
        self.built = {
            "model": model,
            "kwargs": kwargs,
            "device": device,
            "in_process": in_process,
            "env": {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")},
            "torch_world": dist.get_world_size() if dist.is_initialized() else 1,
        }
        self.model = FakeModel(model)
        max_len = kwargs.get("max_model_len") or self.model.config.max_position_embeddings
        self.model_config = SimpleNamespace(max_model_len=max_len)
        executor = SimpleNamespace(driver_worker=SimpleNamespace(model_runner=self.model))
        engine = {"model_executor": executor} if in_process else {}  # out of process: none
        self.llm_engine = SimpleNamespace(**engine)
        self.tokenizer = AutoTokenizer.from_pretrained(model)
        self.sleep_mode = kwargs.get("enable_sleep_mode", False)
        self.asleep = set()  # what is asleep: "weights", "kv_cache"
        log("LLM", self.built)
        if os.environ.get("FAKE_VLLM_LOG"):
            rank = os.environ.get("RANK", "0")
            path = Path(os.environ["FAKE_VLLM_LOG"]) / f"engine-rank{rank}-{os.getpid()}.json"
            path.write_text(json.dumps(self.built))

    def generate(self, prompts, sampling_params=None, *, use_tqdm=True):
        if self.asleep:
            raise RuntimeError(f"generate while asleep ({sorted(self.asleep)}): vLLM would wait")
        many = isinstance(sampling_params, list)
        if many and len(sampling_params) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        respond = type(self).responder or scripted_search_r1(self.tokenizer)
        outputs = []
        for k, prompt in enumerate(prompts):
            ids = list(prompt["prompt_token_ids"])
            if len(ids) >= self.model_config.max_model_len:
                raise ValueError(f"prompt (length {len(ids)}) is longer than max_model_len")
            sampling = sampling_params[k] if many else sampling_params
            tokens, reason, stop = respond(ids, sampling)
            steps = [{t: Logprob(-0.5, 1)} for t in tokens]
            done = CompletionOutput(0, "", list(tokens), None, steps, reason, stop)
            outputs.append(RequestOutput(str(k), ids, [done]))
        seeds = [s.seed for s in sampling_params] if many else [sampling_params.seed]
        log("generate", len(prompts), seeds)
        return outputs

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        if not self.sleep_mode:
            raise RuntimeError("sleep mode is not enabled (LLM(enable_sleep_mode=True))")
        self.asleep = {"weights", "kv_cache"}
        log("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        self.asleep -= set(tags or ("weights", "kv_cache"))
        log("wake_up", tags)
        return not self.asleep

    def apply_model(self, func):
        if "weights" in self.asleep:
            raise RuntimeError("apply_model while the weights are asleep")
        log("apply_model")
        return [func(self.model)]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool:
        log("reset_prefix_cache")
        return True
