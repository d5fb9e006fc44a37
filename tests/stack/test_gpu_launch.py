"""docker/trainer-gpu-launch.sh, the GPU image's `hdr`: `hdr train` as one process per GPU
under torchrun (with the shutdown grace it is given), anything else as plain `hdr`. Run for
real with the project's `hdr` on PATH and, for the torchrun line, a `torchrun` that records
its arguments (no GPU here to launch on)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from stackfiles import ROOT, hdr_executable

LAUNCH = ROOT / "docker" / "trainer-gpu-launch.sh"


def launch(tmp_path: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    recorder = bin_dir / "torchrun"
    recorder.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "torchrun" "$@"\n')
    recorder.chmod(0o755)
    path = f"{bin_dir}:{Path(hdr_executable()).parent}:{os.environ['PATH']}"
    return subprocess.run(
        ["bash", str(LAUNCH), *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PATH": path, **env},
    )


def test_training_runs_one_process_per_gpu_under_torchrun(tmp_path):
    done = launch(tmp_path, "train", "--resume", "/runs/x", HDR_NPROC="8")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [
        "torchrun", "--standalone", "--nproc-per-node", "8", "--shutdown-timeout", "1740",
        "--no-python", "hdr", "train", "--resume", "/runs/x",
    ]  # fmt: skip
    longer = launch(tmp_path, "train", HDR_NPROC="2", HDR_SHUTDOWN_TIMEOUT="3000")
    assert "--shutdown-timeout\n3000\n" in longer.stdout


@pytest.mark.parametrize("args", [["train", "--help"], ["sft", "--help"]])
def test_one_process_and_other_commands_run_hdr_itself(tmp_path, args):
    done = launch(tmp_path, *args, HDR_NPROC="1")
    assert done.returncode == 0, done.stderr
    assert not done.stdout.startswith("torchrun") and f"hdr {args[0]}" in done.stdout


def test_a_bad_process_count_is_one_line(tmp_path):
    done = launch(tmp_path, "train", HDR_NPROC="two")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "trainer-gpu-launch: HDR_NPROC must be a number of processes or 'all', not 'two'"
        " (found two GPUs)"
    ]
