"""The distributed replay-and-update protocol (trainer/distributed.py) on 2 real processes
(torch.multiprocessing, gloo on 127.0.0.1) against the same code in one process: the scan
scored across ranks admits the same groups, and DDP's update on the round-robin share of
fresh + replayed groups leaves the same weights. A real tiny Llama, a buffer of groups the
model itself scored; no server (the end-to-end `hdr train` runs are test_distributed_train.py).
"""

from __future__ import annotations

import faulthandler
import json
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as torch_dist
import torch.multiprocessing as mp
from conftest import tiny_llama
from servers import free_port

from core.errors import UserError
from headroom_drift import GroupReplay, GroupTensors, assemble_batch, make_group
from trainer import distributed, fresh
from trainer.checkpoint import Checkpoint, TrainState, capture_rng, save_checkpoint
from trainer.config import TrainConfig
from trainer.run import Run, build_optimizer
from trainer.scoring import score_groups
from trainer.update import update_policy

STEPS = 3
TIMEOUT_S = 480  # a hang guard; a loaded 2-core machine needs minutes to start torch twice


def small_config(reuse_scan_forward: bool = False) -> TrainConfig:
    return TrainConfig.model_validate(
        {
            "model": {"path": "unused"},
            "steps": 10,
            "grpo": {
                "batch_prompts": 4,
                "group_size": 3,
                "lr": 3e-3,
                "warmup_steps": 0,
                "micro_batch": 4,
                "score_chunk": 5,
            },
            "replay": {
                "budget": 3,
                "capacity": 12,
                "tau": 0.05,
                "scan_chunk": 2,
                "reuse_scan_forward": reuse_scan_forward,
            },
        }
    )


def make_groups(model, step: int, count: int, seed: int) -> list:
    """`count` groups of random token sequences: gen log-probs from `model` (the behaviour
    policy), hand-set rewards that differ inside each group."""
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for k in range(count):
        G, T = 3, 6 + k % 3
        ids = torch.randint(1, 64, (G, T), generator=gen)
        attn = torch.ones(G, T, dtype=torch.long)
        attn[0, :2] = 0  # left padding on one row
        mask = torch.zeros(G, T)
        mask[:, 3:] = 1.0
        rewards = torch.tensor([1.0, 0.0, float(k % 2)])
        adv = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
        lp = score_groups(model, [_Rows(ids, attn, mask)])[0]  # (G, T), 0 off the mask
        tensors = GroupTensors(ids, attn, mask, lp, rewards, adv)
        groups.append(make_group(f"s{step}/{k}", tensors, step))
    return groups


class _Rows:
    """The fields `score_groups` reads, for groups not yet made."""

    def __init__(self, ids, attn, mask):
        self.input_ids, self.attention_mask, self.loss_mask = ids, attn, mask


def bare_run(dist: distributed.Dist, config: TrainConfig, model, run_dir=Path("."), logs=None):
    """A Run of `model` with no generator, server or data: what the protocol's update, replay
    scoring and checkpoints touch."""
    optimizer, scheduler = build_optimizer(model, config)
    return Run(
        config=config,
        run_dir=run_dir,
        model=model,
        tokenizer=None,
        optimizer=optimizer,
        scheduler=scheduler,
        replay=config.make_replay(),
        generator=None,
        client=None,
        train_examples=[],
        eval_examples=[],
        logs=logs or distributed.SilentLogs(),
        dist=dist,
        policy=distributed.wrap_policy(model, dist),
    )


def run_protocol(dist: distributed.Dist, reuse_scan_forward: bool = False) -> dict:
    """STEPS steps of: make fresh groups, select (headroom_drift) with the split scorer,
    update on fresh + replayed, ingest. Returns what a comparison needs, and the rows the
    model forwarded in each update."""
    config = small_config(reuse_scan_forward)
    model = tiny_llama(seed=0)
    forwarded = []
    model.model.register_forward_pre_hook(
        lambda module, args, kwargs: forwarded.append(len(kwargs["input_ids"])), with_kwargs=True
    )
    run = bare_run(dist, config, model)
    selected, scanned, grad_norms, losses, update_rows = [], [], [], [], []
    for step in range(1, STEPS + 1):
        fresh = make_groups(model, step, count=4, seed=step)
        selection = run.replay.select(step, run.score)
        dist.agree([g.group_id for g in selection.groups], "selection")
        forwarded.clear()
        batch = assemble_batch(fresh, selection.groups)
        update = update_policy(run, batch, scanned=run.scan_graphs(selection))
        update_rows.append(sum(forwarded))
        run.replay.ingest(fresh)
        selected.append([g.group_id for g in selection.groups])
        scanned.append(selection.scanned)
        grad_norms.append(update.grad_norm)
        losses.append(update.loss)
    return {
        "selected": selected,
        "scanned": scanned,
        "grad_norms": grad_norms,
        "losses": losses,
        "update_rows": update_rows,
        "weights": {k: v.tolist() for k, v in model.state_dict().items()},
        "buffer_headroom": [g.headroom for g in run.replay.buffer],
        **gradient_memory(model, run.policy),
    }


def gradient_memory(model, policy) -> dict:
    """Where the gradients live after the last update: how many are None, how many distinct
    storages the others view, and (under DDP) the reducer's bucket sizes in bytes."""
    grads = [p.grad for p in model.parameters()]
    storages = {g.untyped_storage().data_ptr() for g in grads if g is not None}
    out = {"params": len(grads), "grads_none": sum(g is None for g in grads),
           "grad_storages": len(storages)}  # fmt: skip
    if hasattr(policy, "_get_ddp_logging_data"):
        logged = policy._get_ddp_logging_data()
        out["buckets"] = [int(x) for x in logged["rebuilt_bucket_sizes"].split(",")]
    return out


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    torch_dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    dist = distributed.Dist(rank=rank, world=world, owns_group=True)
    try:
        result = run_protocol(dist)
        try:  # what a selector that is not deterministic across ranks meets
            dist.agree(rank, "a value each rank holds differently")
            result["refused"] = None
        except UserError as err:
            result["refused"] = str(err)
        Path(out_dir, f"rank-{rank}.json").write_text(json.dumps(result))
    finally:
        distributed.shutdown(dist)


def _ranked(rank: int, worker, *args) -> None:
    """One rank as `run_ranks` starts it: should it hang, every thread's Python stack reaches
    stderr (shown with the failure) shortly before the rank is killed."""
    faulthandler.dump_traceback_later(TIMEOUT_S - 15)
    worker(rank, *args)


def run_ranks(worker, out: Path, *args, nprocs: int = 2) -> None:
    """Run `worker(rank, nprocs, port, out, *args)` on `nprocs` spawned ranks; a rank still
    alive after TIMEOUT_S is killed and fails the test, as does one that did not exit 0
    (torch's `join` raises with its traceback)."""
    ctx = mp.start_processes(
        _ranked,
        args=(worker, nprocs, free_port(), str(out), *args),
        nprocs=nprocs,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            alive = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
            for rank in alive:
                ctx.processes[rank].kill()
            raise AssertionError(
                f"rank(s) {alive} did not finish within {TIMEOUT_S} s (stacks: stderr)"
            )


@pytest.fixture(scope="module")
def two_and_one(tmp_path_factory):
    out = tmp_path_factory.mktemp("dist")
    run_ranks(_worker, out)
    ranks = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]
    return ranks, run_protocol(distributed.Dist())


def test_selection_is_one_global_decision(two_and_one):
    (r0, r1), one = two_and_one
    assert r0["selected"] == r1["selected"] == one["selected"]
    assert r0["scanned"] == one["scanned"]
    assert any(one["selected"][1:]), "nothing was replayed: the test shows nothing"
    # the gate rejected something, so the decision depended on the scores
    assert sum(one["scanned"]) > sum(len(s) for s in one["selected"])
    assert r0["buffer_headroom"] == pytest.approx(one["buffer_headroom"], abs=1e-6)


def test_update_matches_one_process(two_and_one):
    (r0, r1), one = two_and_one
    assert r0["weights"] == r1["weights"]  # DDP keeps the replicas identical
    assert r0["grad_norms"] == pytest.approx(one["grad_norms"], rel=1e-5)
    assert r0["losses"] == pytest.approx(one["losses"], rel=1e-5, abs=1e-7)
    for name, w in one["weights"].items():
        a, b = torch.tensor(w), torch.tensor(r0["weights"][name])
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name
    start = tiny_llama(seed=0).state_dict()
    moved = any(not torch.equal(torch.tensor(one["weights"][k]), start[k]) for k in start)
    assert moved


def test_ddp_gradients_stay_views_into_its_buckets(two_and_one):
    """Under DDP the gradients are zeroed views into the reducer's (rebuilt) buckets between
    updates, so a pass's no_sync micro-batches accumulate into the buckets, not into a second
    copy; the buckets hold the fp32 parameters' bytes, as `hdr plan-memory` counts them. In one
    process the gradients are dropped after the step."""
    from trainer.tools.memory_plan import ModelShape, plan_memory

    (r0, r1), one = two_and_one
    parameters = sum(p.numel() for p in tiny_llama(seed=0).parameters())
    for rank in (r0, r1):
        assert rank["grads_none"] == 0
        assert rank["grad_storages"] == len(rank["buckets"]) >= 1
        assert sum(rank["buckets"]) == 4 * parameters
    assert one["grads_none"] == one["params"] and "buckets" not in one
    shape = ModelShape("tiny", parameters, 32, 64, 2, 32, 64, 128)
    plan = plan_memory(small_config(), shape, gpu_gib=80, gpus=2)
    (bucket_line,) = [x for x in plan.lines if x.component.startswith("DDP gradient buckets")]
    assert bucket_line.gib * 2**30 == sum(r0["buckets"])


def test_ranks_that_disagree_are_refused_in_one_line(two_and_one):
    (r0, r1), _ = two_and_one
    line = "the 2 processes disagree on a value each rank holds differently"
    assert r0["refused"] == r1["refused"] == line


def test_shards_are_contiguous_and_cover_the_step():
    bounds = fresh.shard_bounds(10, 4)
    assert [list(r) for r in bounds] == [[0, 1], [2, 3, 4], [5, 6], [7, 8, 9]]
    assert fresh.shard_seed(0, 3, 0, 1) == fresh.shard_seed(0, 3, 0, 1)
    seeds = {fresh.shard_seed(0, s, r, k) for s in range(5) for r in range(2) for k in range(4)}
    assert len(seeds) == 40


def test_split_map_in_one_process_is_the_plain_call():
    assert distributed.Dist().split_map([1, 2, 3], lambda xs: [x * 2 for x in xs]) == [2, 4, 6]
    assert distributed.Dist(rank=1, world=3).share(8) == [1, 4, 7]


def test_shard_count_the_world_does_not_divide_is_refused(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UserError, match="rollout_shards=1 cannot be split over 2"):
        distributed.init_distributed(small_config())


def test_the_removed_strategy_key_is_refused_with_a_pointer_to_the_supported_path():
    for value in ("fsdp", "ddp"):
        with pytest.raises(ValueError, match=r"distributed\.strategy was removed.*TRL integration"):
            TrainConfig.model_validate({"model": {"path": "x"}, "distributed": {"strategy": value}})


def test_more_shards_than_prompts_is_refused():
    with pytest.raises(ValueError, match=r"rollout_shards=4 exceeds grpo\.batch_prompts=2"):
        TrainConfig.model_validate(
            {
                "model": {"path": "x"},
                "grpo": {"batch_prompts": 2},
                "distributed": {"rollout_shards": 4},
            }
        )


def test_resume_under_another_world_size(tmp_path):
    """Equal per-rank RNG states resume under any world size; differing ones only under the
    world size that wrote them, refused in one line otherwise."""
    model = tiny_llama()
    optimizer, scheduler = build_optimizer(model, small_config())
    state = dict(
        model=model,
        tokenizer=None,
        optimizer=optimizer,
        scheduler=scheduler,
        replay=GroupReplay(4, budget=1),
        counters={"env_calls_total": 0},
        config_yaml="",
    )
    torch.manual_seed(7)
    same = capture_rng()
    path = save_checkpoint(tmp_path / "a", 1, TrainState(**state, rng_states=[same, same]), 1)
    ckpt = Checkpoint(path, 1)
    assert ckpt.world_size == 2 and "world_size" not in ckpt.counters()
    torch.manual_seed(0)
    ckpt.restore_rng(0, 1)
    assert torch.equal(torch.get_rng_state(), same[0]["torch"])
    torch.manual_seed(8)
    other = capture_rng()
    path = save_checkpoint(tmp_path / "b", 1, TrainState(**state, rng_states=[same, other]), 1)
    ckpt = Checkpoint(path, 1)
    ckpt.restore_rng(1, 2)  # the same world size: each rank its own
    assert torch.equal(torch.get_rng_state(), other[0]["torch"])
    with pytest.raises(UserError, match="written by 2 processes whose random states differ"):
        ckpt.restore_rng(0, 1)


def test_the_update_backpropagates_through_the_scan_forward_of_replayed_groups():
    """replay.reuse_scan_forward: the same selections, losses and weights as forwarding the
    admitted groups again, without that second forward."""
    plain = run_protocol(distributed.Dist())
    reused = run_protocol(distributed.Dist(), reuse_scan_forward=True)
    assert reused["selected"] == plain["selected"] and any(plain["selected"][1:])
    assert reused["losses"] == pytest.approx(plain["losses"], abs=1e-6)
    assert reused["grad_norms"] == pytest.approx(plain["grad_norms"], rel=1e-5)
    for name, weight in plain["weights"].items():
        torch.testing.assert_close(
            torch.tensor(reused["weights"][name]), torch.tensor(weight), atol=1e-6, rtol=0
        )
    G = 3  # rows per group (make_groups)
    assert plain["update_rows"] == [G * (4 + len(s)) for s in plain["selected"]]
    assert reused["update_rows"] == [G * 4] * STEPS  # fresh rows only
