"""A SIGTERM that reaches ONE of two processes (gloo on 127.0.0.1) stops both after the same
step, with one checkpoint of that step holding both ranks' RNG states, and both exit on their
own. Each process runs real DDP updates on a tiny Llama between `StopSignals.check` calls, as
`train_steps` does; the signal is a real one, delivered to rank 1 in the middle of step 2.
(`hdr train` under torchrun with a SIGTERMed worker: test_distributed_train.py, slow.)"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as torch_dist
from conftest import tiny_llama
from test_distributed import bare_run, make_groups, run_ranks, small_config

from core.errors import RunInterrupted
from headroom_drift import assemble_batch
from trainer import distributed
from trainer.checkpoint import list_checkpoints, open_checkpoint
from trainer.run import StopSignals
from trainer.telemetry import RunLogs
from trainer.update import update_policy

SIGNALLED_RANK, SIGNALLED_STEP = 1, 2


def _worker(rank: int, world: int, port: int, run_dir: str) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    dist = distributed.Dist(rank=rank, world=world, owns_group=True)
    model = tiny_llama(seed=0)
    logs = RunLogs(Path(run_dir), tensorboard=False) if rank == 0 else None
    run = bare_run(dist, small_config(), model, Path(run_dir), logs)
    result = {"rank": rank, "steps_started": []}
    with StopSignals() as stop:
        try:
            for step in range(1, 10):
                result["steps_started"].append(step)
                fresh = make_groups(model, step, count=4, seed=step)
                update_policy(run, assemble_batch(fresh, []))
                if rank == SIGNALLED_RANK and step == SIGNALLED_STEP:
                    os.kill(os.getpid(), signal.SIGTERM)  # mid-step, as a scheduler would
                stop.check(run, step)
        except RunInterrupted as err:
            result |= {"stopped": str(err), "exit_code": err.exit_code}
        finally:
            result["own_signal"] = stop.signum
            distributed.shutdown(dist)  # as `train` does: no rank leaves before the checkpoint
    Path(run_dir, f"rank-{rank}.json").write_text(json.dumps(result))


def test_sigterm_to_one_rank_stops_both_after_the_same_step_with_one_checkpoint(tmp_path):
    run_ranks(_worker, tmp_path)  # both stop within the bound and leave on their own (exit 0)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    # only rank 1 received the signal; both stopped after step 2 and began no further step
    assert [r["own_signal"] for r in ranks] == [None, signal.SIGTERM]
    assert [r["steps_started"] for r in ranks] == [[1, 2], [1, 2]]
    assert [r["exit_code"] for r in ranks] == [128 + signal.SIGTERM] * 2
    for r in ranks:
        assert r["stopped"].startswith(f"stopped by SIGTERM after step {SIGNALLED_STEP} of 10;")
    # one checkpoint, of that step, written whole by rank 0 with both ranks' RNG states
    assert [step for step, _ in list_checkpoints(tmp_path / "checkpoints")] == [SIGNALLED_STEP]
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.step == SIGNALLED_STEP
    assert sorted(p.name for p in (ckpt.path / "rng").glob("rank-*.json")) == [
        "rank-0.json",
        "rank-1.json",
    ]
    assert f"checkpoint {ckpt.path}" in ranks[0]["stopped"]
