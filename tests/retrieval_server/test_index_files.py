"""Index build, manifest, on-disk formats and the load-time checks (missing, incomplete, stale)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from core.errors import UserError
from retrieval_server.config import ServerConfig
from retrieval_server.index.build import build_index
from retrieval_server.index.encoder import DEFAULT_ENCODER, guess_prefixes, resolve_encoder
from retrieval_server.index.files import MANIFEST, corpus_fingerprint, load_index, validate_index
from retrieval_server.index.staging import partial_dir
from retrieval_server.serving.retrievers import RETRIEVERS, available_retrievers


def test_manifest_describes_the_index(small_index: Path, small_corpus: Path) -> None:
    manifest = json.loads((small_index / MANIFEST).read_text())
    assert manifest["encoder"] == {
        "name": DEFAULT_ENCODER,
        "query_prefix": "",
        "passage_prefix": "",
        "pooling": "mean",
        "max_length": 256,
        "normalize": True,
    }
    assert manifest["dimension"] == 384
    assert manifest["metric"] == "inner_product"
    assert manifest["index_factory"] == "Flat"
    assert manifest["documents"] == len(small_corpus.read_text().splitlines())
    assert manifest["corpus_fingerprint"] == corpus_fingerprint(small_corpus)
    assert (small_index / manifest["corpus_path"]).resolve() == small_corpus.resolve()
    assert {"dense.faiss", "offsets.npy", "bm25/vocab.index.json"} <= set(manifest["files"])


def test_arrays_load_without_pickle_and_offsets_address_lines(
    small_index: Path, small_corpus: Path
) -> None:
    for path in small_index.rglob("*.npy"):
        np.load(path, allow_pickle=False)  # raises on object arrays
    offsets = np.load(small_index / "offsets.npy", allow_pickle=False)
    raw = small_corpus.read_bytes()
    line_starts = [0] + [i + 1 for i, byte in enumerate(raw) if byte == ord("\n")]
    assert offsets.tolist() == line_starts  # every line start, then the file size


def test_loaded_index_reads_documents_by_row(small_index: Path, small_corpus: Path) -> None:
    index = load_index(small_index)
    try:
        lines = small_corpus.read_text().splitlines()
        assert index.dense.ntotal == len(lines) == len(index.documents)
        for row in (0, 9, 10, len(lines) - 1):
            assert index.documents.get(row) == json.loads(lines[row])
        assert available_retrievers(index) == ["bm25", "dense"]
    finally:
        index.close()


@pytest.fixture
def index_copy(small_index: Path, small_corpus: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A private copy of the index and its corpus that a test may damage."""
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(small_corpus, corpus)
    index_dir = tmp_path / "index"
    shutil.copytree(small_index, index_dir)
    return index_dir, corpus


def test_missing_index_directory_is_a_user_error(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        validate_index(tmp_path / "nowhere")


def test_index_without_manifest_is_incomplete(index_copy: tuple[Path, Path]) -> None:
    index_dir, corpus = index_copy
    (index_dir / MANIFEST).unlink()
    with pytest.raises(UserError, match=r"incomplete: no manifest\.json"):
        validate_index(index_dir, corpus)


def test_truncated_index_file_is_incomplete(index_copy: tuple[Path, Path]) -> None:
    index_dir, corpus = index_copy
    dense = index_dir / "dense.faiss"
    dense.write_bytes(dense.read_bytes()[:1000])
    with pytest.raises(UserError, match=r"incomplete: dense.faiss has 1000 bytes"):
        load_index(index_dir, corpus)


def test_missing_bm25_file_is_incomplete(index_copy: tuple[Path, Path]) -> None:
    index_dir, corpus = index_copy
    (index_dir / "bm25" / "vocab.index.json").unlink()
    with pytest.raises(UserError, match=r"bm25/vocab\.index\.json is missing"):
        validate_index(index_dir, corpus)


def test_edited_corpus_of_same_size_does_not_match(index_copy: tuple[Path, Path]) -> None:
    index_dir, corpus = index_copy
    text = corpus.read_text()
    corpus.write_text(text.replace("Accordion", "Accordeon", 1))
    assert len(corpus.read_text()) == len(text)
    with pytest.raises(UserError, match=r"does not match its corpus.*contents changed"):
        validate_index(index_dir, corpus)


def test_grown_corpus_does_not_match(index_copy: tuple[Path, Path]) -> None:
    index_dir, corpus = index_copy
    with corpus.open("a") as file:
        file.write(json.dumps({"id": "999", "contents": '"Extra"\nmore'}) + "\n")
    with pytest.raises(UserError, match="does not match its corpus"):
        validate_index(index_dir, corpus)


def test_moved_corpus_is_reported_with_the_fix(index_copy: tuple[Path, Path]) -> None:
    index_dir, _ = index_copy
    with pytest.raises(UserError, match="--corpus"):
        validate_index(index_dir, index_dir / "missing.jsonl")


def test_corrupt_manifest_is_a_user_error(index_copy: tuple[Path, Path]) -> None:
    index_dir, corpus = index_copy
    (index_dir / MANIFEST).write_text('{"encoder": 3}')
    with pytest.raises(UserError, match="not a valid index manifest"):
        validate_index(index_dir, corpus)


def test_bad_corpus_line_names_the_line(tmp_path: Path) -> None:
    corpus = tmp_path / "bad.jsonl"
    corpus.write_text('{"id": "0", "contents": "\\"A\\"\\ntext"}\n{"id": "1"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:2: needs a string field"):
        build_index(corpus, tmp_path / "index", show_progress=False)
    assert not (tmp_path / "index").exists()
    assert not partial_dir(tmp_path / "index").exists()  # checked before anything is written


def test_hnsw_index_without_bm25_finds_passages(tmp_path: Path) -> None:
    from corpora import WIKI18_SAMPLE

    corpus = tmp_path / "sample.jsonl"
    shutil.copy(WIKI18_SAMPLE, corpus)
    manifest = build_index(
        corpus, tmp_path / "hnsw", index_type="hnsw", bm25=False, show_progress=False
    ).manifest
    assert (manifest.index_factory, manifest.bm25) == ("HNSW32,Flat", False)
    index = load_index(tmp_path / "hnsw")
    config = ServerConfig(index_dir=tmp_path / "hnsw")
    try:
        assert available_retrievers(index) == ["dense"]
        with pytest.raises(UserError, match="built without BM25"):
            RETRIEVERS.get("bm25")(index, config)
        dense = RETRIEVERS.get("dense")(index, config)
        hits = dense.search(["Evan Morris lobbyist for Genentech", "Horatio Hale philologist"], 2)
        assert [query_hits[0][0] for query_hits in hits] == [0, 1]
        assert all(len(query_hits) == 2 for query_hits in hits)
    finally:
        index.close()


def test_encoder_prefixes_follow_the_model_family() -> None:
    assert guess_prefixes("/models/e5-base-v2") == ("query: ", "passage: ")
    assert guess_prefixes("BAAI/bge-base-en-v1.5")[0].startswith("Represent this")
    assert guess_prefixes("BAAI/bge-base-en-v1.5")[1] == ""
    assert guess_prefixes(DEFAULT_ENCODER) == ("", "")
    assert Path(resolve_encoder(DEFAULT_ENCODER), "config.json").is_file()


def test_unknown_retriever_name_lists_the_valid_ones() -> None:
    with pytest.raises(UserError, match="valid: bm25, dense"):
        RETRIEVERS.get("splade")
