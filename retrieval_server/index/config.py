"""How an index's encoder runs (`EncoderConfig`, shared by `hdr index build` and `hdr serve`) and
how its dense part is held and searched at serve time (`DenseSearchConfig`); `ServerConfig`
holds both."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, NonNegativeInt, field_validator

from core.config import StrictModel


class EncoderConfig(StrictModel):
    """How the encoder runs (not what it computes: that is the index's `EncoderSpec`)."""

    backend: Literal["onnx", "torch"] = Field(
        default="onnx",
        description="onnx: ONNX Runtime on the CPU (fastest here, same vectors); torch: "
        "sentence-transformers (CPU or CUDA).",
    )
    device: Literal["cpu", "cuda"] = Field(
        default="cpu", description="Where the encoder runs; cuda needs the torch backend."
    )
    fp16: bool = Field(default=False, description="Half precision (CUDA with torch only).")
    batch_size: int = Field(default=64, ge=1, description="Texts encoded per forward pass.")
    threads: int | None = Field(
        default=None,
        ge=1,
        description="ONNX Runtime intra-op threads; None lets ONNX Runtime choose (all cores).",
    )
    spin_us: int = Field(
        default=50,
        ge=0,
        description="How long an idle ONNX Runtime intra-op thread spins (microseconds) before "
        "it sleeps. One forward pass has dozens of parallel sections microseconds apart, so a "
        "short spin keeps them from waiting on a wake-up (a lone query here: 2.4 ms instead of "
        "3.0), while between requests the threads sleep and leave the cores to the event loop "
        "and FAISS (ONNX Runtime's default spins about 2 ms after every pass); 0: never spin.",
    )


class DenseSearchConfig(StrictModel):
    """How the dense (FAISS) index is held and searched at serve time."""

    mmap: bool = Field(
        default=True,
        description="Memory-map flat vectors read-only instead of copying them into the "
        "process: start-up in seconds and one copy in the page cache shared by all replicas.",
    )
    nprobe: int = Field(
        default=32, ge=1, description="IVF lists searched per query (IVF indexes only)."
    )
    ef_search: int = Field(
        default=128, ge=1, description="HNSW search breadth (HNSW indexes only)."
    )
    refine_k_factor: int = Field(
        default=32,
        ge=0,
        description="For an index converted with --refine (IVF-PQ, ...): fetch k x this many "
        "candidates from the compressed index and rank them by exact inner product on the "
        "memory-mapped flat vectors; 0 serves the compressed scores alone.",
    )
    exact_k_factor: int = Field(
        default=8,
        ge=0,
        description="For an index converted with --refine --compact: the compact codes (held "
        "in RAM) rank the k x refine_k_factor candidates and only the best k x this many are "
        "read from the flat vectors for their exact scores (8 random reads a result instead "
        "of refine_k_factor, where the flat file does not fit the page cache: recall@10 0.96 "
        "at 10M, 2 reads 0.74); 0 skips the "
        "compact codes and re-ranks every candidate exactly.",
    )
    threads: int | None = Field(
        default=None,
        ge=1,
        description="Most OpenMP threads one FAISS search uses; None: all cores. A batch is "
        "searched on at most one thread per query: FAISS splits a batch by query, so the "
        "other threads would only be woken for nothing (on a busy machine that wake-up cost "
        "a lone query 6 ms where the search takes 0.4). A flat index's BLAS search (below) "
        "runs on one thread: a second one saved 20% of the wall time for 64-512 queries and "
        "cost 40% more CPU, which the encoder needs more.",
    )
    blas_from_queries: int = Field(
        default=4,
        ge=0,
        description="A batch of at least this many queries is scored against flat vectors as "
        "one BLAS matrix product instead of FAISS's per-query SIMD scan (FAISS 1.15 keeps "
        "the scan while queries x dimension < 128,000: 333 queries at 384-d, so every batch "
        "hdr serves). Measured over 10,033 x 384 on one thread: 32 "
        "queries 3.3 ms instead of 7.7-12, 256 queries 19 instead of 61-93; the scan wins "
        "below 4 (one query 0.34 ms against 1.1). Also the IVF coarse quantizer's search. "
        "0 keeps FAISS's own threshold.",
    )
    gpus: list[NonNegativeInt] | None = Field(
        default=None,
        min_length=1,
        description="CUDA device ids (numbered inside CUDA_VISIBLE_DEVICES) that hold the index, "
        "sharded across them, flat vectors in float16; None: the CPU. Only these GPUs are "
        "used, so name the ones a trainer on the same node leaves free. Needs the "
        "faiss-gpu-cu12 wheel; HNSW cannot go to a GPU, and a GPU search returns at most "
        "2,048 candidates (max_topk x refine_k_factor is fitted to it).",
    )

    @field_validator("gpus")
    @classmethod
    def distinct_gpus(cls, gpus: list[int] | None) -> list[int] | None:
        if gpus is not None and len(set(gpus)) != len(gpus):
            raise ValueError(f"names a GPU twice: {gpus}")
        return gpus
