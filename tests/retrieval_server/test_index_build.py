"""Building, resuming and importing indexes; what the manifest records about the encoder."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import faiss
import httpx
import numpy as np
import pytest
from corpora import WIKI18_SAMPLE
from servers import running_server

from core.errors import UserError
from retrieval_server.config import EncoderConfig, ServerConfig
from retrieval_server.encoder import Encoder, encoder_spec
from retrieval_server.index import MANIFEST, load_index, read_manifest, validate_index
from retrieval_server.index_build import VECTORS_DIR, build_index, import_index, partial_dir
from retrieval_server.retrievers import RETRIEVERS

HDR = str(Path(sys.executable).with_name("hdr"))


def stored_vectors(index_dir: Path) -> np.ndarray:
    index = faiss.read_index(str(index_dir / "dense.faiss"))
    return index.reconstruct_n(0, index.ntotal)  # (documents, dimension)


def test_interrupted_build_resumes_after_its_finished_chunks(
    small_corpus: Path, small_index: Path, tmp_path: Path
) -> None:
    out = tmp_path / "index"
    chunks = partial_dir(out) / VECTORS_DIR
    command = [HDR, "index", "build", "--corpus", str(small_corpus), "--out", str(out),
               "--chunk-size", "10", "--no-bm25"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not list(chunks.glob("0*.npy")):  # killed as soon as one chunk is saved
            assert process.poll() is None, "the build ended before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
    finally:
        process.kill()
        process.wait()
    assert not out.exists()  # an interrupted build leaves only DIR.partial
    finished = len(list(chunks.glob("0*.npy")))
    assert 1 <= finished < 31

    result = build_index(small_corpus, out, chunk_size=10, bm25=False, show_progress=False)
    assert (result.chunks_reused, result.chunks_encoded) == (finished, 31 - finished)
    assert not partial_dir(out).exists()
    validate_index(out)
    np.testing.assert_allclose(stored_vectors(out), stored_vectors(small_index), atol=1e-5)


def test_a_changed_encoder_spec_does_not_reuse_chunks(tmp_path: Path) -> None:
    corpus = tmp_path / "sample.jsonl"
    shutil.copy(WIKI18_SAMPLE, corpus)
    out = tmp_path / "index"
    build_index(corpus, out, chunk_size=4, bm25=False, show_progress=False)
    plain = stored_vectors(out)
    # leave a finished chunk behind as an interrupted build would, then change the spec
    partial = partial_dir(out)
    (partial / VECTORS_DIR).mkdir(parents=True)
    np.save(partial / VECTORS_DIR / "000000.npy", plain[:4])
    (partial / "build.json").write_text("{}")
    spec = encoder_spec("all-MiniLM-L6-v2", query_prefix="query: ", passage_prefix="passage: ")
    result = build_index(
        corpus, out, spec=spec, chunk_size=4, bm25=False, show_progress=False, force=True
    )
    assert (result.chunks_reused, result.chunks_encoded) == (0, 3)
    assert not np.allclose(stored_vectors(out)[:4], plain[:4], atol=1e-3)


def test_prefixes_and_pooling_are_recorded_and_used(tmp_path: Path) -> None:
    corpus = tmp_path / "sample.jsonl"
    shutil.copy(WIKI18_SAMPLE, corpus)
    spec = encoder_spec("all-MiniLM-L6-v2", query_prefix="query: ", passage_prefix="passage: ")
    out = tmp_path / "index"
    build_index(corpus, out, spec=spec, bm25=False, show_progress=False)
    recorded = json.loads((out / MANIFEST).read_text())["encoder"]
    assert (recorded["query_prefix"], recorded["passage_prefix"]) == ("query: ", "passage: ")
    assert (recorded["pooling"], recorded["max_length"], recorded["normalize"]) == (
        "mean", 256, True
    )  # fmt: skip
    # the stored vectors are the prefixed passages'
    encoder = Encoder(spec)
    passages = [json.loads(line)["contents"] for line in corpus.read_text().splitlines()]
    expected = encoder.encode_passages(passages)
    np.testing.assert_allclose(stored_vectors(out), expected, atol=1e-5)
    # queries are encoded with the recorded prefix, unless the server overrides it
    index = load_index(out)
    try:
        recorded_prefix = RETRIEVERS.get("dense")(index, ServerConfig(index_dir=out))
        assert recorded_prefix.encoder.spec.query_prefix == "query: "
        overridden = RETRIEVERS.get("dense")(index, ServerConfig(index_dir=out, query_prefix=""))
        assert overridden.encoder.spec.query_prefix == ""
        question = "Horatio Hale philologist"
        np.testing.assert_allclose(
            recorded_prefix.encoder.encode_queries([question]),
            overridden.encoder.encode_queries(["query: " + question]),
            atol=1e-6,
        )
    finally:
        index.close()
    cls = encoder_spec("all-MiniLM-L6-v2", pooling="cls")
    assert cls.pooling == "cls"
    assert not np.allclose(Encoder(cls).encode_passages(passages[:2]), expected[:2], atol=1e-2)


def test_onnx_and_torch_backends_give_the_same_vectors() -> None:
    spec = encoder_spec("all-MiniLM-L6-v2")
    texts = [json.loads(line)["contents"] for line in WIKI18_SAMPLE.read_text().splitlines()]
    texts += ["Japanese poetry form with 17 syllables", "x " * 600]  # the last one is truncated
    onnx = Encoder(spec, EncoderConfig(backend="onnx", batch_size=4)).encode_passages(texts)
    torch = Encoder(spec, EncoderConfig(backend="torch", batch_size=4)).encode_passages(texts)
    assert onnx.shape == torch.shape == (len(texts), 384)
    assert float((onnx * torch).sum(axis=1).min()) > 0.9999


def test_format_1_manifest_is_read_as_format_2(small_index: Path, tmp_path: Path) -> None:
    old = tmp_path / "old"
    shutil.copytree(small_index, old)
    manifest = json.loads((old / MANIFEST).read_text())
    manifest.update(format_version=1, encoder="all-MiniLM-L6-v2", index_type="flat")
    manifest.pop("index_factory")
    manifest.pop("imported_from")
    (old / MANIFEST).write_text(json.dumps(manifest))
    upgraded = read_manifest(old)
    assert upgraded.index_factory == "Flat"
    assert upgraded.encoder == encoder_spec("all-MiniLM-L6-v2")


@pytest.fixture(scope="module")
def plain_faiss_file(small_index: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An index made with plain faiss, as Search-R1's index builder makes one: the fixture
    corpus's vectors in an IndexFlatIP, written with faiss.write_index."""
    index = faiss.IndexFlatIP(384)
    index.add(stored_vectors(small_index))
    path = tmp_path_factory.mktemp("plain") / "MiniLM_Flat.index"
    faiss.write_index(index, str(path))
    return path


def test_import_adopts_a_plain_faiss_index(
    plain_faiss_file: Path, small_corpus: Path, retrieval_url: str, tmp_path: Path
) -> None:
    out = tmp_path / "imported"
    result = subprocess.run(
        [HDR, "index", "import", "--faiss", str(plain_faiss_file), "--corpus", str(small_corpus),
         "--encoder", "all-MiniLM-L6-v2", "--out", str(out), "--verify-sample", "16"],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "16 re-encoded passages match" in result.stdout
    manifest = read_manifest(out)
    assert manifest.index_factory == "Flat" and manifest.bm25
    assert manifest.imported_from == str(plain_faiss_file.resolve())
    assert (out / "dense.faiss").stat().st_ino == plain_faiss_file.stat().st_ino  # linked
    queries = ["Japanese poetry form with 17 syllables", "Horatio Hale philologist"]
    body = {"queries": queries, "topk": 5, "return_scores": True}
    with running_server(out) as server:
        imported = httpx.post(f"{server.url}/retrieve", json=body).json()
    assert imported == httpx.post(f"{retrieval_url}/retrieve", json=body).json()


def test_import_refuses_vectors_that_do_not_match(
    plain_faiss_file: Path, small_corpus: Path, tmp_path: Path
) -> None:
    vectors = faiss.read_index(str(plain_faiss_file)).reconstruct_n(0, 310)
    shuffled = faiss.IndexFlatIP(384)
    shuffled.add(np.roll(vectors, 1, axis=0))  # row i no longer holds line i
    path = tmp_path / "shuffled.index"
    faiss.write_index(shuffled, str(path))
    out = tmp_path / "refused"
    spec = encoder_spec("all-MiniLM-L6-v2")
    with pytest.raises(UserError, match=r"do not match all-MiniLM-L6-v2.*cosine"):
        import_index(path, small_corpus, out, spec, verify_sample=8, show_progress=False)
    assert not out.exists() and not partial_dir(out).exists()
    prefixed = encoder_spec("all-MiniLM-L6-v2", passage_prefix="passage: ")
    with pytest.raises(UserError, match="cosine"):
        import_index(plain_faiss_file, small_corpus, out, prefixed, verify_sample=8)
    with pytest.raises(UserError, match=r"holds 310 vectors but .* has 10 passages"):
        import_index(plain_faiss_file, WIKI18_SAMPLE, out, spec)
    wrong_dimension = faiss.IndexFlatIP(768)
    wrong_dimension.add(np.zeros((310, 768), dtype=np.float32))
    faiss.write_index(wrong_dimension, str(tmp_path / "768.index"))
    with pytest.raises(UserError, match="768-d vectors, encoder all-MiniLM-L6-v2 gives 384-d"):
        import_index(tmp_path / "768.index", small_corpus, out, spec)
    assert not out.exists()


def test_import_of_a_lossy_index_checks_by_search(
    plain_faiss_file: Path, small_corpus: Path, tmp_path: Path
) -> None:
    vectors = faiss.read_index(str(plain_faiss_file)).reconstruct_n(0, 310)
    lossy = faiss.index_factory(384, "IVF4,SQ8", faiss.METRIC_INNER_PRODUCT)
    lossy.train(vectors)
    lossy.add(vectors)
    lossy.nprobe = 4
    faiss.write_index(lossy, str(tmp_path / "sq8.index"))
    manifest, summary = import_index(
        tmp_path / "sq8.index", small_corpus, tmp_path / "out", encoder_spec("all-MiniLM-L6-v2"),
        bm25=False, verify_sample=16, show_progress=False,
    )  # fmt: skip
    assert manifest.index_factory == "IVF4,SQ8" and not manifest.bm25
    assert "find their own row in their top 10" in summary
