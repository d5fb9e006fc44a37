"""accelerate's DeepSpeed path on CPU processes (the test bed's stand-in for GPUs).

accelerate 1.15 picks its process-group backend from the accelerator it finds (nccl on CUDA,
...); on a machine with none, a process that `accelerate launch` or torchrun started with
`ACCELERATE_USE_DEEPSPEED=true` gets backend None and then counts itself as one process of
one, while DeepSpeed has already joined a world of all of them (each process trains alone,
but ZeRO-3 partitions across all). `allow_deepspeed_on_cpu_processes` makes accelerate use
gloo there, the backend DeepSpeed's CPU accelerator talks over; everything else (the
DeepSpeed plugin, ZeRO-3's partitioning and gathers, TRL's code) is unchanged. It does
nothing where a GPU is present or only one process runs.

It also keeps DeepSpeed from compiling its CPU shared-memory all-reduce (`deepspeed_shm_comm`)
when its communication layer starts: that op serves only DeepSpeed's tensor-parallel inference
(`inference_all_reduce`), never ZeRO's training collectives (gloo here), and building it is a
C++ JIT compile on the first run of every fresh machine (46 s on this 2-core machine when
idle, 3 min when busy) that every process of a run waits on behind one file lock; the build
folder in ~/.cache/torch_extensions is also shared by every environment of one Python
version, so two environments with different torch builds rebuild it in turn.
"""

from __future__ import annotations

import os


def allow_deepspeed_on_cpu_processes() -> bool:
    """Patch accelerate's backend choice for several CPU processes; returns whether it did."""
    import torch

    if torch.cuda.is_available() or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return False
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return False
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    original = PartialState._prepare_backend
    if getattr(original, "hdr_cpu", False):
        return True

    def prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found, kind = original(self, cpu, sagemaker_dp, backend)
        if found is None and not cpu:
            return "gloo", DistributedType.MULTI_CPU  # accelerate then marks it DEEPSPEED
        return found, kind

    prepare_backend.hdr_cpu = True
    PartialState._prepare_backend = prepare_backend
    skip_shared_memory_op()
    return True


def skip_shared_memory_op() -> None:
    """Mark DeepSpeed's CPU shared-memory op unusable, so its communication layer starts
    without compiling it (DeepSpeed's own compatibility table, which it reads right there)."""
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False
