"""Retrievers, chosen by name: "dense" (FAISS inner product) and "bm25" (bm25s).

A retriever turns a batch of query strings into, per query, up to `topk` (corpus row, score)
hits, best first. Documents are fetched separately, so retrievers know nothing of JSON or HTTP.
BM25 returns only passages that share a term with the query (as Search-R1's pyserini BM25 does),
so a query of stopwords or unknown words gets an empty list rather than arbitrary passages.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from hdr.errors import UserError
from hdr.registry import Registry

if TYPE_CHECKING:
    import numpy as np

    from retrieval_server.encoder import Encoder
    from retrieval_server.index import LoadedIndex

Hit = tuple[int, float]  # (corpus row, score)


class Retriever(Protocol):
    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """Per query, at most `topk` hits sorted by score, highest first."""
        ...


RetrieverFactory = Callable[["LoadedIndex"], Retriever]
RETRIEVERS: Registry[RetrieverFactory] = Registry("retriever")


@RETRIEVERS.register("dense")
class DenseRetriever:
    """Encode queries with the index's encoder, exact or HNSW inner-product search in FAISS."""

    def __init__(self, index: LoadedIndex) -> None:
        from retrieval_server.encoder import Encoder

        self.index = index
        self.encoder: Encoder = Encoder(index.manifest.encoder)
        if self.encoder.dimension != index.manifest.dimension:
            raise UserError(
                f"encoder {index.manifest.encoder} gives {self.encoder.dimension}-d vectors, "
                f"the index holds {index.manifest.dimension}-d ones"
            )

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        vectors = self.encoder.encode_queries(queries)  # (Q, dimension)
        k = min(topk, self.index.dense.ntotal)
        scores, rows = self.index.dense.search(vectors, k)  # (Q, k) each; row -1 = no hit
        return [
            [(int(r), float(s)) for r, s in zip(query_rows, query_scores, strict=True) if r >= 0]
            for query_rows, query_scores in zip(rows, scores, strict=True)
        ]


@RETRIEVERS.register("bm25")
class BM25Retriever:
    """Okapi BM25 (bm25s defaults k1=1.5, b=0.75) over the index's tokenised passages."""

    def __init__(self, index: LoadedIndex) -> None:
        if index.bm25 is None or index.bm25_tokenizer is None:
            raise UserError(
                f"index {index.files.index_dir} was built without BM25 (--no-bm25); "
                "rebuild it with --bm25 to serve the bm25 retriever"
            )
        self.bm25 = index.bm25
        self.tokenizer = index.bm25_tokenizer

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        # update_vocab=False: unknown words are dropped and the shared vocabulary never grows.
        token_ids = self.tokenizer.tokenize(
            queries, update_vocab=False, return_as="ids", show_progress=False, allow_empty=False
        )
        return [self._search_one(ids, topk) for ids in token_ids]

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


def make_retrievers(index: LoadedIndex, names: list[str]) -> dict[str, Retriever]:
    """Instantiate the named retrievers over one loaded index."""
    return {name: RETRIEVERS.get(name)(index) for name in names}


def available_retrievers(index: LoadedIndex) -> list[str]:
    """Names the index can serve: dense always, bm25 when it was built."""
    return [name for name in RETRIEVERS.names() if name != "bm25" or index.bm25 is not None]
