"""The `hdr index ...` and `hdr serve` commands, run as a user runs them (subprocesses)."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from servers import free_port

HDR = str(Path(sys.executable).with_name("hdr"))


def hdr(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HDR, *args], capture_output=True, text=True, timeout=timeout, check=False
    )


def assert_one_line_user_error(result: subprocess.CompletedProcess[str], fragment: str) -> None:
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hdr: error: ") and fragment in lines[0], lines[0]
    assert "Traceback" not in result.stderr + result.stdout


def test_prepare_wiki_writes_search_r1_jsonl(tmp_path: Path) -> None:
    out = tmp_path / "wiki.jsonl"
    result = hdr("index", "prepare-wiki", "--out", str(out), "--limit", "5")
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["id"] for line in lines] == ["0", "1", "2", "3", "4"]
    assert lines[0]["contents"].startswith('"20th-century classical music"\n')


def test_build_refuses_a_missing_corpus_and_an_unknown_index_type(tmp_path: Path) -> None:
    missing = hdr("index", "build", "--corpus", str(tmp_path / "no.jsonl"), "--out", str(tmp_path))
    assert_one_line_user_error(missing, "corpus file not found")
    corpus = tmp_path / "c.jsonl"
    corpus.write_text('{"id": "0", "contents": "\\"A\\"\\nb"}\n')
    ivf = hdr("index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "i"),
              "--index-type", "IVF8,Nonsense")  # fmt: skip
    assert_one_line_user_error(ivf, "is not a FAISS factory string")
    assert not (tmp_path / "i").exists() and not (tmp_path / "i.partial").exists()


@pytest.fixture
def broken_copies(small_index: Path, small_corpus: Path, tmp_path: Path) -> dict[str, list[str]]:
    """`hdr serve` arguments for an index that is missing, incomplete, or off its corpus."""
    incomplete = tmp_path / "incomplete"
    shutil.copytree(small_index, incomplete)
    (incomplete / "offsets.npy").unlink()
    edited = tmp_path / "edited.jsonl"
    edited.write_text(small_corpus.read_text().replace("Batman", "Robin!", 1))
    return {
        "does not exist": ["--index", str(tmp_path / "nowhere")],
        "incomplete: offsets.npy is missing": ["--index", str(incomplete)],
        "does not match its corpus": ["--index", str(small_index), "--corpus", str(edited)],
        "unknown retriever 'splade'": ["--index", str(small_index), "--retriever", "splade"],
        "config key max_topkk": ["--index", str(small_index), "--set", "max_topkk=3"],
        "default_topk 3 exceeds max_topk 2": ["--index", str(small_index), "--set", "max_topk=2"],
    }


def test_serve_refuses_to_start_with_one_line_and_exit_2(
    broken_copies: dict[str, list[str]],
) -> None:
    for fragment, args in broken_copies.items():
        assert_one_line_user_error(hdr("serve", *args, "--port", "9"), fragment)


def start_serve(*args: str) -> tuple[subprocess.Popen[str], str, dict]:
    """`hdr serve ARGS` on a free port: the process, its URL and its first /health."""
    port = free_port()
    process = subprocess.Popen(
        [HDR, "serve", *args, "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        if process.poll() is not None:
            raise AssertionError(process.stdout.read())
        try:
            return process, url, httpx.get(f"{url}/health", timeout=5).json()
        except httpx.TransportError:
            if time.monotonic() > deadline:
                process.kill()
                raise AssertionError("hdr serve did not come up") from None
            time.sleep(0.2)


def stop_serve(process: subprocess.Popen[str]) -> str:
    process.terminate()  # uvicorn shuts down gracefully, then re-raises SIGTERM
    output, _ = process.communicate(timeout=30)
    return output


def test_serve_starts_on_loopback_and_answers(small_index: Path) -> None:
    process, url, health = start_serve("--index", str(small_index), "--retriever", "bm25")
    try:
        assert health["default_retriever"] == "bm25"
        body = {"queries": ["Great Wall of China"], "topk": 3, "return_scores": True}
        response = httpx.post(f"{url}/retrieve", json=body, timeout=60)
        assert response.status_code == 200
        assert response.json()["result"][0][0]["document"]["contents"].startswith(
            '"Great Wall of China"'
        )
    finally:
        output = stop_serve(process)
    assert f"hdr serve: {url} ready" in output  # loopback by default
    assert "Application shutdown complete" in output


def test_a_bm25_only_index_builds_without_encoding_and_serves_bm25(
    small_corpus: Path, tmp_path: Path
) -> None:
    """`--no-dense`: no FAISS file, nothing encoded; `hdr serve` defaults to bm25 on it and
    answers a dense request with a 4xx that names what it has."""
    out = tmp_path / "bm25-only"
    built = hdr("index", "build", "--corpus", str(small_corpus), "--out", str(out), "--no-dense")
    assert built.returncode == 0, built.stderr
    assert "no dense index" in built.stdout and "encode passages" not in built.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["index_factory"] is None and manifest["bm25"] is True
    assert not (out / "dense.faiss").exists() and "dense.faiss" not in manifest["files"]

    process, url, health = start_serve("--index", str(out))
    try:
        assert (health["default_retriever"], health["retrievers"]) == ("bm25", ["bm25"])
        found = httpx.post(f"{url}/retrieve", json={"queries": ["Great Wall of China"]})
        assert found.json()["result"][0][0]["contents"].startswith('"Great Wall of China"')
        dense = httpx.post(f"{url}/retrieve", json={"queries": ["x"], "retriever": "dense"})
        assert dense.status_code == 400 and "available: bm25" in dense.text
    finally:
        stop_serve(process)
    assert_one_line_user_error(
        hdr("serve", "--index", str(out), "--retriever", "dense", "--port", "0"),
        "retriever 'dense' is not available",
    )
    convert = ["--from", str(out), "--out", str(tmp_path / "c"), "--index-type", "IVF4,Flat"]
    assert_one_line_user_error(hdr("index", "convert", *convert), "has no dense index to convert")
    nothing = tmp_path / "nothing"
    neither = ["--corpus", str(small_corpus), "--out", str(nothing), "--no-dense", "--no-bm25"]
    assert_one_line_user_error(hdr("index", "build", *neither), "leaves nothing to build")
    assert not nothing.exists()


def test_serve_checks_its_port_before_loading_the_index(small_index: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = hdr("serve", "--index", str(small_index), "--port", str(port))
    assert_one_line_user_error(result, f"cannot listen on 127.0.0.1:{port}")


@pytest.mark.parametrize(
    ("field", "change", "says"),
    [
        ("dimension", 1, "the index's dimension is 384, the manifest's dimension is 385"),
        ("documents", -1, "it holds 310 passages, the manifest's documents is 309"),
    ],
)
def test_serve_reports_an_index_inconsistent_with_its_manifest_in_one_line(
    small_index: Path, tmp_path: Path, field: str, change: int, says: str
) -> None:
    """Valid JSON, right file sizes, but not what the FAISS (or offsets) file holds: found
    while the server starts (inside uvicorn's lifespan), still one line and exit 2, naming
    the field and both values."""
    index = tmp_path / "index"
    shutil.copytree(small_index, index)
    manifest = json.loads((index / "manifest.json").read_text())
    manifest[field] += change
    (index / "manifest.json").write_text(json.dumps(manifest))
    corpus = (small_index / manifest["corpus_path"]).resolve()
    result = hdr("serve", "--index", str(index), "--corpus", str(corpus), "--port", "0")
    assert_one_line_user_error(result, f"does not match {index / 'manifest.json'}: {says}")


def test_a_corpus_line_that_is_not_utf8_is_named_like_a_bad_json_line(tmp_path: Path) -> None:
    corpus = tmp_path / "latin1.jsonl"
    good = [json.dumps({"id": str(i), "contents": f'"T{i}"\ntext {i}'}) for i in range(20)]
    latin1 = '{"id": "20", "contents": "\\"Caf\xe9\\"\\nau lait"}'.encode("latin-1")
    corpus.write_bytes("\n".join(good).encode() + b"\n" + latin1 + b"\n")
    out = tmp_path / "index"
    result = hdr("index", "build", "--corpus", str(corpus), "--out", str(out), "--no-dense")
    assert_one_line_user_error(result, f"{corpus}:21: not UTF-8 (byte 0xe9 at column 32)")
    assert not out.exists() and not (tmp_path / "index.partial").exists()


def test_a_corpus_with_an_id_used_twice_is_refused_naming_the_id_and_its_lines(
    tmp_path: Path,
) -> None:
    """Otherwise `/retrieve` answers the same id twice in one top k."""
    corpus = tmp_path / "twice.jsonl"
    ids = [str(i) for i in range(50)] + ["7", "12", "12"]  # lines 51-53 repeat ids 7 and 12
    corpus.write_text(
        "".join(json.dumps({"id": i, "contents": f'"T{n}"\ntext {n}'}) + "\n"
                for n, i in enumerate(ids))
    )  # fmt: skip
    out = tmp_path / "index"
    result = hdr("index", "build", "--corpus", str(corpus), "--out", str(out), "--no-dense")
    assert_one_line_user_error(
        result, f"{corpus}: id '7' appears on lines 8, 51; 1 more ids repeat; every passage"
    )
    assert not out.exists()


def test_subcommands_without_a_config_take_their_options_as_key_value(tmp_path: Path) -> None:
    """`hdr --help` says every subcommand takes KEY=VALUE: where there is no config to
    override, KEY=VALUE is the option (`limit=5` is `--limit 5`, `dense=false` `--no-dense`)."""
    corpus = tmp_path / "wiki.jsonl"
    prepared = hdr("index", "prepare-wiki", "--out", str(corpus), "limit=5")
    assert prepared.returncode == 0, prepared.stderr
    assert len(corpus.read_text().splitlines()) == 5
    built = hdr("index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "index"),
                "batch_size=8", "dense=false", "chunk_size=2")  # fmt: skip
    assert built.returncode == 0, built.stderr
    assert "indexed 5 passages" in built.stdout and "no dense index" in built.stdout
    assert_one_line_user_error(
        hdr("index", "prepare-wiki", "--out", str(tmp_path / "w2.jsonl"), "limitt=5"),
        "`hdr index prepare-wiki` has no setting limitt: it has no config, and its KEY=VALUE"
        " arguments are its options (--force, --limit, --out). Did you mean --limit?",
    )
    assert_one_line_user_error(
        hdr("index", "build", "--corpus", str(corpus), "--out", str(tmp_path / "i2"), "dense=2"),
        "dense=2: --dense is a flag; write dense=true or dense=false",
    )
    root_help = hdr("--help").stdout
    assert "where it has no" in root_help and "config, its options written as settings" in (
        " ".join(root_help.split())
    )


def test_serve_starts_quietly_and_exports_the_onnx_encoder_once(
    small_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first start exports the query encoder to ONNX (torch's tracer warns about
    constructs that are constant for BERT-style models); no start prints those warnings, and
    the export is cached, so the second start does not make one."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("HDR_CACHE_DIR", str(cache))
    outputs = []
    for _ in range(2):
        process, _url, _health = start_serve("--index", str(small_index), "--no-access-log")
        outputs.append(stop_serve(process))
        exports = list(cache.glob("onnx/*/model.onnx"))
        assert len(exports) == 1, exports
        if len(outputs) == 1:
            exported_at = exports[0].stat().st_mtime_ns
    assert exports[0].stat().st_mtime_ns == exported_at  # the second start reused it
    for output in outputs:
        assert "Warning" not in output and "warn" not in output.lower(), output
        lines = [line for line in output.splitlines() if line.strip()]
        assert len(lines) <= 6, output  # ready, startup complete, the shutdown lines


def test_build_checks_the_whole_corpus_before_encoding(tmp_path: Path) -> None:
    corpus = tmp_path / "c.jsonl"
    good = [json.dumps({"id": str(i), "contents": f'"T{i}"\ntext {i}'}) for i in range(1000)]
    corpus.write_text("\n".join([*good, '{"id": "1000", "contents": 7}']) + "\n")
    out = tmp_path / "index"
    assert_one_line_user_error(
        hdr("index", "build", "--corpus", str(corpus), "--out", str(out)), f"{corpus}:1001"
    )
    assert not out.exists()  # nothing half-made


def test_served_connections_send_without_nagle_delay() -> None:
    """The socket `hdr serve` binds before loading makes asyncio (hence uvicorn) set
    TCP_NODELAY on each accepted connection; without it, a keep-alive response's body waited
    for the client's delayed ACK of its headers (40 ms a request on Linux)."""
    import asyncio

    from retrieval_server.serving.runtime import bind_port

    async def accepted_nodelay() -> int:
        listener = bind_port("127.0.0.1", 0)
        seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport: asyncio.BaseTransport) -> None:
                sock = transport.get_extra_info("socket")
                seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))

        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        _, writer = await asyncio.open_connection(*listener.getsockname())
        try:
            return await asyncio.wait_for(seen, 10)
        finally:
            writer.close()
            server.close()

    assert asyncio.run(accepted_nodelay()) == 1


def test_serve_options_sit_between_the_config_file_and_the_overrides(tmp_path: Path) -> None:
    """`hdr serve`'s options are typed values over the YAML file, under KEY=VALUE overrides;
    a value YAML would read otherwise (a prefix with a colon and brackets) stays a string."""
    from retrieval_server.cli import server_config_from

    config_file = tmp_path / "serve.yaml"
    config_file.write_text("max_topk: 7\ndense:\n  nprobe: 4\n  ef_search: 50\n")
    options = {
        "index_dir": tmp_path / "index",
        "default_retriever": None,  # not given: the default stays (and stays unset)
        "retrievers": ["bm25"],
        "query_prefix": "query: [x]",
        "dense": {"nprobe": 8, "ef_search": None, "mmap": False},
        "encoder": {"backend": None, "device": None},
    }
    config = server_config_from(config_file, options, ["dense.nprobe=16", "max_topk=9"])
    assert config.index_dir == tmp_path / "index"
    assert config.retrievers == ["bm25"]
    assert config.query_prefix == "query: [x]"
    assert (config.dense.nprobe, config.dense.ef_search, config.dense.mmap) == (16, 50, False)
    assert config.max_topk == 9
    assert "default_retriever" not in config.model_fields_set
    assert config.encoder.backend == "onnx"
