"""The trainer container's entrypoint, run directly on the host against a live retrieval server.

The retrieval entrypoint serves a small corpus on a free loopback port; the trainer entrypoint
then does what the `trainer` service does on `docker compose up`: builds the tiny policy
(`hdr init-model`, `hdr sft`), then `hdr train --config configs/tiny-cpu.yaml` with the
retrieval URL and run directory it derives from its environment. Dotted overrides on the
command line (as `docker compose run trainer key=value ...` passes them) shrink the run to one
step. About a minute and a half on a 2-core CPU, so it is marked slow (`make test-slow`).
"""

from __future__ import annotations

import json
import subprocess

import pytest
import yaml
from servers import free_port
from stackfiles import (
    ENTRYPOINTS,
    SMALL_RUN,
    TRAIN_TIMEOUT,
    Entrypoint,
    container_env,
    trainer_env,
)


@pytest.mark.slow
def test_trainer_entrypoint_builds_the_tiny_policy_and_trains_against_the_server(tmp_path):
    server = Entrypoint(container_env(tmp_path / "data", free_port()), tmp_path / "server.log")
    try:
        server.wait_healthy()
        url = server.url("")
        runs = tmp_path / "runs"
        env = trainer_env(runs, url, HDR_RUN_NAME="smoke")
        done = subprocess.run(
            ["bash", str(ENTRYPOINTS["trainer"]), *SMALL_RUN],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=TRAIN_TIMEOUT,
        )
        log = done.stdout + done.stderr
        assert done.returncode == 0, log
        retrieve_calls = server.output().count("POST /retrieve")
        server.stop()
    finally:
        server.kill()

    policy = runs / "tiny-policy"
    assert (policy / "init" / "config.json").is_file()
    assert (policy / "sft" / "config.json").is_file()
    assert log.index("building the tiny policy") < log.index("hdr train --config")

    run = runs / "smoke"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["retrieval"]["urls"] == [url]
    assert saved["model"]["path"] == str(policy / "sft")
    assert saved["out_dir"] == str(run)
    assert saved["steps"] == 1
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [record["step"] for record in metrics] == [1]
    assert (run / "final" / "config.json").is_file()
    # SFT's scripted rollouts searched through the server (the untrained policy may not).
    assert retrieve_calls >= 1
