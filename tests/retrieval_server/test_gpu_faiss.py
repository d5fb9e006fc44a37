"""FAISS-GPU's limits, decided before anything is copied to a GPU
(`retrieval_server.index.gpu_faiss`).

This machine has no GPU and faiss-cpu, so these tests exercise the decisions (pure functions,
and real FAISS indexes for the HNSW check) and the one path a CPU reaches end to end: asking
for GPUs with faiss-cpu installed. The clone itself (`index_cpu_to_gpus_list`) has not run.
"""

from __future__ import annotations

from pathlib import Path

import faiss
import pytest

from core.config import build_config
from core.errors import UserError
from retrieval_server.config import DenseSearchConfig, ServerConfig
from retrieval_server.index.files import has_hnsw, load_index
from retrieval_server.index.gpu_faiss import (
    GPU_MAX_K,
    check_gpu_index,
    check_gpus,
    fit_gpu_search,
)


def test_gpus_must_exist_and_need_the_cuda12_wheel() -> None:
    with pytest.raises(UserError, match=r"pip install faiss-gpu-cu12$"):
        check_gpus([0], gpu_faiss=False, visible=0)
    with pytest.raises(UserError, match="faiss sees no GPU"):
        check_gpus([0], gpu_faiss=True, visible=0)
    with pytest.raises(UserError, match=r"names GPU 2, but faiss sees 2 \(ids 0-1"):
        check_gpus([1, 2], gpu_faiss=True, visible=2)
    check_gpus([1], gpu_faiss=True, visible=2)  # the trainer keeps GPU 0


@pytest.mark.parametrize(
    ("factory", "hnsw"),
    [("HNSW8,Flat", True), ("PCA8,HNSW8,Flat", True), ("Flat", False), ("IVF4,Flat", False)],
)
def test_hnsw_is_refused_on_gpu_also_behind_a_transform(factory: str, hnsw: bool) -> None:
    index = faiss.index_factory(16, factory, faiss.METRIC_INNER_PRODUCT)
    assert has_hnsw(index) == hnsw
    if hnsw:
        with pytest.raises(UserError, match=f"a {factory} index cannot go to a GPU"):
            check_gpu_index(factory, has_hnsw(index))
    else:
        check_gpu_index(factory, has_hnsw(index))


def test_refine_candidates_are_fitted_to_the_gpu_k_limit(capsys) -> None:
    assert fit_gpu_search(max_topk=64, nprobe=32, refine_k_factor=32) == 32  # 2048: fits
    assert capsys.readouterr().err == ""
    assert fit_gpu_search(max_topk=100, nprobe=None, refine_k_factor=32) == 20  # 2000
    warning = capsys.readouterr().err
    assert warning.startswith("hdr: warning: dense.refine_k_factor 32 lowered to 20 on GPU")
    assert "lower max_topk to 64 to keep the factor" in warning
    assert fit_gpu_search(max_topk=GPU_MAX_K, nprobe=None, refine_k_factor=0) == 0  # no refine


def test_gpu_searches_past_2048_results_or_lists_are_refused() -> None:
    with pytest.raises(UserError, match="max_topk 2049 exceeds FAISS-GPU's 2048"):
        fit_gpu_search(max_topk=2049, nprobe=None, refine_k_factor=0)
    with pytest.raises(UserError, match=r"dense\.nprobe 4096 exceeds FAISS-GPU's 2048"):
        fit_gpu_search(max_topk=10, nprobe=4096, refine_k_factor=0)
    assert fit_gpu_search(max_topk=10, nprobe=None, refine_k_factor=0) == 0  # not IVF: no limit


@pytest.mark.parametrize(
    ("gpus", "message"),
    [("[0, 0]", "names a GPU twice"), ("[]", "at least 1 item"), ("[-1]", "greater than or")],
)
def test_dense_gpus_is_a_list_of_distinct_device_ids(gpus: str, message: str) -> None:
    with pytest.raises(UserError, match=message):
        build_config(ServerConfig, {"index_dir": "x"}, [f"dense.gpus={gpus}"])
    config = build_config(ServerConfig, {"index_dir": "x"}, ["dense.gpus=[1, 3]"])
    assert config.dense.gpus == [1, 3]
    assert ServerConfig(index_dir=Path("x")).dense.gpus is None  # the CPU by default


def test_asking_faiss_cpu_for_gpus_is_one_line_naming_the_gpu_wheel(small_index: Path) -> None:
    with pytest.raises(UserError) as refused:
        load_index(small_index, dense=DenseSearchConfig(gpus=[0]), with_bm25=False)
    assert str(refused.value) == (
        "dense.gpus [0] needs faiss built with GPU support: "
        "pip uninstall faiss-cpu && pip install faiss-gpu-cu12"
    )
