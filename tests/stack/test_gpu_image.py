"""The GPU trainer image (docker/trainer-gpu.Dockerfile) built here, where there is no GPU and no
image registry: from the stand-in base `make test-stack` uses (docker/standin-base.sh; built
first where missing), every package from the package index (torch's CUDA 13 build among them:
installing and importing vLLM, TRL and DeepSpeed needs no GPU). Slow (`make test-slow`): the
first build downloads several GB. It needs a Docker engine: one that answers, or one
docker/engine.sh can start (it is stopped again afterwards); else the tests skip saying why.

Inside the image: the libraries the image is for, at the `gpu` extra's versions; `hdr train
--help` and `hdr plan-memory` of the 3B config on 8 x 80 GB through the image's own launcher
(docker/trainer-gpu-launch.sh); the entrypoint with no model mounted refuses in one line, and
with a model but no data too; the image's size as docs/stack.md reports it.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from stackfiles import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(5400)]

IMAGE = os.environ.get("HDR_STACK_GPU_IMAGE", "hdr-trainer:gpu-test")
BASE = os.environ.get("HDR_STACK_BASE", "hdr-standin/python:3.11-slim")
LAUNCH = "/app/docker/trainer-gpu-launch.sh"
DOCS = ROOT / "docs" / "stack.md"


def sh(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kwargs)


def engine_answers() -> bool:
    try:
        return sh("docker", "info", timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def engine():
    """A Docker engine for the module: the one running, or one docker/engine.sh starts."""
    if engine_answers():
        yield
        return
    available = sh(str(ROOT / "docker" / "engine.sh"), "available")
    if available.returncode != 0:
        pytest.skip(f"no Docker engine: {available.stderr.strip().splitlines()[-1:]}")
    started = sh(str(ROOT / "docker" / "engine.sh"), "start", timeout=300)
    assert started.returncode == 0, started.stderr
    try:
        yield
    finally:
        sh(str(ROOT / "docker" / "engine.sh"), "stop", timeout=300)


def build_command() -> tuple[list[str], dict[str, str]]:
    """`docker build` with BuildKit where the client has it (as tests/stack/run.sh chooses)."""
    env = dict(os.environ)
    if sh("docker", "buildx", "version").returncode == 0:
        return ["docker", "build"], {**env, "DOCKER_BUILDKIT": "1"}
    legacy = Path("/usr/bin/docker")
    version = (
        sh(str(legacy), "version", "--format", "{{.Client.Version}}") if legacy.exists() else None
    )
    if version is not None and version.stdout.startswith("20."):
        return [str(legacy), "build"], {**env, "DOCKER_BUILDKIT": "1"}
    return ["docker", "build"], env


@pytest.fixture(scope="module")
def image(engine) -> str:
    if sh("docker", "image", "inspect", BASE).returncode != 0:
        standin = sh(str(ROOT / "docker" / "standin-base.sh"), BASE, timeout=1800)
        assert standin.returncode == 0, standin.stderr[-2000:]
    command, env = build_command()
    build = subprocess.run(
        [*command, "--network", "host", "--build-arg", f"BASE_IMAGE={BASE}",
         "-f", "docker/trainer-gpu.Dockerfile", "-t", IMAGE, "."],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=5000,
    )  # fmt: skip
    assert build.returncode == 0, (build.stdout + build.stderr)[-4000:]
    # the build's own check line: torch's CUDA build (the build stops on any other)
    assert re.search(r"torch 2\.13\.0\S* CUDA 13\.\d", build.stdout + build.stderr)
    return IMAGE


def in_image(image: str, *args: str, entrypoint: str = LAUNCH, mounts=(), timeout=600):
    volumes = [arg for mount in mounts for arg in ("-v", mount)]
    return sh("docker", "run", "--rm", "--network", "none", *volumes, "--entrypoint",
              entrypoint, image, *args, timeout=timeout)  # fmt: skip


def test_the_image_holds_the_gpu_set(image):
    probe = (
        "import json, torch, vllm, trl, deepspeed, transformers;"
        "print(json.dumps([torch.__version__, torch.version.cuda, vllm.__version__,"
        " trl.__version__, deepspeed.__version__, transformers.__version__]))"
    )
    done = in_image(image, "-c", probe, entrypoint="python")
    assert done.returncode == 0, done.stderr[-2000:]
    torch, cuda, vllm, trl, deepspeed, transformers = json.loads(done.stdout.splitlines()[-1])
    assert torch.startswith("2.13.0") and "+cpu" not in torch and cuda.startswith("13.")
    assert (vllm, trl, deepspeed, transformers) == ("0.31.0", "1.16.0", "0.19.8", "5.17.0")
    user = sh("docker", "image", "inspect", "--format", "{{.Config.User}}", image)
    assert user.stdout.strip() == "hdr"


def test_train_help_and_plan_memory_run_inside(image):
    done = in_image(image, "train", "--help")
    assert done.returncode == 0 and "Usage: hdr train" in done.stdout, done.stderr[-2000:]
    plan = in_image(image, "plan-memory", "--config", "/app/configs/search-r1-qwen2.5-3b.yaml",
                    "--gpu-gb", "80", "--gpus", "8")  # fmt: skip
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert "| DDP gradient buckets (fp32; the gradients are views into them)" in plan.stdout
    assert "peak: rollout, 73.2 GiB of 76.0 usable" in plan.stdout


def test_nothing_mounted_is_refused_in_one_line_and_so_is_missing_data(
    image, qwen_policy_dir, tmp_path
):
    """The entrypoint as compose runs it (no retrieval server needed: the model and the data
    are checked first). No model at /models/policy: one `hdr: error:` line, exit 2; a model
    mounted but no Search-R1 data at /runs/data/searchr1: the same for the data file."""
    policy = tmp_path / "policy"  # readable by the image's user (pytest's folders are 0700)
    shutil.copytree(qwen_policy_dir, policy)
    for path in [policy, *policy.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    done = in_image(image, entrypoint="/app/docker/trainer-entrypoint.sh")
    assert done.returncode == 2, done.stdout + done.stderr
    errors = [x for x in done.stderr.splitlines() if x.startswith("hdr: error:")]
    assert errors == [done.stderr.strip().splitlines()[-1]]
    assert errors[0].startswith("hdr: error: no model at /models/policy")
    with_model = in_image(image, entrypoint="/app/docker/trainer-entrypoint.sh",
                          mounts=[f"{policy}:/models/policy:ro"])  # fmt: skip
    assert with_model.returncode == 2, with_model.stdout + with_model.stderr
    last = with_model.stderr.strip().splitlines()[-1]
    assert last == "hdr: error: dataset file not found: data/searchr1/train.parquet"


def test_the_size_docs_stack_md_reports(image):
    size = int(sh("docker", "image", "inspect", "--format", "{{.Size}}", image).stdout) / 1e9
    print(f"\n{image}: {size:.2f} GB")
    stated = re.search(r"GPU image \(`hdr-trainer:gpu`\) is\s+([\d.]+) GB", DOCS.read_text())
    assert stated, "docs/stack.md does not state the GPU image's size"
    assert abs(float(stated[1]) - size) <= 0.1 * size, (stated[1], size)
