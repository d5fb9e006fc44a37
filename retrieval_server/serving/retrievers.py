"""Retrievers, chosen by name: "dense" (FAISS inner product) and "bm25" (bm25s).

Which of them a server loads is chosen at serve time (`ServerConfig.retrievers`): a dense-only
server never reads BM25, a BM25-only one never loads the encoder or the FAISS index.
A retriever turns a batch of query strings into, per query, up to `topk` (corpus row, score)
hits, best first. Documents are fetched separately, so retrievers know nothing of JSON or HTTP.
BM25 returns only passages that share a term with the query (as Search-R1's pyserini BM25 does),
so a query of stopwords or unknown words gets an empty list rather than arbitrary passages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from core.errors import UserError
from core.registry import Registry

if TYPE_CHECKING:
    import numpy as np

    from retrieval_server.config import ServerConfig
    from retrieval_server.index.encoder import Encoder
    from retrieval_server.index.files import LoadedIndex

Hit = tuple[int, float]  # (corpus row, score)


class Retriever(Protocol):
    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Per query, at most `topk` hits sorted by score, highest first."""
        ...


RetrieverFactory = Callable[["LoadedIndex", "ServerConfig"], Retriever]
RETRIEVERS: Registry[RetrieverFactory] = Registry("retriever")


@RETRIEVERS.register("dense")
class DenseRetriever:
    """Encode queries as the index's passages were (its manifest's encoder spec, with the
    server's query-prefix override), then inner-product search in FAISS (any index type)."""

    def __init__(self, index: LoadedIndex, config: ServerConfig) -> None:
        from retrieval_server.index.encoder import Encoder

        if index.dense is None:
            raise UserError(f"index {index.files.index_dir} was loaded without its dense index")
        import faiss

        self.dense = index.dense
        self.threads = config.dense.threads or faiss.omp_get_max_threads()
        self._set_threads = faiss.omp_set_num_threads
        self.blas_from = config.dense.blas_from_queries
        if self.blas_from:  # process-wide, in query floats (queries x dimension)
            faiss.cvar.distance_compute_blas_threshold = self.blas_from * index.dense.d
        self.flat = isinstance(index.dense, faiss.IndexFlat)  # read_index gives the subclass
        spec = index.manifest.encoder
        if config.query_prefix is not None:
            spec = spec.model_copy(update={"query_prefix": config.query_prefix})
        self.encoder: Encoder = Encoder(spec, config.encoder)
        if self.encoder.dimension != index.manifest.dimension:
            raise UserError(
                f"encoder {spec.name} gives {self.encoder.dimension}-d vectors, "
                f"the index holds {index.manifest.dimension}-d ones"
            )

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        vectors = self.encoder.encode_queries(queries)  # (Q, dimension)
        k = min(topk, self.dense.ntotal)
        # per calling thread (OpenMP's setting is the thread's own)
        self._set_threads(self.search_threads(len(queries)))
        scores, rows = self.dense.search(vectors, k)  # (Q, k) each; row -1 = no hit
        return [
            [(int(r), float(s)) for r, s in zip(query_rows, query_scores, strict=True) if r >= 0]
            for query_rows, query_scores in zip(rows, scores, strict=True)
        ]

    def search_threads(self, queries: int) -> int:
        """OpenMP threads for a search of `queries`: one a query, one for a flat BLAS product."""
        if self.flat and self.blas_from and queries >= self.blas_from:
            return 1
        return max(1, min(self.threads, queries))


@RETRIEVERS.register("bm25")
class BM25Retriever:
    """Okapi BM25 (bm25s defaults k1=1.5, b=0.75) over the index's tokenised passages; its
    arrays are memory-mapped and a batch of queries is scored on `bm25_threads` threads."""

    def __init__(self, index: LoadedIndex, config: ServerConfig) -> None:
        import os
        from concurrent.futures import ThreadPoolExecutor

        if index.bm25 is None or index.bm25_tokenizer is None:
            raise UserError(
                f"index {index.files.index_dir} was built without BM25 (--no-bm25); "
                "rebuild it with --bm25 to serve the bm25 retriever"
            )
        self.bm25 = index.bm25
        self.tokenizer = index.bm25_tokenizer
        self.threads = config.bm25_threads or os.cpu_count() or 1
        self.pool = ThreadPoolExecutor(self.threads, thread_name_prefix="bm25")

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        # update_vocab=False: unknown words are dropped and the shared vocabulary never grows.
        token_ids = self.tokenizer.tokenize(
            queries, update_vocab=False, return_as="ids", show_progress=False, allow_empty=False
        )
        if len(queries) == 1 or self.threads == 1:
            return [self._search_one(ids, topk) for ids in token_ids]
        # numpy releases the GIL in the scoring sums and the partition, so threads overlap.
        return list(self.pool.map(lambda ids: self._search_one(ids, topk), token_ids))

    def _search_one(self, token_ids: list[int], topk: int) -> list[Hit]:
        if not token_ids:
            return []
        scores = self.bm25.get_scores_from_ids(token_ids)  # (documents,)
        return top_positive(scores, topk)


def top_positive(scores: np.ndarray, topk: int) -> list[Hit]:
    """The `topk` highest positive scores, ties broken by lower row (deterministic)."""
    import numpy as np

    k = min(topk, len(scores))
    candidates = np.argpartition(-scores, k - 1)[:k]  # (k,) unordered
    order = np.lexsort((candidates, -scores[candidates]))
    return [
        (int(candidates[i]), float(scores[candidates[i]]))
        for i in order
        if scores[candidates[i]] > 0
    ]


def make_retrievers(
    index: LoadedIndex, names: list[str], config: ServerConfig
) -> dict[str, Retriever]:
    """Instantiate the named retrievers over one loaded index."""
    return {name: RETRIEVERS.get(name)(index, config) for name in names}


def available_retrievers(index: LoadedIndex) -> list[str]:
    """Names the loaded index can serve: dense if its FAISS index is loaded, bm25 likewise."""
    loaded = {"dense": index.dense is not None, "bm25": index.bm25 is not None}
    return [name for name in RETRIEVERS.names() if loaded.get(name, True)]
