"""`hdr train` under torchrun with 2 processes (gloo on the CPU) against the same config and
seed in 1 process, on the tiny SFT policy and a real `hdr serve`-equivalent server: the same
prompts and the same replay set each step, the same weights after 3 steps within float
tolerance. Then one rank SIGKILLed mid-run: the job fails (no hang), and resuming continues
exactly under 2 processes and within float tolerance under 1. Slow: five training jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_CPU, replay_state, same_state, tiny_overrides
from processes import alive, children
from safetensors.torch import load_file

from trainer.checkpoint import list_checkpoints, open_checkpoint

pytestmark = pytest.mark.slow

JOB_TIMEOUT_S = 900  # one training job; a hang guard, generous for a loaded 2-core machine
FAIL_TIMEOUT_S = 120  # from the SIGKILL to the whole job's exit
STEPS = 3

EXACT_KEYS = [  # what a resumed run under the same world size reproduces bit for bit
    "reward_mean",
    "em_mean",
    "entropy",
    "loss",
    "grad_norm",
    "fresh_tokens",
    "replay_tokens",
    "fresh_group_ids",
    "replayed_group_ids",
    "scanned_groups",
    "drift_scanned_q",
    "headroom_stored",
    "headroom_refreshed",
    "replay_ages",
    "buffer_size",
    "env_calls",
    "env_calls_total",
]


def env() -> dict:
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "GLOO_SOCKET_IFNAME": "lo",  # collectives stay on the loopback
    }


def hdr(*args: str) -> list[str]:
    return [sys.executable, "-m", "hdr.cli", *args]


def torchrun(nproc: int, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "hdr.cli",
        *args,
    ]


def rows(run_dir: Path, name: str = "metrics") -> list[dict]:
    return [json.loads(x) for x in (run_dir / f"{name}.jsonl").read_text().splitlines()]


def weights(run_dir: Path, step: int | None = None) -> dict[str, torch.Tensor]:
    where = run_dir / "final" if step is None else run_dir / "checkpoints" / f"step-{step:06d}"
    return load_file(where / ("model.safetensors" if step is None else "model/model.safetensors"))


def worker_pids(agent_pid: int) -> dict[int, int]:
    """rank -> pid of torchrun's worker processes (its children, with RANK in their env)."""
    out = {}
    for pid in children(agent_pid):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"RANK="):
                out[int(item[5:])] = pid
    return out


@pytest.fixture(scope="module")
def runs(sft_policy, small_qa, retrieval_url, tmp_path_factory):
    root = tmp_path_factory.mktemp("distributed")

    def train_args(out: Path) -> list[str]:
        return [
            "train",
            "--config",
            str(TINY_CPU),
            *tiny_overrides(
                retrieval_url,
                sft_policy,
                small_qa,
                out,
                f"steps={STEPS}",
                "distributed.rollout_shards=2",
                "eval.every=3",
                "eval.at_start=false",
                "checkpoint.keep_last=3",
            ),
        ]

    one, two, cut = root / "one", root / "two", root / "cut"
    subprocess.run(hdr(*train_args(one)), env=env(), check=True, timeout=JOB_TIMEOUT_S)
    subprocess.run(torchrun(2, *train_args(two)), env=env(), check=True, timeout=JOB_TIMEOUT_S)

    job = subprocess.Popen(torchrun(2, *train_args(cut)), env=env())
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while not list_checkpoints(cut / "checkpoints"):
        assert job.poll() is None, "the job ended before its first checkpoint was seen"
        assert time.monotonic() < deadline
        time.sleep(0.02)
    pids = worker_pids(job.pid)
    assert sorted(pids) == [0, 1]
    os.kill(pids[1], signal.SIGKILL)
    killed = time.monotonic()
    code = job.wait(timeout=FAIL_TIMEOUT_S)
    failed_after = time.monotonic() - killed
    survivors = [pid for pid in pids.values() if alive(pid)]
    killed_at = open_checkpoint(cut).step
    assert killed_at < STEPS, "the job finished before a rank could be killed"

    cut1 = root / "cut1"  # the same checkpoint, resumed by one process
    shutil.copytree(cut, cut1)
    resume_two = torchrun(2, "train", "--resume", str(cut))
    subprocess.run(resume_two, env=env(), check=True, timeout=JOB_TIMEOUT_S)
    resume_one = hdr("train", "--resume", str(cut1))
    subprocess.run(resume_one, env=env(), check=True, timeout=JOB_TIMEOUT_S)
    return {
        "one": one,
        "two": two,
        "cut": cut,
        "cut1": cut1,
        "code": code,
        "failed_after": failed_after,
        "survivors": survivors,
        "killed_at": killed_at,
        "start": sft_policy,
    }


def test_two_processes_draw_the_same_prompts_and_replay_as_one(runs):
    one, two = rows(runs["one"]), rows(runs["two"])
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))  # rank 0 alone logs
    assert [r["world_size"] for r in two] == [2] * STEPS
    for a, b in zip(one, two, strict=True):
        assert a["fresh_group_ids"] == b["fresh_group_ids"]  # same prompts, same step index
        assert a["replayed_group_ids"] == b["replayed_group_ids"]
        assert a["fresh_tokens"] == b["fresh_tokens"]  # the same sampled trajectories
        assert a["env_calls"] == b["env_calls"]
        assert a["reward_mean"] == pytest.approx(b["reward_mean"], abs=1e-12)
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-4, abs=1e-6)
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4)
    assert any(r["replayed_group_ids"] for r in one), "nothing was replayed: nothing shown"
    assert len(rows(runs["two"], "eval")) == 1  # evaluated once, by rank 0


def test_two_processes_reach_the_same_weights(runs):
    a, b = weights(runs["one"]), weights(runs["two"])
    assert a.keys() == b.keys()
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-5), name
    start = load_file(Path(runs["start"]) / "model.safetensors")
    assert any(not torch.equal(a[k], start[k]) for k in a)  # weights did move during training


def test_a_killed_rank_fails_the_job_without_a_hang(runs):
    assert runs["code"] != 0
    assert runs["failed_after"] < FAIL_TIMEOUT_S
    assert runs["survivors"] == []


def test_resume_under_the_same_world_size_is_exact(runs):
    two, cut, k = rows(runs["two"]), rows(runs["cut"]), runs["killed_at"]
    assert [r["step"] for r in cut] == list(range(1, STEPS + 1))
    for a, b in zip(two[k:], cut[k:], strict=True):
        assert {key: a[key] for key in EXACT_KEYS} == {key: b[key] for key in EXACT_KEYS}
    a, b = weights(runs["two"], STEPS), weights(runs["cut"], STEPS)
    assert all(torch.equal(a[name], b[name]) for name in a)
    ca, cb = (runs[n] / "checkpoints" / f"step-{STEPS:06d}" for n in ("two", "cut"))
    assert same_state(replay_state(ca), replay_state(cb))
    assert sorted(p.name for p in (cb / "rng").iterdir()) == [
        "rank-0.json",
        "rank-0.safetensors",
        "rank-1.json",
        "rank-1.safetensors",
    ]


def test_resume_under_one_process_continues(runs):
    two, cut1, k = rows(runs["two"]), rows(runs["cut1"]), runs["killed_at"]
    for a, b in zip(two[k:], cut1[k:], strict=True):
        assert a["fresh_group_ids"] == b["fresh_group_ids"]
        assert a["replayed_group_ids"] == b["replayed_group_ids"]
        assert a["fresh_tokens"] == b["fresh_tokens"]
        assert b["world_size"] == 1
    a, b = weights(runs["two"]), weights(runs["cut1"])
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=1e-4, atol=1e-5), name


def test_sigterm_to_one_worker_stops_the_job_after_a_step_with_its_checkpoint(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    """`hdr train` under torchrun; one worker (rank 1) gets SIGTERM after step 1 was logged.
    Both ranks agree at the next step boundary, rank 0 writes that step's checkpoint (with
    both ranks' RNG states), and the job ends by itself: no rank is SIGKILLed, and no rank
    leaves before the checkpoint is whole (torchrun stops the others 30 s after one exits)."""
    out = tmp_path / "stopped"
    args = [
        "train",
        "--config",
        str(TINY_CPU),
        *tiny_overrides(
            retrieval_url, sft_policy, small_qa, out, "steps=40", "distributed.rollout_shards=2",
            "eval.every=0", "eval.at_start=false", "checkpoint.save_every=0",
        ),
    ]  # fmt: skip
    log = tmp_path / "stderr.log"
    with log.open("w") as sink:
        job = subprocess.Popen(torchrun(2, *args), env=env(), stderr=sink)
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while not (out / "metrics.jsonl").is_file() or not rows(out):
            assert job.poll() is None, log.read_text()
            assert time.monotonic() < deadline
            time.sleep(0.05)
        pids = worker_pids(job.pid)
        os.kill(pids[1], signal.SIGTERM)
        code = job.wait(timeout=FAIL_TIMEOUT_S)
    stderr = log.read_text()
    stopped = [line for line in stderr.splitlines() if "hdr: stopped: stopped by SIGTERM" in line]
    assert stopped, stderr
    steps = {int(line.split("after step ")[1].split()[0]) for line in stopped}
    (step,) = steps  # every rank that reported names the same step
    assert [s for s, _ in list_checkpoints(out / "checkpoints")] == [step]
    ckpt = open_checkpoint(out)
    assert sorted(p.name for p in (ckpt.path / "rng").glob("*.json")) == [
        "rank-0.json",
        "rank-1.json",
    ]
    assert [r["step"] for r in rows(out)] == list(range(1, step + 1))
    assert "SIGKILL" not in stderr and "Signals.SIGKILL" not in stderr
    assert not any(alive(pid) for pid in pids.values())
    assert code != 0  # torchrun reports the workers' exit code 143 as a failed job
