"""Asynchronous rollout in hdr's loop (trainer/async_rollout/workers.py), with real rollout worker
processes, a real retrieval server and the tiny policy:

- with the queue bound 0 a worker-run training run is the synchronous loop: the same tokens
  bit for bit, losses within 1e-6, the same final weights;
- with the bound 1 later steps' groups arrive one update late; the drift gate measures their
  drift, rejects what is over tau (into the buffer), where a version bound admits them all,
  and the ledger counts the gate's teacher-forced tokens;
- faults: a worker killed mid-run stops the run in one line with its checkpoint intact; a run
  stopped and resumed rolls the steps in flight out again and trains no group twice.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import TINY_CPU, replay_state, tiny_overrides

from core.config import load_config
from core.errors import RunInterrupted, UserError
from trainer.checkpoint import open_checkpoint
from trainer.config import TrainConfig
from trainer.loop import train
from trainer.run import load_train_config

pytestmark = pytest.mark.timeout(1800)


def rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def config(url, model, qa, out, *extra: str) -> TrainConfig:
    overrides = tiny_overrides(
        url, model, qa, out,
        "steps=3", "eval.every=0", "checkpoint.save_every=3",
        "replay.capacity=64", "replay.store_zero_advantage=true",
        *extra,
    )  # fmt: skip
    return load_config(TrainConfig, TINY_CPU, overrides)


def stored_tokens(run_dir: Path) -> list[list[list[int]]]:
    """Every fresh group's token ids, in step order (the buffer of the last checkpoint keeps
    them all: capacity 64, zero-advantage groups too)."""
    return [
        g["tensors"]["input_ids"].tolist()
        for g in replay_state(open_checkpoint(run_dir).path)["groups"]
    ]


WORKER_SETUPS = [
    pytest.param(["async_rollout.workers=1"], id="one-worker"),
    # two workers each rolling out one of every step's two shards, or whole steps in turn
    pytest.param(["async_rollout.workers=2", "async_rollout.split=shards"],
                 id="two-workers-shards", marks=pytest.mark.slow),
    pytest.param(["async_rollout.workers=2", "async_rollout.split=steps"],
                 id="two-workers-steps", marks=pytest.mark.slow),
]  # fmt: skip


@pytest.mark.parametrize("setup", WORKER_SETUPS)
def test_bound_0_with_workers_is_the_synchronous_loop(
    setup, sft_policy, small_qa, retrieval_url, tmp_path
):
    shards = "distributed.rollout_shards=2"
    sync = train(config(retrieval_url, sft_policy, small_qa, tmp_path / "sync", shards))
    worker = train(
        config(retrieval_url, sft_policy, small_qa, tmp_path / "async", shards, *setup,
               "async_rollout.max_lag=0")
    )  # fmt: skip
    a, b = rows(sync), rows(worker)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert any(r["loss"] != 0 for r in a)  # the weights moved: the versions differ
    assert stored_tokens(sync) == stored_tokens(worker)  # the same tokens, bit for bit
    assert len(stored_tokens(sync)) == 3 * 4
    for ra, rb in zip(a, b, strict=True):
        assert abs(ra["loss"] - rb["loss"]) <= 1e-6
        assert ra["reward_mean"] == rb["reward_mean"]
        assert ra["cost_generated_tokens"] == rb["cost_generated_tokens"]
        assert ra["search_calls"] == rb["search_calls"] > 0  # the workers' retrieval counted
        assert rb["rollout_lags"] == [0, 0, 0, 0] and rb["late_groups"] == 0
        assert "rollout_lags" not in ra
    wa = open_checkpoint(sync).model_dir
    wb = open_checkpoint(worker).model_dir
    from safetensors.torch import load_file

    ta, tb = load_file(wa / "model.safetensors"), load_file(wb / "model.safetensors")
    assert max(float((ta[k] - tb[k]).abs().max()) for k in ta) <= 1e-6


@pytest.mark.slow
@pytest.mark.parametrize("rule", ["version_bound", "drift_gate"])
def test_late_groups_pass_the_staleness_rule(rule, sft_policy, small_qa, retrieval_url, tmp_path):
    # tau below any real drift: the drift gate rejects every late group, the bound admits all
    run = train(
        config(retrieval_url, sft_policy, small_qa, tmp_path / rule, "steps=4",
               "async_rollout.workers=1", "async_rollout.max_lag=1",
               f"async_rollout.rule={rule}", "async_rollout.tau=1e-9", "grpo.lr=1e-2")
    )  # fmt: skip
    got = rows(run)
    assert got[0]["rollout_lags"] == [0, 0, 0, 0]  # step 1 waits for nothing to train on
    lags = [lag for r in got for lag in r["rollout_lags"]]
    assert set(lags) <= {0, 1} and 1 in lags
    for r in got:
        late = sum(r["rollout_lags"])
        assert r["late_groups"] == late == len(r["late_drift"])
        assert all(d > 1e-9 for d in r["late_drift"])  # the weights moved under them
        assert (r["cost_gate_tf_tokens"] > 0) == (late > 0)
        trained = len(r["fresh_group_ids"])
        if rule == "version_bound":
            assert r["late_admitted"] == late and trained == 4
            assert r["staleness_tau"] is None
        else:
            assert r["late_admitted"] == 0 and r["late_to_buffer"] == late
            assert trained == 4 - late and r["staleness_tau"] == 1e-9


def test_steps_are_dealt_round_robin_or_shared():
    from trainer.async_rollout.workers import responsible

    assert [responsible("steps", 2, 3, s) for s in (3, 4, 5)] == [{0}, {1}, {0}]
    assert responsible("shards", 3, 1, 7) == {0, 1, 2}


def kill_worker_after_step(run_dir: Path, step: int, killed: list) -> None:
    deadline = time.monotonic() + 900
    while len(rows(run_dir)) < step and time.monotonic() < deadline:
        time.sleep(0.02)
    workers = [p for p in multiprocessing.active_children() if p.name.startswith("hdr-rollout")]
    for proc in workers:
        os.kill(proc.pid, signal.SIGKILL)
        killed.append(proc.pid)


def test_a_killed_worker_stops_the_run_in_one_line_with_its_checkpoint(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    out = tmp_path / "run"
    cfg = config(retrieval_url, sft_policy, small_qa, out, "steps=8",
                 "checkpoint.save_every=1", "async_rollout.workers=1",
                 "async_rollout.max_lag=1")  # fmt: skip
    killed: list[int] = []
    watcher = threading.Thread(target=kill_worker_after_step, args=(out, 1, killed))
    watcher.start()
    with pytest.raises(UserError) as raised:
        train(cfg)
    watcher.join()
    message = str(raised.value)
    assert killed and "\n" not in message
    done = len(rows(out))
    assert done < 8
    assert f"step {done + 1} stopped: rollout worker 0 ended before delivering step" in message
    assert f"(pid {killed[0]}, killed by SIGKILL)" in message
    assert f"last checkpoint: step {done}; continue with --resume {out}" in message
    assert open_checkpoint(out).step == done  # every logged step whole, its checkpoint intact
    assert [r["step"] for r in rows(out)] == list(range(1, done + 1))
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("hdr-rollout")]


def test_workers_that_do_not_start_in_time_are_stopped(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    """A start that fails (here: the workers are not ready within the start timeout) stops
    the workers already spawned, in one line; none is left running beside the trainer."""
    cfg = config(retrieval_url, sft_policy, small_qa, tmp_path / "run",
                 "async_rollout.workers=1", "async_rollout.start_timeout_s=0.01")  # fmt: skip
    with pytest.raises(UserError, match="rollout workers not ready after 0 s"):
        train(cfg)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("hdr-rollout")]


def stop_after_step(run_dir: Path, step: int) -> None:
    deadline = time.monotonic() + 900
    while len(rows(run_dir)) < step and time.monotonic() < deadline:
        time.sleep(0.02)
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.slow
def test_resume_rolls_the_steps_in_flight_out_again_and_trains_no_group_twice(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    out = tmp_path / "run"
    cfg = config(retrieval_url, sft_policy, small_qa, out, "steps=6",
                 "checkpoint.save_every=0", "async_rollout.workers=1",
                 "async_rollout.max_lag=1", "async_rollout.rule=adaptive_drift_gate",
                 "async_rollout.tau=1e-3", "async_rollout.adaptive_gate.target=0.5")  # fmt: skip
    stopper = threading.Thread(target=stop_after_step, args=(out, 2))
    stopper.start()
    with pytest.raises(RunInterrupted):
        train(cfg)
    stopper.join()
    ckpt = open_checkpoint(out)
    first = rows(out)
    assert ckpt.step == len(first) >= 2
    saved = torch.load(ckpt.path / "replay.pt", weights_only=True)  # the lifecycle's state
    tau_after = saved["late_gate"]["tau"]
    assert tau_after != 1e-3  # the late groups moved the adaptive tau

    resumed = train(load_train_config(None, ["steps=6"], str(out)), resume=out)
    got = rows(resumed)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    assert got[: ckpt.step] == first  # the steps before the checkpoint are kept as logged
    nxt = got[ckpt.step]
    # step ckpt+1 was in flight when the run stopped: re-rolled from the checkpoint's weights
    assert nxt["rollout_lags"] == [0, 0, 0, 0]
    assert nxt["staleness_tau"] == pytest.approx(tau_after)  # the gate resumed where it was
    ids = [i for r in got for i in r["fresh_group_ids"]]
    assert len(ids) == len(set(ids))  # no fresh group trained twice
    assert torch.isfinite(torch.tensor([r["loss"] for r in got])).all()


def stop_server_after_step(server, run_dir: Path, step: int, then: threading.Event) -> None:
    deadline = time.monotonic() + 900
    while len(rows(run_dir)) < step and time.monotonic() < deadline:
        time.sleep(0.02)
    server.stop()
    then.set()


def outage_config(url, model, qa, out, grace_s: float) -> TrainConfig:
    return config(url, model, qa, out, "steps=4", "checkpoint.save_every=1",
                  "async_rollout.workers=1", "async_rollout.max_lag=1",
                  "retrieval.max_retries=2", "retrieval.backoff_s=0.05",
                  "retrieval.backoff_max_s=0.2", f"retrieval.outage_grace_s={grace_s}")  # fmt: skip


@pytest.mark.slow
def test_a_worker_waits_out_a_retrieval_outage_and_the_run_completes(
    small_index, sft_policy, small_qa, tmp_path
):
    from servers import running_server

    out, stopped, restarted = tmp_path / "run", threading.Event(), []

    def outage(server, port: int) -> None:
        stop_server_after_step(server, out, 1, stopped)
        time.sleep(8.0)
        restarted.append(running_server(small_index, port=port))
        restarted[0].__enter__()  # the same URL again

    with running_server(small_index) as first:
        port = int(first.url.rsplit(":", 1)[1])
        cfg = outage_config(first.url, sft_policy, small_qa, out, grace_s=300)
        worker = threading.Thread(target=outage, args=(first, port), daemon=True)
        worker.start()
        try:
            run_dir = train(cfg)
        finally:
            worker.join(timeout=120)
            if restarted:
                restarted[0].__exit__(None, None, None)
    got = rows(run_dir)
    assert stopped.is_set() and [r["step"] for r in got] == [1, 2, 3, 4]
    # the worker's client paused (its counters join the run's) and nothing was lost
    assert sum(r["retrieval_outages"] for r in got) >= 1
    assert sum(r["retrieval_outage_s"] for r in got) >= 2
    assert all(r["dropped_groups"] == 0 and r["retrieval_failed_queries"] == 0 for r in got)


@pytest.mark.slow
def test_past_the_grace_an_async_run_stops_in_one_line_with_its_checkpoint(
    small_index, sft_policy, small_qa, tmp_path
):
    from servers import running_server

    out, stopped = tmp_path / "run", threading.Event()
    with running_server(small_index) as server:
        cfg = outage_config(server.url, sft_policy, small_qa, out, grace_s=2)
        watcher = threading.Thread(
            target=stop_server_after_step, args=(server, out, 1, stopped), daemon=True
        )
        watcher.start()
        with pytest.raises(UserError) as raised:
            train(cfg)
        watcher.join(timeout=60)
    message = str(raised.value)
    done = len(rows(out))
    assert "\n" not in message and done < 4
    assert "no retrieval server answered for 2 s (retrieval.outage_grace_s)" in message
    assert f"step {done + 1} stopped:" in message
    assert f"last checkpoint: step {done}; continue with --resume {out}" in message
    assert open_checkpoint(out).step == done
