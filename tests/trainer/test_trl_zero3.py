"""hdr's scoring inside TRL on two processes under accelerate + DeepSpeed ZeRO-3 (CPU, gloo).

The DeepSpeed settings are configs/trl/accelerate-zero3.yaml's (stage 3, no offload, zero.Init,
16-bit save) with the sizes scaled to a tiny model: `stage3_param_persistence_threshold`,
`stage3_max_reuse_distance` and `stage3_prefetch_bucket_size` 0, so that ZeRO-3 gathers every
module's weights at each call as it must for a 3B model (below those sizes it keeps a tiny
model's weights whole and hides the gathers), and fp32 instead of bf16 on the CPU. accelerate
reads them from the environment `accelerate launch --config_file` sets.

Defect 1 of the TRL review: each process scores its own fresh rows, and the output layer runs
in slices of `HEAD_SLICE` positions, so responses of ~60 tokens on one process and ~700 on the
other made 2 against 22 output-layer calls: ZeRO-3's per-call gathers no longer paired up and
the processes hung or failed. Now every process runs as many forwards and slices as the
busiest one.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from servers import free_port

pytest.importorskip("deepspeed")
pytest.importorskip("trl")

TIMEOUT_S = 240  # a hang guard: a loaded 2-core machine needs a minute to start two ranks
RESPONSE_TOKENS = (60, 700)  # per process
G = 8


def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "none"},
            "offload_param": {"device": "none"},
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 1_000_000,
    }


def accelerate_env(rank: int, world: int, port: int, ds_json: Path) -> dict[str, str]:
    """What `accelerate launch --config_file` (DeepSpeed, zero3_init_flag) sets per process."""
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds_json),
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_MIXED_PRECISION": "no",
        "OMP_NUM_THREADS": "1",
    }  # fmt: skip


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def fresh_rows(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two groups of G rows: a 12-token prompt, then RESPONSE_TOKENS[rank] policy tokens."""
    g = torch.Generator().manual_seed(100 + rank)
    P, C = 12, RESPONSE_TOKENS[rank]
    ids = torch.randint(3, 64, (2 * G, P + C), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.zeros(2 * G, P + C)
    mask[:, P:] = 1
    return ids, attn, mask


def _zero3_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(accelerate_env(rank, world, port, Path(out_dir) / "ds.json"))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    from trainer.integrations.accelerate_cpu import allow_deepspeed_on_cpu_processes
    from trainer.integrations.trl import zero3_call_agreement
    from trainer.scoring import stored_groups

    assert allow_deepspeed_on_cpu_processes()
    accelerator = Accelerator()
    assert accelerator.num_processes == world and accelerator.distributed_type == "DEEPSPEED"
    reference = tiny_model()
    ids, attn, mask = fresh_rows(rank)
    rewards = torch.tensor([[1.0, 0.0] * (G // 2)] * 2)
    names = [f"s1/{rank}/{k}" for k in range(2)]
    with torch.no_grad():
        expected, _, _ = stored_groups(
            reference, ids, attn, mask, rewards, rewards, 1, names, 4, 1.0
        )
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, optimizer = accelerator.prepare(model, optimizer)
    sharded = accelerator.unwrap_model(engine)
    assert all(p.numel() == 0 for p in sharded.parameters())  # ZeRO-3 holds shards only
    started = time.perf_counter()
    with torch.no_grad():
        fresh, _, _ = stored_groups(
            sharded, ids, attn, mask, rewards, rewards, 1, names, 4, 1.0,
            agree=zero3_call_agreement(accelerator),
        )  # fmt: skip
    total = accelerator.reduce(torch.tensor([float(len(fresh))]), reduction="sum")
    worst = max(
        float((a.gen_logprobs - b.gen_logprobs).abs().max())
        for a, b in zip(fresh, expected, strict=True)
    )
    Path(out_dir, f"rank-{rank}.json").write_text(
        json.dumps({"groups": float(total), "worst": worst, "s": time.perf_counter() - started})
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _ranked(rank: int, worker, *args) -> None:
    """A rank that hangs prints every thread's Python stack to stderr before it is killed."""
    faulthandler.dump_traceback_later(TIMEOUT_S - 15)
    worker(rank, *args)


def run_ranks(worker, out: Path, nprocs: int = 2) -> None:
    """`worker(rank, nprocs, port, out)` on spawned ranks, killed after TIMEOUT_S (as
    test_distributed's run_ranks)."""
    ctx = mp.start_processes(
        _ranked, args=(worker, nprocs, free_port(), str(out)), nprocs=nprocs, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            alive = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
            for rank in alive:
                ctx.processes[rank].kill()
            raise AssertionError(f"rank(s) {alive} did not finish within {TIMEOUT_S} s")


def test_zero3_scoring_of_uneven_responses_pairs_every_gather(tmp_path):
    """60 against 700 response tokens per process: both finish, with the log-probs of the
    unsharded model (defect 1; before the fix the processes hung in ZeRO-3's gathers)."""
    (tmp_path / "ds.json").write_text(json.dumps(ds_config()))
    run_ranks(_zero3_worker, tmp_path)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["groups"] for r in ranks] == [4.0, 4.0]
    assert all(r["worst"] < 1e-5 for r in ranks), ranks
