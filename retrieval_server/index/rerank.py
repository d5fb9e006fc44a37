"""Exact re-ranking of a compressed index's candidates from the flat vectors on disk.

A compressed index (fast-scan PQ) proposes candidates; their exact vectors, in the flat file
`hdr index convert --refine` keeps (`refine.faiss`, memory-mapped), give the final scores.
Where that file does not fit in the page cache (wiki-18's is 64.5 GB), every candidate row
is a disk read. Reading them as FAISS's `IndexRefine` does, one page fault after another,
leaves the disk one request at a time: 0.36 ms a row at 10M x 768 under a 4 GiB memory
limit on this machine (16 q/s for 320 candidates a query). `ExactRerank` first tells the
kernel every row the batch will read (`madvise(MADV_WILLNEED)`, which starts the reads at
once and returns), then gathers and scores them, so the disk serves them in parallel: 80
random rows took 3.6-5.1 ms this way against 576-649 ms through plain faults of a NumPy view
(bench/scale.py measures the served points). `with_refine` is FAISS's own re-ranking from
vectors or finer codes held in RAM, the first stage of `with_compact_refine`.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.errors import UserError

if TYPE_CHECKING:
    import faiss

FLOAT_BYTES = 4


class FlatRows:
    """The float32 rows of a FAISS `IndexFlat` file, memory-mapped read-only: the file ends
    with its `ntotal x d` floats (what `faiss.write_index` and `FlatFileWriter` write)."""

    def __init__(self, path: Path, ntotal: int, dimension: int) -> None:
        self.path, self.ntotal, self.dimension = Path(path), ntotal, dimension
        self.row_bytes = dimension * FLOAT_BYTES
        size = self.path.stat().st_size
        self.offset = size - ntotal * self.row_bytes
        if self.offset < 0:
            raise UserError(f"{path} is smaller than {ntotal} x {dimension} float32 rows")
        self._fd = os.open(self.path, os.O_RDONLY)
        self._map = mmap.mmap(self._fd, 0, prot=mmap.PROT_READ)
        self.rows = np.frombuffer(
            self._map, dtype=np.float32, count=ntotal * dimension, offset=self.offset
        ).reshape(ntotal, dimension)

    def prefetch(self, rows: np.ndarray) -> None:
        """Start reading `rows` from disk (asynchronously; returns at once)."""
        page = mmap.PAGESIZE
        for row in rows.tolist():
            start = self.offset + row * self.row_bytes
            aligned = start - start % page
            self._map.madvise(mmap.MADV_WILLNEED, aligned, start + self.row_bytes - aligned)


class ExactRerank:
    """`approximate` proposes k x `k_factor` candidates a query; their rows of `flat`, read
    ahead all at once, rank them by exact inner product. Searched like a FAISS index by the
    dense retriever (`ntotal`, `d`, `search`)."""

    def __init__(self, approximate: faiss.Index, flat: FlatRows, k_factor: float) -> None:
        self.approximate, self.flat, self.k_factor = approximate, flat, k_factor
        self.ntotal, self.d = approximate.ntotal, approximate.d

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(scores, rows), each (Q, k); rows -1 (score -inf) where fewer than k were found."""
        wanted = min(self.ntotal, max(k, int(k * self.k_factor)))
        _, candidates = self.approximate.search(queries, wanted)
        found = [np.unique(row[row >= 0]) for row in candidates]  # sorted: reads in file order
        for rows in found:
            self.flat.prefetch(rows)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        labels = np.full((len(queries), k), -1, dtype=np.int64)
        for q, rows in enumerate(found):
            exact = self.flat.rows[rows] @ queries[q]
            best = np.argsort(-exact, kind="stable")[:k]
            scores[q, : len(best)], labels[q, : len(best)] = exact[best], rows[best]
        return scores, labels


def with_refine(approximate: faiss.Index, exact: faiss.Index, k_factor: float) -> faiss.Index:
    """`approximate` (e.g. IVF-PQ) proposes k x `k_factor` candidates per query; `exact` (finer
    codes or flat vectors in RAM) re-scores and re-ranks them with FAISS's `IndexRefine`. The
    served re-ranking from the memory-mapped flat file is `ExactRerank`, which reads the
    candidates' rows ahead instead of one page fault at a time."""
    import faiss

    refined = faiss.IndexRefine(approximate, exact)  # keeps Python references to both
    refined.k_factor = k_factor
    return refined


def with_exact_rerank(approximate: faiss.Index, flat_path: Path, k_factor: float) -> ExactRerank:
    """`approximate` re-ranked exactly from the flat file at `flat_path` (module docstring)."""
    flat = FlatRows(flat_path, approximate.ntotal, approximate.d)
    return ExactRerank(approximate, flat, k_factor)


def with_compact_refine(
    approximate: faiss.Index,
    compact: faiss.Index,
    flat_path: Path,
    k_factor: int,
    exact_k_factor: int,
) -> ExactRerank:
    """Two re-ranking stages: `approximate` proposes k x `k_factor` candidates, `compact` (finer
    codes held in RAM, e.g. PQ192: a quarter of the flat bytes) re-scores them and keeps the
    best k x `exact_k_factor`, and only those rows are read from the flat file for their
    exact scores: 2-8 reads a result instead of `k_factor`."""
    keep = min(exact_k_factor, k_factor)
    return with_exact_rerank(with_refine(approximate, compact, k_factor / keep), flat_path, keep)
