"""What every index command writes with: FAISS factory strings, the dense index from vectors
read a chunk at a time, and BM25.

`write_dense` makes any factory string from a `VectorSource` (a build's encoded chunks,
`ChunkFiles`; an existing index's stored vectors, `StoredVectors`): "Flat" is streamed to disk
chunk by chunk (`FlatFileWriter`: the full matrix is never in memory); other factory strings
are trained on a sample of `train_sample` vectors and filled chunk by chunk. BM25 is built
when asked, and by default only for corpora up to `BM25_AUTO_MAX_DOCUMENTS` passages: bm25s
indexes from token ids held in memory (a few GB per million passages).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from core.errors import UserError, error_reason
from retrieval_server.index.corpus import read_contents
from retrieval_server.index.defaults import DEFAULT_CHUNK_SIZE, DEFAULT_TRAIN_SAMPLE
from retrieval_server.index.files import FLAT_FACTORY, make_bm25_tokenizer

if TYPE_CHECKING:
    import faiss
    import numpy as np

INDEX_ALIASES = {"flat": FLAT_FACTORY, "hnsw": "HNSW32,Flat"}

# faiss-cpu 1.15's OPQ training corrupts the heap on small samples (310 and 1,000 vectors
# aborted the process here; 4,000 trained), so OPQ needs FAISS's own recommended sample for
# 256-centroid codebooks (39 x 256).
OPQ_MIN_TRAIN = 39 * 256


FAST_SCAN_ALIAS = "fast-scan"


def fast_scan_factory(vectors: int, dimension: int) -> str:
    """The compressed layout chosen by measurement (docs/notebook/retrieval.md, "Operating
    points"):
    IVF lists near sqrt(vectors) (a power of two, 16..65,536, at least 39 vectors a list to
    train: IVF1024 at 1M, IVF4096 at 10M and 21M), 4-bit fast-scan PQ with one sub-quantizer
    per 8 dimensions (768-d: PQ96x4fs, half the bytes of PQ96 and 3-4x faster to scan).
    Served with `--refine`: on real MiniLM vectors and on the synthetic ones, re-ranking
    32 x k candidates exactly gives the recall of 8-bit PQ + refine at a fraction of the
    scan. Fewer lists than FAISS's 4-16 x sqrt(n) guideline: fast-scan makes the longer lists
    cheap to scan (910 q/s a thread at 10M, nprobe 64), and assigning 10M vectors to 4x the
    lists would take 4x the build's longest step on a CPU."""
    import math

    lists = 2 ** round(math.log2(max(1.0, math.sqrt(vectors))))
    lists = max(16, min(65_536, lists, 2 ** int(math.log2(max(16, vectors // 39)))))
    # sub-quantizers: the largest even divisor of the dimension up to dimension / 8
    sub = next((m for m in range(dimension // 8, 1, -1) if m % 2 == 0 and dimension % m == 0), 2)
    return f"IVF{lists},PQ{sub}x4fs"


def factory_string(
    index_type: str, vectors: int | None = None, dimension: int | None = None
) -> str:
    """A FAISS factory string from `--index-type`: the aliases flat, hnsw and fast-scan (sized
    for `vectors` of `dimension`: `fast_scan_factory`), or a factory string."""
    if index_type == FAST_SCAN_ALIAS:
        if vectors is None or dimension is None:
            raise UserError(f"--index-type {FAST_SCAN_ALIAS} needs the vector count and size")
        return fast_scan_factory(vectors, dimension)
    return INDEX_ALIASES.get(index_type, index_type)


def check_trainable(factory: str, vectors: int, train_sample: int) -> None:
    """Refuse, before any work, a factory string that cannot be trained on what there is."""
    if "OPQ" in factory.upper() and min(vectors, train_sample) < OPQ_MIN_TRAIN:
        raise UserError(
            f"{factory!r} needs at least {OPQ_MIN_TRAIN:,} training vectors for its OPQ rotation"
            f" ({min(vectors, train_sample):,} available): use IVF..,PQ.. without OPQ here"
        )


def new_faiss_index(factory: str, dimension: int) -> faiss.Index:
    """An empty inner-product index from a factory string; a bad string is a UserError."""
    import faiss

    try:
        return faiss.index_factory(dimension, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise UserError(
            f"{factory!r} is not a FAISS factory string for {dimension}-d vectors "
            f"(e.g. Flat, HNSW32,Flat, IVF1024,SQ8, IVF4096,PQ96, OPQ96,IVF4096,PQ96): "
            f"{error_reason(err)}"
        ) from None


class FlatFileWriter:
    """Writes an inner-product `IndexFlat` file chunk by chunk, byte for byte what
    `faiss.write_index` writes, without holding the vectors: header (taken from faiss's own
    serialisation of an empty index, with the count set), then the float32 rows."""

    def __init__(self, path: Path, dimension: int, total: int) -> None:
        import faiss
        import numpy as np

        empty = faiss.serialize_index(faiss.IndexFlatIP(dimension)).tobytes()
        # fourcc, d (int32), ntotal (int64) at bytes 8..16, ..., then the code vector's length
        # (uint64, in floats) as the last 8 bytes of an empty index, then the floats.
        header = bytearray(empty[:-8])
        header[8:16] = np.int64(total).tobytes()
        self.dimension, self.total, self.written = dimension, total, 0
        self._file = path.open("wb")
        self._file.write(bytes(header) + np.uint64(total * dimension).tobytes())

    def add(self, vectors: np.ndarray) -> None:
        import numpy as np

        vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # (n, dimension)
        if vectors.ndim != 2 or vectors.shape[1] != self.dimension:
            raise ValueError(f"expected (n, {self.dimension}) vectors, got {vectors.shape}")
        self._file.write(vectors.tobytes())
        self.written += len(vectors)

    def abandon(self) -> None:
        """Close after a failure, without the row check (a second full-disk error on the
        final flush is dropped: the first one is what the caller reports)."""
        with suppress(OSError):
            self._file.close()

    def close(self) -> None:
        self._file.close()
        if self.written != self.total:
            raise ValueError(f"flat file has {self.written} rows, its header says {self.total}")


class VectorSource(Protocol):
    """Passage vectors in row order, read a chunk at a time."""

    count: int
    dimension: int

    def chunks(self) -> Iterator[np.ndarray]:
        """(n, dimension) float32 blocks, in row order, covering every row once."""
        ...

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), dimension) float32 vectors of the given (sorted) rows."""
        ...


class ChunkFiles:
    """The `vectors/NNNNNN.npy` chunks of a build."""

    def __init__(self, paths: list[Path]) -> None:
        import numpy as np

        self.paths = paths
        shapes = [np.load(path, mmap_mode="r").shape for path in paths]
        self.starts = np.cumsum([0] + [shape[0] for shape in shapes])  # (chunks + 1,)
        self.count, self.dimension = int(self.starts[-1]), shapes[0][1]

    def chunks(self) -> Iterator[np.ndarray]:
        import numpy as np

        for path in self.paths:
            yield np.load(path)

    def rows(self, rows: np.ndarray) -> np.ndarray:
        import numpy as np

        chunk_of_row = np.searchsorted(self.starts, rows, side="right") - 1
        parts = []
        for chunk in np.unique(chunk_of_row):
            vectors = np.load(self.paths[chunk], mmap_mode="r")
            parts.append(vectors[rows[chunk_of_row == chunk] - self.starts[chunk]])
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


class StoredVectors:
    """The vectors an existing FAISS index stores (Flat, HNSW..Flat), read back by row."""

    def __init__(self, index: faiss.Index, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.index, self.chunk_size = index, chunk_size
        self.count, self.dimension = index.ntotal, index.d

    def chunks(self) -> Iterator[np.ndarray]:
        for start in range(0, self.count, self.chunk_size):
            yield self.block(start, min(self.chunk_size, self.count - start))

    def block(self, start: int, count: int) -> np.ndarray:
        """(count, dimension) float32 vectors of rows [start, start + count)."""
        return self.index.reconstruct_n(start, count)

    def rows(self, rows: np.ndarray) -> np.ndarray:
        return self.index.reconstruct_batch(rows)


def training_rows(count: int, sample: int) -> np.ndarray:
    """A fixed pseudo-random sorted sample of rows to train on (all rows if fewer)."""
    import numpy as np

    if sample >= count:
        return np.arange(count)
    return np.sort(np.random.default_rng(0).choice(count, sample, replace=False))


def write_dense(
    source: VectorSource,
    factory: str,
    path: Path,
    train_sample: int = DEFAULT_TRAIN_SAMPLE,
    on_chunk: Callable[[int], None] = lambda rows: None,
) -> None:
    """Make the FAISS index `factory` over every vector of `source` and write it to `path`."""
    import faiss

    if factory == FLAT_FACTORY:
        writer = FlatFileWriter(path, source.dimension, source.count)
        try:
            for vectors in source.chunks():
                writer.add(vectors)
                on_chunk(len(vectors))
        except BaseException:
            writer.abandon()  # the error says why (a full disk, Ctrl-C), not the row count
            raise
        writer.close()
        return
    index = new_faiss_index(factory, source.dimension)
    if not index.is_trained:
        try:
            index.train(source.rows(training_rows(source.count, train_sample)))
        except RuntimeError as err:
            raise UserError(f"cannot train {factory!r}: {error_reason(err)}") from None
    for vectors in source.chunks():
        index.add(vectors)
        on_chunk(len(vectors))
    faiss.write_index(index, str(path))


def write_bm25(
    corpus: Path, offsets: np.ndarray, bm25_dir: Path, chunk_size: int, show_progress: bool
) -> None:
    """Tokenise every passage, index with bm25s, save with the vocabulary (npy + JSON only)."""
    import bm25s
    from bm25s.tokenization import Tokenized

    tokenizer = make_bm25_tokenizer()
    token_ids: list[list[int]] = []
    documents = len(offsets) - 1
    for start in range(0, documents, chunk_size):
        passages = read_contents(corpus, offsets, start, min(start + chunk_size, documents))
        token_ids += tokenizer.tokenize(
            passages, update_vocab=True, return_as="ids", show_progress=False, allow_empty=False
        )
    retriever = bm25s.BM25()
    retriever.index(  # bm25s draws its own bars: only on a terminal, where they redraw in place
        Tokenized(ids=token_ids, vocab=tokenizer.get_vocab_dict()),
        show_progress=show_progress and sys.stderr.isatty(),
    )
    retriever.save(str(bm25_dir), allow_pickle=False, show_progress=False)
    tokenizer.save_vocab(str(bm25_dir))
