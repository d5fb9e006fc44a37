"""A run stopped by a signal, or by a missing server, always leaves a state the user can
continue from, and says how (the real `hdr train`, in subprocesses)."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import TINY_CPU, tiny_overrides
from servers import free_port

from agent_env.policy_settings import SETTINGS_FILE
from trainer.checkpoint import open_checkpoint

HDR = [sys.executable, "-m", "hdr.cli"]


def env(**extra: str) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def steps_logged(run_dir) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.timeout(1800)  # a shared, loaded machine: the run, its checkpoint, the resume
# SIGTERM in the slow suite: the default run meets it in the stack tests' host trainer
# (tests/stack/test_stack_trainer_restart_host.py), the same stop and checkpoint path
@pytest.mark.parametrize(
    "sig",
    [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.slow)],
    ids=["SIGINT", "SIGTERM"],
)
def test_a_signal_stops_after_the_step_with_a_checkpoint_that_resume_continues(
    sig, sft_policy, small_qa, retrieval_url, tmp_path
):
    out = tmp_path / "run"
    overrides = tiny_overrides(
        retrieval_url, sft_policy, small_qa, out,
        "steps=500", "checkpoint.save_every=100", "log.progress=true",
    )  # fmt: skip
    command = [*HDR, "train", "--config", str(TINY_CPU), *overrides]
    # stderr is a file, as in a log: progress must come as plain lines (every 0 s here)
    log = tmp_path / "stderr.log"
    with log.open("w") as sink:
        proc = subprocess.Popen(command, env=env(HDR_PROGRESS_INTERVAL="0"), stderr=sink)
        deadline = time.monotonic() + 900
        while len(steps_logged(out)) < 2:  # stop at step 2 or later, long before a checkpoint
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(sig)
        proc.wait(timeout=900)
    stderr = log.read_text()
    assert proc.returncode == 128 + sig, stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith(f"hdr: stopped: stopped by {sig.name} after step "), last
    assert f"continue with: hdr train --resume {out}" in last
    assert "Traceback" not in stderr

    # progress in a file: whole lines, no carriage returns, no third-party loading bars
    assert "\r" not in stderr and "Loading weights" not in stderr
    assert "train headroom_drift: 0/500" in stderr
    assert "step 0 held-out (4 questions): Mean@2" in stderr  # scores printed as computed
    assert "step 2 held-out" in stderr

    ckpt = open_checkpoint(out)
    assert ckpt.step >= 2 and steps_logged(out) == list(range(1, ckpt.step + 1))
    assert (ckpt.model_dir / SETTINGS_FILE).is_file()  # the prompt travels with the model

    again = subprocess.run(command, env=env(), capture_output=True, text=True)
    assert again.returncode == 2
    assert again.stderr.strip().splitlines() == [
        f"hdr: error: run directory {out} already holds a run (checkpoint at step {ckpt.step});"
        f" continue it with `hdr train --resume {out}`, start it over with --force, or"
        " choose another out_dir"
    ]

    resume = [*HDR, "train", "--resume", str(out), f"steps={ckpt.step + 1}", "log.progress=false"]
    done = subprocess.run(resume, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert steps_logged(out) == list(range(1, ckpt.step + 2))
    assert (out / "final" / "config.json").is_file() and (out / "final" / SETTINGS_FILE).is_file()


def test_no_server_is_one_line_and_the_same_command_runs_again(sft_policy, small_qa, tmp_path):
    """Case 3 of the first hour: no server listening. `hdr train` and `hdr sft` say so in one
    line at once (the default outage grace, minutes, is for a server that restarts mid-run,
    not for one that was never started); nothing is written, so the same command runs again."""
    out, url = tmp_path / "run", f"http://127.0.0.1:{free_port()}"
    overrides = tiny_overrides(url, sft_policy, small_qa, out)
    train = [*HDR, "train", "--config", str(TINY_CPU), *overrides]
    sft = [*HDR, "sft", "--config", str(TINY_CPU), *overrides, f"model.path={tmp_path / 'sft'}"]
    for command in (train, train, sft):
        started = time.monotonic()
        result = subprocess.run(command, env=env(), capture_output=True, text=True)
        assert result.returncode == 2, result.stderr
        assert time.monotonic() - started < 120  # far inside the 300 s grace: it did not wait
        lines = result.stderr.strip().splitlines()
        errors = [x for x in lines if x.startswith("hdr: error: ")]
        assert errors == lines[-1:], result.stderr  # one error line, the last
        assert f"no retrieval server answers at {url}" in errors[0]
        assert "Traceback" not in result.stderr
    assert not out.exists() and not (tmp_path / "sft").exists()


def test_the_stop_handler_imports_nothing():
    """A signal can land while `hdr train` imports (transformers, in a run's first seconds), and
    Python 3.11's import lock then breaks with a KeyError if the handler imports too. In a fresh
    interpreter, the handler's first call imports nothing and still says it is stopping."""
    probe = (
        "import builtins, signal\n"
        "from trainer.run import StopSignals\n"
        "seen = []\n"
        "real = builtins.__import__\n"
        "builtins.__import__ = lambda name, *a, **k: seen.append(name) or real(name, *a, **k)\n"
        "StopSignals()._handle(signal.SIGTERM, None)\n"
        "builtins.__import__ = real\n"
        "print(seen)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, env=env(), timeout=300
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"
    assert "hdr train: stopping after this step with a checkpoint" in done.stderr
