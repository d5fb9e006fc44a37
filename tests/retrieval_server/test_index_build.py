"""Building, resuming and importing indexes; what the manifest records about the encoder."""

from __future__ import annotations

import json
import re
import shlex
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
from retrieval_server.index.build import build_index
from retrieval_server.index.encoder import Encoder, encoder_spec
from retrieval_server.index.files import (
    MANIFEST,
    corpus_fingerprint,
    load_index,
    read_manifest,
    validate_index,
)
from retrieval_server.index.importing import import_index
from retrieval_server.index.staging import VECTORS_DIR, partial_dir
from retrieval_server.serving.retrievers import RETRIEVERS

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


def test_a_changed_encoder_spec_refuses_to_discard_chunks_until_they_are_removed(
    tmp_path: Path,
) -> None:
    corpus = tmp_path / "sample.jsonl"
    shutil.copy(WIKI18_SAMPLE, corpus)
    out = tmp_path / "index"
    build_index(corpus, out, chunk_size=4, bm25=False, show_progress=False)
    plain = stored_vectors(out)
    # leave a finished chunk behind as an interrupted build with the default spec would
    partial = partial_dir(out)
    (partial / VECTORS_DIR).mkdir(parents=True)
    np.save(partial / VECTORS_DIR / "000000.npy", plain[:4])
    state = {"corpus_fingerprint": corpus_fingerprint(corpus),
             "corpus_bytes": corpus.stat().st_size,
             "encoder": encoder_spec("all-MiniLM-L6-v2").model_dump(), "chunk_size": 4}  # fmt: skip
    (partial / "build.json").write_text(json.dumps(state))
    spec = encoder_spec("all-MiniLM-L6-v2", query_prefix="query: ", passage_prefix="passage: ")
    with pytest.raises(UserError) as refused:
        build_index(corpus, out, spec=spec, chunk_size=4, bm25=False, show_progress=False,
                    force=True)  # fmt: skip
    assert str(refused.value) == (
        f"{partial} holds 1 encoded chunks of an interrupted build with other settings"
        " (--passage-prefix '' then, 'passage: ' now; --query-prefix '' then, 'query: ' now):"
        f" rerun with the earlier settings to resume, or remove it with `rm -r {partial}` to"
        " start over"
    )
    assert (partial / VECTORS_DIR / "000000.npy").is_file()  # nothing discarded
    shutil.rmtree(partial)  # what the line says to do
    result = build_index(
        corpus, out, spec=spec, chunk_size=4, bm25=False, show_progress=False, force=True
    )
    assert (result.chunks_reused, result.chunks_encoded) == (0, 3)
    assert not np.allclose(stored_vectors(out)[:4], plain[:4], atol=1e-3)


@pytest.mark.slow  # the default run resumes a build too (test_interrupted_build_resumes_...)
def test_ctrl_c_says_how_to_resume_and_another_chunk_size_refuses_to_discard_the_chunks(
    small_corpus: Path, tmp_path: Path
) -> None:
    """Ctrl-C: one line with the command that resumes, exit 130. A rerun with another
    --chunk-size would throw the encoded chunks away (hours at 21M passages): refused,
    naming the setting; the same command then resumes after them."""
    out = tmp_path / "index"
    chunks = partial_dir(out) / VECTORS_DIR
    command = [HDR, "index", "build", "--corpus", str(small_corpus), "--out", str(out),
               "--chunk-size", "10", "--no-bm25"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 300
        while not list(chunks.glob("0*.npy")):  # Ctrl-C as soon as one chunk is saved
            assert process.poll() is None, "the build ended before it could be interrupted"
            assert time.monotonic() < deadline
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
        process.wait()
    assert process.returncode == 130
    lines = [line for line in stderr.splitlines() if not line.startswith("encode passages")]
    assert lines == [f"hdr: stopped; to resume run: {shlex.join(['hdr', *command[1:]])}"]
    finished = len(list(chunks.glob("0*.npy")))

    other = hdr_run(*command[1:-3], "--chunk-size", "20", "--no-bm25")
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert (
        f"hdr: error: {partial_dir(out)} holds {finished} encoded chunks of an interrupted build"
        " with other settings (--chunk-size 10 then, 20 now): rerun with the earlier settings to"
        " resume"
    ) in other.stderr
    assert len(list(chunks.glob("0*.npy"))) == finished
    bm25_only = hdr_run(*command[1:-3], "--no-dense")
    assert bm25_only.returncode == 2 and "which this command would discard" in bm25_only.stderr

    resumed = hdr_run(*command[1:])
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed after {finished} chunks" in resumed.stdout


def hdr_run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([HDR, *args], capture_output=True, text=True, timeout=300, check=False)


def can_mount_a_small_disk() -> bool:
    """Whether this machine lets a test mount a tmpfs in its own user and mount namespace."""
    probe = "d=$(mktemp -d) && mount -t tmpfs -o size=64k none $d && umount $d"
    try:
        done = subprocess.run(["unshare", "-rm", "sh", "-c", probe], capture_output=True,
                              timeout=30, check=False)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.mark.slow  # mounts a small disk and fills it: about 17 s
@pytest.mark.skipif(not can_mount_a_small_disk(), reason="needs unshare -rm and tmpfs mounts")
def test_a_full_disk_is_one_line_that_keeps_the_resumable_work(
    small_corpus: Path, tmp_path: Path
) -> None:
    """On a 320 KiB disk (a tmpfs in a namespace of the test's own) the build fills it after a
    few chunks: one line naming the .partial folder, its size, the space needed and free, and
    the commands to resume or remove it; the chunks stay. With the disk grown, the same
    command resumes after them."""
    disk = tmp_path / "disk"
    disk.mkdir()
    out = disk / "index"
    build = shlex.join([HDR, "index", "build", "--corpus", str(small_corpus), "--out", str(out),
                        "--chunk-size", "20", "--no-bm25"])  # fmt: skip
    script = f"""
        mount -t tmpfs -o size=320k none {disk}
        {build} > {tmp_path}/out1 2> {tmp_path}/err1; echo $? > {tmp_path}/rc1
        ls {out}.partial/vectors | grep -c '^0.*[0-9].npy$' > {tmp_path}/chunks
        mount -o remount,size=8m {disk}
        {build} > {tmp_path}/out2 2> {tmp_path}/err2; echo $? > {tmp_path}/rc2
    """
    subprocess.run(["unshare", "-rm", "sh", "-c", script], timeout=600, check=True)
    errors = [line for line in (tmp_path / "err1").read_text().splitlines()
              if not line.startswith(("encode passages", "index Flat"))]  # fmt: skip
    assert (tmp_path / "rc1").read_text().strip() == "2", errors
    chunks = int((tmp_path / "chunks").read_text())
    assert 1 <= chunks < 16
    assert len(errors) == 1, errors
    assert re.fullmatch(
        rf"hdr: error: no space left on the device of {re.escape(str(out))}\.partial: it holds"
        rf" [0-9.]+ KiB of resumable work \({chunks} encoded chunks\); the build needs about"
        r" [0-9.]+ KiB in all there and [0-9.]+ (B|KiB) is free\. Free space and rerun"
        rf" `hdr index build --corpus {re.escape(str(small_corpus))} --out {re.escape(str(out))}"
        rf" --chunk-size 20` with the same options to resume, or remove the folder with"
        rf" `rm -r {re.escape(str(out))}\.partial`",
        errors[0],
    ), errors[0]
    assert (tmp_path / "rc2").read_text().strip() == "0", (tmp_path / "err2").read_text()
    assert f"resumed after {chunks} chunks" in (tmp_path / "out2").read_text()


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
