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
    recorder.write_text(
        '#!/usr/bin/env bash\nprintf "%s\\n" "torchrun" "$@"\n'
        'echo "CUDA_VISIBLE_DEVICES=${CUDA_VISIBLE_DEVICES-unset}" >&2\n'
    )
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


def test_the_gpus_listed_are_the_ones_training_sees(tmp_path):
    """Compose makes every GPU visible (a literal `count: all`, which both compose clients
    accept); HDR_GPU_DEVICES keeps a run to some of them, as CUDA_VISIBLE_DEVICES."""
    done = launch(tmp_path, "train", HDR_NPROC="2", HDR_GPU_DEVICES="4,5")
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:4] == ["torchrun", "--standalone", "--nproc-per-node", "2"]
    assert done.stderr.strip() == "CUDA_VISIBLE_DEVICES=4,5"
    unset = launch(tmp_path, "train", HDR_NPROC="2", HDR_GPU_DEVICES="")
    assert unset.stderr.strip() == "CUDA_VISIBLE_DEVICES=unset"


@pytest.mark.parametrize(
    "devices, nproc, message",
    [
        ("0;1", "1", "HDR_GPU_DEVICES must be GPU indices or UUIDs separated by commas"),
        ("0,1", "4", "HDR_NPROC is 4 but HDR_GPU_DEVICES lists 2 GPUs (0,1)"),
    ],
)
def test_bad_gpu_lists_are_one_line(tmp_path, devices, nproc, message):
    done = launch(tmp_path, "train", HDR_NPROC=nproc, HDR_GPU_DEVICES=devices)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], lines
