"""The exact re-ranking stage: rows read from a real FAISS flat file (as faiss and as
`FlatFileWriter` write it), candidates re-scored exactly and ranked as brute force does."""

from __future__ import annotations

from pathlib import Path

import faiss
import numpy as np
import pytest

from core.errors import UserError
from retrieval_server.index.rerank import FlatRows, with_exact_rerank
from retrieval_server.index.writers import FlatFileWriter

ROWS, DIMENSION = 500, 24


@pytest.fixture(scope="module")
def vectors() -> np.ndarray:
    rng = np.random.default_rng(7)
    data = rng.standard_normal((ROWS, DIMENSION)).astype(np.float32)
    return data / np.linalg.norm(data, axis=1, keepdims=True)


def test_the_rows_are_the_flat_files_vectors_as_faiss_and_the_writer_write_them(
    vectors: np.ndarray, tmp_path: Path
) -> None:
    flat = faiss.IndexFlatIP(DIMENSION)
    flat.add(vectors)
    faiss.write_index(flat, str(tmp_path / "faiss.faiss"))
    writer = FlatFileWriter(tmp_path / "writer.faiss", DIMENSION, ROWS)
    writer.add(vectors[:123])
    writer.add(vectors[123:])
    writer.close()
    for name in ("faiss.faiss", "writer.faiss"):
        rows = FlatRows(tmp_path / name, ROWS, DIMENSION)
        rows.prefetch(np.array([0, 7, ROWS - 1]))
        assert np.array_equal(rows.rows, vectors)
    with pytest.raises(UserError, match="smaller than"):
        FlatRows(tmp_path / "faiss.faiss", ROWS * 2, DIMENSION)


def test_candidates_are_ranked_by_their_exact_inner_product(
    vectors: np.ndarray, tmp_path: Path
) -> None:
    """A coarse PQ proposes; with every row a candidate the result is brute force's, ids and
    scores; with fewer it keeps exact scores for what it returns and pads nothing."""
    flat = faiss.IndexFlatIP(DIMENSION)
    flat.add(vectors)
    faiss.write_index(flat, str(tmp_path / "flat.faiss"))
    coarse = faiss.index_factory(DIMENSION, "PQ4x4", faiss.METRIC_INNER_PRODUCT)
    coarse.train(vectors)
    coarse.add(vectors)
    queries = vectors[:20] + 0.3 * np.random.default_rng(8).standard_normal((20, DIMENSION)).astype(
        np.float32
    )
    truth_scores, truth_rows = flat.search(queries, 5)
    everything = with_exact_rerank(coarse, tmp_path / "flat.faiss", ROWS / 5)
    scores, rows = everything.search(queries, 5)
    assert np.array_equal(rows, truth_rows)
    assert scores == pytest.approx(truth_scores, abs=1e-5)
    assert not np.array_equal(coarse.search(queries, 5)[1], truth_rows)  # the codes alone miss
    few = with_exact_rerank(coarse, tmp_path / "flat.faiss", 2)
    scores, rows = few.search(queries, 5)
    assert (rows >= 0).all()
    exact = np.einsum("qd,qkd->qk", queries, vectors[rows])
    assert scores == pytest.approx(exact, abs=1e-5)
    assert (np.diff(scores, axis=1) <= 0).all()  # ranked, best first
    scores, rows = with_exact_rerank(coarse, tmp_path / "flat.faiss", 2).search(
        queries[:1], ROWS + 5
    )
    assert (rows[0, :ROWS] >= 0).all() and (rows[0, ROWS:] == -1).all()
    assert np.isneginf(scores[0, ROWS:]).all()
