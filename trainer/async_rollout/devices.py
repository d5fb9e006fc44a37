"""Where asynchronous rollout workers run (`async_rollout.devices`): the device map
that trainer/async_rollout/workers.py applies in each worker process and
trainer/tools/memory_plan.py plans.

Each worker is mapped to one device (empty map: `model.device`). A worker on `cuda:N` sees
that one GPU only: its process's CUDA_VISIBLE_DEVICES, set before anything in it touches
CUDA, names the N-th GPU the trainer's process sees. So its vLLM engine, whose uniprocess
executor takes the first visible GPU, and its hf copy of the policy land there. A vllm worker's
module is only the copy each new version passes through on its way into the engine (and the
weight check's teacher forcing): it stays on the CPU. vLLM engines that share a GPU start one
at a time, since each sizes its KV cache from the memory it sees free while it profiles.
"""

from __future__ import annotations

import os

from core.errors import UserError
from trainer.config import TrainConfig


def worker_device(config: TrainConfig, index: int) -> str:
    """The device worker `index` is mapped to (`async_rollout.devices`, else `model.device`)."""
    a = config.async_rollout
    return a.devices[index] if a.devices else config.model.device


def worker_placement(
    config: TrainConfig, index: int, visible: str | None
) -> tuple[str | None, str]:
    """Where worker `index` runs (module docstring): the CUDA_VISIBLE_DEVICES its
    process gets (None: it keeps the inherited one) and the torch device of its module.
    `visible`: this process's CUDA_VISIBLE_DEVICES (None when unset: every GPU)."""
    device = worker_device(config, index)
    if not device.startswith("cuda"):
        # mapped to the CPU by name: no GPU at all, or a vLLM engine would take GPU 0 unplanned
        return ("" if config.async_rollout.devices else None), "cpu"
    n = int(device.partition(":")[2] or 0)
    listed = [d.strip() for d in visible.split(",") if d.strip()] if visible is not None else None
    if listed is not None and n >= len(listed):
        raise UserError(
            f"async_rollout.devices maps worker {index} to {device}, but this process sees"
            f" {len(listed)} GPU(s) (CUDA_VISIBLE_DEVICES={visible})"
        )
    module = "cpu" if config.generation.backend == "vllm" else "cuda:0"
    return (listed[n] if listed is not None else str(n)), module


def place_worker(config: TrainConfig, index: int) -> TrainConfig:
    """Restrict this worker process to its GPU (before CUDA is first touched here) and return
    the config it runs with: its module's device in this process's numbering."""
    visible, module = worker_placement(config, index, os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    update = {"model": config.model.model_copy(update={"device": module})}
    if config.generation.backend == "hf":
        update["generation"] = config.generation.model_copy(update={"device": module})
    return config.model_copy(update=update)


def shared_vllm_gpus(config: TrainConfig) -> bool:
    """Whether two vLLM workers are mapped to one GPU (they then start one at a time)."""
    if config.generation.backend != "vllm":
        return False
    devices = [worker_device(config, w) for w in range(config.async_rollout.workers)]
    gpus = [d.partition(":")[2] or "0" for d in devices if d.startswith("cuda")]
    return len(set(gpus)) < len(gpus)
