"""FAISS index types by factory string, memory-mapped flat indexes, and chosen retrievers.

Every factory string is made from the session's Flat index with `convert_index` (its stored
vectors, no re-encoding) and served by a real server on the fixture corpus.
"""

from __future__ import annotations

import json
from pathlib import Path

import faiss
import httpx
import numpy as np
import pytest
from servers import running_server

from core.errors import UserError
from retrieval_server.config import DenseSearchConfig, ServerConfig
from retrieval_server.index.convert import convert_index
from retrieval_server.index.corpus import iter_vital_articles
from retrieval_server.index.files import MANIFEST, load_index, read_manifest
from retrieval_server.index.staging import partial_dir
from retrieval_server.index.writers import FlatFileWriter
from retrieval_server.serving.retrievers import DenseRetriever

# factory string -> least share of queries whose served top passage is the exact (Flat) one;
# 1.0 for indexes that keep exact vectors and search every list here (nprobe >= nlist).
FACTORIES = {
    "HNSW16,Flat": 1.0,
    "IVF8,Flat": 1.0,
    "IVF8,SQ8": 0.95,
    "IVF4,PQ48": 0.8,
}
# PQ training (48 k-means of 256 centroids) takes seconds on an idle machine but minutes on a
# loaded one, so the PQ strings run with the slow tests.
SLOW_FACTORIES = {"IVF4,PQ48"}
QUERIES = 40


def fixture_queries() -> list[tuple[str, int]]:
    """(short description of a vital article, its corpus row) for articles in the fixture corpus
    (rows 10+ are the vital articles in package order)."""
    articles = list(zip(range(10, 310), iter_vital_articles(), strict=False))
    pairs = [(article.description, row) for row, article in articles if article.description]
    return pairs[:: max(1, len(pairs) // QUERIES)][:QUERIES]


def top_rows(url: str, queries: list[str], topk: int = 1, **body: object) -> list[list[int]]:
    response = httpx.post(
        f"{url}/retrieve",
        json={"queries": queries, "topk": topk, "return_scores": True, **body},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    return [[int(item["document"]["id"]) for item in query] for query in response.json()["result"]]


@pytest.fixture(scope="module")
def flat_top(retrieval_url: str) -> list[int]:
    """Top row per fixture query from the exact (Flat) index (right for about 2 in 3: short
    descriptions such as "American actor" are ambiguous)."""
    return [rows[0] for rows in top_rows(retrieval_url, [q for q, _ in fixture_queries()])]


def test_flat_file_writer_writes_what_faiss_writes(tmp_path: Path) -> None:
    vectors = np.random.default_rng(0).standard_normal((1000, 24)).astype(np.float32)
    reference = faiss.IndexFlatIP(24)
    reference.add(vectors)
    faiss.write_index(reference, str(tmp_path / "reference.faiss"))
    writer = FlatFileWriter(tmp_path / "streamed.faiss", 24, 1000)
    for start in range(0, 1000, 300):  # uneven chunks, the last one short
        writer.add(vectors[start : start + 300])
    writer.close()
    streamed = (tmp_path / "streamed.faiss").read_bytes()
    assert streamed == (tmp_path / "reference.faiss").read_bytes()


@pytest.mark.parametrize(
    "factory",
    [pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FACTORIES else f for f in FACTORIES],
)
def test_each_factory_string_serves_the_right_passages(
    factory: str, small_index: Path, flat_top: list[int], tmp_path: Path
) -> None:
    out = tmp_path / "converted"
    manifest = convert_index(small_index, out, factory, show_progress=False)
    assert manifest.index_factory == factory
    assert read_manifest(out).index_factory == factory
    assert not partial_dir(out).exists()
    queries = fixture_queries()
    with running_server(out, dense={"nprobe": 8}) as server:
        health = httpx.get(f"{server.url}/health").json()
        assert health["index_type"] == factory
        served = [rows[0] for rows in top_rows(server.url, [q for q, _ in queries])]
    agree = np.mean([a == b for a, b in zip(served, flat_top, strict=True)])
    assert agree >= FACTORIES[factory], (factory, agree)
    # and about as often right as exact search: the article a description was made from
    right = np.mean([top == row for top, (_, row) in zip(served, queries, strict=True)])
    flat_right = np.mean([top == row for top, (_, row) in zip(flat_top, queries, strict=True)])
    assert flat_right >= 0.5
    assert right >= flat_right - (1 - FACTORIES[factory]), (factory, right, flat_right)


def test_bad_factory_string_is_refused_before_any_work(small_index: Path, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="not a FAISS factory string"):
        convert_index(small_index, tmp_path / "bad", "IVF8,Nonsense", show_progress=False)
    assert not (tmp_path / "bad").exists() and not partial_dir(tmp_path / "bad").exists()
    # OPQ on 310 vectors would abort the process inside FAISS: refused instead
    with pytest.raises(UserError, match="needs at least 9,984 training vectors"):
        convert_index(small_index, tmp_path / "opq", "OPQ48,IVF4,PQ48", show_progress=False)
    assert not partial_dir(tmp_path / "opq").exists()


def test_mmap_results_are_identical_to_in_memory(small_index: Path) -> None:
    vectors = faiss.read_index(str(small_index / "dense.faiss")).reconstruct_n(0, 50)
    results = []
    for mmap in (True, False):
        index = load_index(small_index, dense=DenseSearchConfig(mmap=mmap), with_bm25=False)
        try:
            results.append(index.dense.search(vectors, 10))
        finally:
            index.close()
    (mapped_scores, mapped_rows), (read_scores, read_rows) = results
    np.testing.assert_array_equal(mapped_rows, read_rows)
    np.testing.assert_array_equal(mapped_scores, read_scores)
    assert mapped_rows[:, 0].tolist() == list(range(50))


def test_mmap_serves_the_same_as_in_memory(small_index: Path, retrieval_url: str) -> None:
    queries = [q for q, _ in fixture_queries()][:10]
    with running_server(small_index, dense={"mmap": False}) as server:
        assert top_rows(server.url, queries, topk=5) == top_rows(retrieval_url, queries, topk=5)


def test_a_batch_through_blas_finds_what_lone_queries_find(small_index: Path) -> None:
    """A flat batch of >= dense.blas_from_queries is one BLAS product, a lone query FAISS's
    SIMD scan: batching must not change the passages or their scores."""
    queries = [q for q, _ in fixture_queries()]
    index = load_index(small_index, with_bm25=False)
    try:
        retriever = DenseRetriever(index, ServerConfig(index_dir=small_index))
        assert faiss.cvar.distance_compute_blas_threshold == 4 * index.dense.d  # query floats
        assert retriever.search_threads(len(queries)) == 1  # one thread for the product
        batched = retriever.search(queries, 5)
        alone = [retriever.search([query], 5)[0] for query in queries]
    finally:
        index.close()
    for batch_hits, lone_hits in zip(batched, alone, strict=True):
        assert [row for row, _ in batch_hits] == [row for row, _ in lone_hits]
        np.testing.assert_allclose(
            [score for _, score in batch_hits], [score for _, score in lone_hits], atol=1e-5
        )


def test_dense_only_server(small_index: Path) -> None:
    with running_server(small_index, retrievers=["dense"]) as server:
        health = httpx.get(f"{server.url}/health").json()
        assert health["retrievers"] == ["dense"]
        assert top_rows(server.url, ["Japanese poetry form with 17 syllables"])[0]
        refused = httpx.post(
            f"{server.url}/retrieve", json={"queries": ["Accordion"], "retriever": "bm25"}
        )
        assert refused.status_code == 400 and "available: dense" in refused.json()["detail"]


def test_bm25_only_server(small_index: Path) -> None:
    with running_server(small_index, retrievers=["bm25"], default_retriever="bm25") as server:
        health = httpx.get(f"{server.url}/health").json()
        assert (health["retrievers"], health["default_retriever"]) == (["bm25"], "bm25")
        accordion = top_rows(server.url, ["accordion bellows keyboard instrument"])[0]
        lines = (small_index / read_manifest(small_index).corpus_path).read_text().splitlines()
        assert json.loads(lines[accordion[0]])["contents"].startswith('"Accordion"')
        refused = httpx.post(
            f"{server.url}/retrieve", json={"queries": ["Accordion"], "retriever": "dense"}
        )
        assert refused.status_code == 400


def test_serving_a_retriever_the_index_lacks_is_refused(small_index: Path, tmp_path: Path) -> None:
    out = tmp_path / "no-bm25"
    convert_index(small_index, out, "Flat", show_progress=False)
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["bm25"] is True  # carried over; drop it to make an index without BM25
    manifest["bm25"] = False
    manifest["files"] = {k: v for k, v in manifest["files"].items() if not k.startswith("bm25/")}
    (out / MANIFEST).write_text(json.dumps(manifest))
    from retrieval_server.config import ServerConfig
    from retrieval_server.serving.metrics import ServerMetrics
    from retrieval_server.serving.state import load_serving_state

    config = ServerConfig(index_dir=out, retrievers=["bm25"])
    with pytest.raises(UserError, match="retriever 'bm25' is not available"):
        load_serving_state(config, ServerMetrics())


def top_scored(url: str, queries: list[str], topk: int) -> list[list[tuple[int, float]]]:
    response = httpx.post(
        f"{url}/retrieve", json={"queries": queries, "topk": topk, "return_scores": True}
    )
    assert response.status_code == 200, response.text
    result = response.json()["result"]
    return [[(int(item["document"]["id"]), item["score"]) for item in query] for query in result]


@pytest.mark.parametrize("factory", ["IVF4,PQ8", "fast-scan"])
def test_refine_reranks_a_lossy_index_exactly_from_the_mapped_flat_vectors(
    small_index: Path, retrieval_url: str, tmp_path: Path, factory: str
) -> None:
    """`convert --refine`: the compressed index (PQ, or the fast-scan alias: 4-bit fast-scan
    PQ), made in 7 resumable steps, proposes; the hard-linked Flat vectors (memory-mapped)
    re-rank. With every passage a candidate (310 rows <= 5 x 62) the served top 5 are exactly
    the Flat index's, ids and scores; the compressed codes alone are not."""
    out = tmp_path / "pq-refined"
    manifest = convert_index(
        small_index, out, factory, show_progress=False, refine=True, chunk_size=50
    )  # 7 resumable steps, merged
    assert manifest.refine and "refine.faiss" in manifest.files
    if factory == "fast-scan":  # the measured layout, sized for 310 384-d vectors
        assert manifest.index_factory == "IVF16,PQ48x4fs"
    assert (out / "refine.faiss").stat().st_ino == (small_index / "dense.faiss").stat().st_ino
    queries = [q for q, _ in fixture_queries()]
    exact = top_rows(retrieval_url, queries, topk=5)
    exact_scored = top_scored(retrieval_url, queries, topk=5)
    with running_server(out, dense={"nprobe": 16, "refine_k_factor": 62}) as server:
        refined = top_rows(server.url, queries, topk=5)
        refined_scored = top_scored(server.url, queries, topk=5)
    with running_server(out, dense={"nprobe": 16, "refine_k_factor": 0}) as server:
        unrefined = top_rows(server.url, queries, topk=5)
    assert refined == exact
    for served, truth in zip(refined_scored, exact_scored, strict=True):
        assert [row for row, _ in served] == [row for row, _ in truth]
        assert [score for _, score in served] == pytest.approx([s for _, s in truth], abs=1e-5)
    assert unrefined != exact
    with pytest.raises(UserError, match="--refine needs a Flat source index"):
        convert_index(out, tmp_path / "again", "IVF4,PQ8", show_progress=False, refine=True)
    assert not partial_dir(tmp_path / "again").exists()


def test_compact_codes_rank_the_candidates_and_only_the_best_are_read_exactly(
    small_index: Path, retrieval_url: str, tmp_path: Path
) -> None:
    """`convert --refine --compact`: the 4-bit codes propose every passage (5 x 62 = 310 rows),
    the compact codes (held in RAM) rank them, and only the best 5 x `exact_k_factor` get their
    exact scores from the flat vectors. With SQ8 codes (near exact) and 2 exact reads a result
    the served top 5 are the Flat index's, ids and scores; with codes too coarse to rank (PQ8x4)
    and 1 read a result they are not, so the compact stage is what ranks; with the stage
    switched off (`exact_k_factor` 0) every candidate is re-ranked exactly again."""
    queries = [q for q, _ in fixture_queries()]
    exact_scored = top_scored(retrieval_url, queries, topk=5)
    served: dict[str, list[list[tuple[int, float]]]] = {}
    for compact, exact_k_factor in (("SQ8", 2), ("PQ8x4", 1), ("PQ8x4", 0)):
        out = tmp_path / f"compact-{compact}"
        if not out.exists():
            manifest = convert_index(
                small_index, out, "IVF4,PQ8x4fs", show_progress=False, refine=True,
                chunk_size=100, compact=compact,
            )  # fmt: skip
            assert manifest.compact_factory == compact and "compact.faiss" in manifest.files
            leftovers = [p.name for p in out.iterdir() if p.name.startswith(("added", "compact."))]
            assert leftovers == ["compact.faiss"]  # no trained index or steps left behind
        dense = {"nprobe": 4, "refine_k_factor": 62, "exact_k_factor": exact_k_factor}
        with running_server(out, dense=dense) as server:
            served[f"{compact} x{exact_k_factor}"] = top_scored(server.url, queries, topk=5)

    def same(scored: list[list[tuple[int, float]]]) -> bool:
        return all(
            [row for row, _ in got] == [row for row, _ in truth]
            and [score for _, score in got] == pytest.approx([s for _, s in truth], abs=1e-5)
            for got, truth in zip(scored, exact_scored, strict=True)
        )

    assert same(served["SQ8 x2"])
    assert not same(served["PQ8x4 x1"])
    assert same(served["PQ8x4 x0"])
    # what the compact stage returns still carries exact scores: each served (row, score) of
    # the coarse ranking that the exact top 5 also holds has the exact score
    for got, truth in zip(served["PQ8x4 x1"], exact_scored, strict=True):
        exact_of = dict(truth)
        for row, score in got:
            if row in exact_of:
                assert score == pytest.approx(exact_of[row], abs=1e-5)


def test_compact_codes_are_refused_without_refine_or_with_lists(
    small_index: Path, tmp_path: Path
) -> None:
    with pytest.raises(UserError, match=r"--compact ranks the candidates .* it needs --refine"):
        convert_index(small_index, tmp_path / "a", "IVF4,PQ8x4fs", show_progress=False,
                      compact="SQ8")  # fmt: skip
    with pytest.raises(UserError, match="must be codes without lists or graphs"):
        convert_index(small_index, tmp_path / "b", "IVF4,PQ8x4fs", show_progress=False,
                      refine=True, compact="IVF4,PQ8")  # fmt: skip
    with pytest.raises(UserError, match="must be codes without lists or graphs"):
        convert_index(small_index, tmp_path / "c", "IVF4,PQ8x4fs", show_progress=False,
                      refine=True, compact="Flat")  # fmt: skip
    assert not any((tmp_path / name).exists() for name in ("a", "b", "c"))
