"""The retrieval server's path without torch, as the retrieval image runs it: an encoder
exported ahead of time (`hdr index export-encoder`, into its model directory), then
`hdr index prepare-wiki`, `hdr index build` and `hdr serve` in a Python where torch,
transformers and sentence-transformers cannot be imported."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from servers import free_port
from stackfiles import ROOT, base_env, hdr_executable

from retrieval_server.index.encoder import SHIPPED_ONNX_DIR, resolve_encoder, shipped_onnx

# What the retrieval image lacks; importing any of them fails in the child processes.
ABSENT = ("torch", "transformers", "sentence_transformers")
ARTICLES = 40


def without_torch(tmp_path: Path) -> dict[str, str]:
    """The environment of a `hdr` whose Python cannot import ABSENT (a sitecustomize that
    blocks them, first on PYTHONPATH)."""
    blocker = tmp_path / "blocker"
    blocker.mkdir(exist_ok=True)
    lines = ["import sys"] + [f"sys.modules[{name!r}] = None" for name in ABSENT]
    (blocker / "sitecustomize.py").write_text("\n".join(lines) + "\n")
    env = base_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), str(ROOT), env.get("PYTHONPATH", "")])
    env["HDR_CACHE_DIR"] = str(tmp_path / "cache")  # empty: no export cached on first use
    return env


def hdr(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [hdr_executable(), *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=600
    )


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    """A copy of the packaged encoder with its ONNX export, made with torch (as the image's
    build stage and a user's host do)."""
    model = tmp_path_factory.mktemp("encoder") / "minilm"
    shutil.copytree(resolve_encoder("all-MiniLM-L6-v2"), model)
    done = hdr("index", "export-encoder", str(model), env=base_env(), cwd=model.parent)
    assert done.returncode == 0, done.stderr
    assert (model / SHIPPED_ONNX_DIR / "model.onnx").is_file()
    assert shipped_onnx(model) == model / SHIPPED_ONNX_DIR / "model.onnx"
    again = hdr("index", "export-encoder", str(model), env=base_env(), cwd=model.parent)
    assert again.returncode == 0 and "already holds an ONNX export" in again.stdout
    return model


def test_an_export_of_other_weights_is_not_used(exported, tmp_path):
    model = tmp_path / "changed"
    shutil.copytree(exported, model)
    weights = model / "model.safetensors"
    weights.write_bytes(weights.read_bytes() + b"\0")  # other weights: another size
    assert shipped_onnx(model) is None
    # and is never replaced by a new one: that folder may be anyone's
    done = hdr("index", "export-encoder", str(model), env=base_env(), cwd=tmp_path)
    assert done.returncode == 2
    expected = f"{model / SHIPPED_ONNX_DIR} exists; remove it (or name another --out)"
    assert done.stderr.strip() == f"hdr: error: {expected} to export again"


def test_index_build_and_serve_run_without_torch(exported, tmp_path):
    env = without_torch(tmp_path)
    probe = subprocess.run(
        [str(Path(hdr_executable()).parent / "python"), "-c", "import torch"],
        env=env,
        capture_output=True,
        text=True,
    )
    assert probe.returncode != 0 and "torch" in probe.stderr  # the blocker works
    prepared = hdr(
        "index", "prepare-wiki", "--out", "c.jsonl", "--limit", str(ARTICLES), env=env, cwd=tmp_path
    )
    assert prepared.returncode == 0, prepared.stderr

    # Without an export, one line that says how to make one.
    refused = hdr("index", "build", "--corpus", "c.jsonl", "--out", "plain", env=env, cwd=tmp_path)
    assert refused.returncode == 2, refused.stderr
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and "hdr index export-encoder" in lines[0], lines
    assert not (tmp_path / "plain" / "manifest.json").exists()

    build = ["index", "build", "--corpus", "c.jsonl", "--out", "idx", "--encoder", str(exported)]
    built = hdr(*build, env=env, cwd=tmp_path)
    assert built.returncode == 0, built.stderr
    assert not (tmp_path / "cache").exists()  # the shipped export was used, nothing exported

    port = free_port()
    log = (tmp_path / "serve.log").open("w")
    server = subprocess.Popen(
        [hdr_executable(), "serve", "--index", "idx", "--port", str(port)],
        env=env,
        cwd=tmp_path,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "serve.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.3)
        first = (tmp_path / "c.jsonl").read_text().splitlines()[0]
        title = httpx.Response(200, content=first).json()["contents"].split("\n")[0].strip('"')
        request = {"queries": [title], "topk": 3, "return_scores": True}
        response = httpx.post(f"http://127.0.0.1:{port}/retrieve", json=request, timeout=60)
        assert response.status_code == 200, response.text
        ids = [hit["document"]["id"] for hit in response.json()["result"][0]]
        assert "0" in ids, (title, ids)
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()
