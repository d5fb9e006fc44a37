"""The dense index on GPUs (`dense.gpus`): which GPUs, which indexes, which search sizes.

FAISS's GPU build clones a CPU index onto GPUs (`index_cpu_to_gpus_list`), sharded across the
ones named, with flat storage in float16. Its limits, read from faiss's source (GpuCloner.cpp,
DeviceDefs.cuh) and turned into one-line refusals before anything is copied:

- only the GPUs named are used: a trainer on the same node keeps its own cards (faiss's
  `index_cpu_to_all_gpus` would take every visible one);
- HNSW has no GPU implementation ("This index type is not implemented on GPU");
- a GPU search returns at most 2,048 neighbours and probes at most 2,048 IVF lists
  (GPU_MAX_SELECTION_K); with `--refine` the GPU is asked for topk x refine_k_factor
  candidates, so the factor is lowered to fit `max_topk` (with a warning).

The decisions are pure functions of numbers and flags, so they are tested on a machine without a
GPU; `clone_to_gpus` is written against faiss's GPU API and has not run here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.errors import UserError, error_reason, warn

if TYPE_CHECKING:
    import faiss

GPU_MAX_K = 2048  # GPU_MAX_SELECTION_K of faiss's CUDA build: largest k and nprobe per search
GPU_FAISS_PACKAGE = "faiss-gpu-cu12"  # the pip wheel of faiss with CUDA 12 support


def check_gpus(gpus: list[int], gpu_faiss: bool, visible: int) -> None:
    """Refuse GPU ids faiss cannot use: no GPU build of faiss, no GPU visible, an id past the
    visible ones (numbered inside CUDA_VISIBLE_DEVICES, as faiss and torch number them)."""
    if not gpu_faiss:
        raise UserError(
            f"dense.gpus {gpus} needs faiss built with GPU support: "
            f"pip uninstall faiss-cpu && pip install {GPU_FAISS_PACKAGE}"
        )
    if visible == 0:
        raise UserError(f"dense.gpus {gpus}: faiss sees no GPU (check CUDA_VISIBLE_DEVICES)")
    beyond = [gpu for gpu in gpus if gpu >= visible]
    if beyond:
        raise UserError(
            f"dense.gpus names GPU {beyond[0]}, but faiss sees {visible} "
            f"(ids 0-{visible - 1}, numbered inside CUDA_VISIBLE_DEVICES)"
        )


def check_gpu_index(factory: str, hnsw: bool) -> None:
    """Refuse an index FAISS cannot clone to a GPU (HNSW, possibly behind a transform)."""
    if hnsw:
        raise UserError(
            f"a {factory} index cannot go to a GPU (FAISS has no GPU HNSW); serve it on the CPU "
            "(dense.gpus=null) or convert it to Flat or IVF with `hdr index convert`"
        )


def fit_gpu_search(max_topk: int, nprobe: int | None, refine_k_factor: int) -> int:
    """The refine factor a GPU search can use: `refine_k_factor`, lowered (with a warning) so
    that max_topk x factor candidates fit GPU_MAX_K. Refuses a `max_topk` or IVF `nprobe`
    (None: not an IVF index) over GPU_MAX_K. A factor of 0 (no refining) stays 0."""
    if max_topk > GPU_MAX_K:
        raise UserError(
            f"max_topk {max_topk} exceeds FAISS-GPU's {GPU_MAX_K} results per query; "
            f"set max_topk={GPU_MAX_K} or less, or serve on the CPU (dense.gpus=null)"
        )
    if nprobe is not None and nprobe > GPU_MAX_K:
        raise UserError(
            f"dense.nprobe {nprobe} exceeds FAISS-GPU's {GPU_MAX_K} lists per query; "
            f"set dense.nprobe={GPU_MAX_K} or less"
        )
    fitting = GPU_MAX_K // max_topk
    if refine_k_factor <= fitting:
        return refine_k_factor
    warn(
        f"dense.refine_k_factor {refine_k_factor} lowered to {fitting} on GPU: max_topk "
        f"{max_topk} x {refine_k_factor} candidates exceeds FAISS-GPU's {GPU_MAX_K} per query "
        f"(lower max_topk to {GPU_MAX_K // refine_k_factor} to keep the factor)"
    )
    return fitting


def gpu_faiss_available() -> tuple[bool, int]:
    """(whether this faiss has GPU support, how many GPUs it sees)."""
    import faiss

    if not hasattr(faiss, "GpuMultipleClonerOptions"):
        return False, 0
    return True, faiss.get_num_gpus()


def clone_to_gpus(index: faiss.Index, gpus: list[int]) -> faiss.Index:
    """The index copied to the GPUs `gpus` (sharded across them, float16 flat storage).

    Written against faiss's GPU API (`index_cpu_to_gpus_list`, `GpuMultipleClonerOptions`);
    untested here, where faiss-cpu has no GPU support. A clone faiss refuses (e.g. an IVF-PQ
    code size its GPU kernels lack) is one line naming faiss's reason.
    """
    import faiss

    options = faiss.GpuMultipleClonerOptions()
    options.shard = True  # each GPU holds a slice: wiki-18's 64 GB fits on several cards
    options.useFloat16 = True
    try:
        return faiss.index_cpu_to_gpus_list(index, co=options, gpus=list(gpus))
    except RuntimeError as err:
        raise UserError(
            f"faiss cannot put this index on GPUs {gpus}: {error_reason(err)}"
        ) from None
