"""The retrieval container's entrypoint, run directly on the host as the container runs it.

The script gets only what the container gets: environment variables (as docker-compose.yml
sets them, with a small corpus and a free loopback port) and `hdr` on PATH. On the first start
it prepares the corpus and builds the index, then serves; a second start reuses the index.
The compose file's and the Dockerfile's healthcheck commands are run against the live server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import yaml
from servers import free_port
from stackfiles import (
    ARTICLES,
    COMPOSE,
    ROOT,
    START_TIMEOUT,
    Entrypoint,
    container_env,
    process_exists,
    wait_for_child,
)


def compose_health_code(port: int) -> str:
    service = yaml.safe_load(COMPOSE.read_text())["services"]["retrieval"]
    return service["healthcheck"]["test"][3].replace(":8000/", f":{port}/")


def dockerfile_health_code() -> str:
    text = (ROOT / "docker" / "retrieval.Dockerfile").read_text()
    line = next(line for line in text.splitlines() if line.strip().startswith("CMD ["))
    return json.loads(line.strip()[len("CMD ") :])[2]


def healthcheck(code: str, port: int) -> int:
    env = {**os.environ, "HDR_PORT": str(port)}
    return subprocess.run([sys.executable, "-c", code], env=env, timeout=30).returncode


def test_first_start_builds_the_index_once_then_serves_and_stops_cleanly(tmp_path):
    data = tmp_path / "data"
    # Two replicas on one empty data directory, as docker-compose.replicas.yml starts them.
    replicas = [
        Entrypoint(container_env(data, free_port()), tmp_path / f"replica-{i}.log") for i in (1, 2)
    ]
    try:
        healths = [replica.wait_healthy() for replica in replicas]
        builders = [replica for replica in replicas if "building it from" in replica.output()]
        assert len(builders) == 1, "exactly one replica builds; the other waits for its lock"
        first = replicas[0]
        # exec: the server replaced the shell, so `docker stop`'s SIGTERM reaches it.
        cmdline = Path(f"/proc/{first.proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"serve" in cmdline and not any(arg.endswith(b".sh") for arg in cmdline)

        corpus = data / "wiki-vital.jsonl"
        assert len(corpus.read_text().splitlines()) == ARTICLES
        assert (data / "index" / "manifest.json").is_file()
        for health in healths:
            assert health["status"] == "ok"
            assert health["documents"] == ARTICLES
            assert health["default_retriever"] == "dense"

        # Open without a token: the empty HDR_API_TOKEN compose passes means no auth.
        response = httpx.post(
            first.url("/retrieve"),
            json={"queries": ["Albert Einstein physicist"], "topk": 3, "return_scores": True},
            timeout=30.0,
        )
        assert response.status_code == 200, response.text
        (hits,) = response.json()["result"]
        assert len(hits) == 3
        ids = {json.loads(line)["id"] for line in corpus.read_text().splitlines()}
        assert {hit["document"]["id"] for hit in hits} <= ids

        assert healthcheck(compose_health_code(first.port), first.port) == 0
        assert healthcheck(dockerfile_health_code(), first.port) == 0
        for replica in replicas:
            replica.stop()
        assert healthcheck(compose_health_code(first.port), first.port) != 0
    finally:
        for replica in replicas:
            replica.kill()

    # A later start on the same data: no rebuild, the same index served.
    built = (data / "index" / "manifest.json").stat().st_mtime_ns
    again = Entrypoint(container_env(data, free_port()), tmp_path / "again.log")
    try:
        assert again.wait_healthy()["documents"] == ARTICLES
        assert "building" not in again.output() and "preparing" not in again.output()
        assert (data / "index" / "manifest.json").stat().st_mtime_ns == built
        again.stop()
    finally:
        again.kill()


def test_a_failed_build_exits_non_zero_and_serves_nothing(tmp_path):
    env = container_env(tmp_path / "data", free_port())
    env["HDR_ENCODER"] = str(tmp_path / "no-such-encoder")
    entrypoint = Entrypoint(env, tmp_path / "failed.log")
    try:
        status = entrypoint.proc.wait(timeout=START_TIMEOUT)
    finally:
        entrypoint.kill()
    assert status != 0, entrypoint.output()
    assert "hdr: error: encoder" in entrypoint.output()
    assert "no-such-encoder" in entrypoint.output()
    assert not (tmp_path / "data" / "index" / "manifest.json").exists()
    assert "serving" not in entrypoint.output()


def test_sigterm_during_the_first_start_build_stops_it_at_once(tmp_path):
    """`docker stop` while the index is being built: the entrypoint passes SIGTERM on to
    `hdr index build` (it runs before the final `exec`) and exits 143 without serving."""
    data = tmp_path / "data"
    entrypoint = Entrypoint(container_env(data, free_port()), tmp_path / "stopped.log")
    try:
        builder = wait_for_child(entrypoint.proc, "index build")
        entrypoint.proc.send_signal(signal.SIGTERM)
        status = entrypoint.proc.wait(timeout=START_TIMEOUT)
    finally:
        entrypoint.kill()
    output = entrypoint.output()
    assert status == 128 + signal.SIGTERM, output
    assert not process_exists(builder), "hdr index build outlived the entrypoint"
    assert output.strip().splitlines()[-1] == "retrieval-entrypoint: stopped by a signal"
    assert not (data / "index" / "manifest.json").exists()
    assert "serving" not in output


def test_with_builds_off_a_missing_index_is_one_line_and_nothing_is_written(tmp_path):
    """HDR_BUILD_INDEX=0 (docker-compose.wiki18.yml: a 21M-passage index is made beforehand):
    no index is refused at once in one line, exit 2, and no corpus or index is started."""
    env = container_env(tmp_path / "data", free_port())
    env.update(HDR_BUILD_INDEX="0", HDR_INDEX_DIR=str(tmp_path / "data" / "index-e5"))
    done = subprocess.run(
        ["bash", str(ROOT / "docker" / "retrieval-entrypoint.sh")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(f"retrieval-entrypoint: no index at {tmp_path / 'data' / 'index-e5'}")
    assert "HDR_BUILD_INDEX=0" in line and "hdr index import" in line
    assert not (tmp_path / "data").exists()
