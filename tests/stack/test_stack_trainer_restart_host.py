"""Starting the trainer container again, after Ctrl-C and after a finished run, on the host.

`docker/trainer-entrypoint.sh` runs as the `trainer` service runs it (tests/stack/stackfiles.py
`trainer_env`), against the session's retrieval server, three times on one runs directory, as
`docker compose up`, Ctrl-C, `up`, `up` would:

1. a fresh run, sent SIGTERM (what `docker stop` sends) once `hdr train` has started: the
   signal reaches `hdr train`, which writes a checkpoint and exits 143;
2. the second start resumes that checkpoint (`hdr train --resume`) and runs to the configured
   steps;
3. the third finds the run complete: exit 0, one line, nothing written.

Each start is a module fixture that records what it saw, so each test can also run alone. The
runs directory holds the tiny policy already (an untrained one from `hdr init-model` under both
`tiny-policy/init` and `tiny-policy/sft`, standing in for the SFT output): the entrypoint must
reuse it, since `hdr init-model` and `hdr sft` refuse to overwrite. A last test stops the
entrypoint while it builds the tiny policy. Tens of seconds in all on a 2-core CPU.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from stackfiles import (
    ENTRYPOINTS,
    SMALL_RUN,
    TRAIN_TIMEOUT,
    base_env,
    hdr_executable,
    process_exists,
    trainer_env,
    wait_for_child,
)

RUN_NAME = "tiny-cpu"
STEPS = 3
# One checkpoint a step, so the resume has a recent one; the same arguments on every start.
ARGS = [*SMALL_RUN, f"steps={STEPS}", "checkpoint.save_every=1", "log.progress=false"]


@dataclass
class Start:
    """What one start of the entrypoint did."""

    returncode: int
    log: str
    cmdline: list[str]  # of the entrypoint's process when it was signalled (empty: not)
    before: dict[str, str]  # every path under the runs directory -> sha256 ("dir" for folders)
    after: dict[str, str]
    steps: list[int]  # the steps metrics.jsonl records afterwards
    checkpoints: list[str]  # the checkpoint directories afterwards


def tree(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): "dir"
        if path.is_dir()
        else hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
    }


def logged_steps(run: Path) -> list[int]:
    metrics = run / "metrics.jsonl"
    lines = metrics.read_text().splitlines() if metrics.exists() else []
    return [json.loads(line)["step"] for line in lines]


def start(env: dict[str, str], log: Path, signal_when_training: bool = False) -> Start:
    """Run the entrypoint to its end; optionally SIGTERM it once `hdr train` has written the
    run's config.yaml (by then its stop handler is installed)."""
    runs = Path(env["HDR_RUNS_DIR"])
    run = runs / env["HDR_RUN_NAME"]
    before = tree(runs)
    cmdline: list[str] = []
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", str(ENTRYPOINTS["trainer"]), *ARGS],
            env=env,
            cwd=log.parent,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        if signal_when_training:
            deadline = time.monotonic() + TRAIN_TIMEOUT
            while not (run / "config.yaml").exists():
                assert proc.poll() is None, log.read_text()
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)
            raw = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
            cmdline = [arg.decode() for arg in raw.split(b"\0") if arg]
            proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=TRAIN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    checkpoints = run / "checkpoints"
    return Start(
        returncode=proc.returncode,
        log=log.read_text(),
        cmdline=cmdline,
        before=before,
        after=tree(runs),
        steps=logged_steps(run),
        checkpoints=sorted(p.name for p in checkpoints.iterdir()) if checkpoints.is_dir() else [],
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """A runs directory that holds the tiny policy, as the first start would have left it."""
    runs = tmp_path_factory.mktemp("restart") / "runs"
    policy = runs / "tiny-policy"
    small = [
        "vocab_size=600",
        "hidden_size=32",
        "num_layers=2",
        "num_heads=2",
        "intermediate_size=64",
    ]
    subprocess.run(
        [hdr_executable(), "init-model", "--out", str(policy / "init"), *small],
        env=base_env(),
        check=True,
        capture_output=True,
        timeout=TRAIN_TIMEOUT,
    )
    shutil.copytree(policy / "init", policy / "sft")
    return runs


@pytest.fixture(scope="module")
def env(runs: Path, retrieval_url: str) -> dict[str, str]:
    return trainer_env(runs, retrieval_url, HDR_RUN_NAME=RUN_NAME, HDR_MODEL="tiny")


@pytest.fixture(scope="module")
def stopped(env: dict[str, str], runs: Path) -> Start:
    return start(env, runs.parent / "first.log", signal_when_training=True)


@pytest.fixture(scope="module")
def resumed(stopped: Start, env: dict[str, str], runs: Path) -> Start:
    return start(env, runs.parent / "second.log")


@pytest.fixture(scope="module")
def completed(resumed: Start, env: dict[str, str], runs: Path) -> Start:
    return start(env, runs.parent / "third.log")


def policy_files(files: dict[str, str]) -> dict[str, str]:
    return {path: digest for path, digest in files.items() if path.startswith("tiny-policy")}


def test_sigterm_reaches_hdr_train_which_stops_with_a_checkpoint(stopped, runs):
    run = runs / RUN_NAME
    # `exec`: the entrypoint's process is `hdr train` itself, which got the signal.
    program, command = Path(stopped.cmdline[1]).name, stopped.cmdline[2]
    assert (program, command) == ("hdr", "train"), stopped.cmdline
    assert stopped.returncode == 128 + signal.SIGTERM, stopped.log
    last = stopped.log.strip().splitlines()[-1]
    assert last == (
        f"hdr: stopped: stopped by SIGTERM after step 0 of {STEPS};"
        f" checkpoint {run}/checkpoints/step-000000; continue with: hdr train --resume {run}"
    )
    assert stopped.checkpoints == ["step-000000"]
    assert f"{RUN_NAME}/checkpoints/step-000000/manifest.json" in stopped.after
    assert f"{RUN_NAME}/final" not in stopped.after
    # The tiny policy on the volume is reused as it is: neither step ran again.
    assert "reusing the untrained tiny policy" in stopped.log
    assert "reusing the tiny policy" in stopped.log
    assert "building" not in stopped.log
    assert policy_files(stopped.after) == policy_files(stopped.before)
    assert "Traceback" not in stopped.log


def test_the_next_start_resumes_the_checkpoint_and_runs_to_the_configured_steps(
    stopped, resumed, runs, retrieval_url
):
    run = runs / RUN_NAME
    assert resumed.returncode == 0, resumed.log
    assert f"trainer-entrypoint: hdr train --resume {run} " in resumed.log
    assert "hdr train --config" not in resumed.log and "reusing" not in resumed.log
    assert stopped.steps == [] and resumed.steps == list(range(1, STEPS + 1))
    assert resumed.checkpoints == ["step-000002", "step-000003"]  # checkpoint.keep_last: 2
    assert f"{RUN_NAME}/final/config.json" in resumed.after
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["retrieval"]["urls"] == [retrieval_url]
    assert saved["model"]["path"] == str(runs / "tiny-policy" / "sft")
    assert saved["steps"] == STEPS
    assert policy_files(resumed.after) == policy_files(stopped.before)
    assert "Traceback" not in resumed.log


def test_a_start_after_the_run_completed_exits_0_with_one_line_and_writes_nothing(completed, runs):
    run = runs / RUN_NAME
    assert f"{RUN_NAME}/final/config.json" in completed.before
    assert completed.returncode == 0, completed.log
    assert completed.log.splitlines() == [
        f"trainer-entrypoint: run {run} is complete: its final model is {run}/final. To start"
        f" over, set HDR_RUN_NAME to a new name or remove {run} (docker compose down -v removes"
        " the runs volume, and the index volume with it)"
    ]
    assert completed.after == completed.before


def test_sigterm_while_the_tiny_policy_is_built_stops_the_build_at_once(tmp_path):
    """`hdr init-model` runs before the final `exec`; the entrypoint passes the signal on to it
    instead of waiting for it to finish (nor does it go on to `hdr sft`)."""
    runs = tmp_path / "runs"
    # No server is needed: the signal comes before the steps that would search.
    env = trainer_env(runs, "http://127.0.0.1:9", HDR_RUN_NAME=RUN_NAME, HDR_MODEL="tiny")
    log = tmp_path / "entrypoint.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            ["bash", str(ENTRYPOINTS["trainer"]), *ARGS],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        builder = wait_for_child(proc, "init-model")
        proc.send_signal(signal.SIGTERM)
        status = proc.wait(timeout=TRAIN_TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    output = log.read_text()
    assert status == 128 + signal.SIGTERM, output
    assert not process_exists(builder), "hdr init-model outlived the entrypoint"
    assert output.strip().splitlines()[-1] == "trainer-entrypoint: stopped by a signal"
    # Killed before it wrote its model, and never published as the policy.
    assert not (runs / "tiny-policy" / "init.partial" / "model.safetensors").exists()
    assert not (runs / "tiny-policy" / "init").exists()
    assert "hdr sft" not in output and "hdr train" not in output
