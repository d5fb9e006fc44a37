"""A stand-in for vLLM 0.31.0's offline API on CUDA, for what the real engine cannot show on
a CPU: sleep mode (the CPU build refuses `enable_sleep_mode`) and CUDA placement (which
device each rank's engine takes). Everything else hdr's vllm backend does is tested on the
real engine (the tests marked `vllm`, tests/real_vllm.py); this fake stays only for those two.

It records how each engine is built and every call it receives (`EVENTS`, and one JSON file
per engine under $FAKE_VLLM_LOG), and answers with scripted completions. Where vLLM 0.31
would refuse something, it refuses too, so a test fails where a GPU run would:
- keyword arguments are checked against the names vLLM 0.31.0's `LLM.__init__` /
  `EngineArgs` and `SamplingParams` define (the subset hdr may pass, read from that
  release's source);
- placement follows 0.31's executors: `distributed_executor_backend="external_launcher"`
  takes cuda:$LOCAL_RANK (and turns V1 multiprocessing off); otherwise the uniprocess
  executor takes cuda:0; with VLLM_ENABLE_V1_MULTIPROCESSING=1 the engine is out of process
  (`llm_engine` has no `model_executor`; `OUT_OF_PROCESS` forces that);
- a prompt as long as `max_model_len` is refused; `sleep` without `enable_sleep_mode` is
  refused; generating while asleep is refused (the scheduler is paused: vLLM would wait);
  `collective_rpc("reload_weights")` with the weights asleep is refused (level 2 discarded
  them);
- the weights are a real transformers model of the model directory: `reload_weights` loads
  the tensors it is given into it (names in `DROPPED` are skipped, to stand for names that do
  not map), and a request with `prompt_logprobs` is scored by it, so hdr's check after each
  sync compares real numbers.

`responder(prompt_ids, sampling)` makes each completion: (token_ids, finish_reason,
stop_reason); set `LLM.responder` to replay recorded shapes. The default acts like a
Search-R1 policy: search, then answer, each closed by its stop string.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace

__version__ = "0.31.0"

LLM_ARGS = {  # vllm 0.31.0: LLM.__init__ parameters and the EngineArgs fields hdr passes
    "model", "tokenizer", "tensor_parallel_size", "dtype", "seed", "gpu_memory_utilization",
    "enforce_eager", "kv_cache_memory_bytes", "enable_prefix_caching", "max_model_len",
    "max_num_seqs", "logprobs_mode", "generation_config", "enable_sleep_mode",
    "distributed_executor_backend", "max_num_batched_tokens",
}  # fmt: skip
SAMPLING_ARGS = {  # vllm 0.31.0: SamplingParams fields hdr may set
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "max_tokens", "min_tokens", "logprobs", "skip_special_tokens",
    "spaces_between_special_tokens", "include_stop_str_in_output", "detokenize",
    "prompt_logprobs",
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
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class FakeModel:
    """The engine's weights: a transformers model of `model_dir`, loaded by `reload_weights`."""

    def __init__(self, model_dir: str) -> None:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        self.config = AutoConfig.from_pretrained(model_dir)
        self.module = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def reload_weights(self, weights_iterator, is_checkpoint_format: bool = True) -> None:
        import torch

        own = self.module.state_dict()
        loaded = 0
        with torch.no_grad():
            for name, tensor in weights_iterator:
                if name in DROPPED or name not in own:
                    continue
                own[name].copy_(tensor.detach().to(own[name].device, own[name].dtype))
                loaded += 1
        log("reload_weights", loaded)

    def prompt_logprobs(self, ids: list[int]) -> list[dict[int, Logprob] | None]:
        import torch

        with torch.no_grad():
            row = torch.tensor([ids])
            logits = self.module(input_ids=row).logits[0, :-1].float()
            picked = torch.log_softmax(logits, -1).gather(1, row[0, 1:, None])[:, 0]
        return [None] + [{t: Logprob(float(x), 1)} for t, x in zip(ids[1:], picked, strict=True)]


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
            "env": {
                k: os.environ.get(k)
                for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES")
            },
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
            if getattr(sampling, "prompt_logprobs", None) is not None:  # scoring, not sampling
                scored = self.model.prompt_logprobs(ids)
                done = CompletionOutput(0, "", [ids[-1]], None, [{ids[-1]: Logprob(0.0)}], "length")
                outputs.append(RequestOutput(str(k), ids, [done], prompt_logprobs=scored))
                continue
            tokens, reason, stop = respond(ids, sampling)
            steps = [{t: Logprob(-0.5, 1)} for t in tokens]
            done = CompletionOutput(0, "", list(tokens), None, steps, reason, stop)
            outputs.append(RequestOutput(str(k), ids, [done]))
        if getattr(sampling_params, "prompt_logprobs", None) is not None:
            log("prompt_logprobs", len(prompts))
            return outputs
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

    def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if method != "reload_weights":
            raise NotImplementedError(f"the fake answers reload_weights only, not {method!r}")
        if "weights" in self.asleep:
            raise RuntimeError("reload_weights while the weights are asleep")
        log("collective_rpc", method)
        self.model.reload_weights(**(kwargs or {}))
        return [None]

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False) -> bool:
        log("reset_prefix_cache")
        return True
