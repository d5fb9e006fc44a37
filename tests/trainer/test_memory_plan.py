"""`hdr plan-memory`'s arithmetic against a case worked out by hand, the parameter count
against a hand count and a real model, and its refusals as one line."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

from core.config import load_config
from trainer.config import TrainConfig
from trainer.tools.memory_plan import PHASES, ModelShape, model_shape, plan_memory

GIB = 2**30

# A 1-billion-parameter model: hidden 2048, MLP 8192, 16 layers, K/V width 256, 32,000 tokens.
SHAPE = ModelShape("hand", 10**9, 2048, 8192, 16, 256, 32000, 32768)
CONFIG = TrainConfig.model_validate(
    {
        "model": {"path": "x", "compute_dtype": "bfloat16", "gradient_checkpointing": True},
        "grpo": {"beta": 0.001, "micro_batch": 4, "score_chunk": 8},
        "generation": {
            "backend": "vllm",
            "dtype": "bfloat16",
            "gpu_memory_utilization": 0.3,
            "enable_sleep_mode": True,
            "max_model_len": 4096,
        },
    }
)


def test_the_plan_of_a_hand_worked_case():
    plan = plan_memory(CONFIG, SHAPE, gpu_gib=80)
    got = {line.component.split(":")[0]: (line.gib, line.phases) for line in plan.lines}
    every = ("rollout", "scoring", "update")
    hand = {  # bytes, worked out by hand
        "fp32 master weights": (4e9, every),
        "AdamW moments (2 x fp32)": (8e9, every),
        "fp32 gradients (freed after the step)": (4e9, ("update",)),
        "bf16 KL reference model": (2e9, every),
        "autocast's bf16 weight copies": (2e9, ("scoring", "update")),
        "CUDA context and workspaces": (GIB, every),
        # 8 rows x 4096 tokens x (8*2048 + 6*8192 = 65,536 B) = 2 GiB; head 512 x 32000 x 6
        "scoring activations": (2 * GIB + 98_304_000, ("scoring",)),
        # 4 x 4096 tokens x (16 layers x 4 x 2048 + 40*2048 + 14*8192 + 10*256 = 330,240 B);
        # head 512 x 32000 x 14
        "update activations": (16_384 * 330_240 + 229_376_000, ("update",)),
        # 4 x 4096 tokens x 65,536 B = 1 GiB; head 512 x 32000 x 6
        "KL reference forward, no grad": (GIB + 98_304_000, ("update",)),
        "vLLM engine": (0.3 * 80 * GIB, ("rollout",)),
        "vLLM asleep": (GIB, ("scoring", "update")),
    }
    assert got.keys() == hand.keys()
    for name, (n_bytes, phases) in hand.items():
        assert got[name][0] == pytest.approx(n_bytes / GIB, rel=1e-12), name
        assert got[name][1] == phases, name
    assert plan.total("rollout") == pytest.approx(38.0385160, abs=1e-6)
    assert plan.total("scoring") == pytest.approx(18.9927138, abs=1e-6)
    assert plan.total("update") == pytest.approx(26.9706896, abs=1e-6)
    assert plan.peak[0] == "rollout"
    # KV: 24 GiB - 2e9 B of bf16 weights - 2 GiB of vLLM's own; a 4096-token sequence holds
    # 4096 x (2 x 16 layers x 256 x 2 B) = 1/16 GiB
    assert plan.kv_cache_gib == pytest.approx(24 - 2e9 / GIB - 2, abs=1e-9)
    assert plan.sequences_at_full_length == 322
    # the update's 26.97 GiB needs 26.97 / 0.95; the rollout 14.04 GiB / (0.95 - 0.3)
    assert plan.minimum_gpu_gib == pytest.approx(26.9706896 / 0.95, abs=1e-6)
    assert plan.refusal() is None


def test_a_config_that_cannot_fit_names_the_setting_to_turn():
    plan = plan_memory(CONFIG, SHAPE, gpu_gib=24)
    assert plan.refusal() == (
        "the update phase needs 27.0 GiB per GPU, over the 22.8 GiB usable of 24; the largest"
        " part a setting shrinks is update activations: 4 rows x 4096 tokens, checkpointed"
        " (5.3 GiB): grpo.micro_batch=2"
    )
    awake = CONFIG.model_copy(
        update={"generation": CONFIG.generation.model_copy(update={"enable_sleep_mode": False})}
    )
    assert (
        plan_memory(awake, SHAPE, gpu_gib=36)
        .refusal()
        .endswith(
            "vLLM engine: gpu_memory_utilization 0.3 of the GPU (10.8 GiB):"
            " generation.enable_sleep_mode=true"
        )
    )
    # what no setting shrinks, at its largest in the update: master 4e9 + AdamW 8e9 + grads
    # 4e9 + autocast 2e9 bytes + context 1 + asleep 1 GiB = 18.76 GiB, / 0.95 = 19.75
    tiny = plan_memory(CONFIG, SHAPE, gpu_gib=12).refusal()
    assert (
        "more than settings can save: what no setting shrinks needs a GPU of at least 20 GiB"
        in tiny
    )
    no_kv = CONFIG.model_copy(
        update={"generation": CONFIG.generation.model_copy(update={"max_model_len": 32768})}
    )  # a 32k-token sequence needs 0.5 GiB of KV; 5% of 80 GiB leaves 4 - 1.86 - 2
    low = no_kv.generation.model_copy(update={"gpu_memory_utilization": 0.05})
    refused = plan_memory(no_kv.model_copy(update={"generation": low}), SHAPE, 80).refusal()
    assert refused.startswith("vLLM's share leaves 0.1 GiB of KV cache, less than one sequence")


def test_parameters_are_counted_as_the_model_holds_them(qwen_policy_dir, qwen_model):
    shape = model_shape(str(qwen_policy_dir))
    # embedding 151,936 x 64 (tied with the output layer); per layer q 64x64+64, k and v
    # 64x32+32, o 64x64, MLP 3 x 64x128, two norms of 64; a final norm of 64
    per_layer = 4160 + 2 * 2080 + 4096 + 3 * 64 * 128 + 2 * 64
    assert shape.parameters == 151_936 * 64 + 2 * per_layer + 64 == 9_798_208
    assert shape.parameters == sum(p.numel() for p in qwen_model.parameters())
    assert (shape.hidden, shape.kv_width, shape.layers) == (64, 32, 2)
    published = model_shape("Qwen/Qwen2.5-3B-Instruct")  # no download: published values
    assert published.parameters == 3_085_938_688


def test_the_3b_config_fits_80_gb_and_is_refused_on_40_in_one_line():
    config = load_config(TrainConfig, REPO / "configs/search-r1-qwen2.5-3b.yaml", [])
    plan = plan_memory(config, model_shape(config.model.path), gpu_gib=80)
    assert plan.refusal() is None and plan.peak[1] < 0.95 * 80
    done = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "plan-memory", "--config",
         str(REPO / "configs/search-r1-qwen2.5-3b.yaml"), "--gpu-gb", "40"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    # what no setting shrinks, at its largest in the update: weights 11.50 + AdamW 22.99 +
    # gradients 11.50 + autocast's copies 5.75 + context 1 + the asleep engine 1 = 53.74 / 0.95
    assert line.startswith("hdr: error: ") and "needs a GPU of at least 57 GiB" in line
    assert "| **total** |" in done.stdout  # the table is printed before the refusal


def test_ddp_buckets_are_held_in_every_phase_on_the_8_gpu_run():
    """The 3B config under DDP on 8 x 80 GB: torch's reducer holds the fp32 gradient buckets
    (4 bytes x 3,085,938,688 parameters) for the whole run, the rollout with vLLM awake
    included. The old arithmetic counted them in the update only (as 0, the gradients being
    views) and passed vLLM at 0.35 of the card with a 69.7 GiB rollout; with the buckets that
    rollout is 81.2 GiB and is refused naming the share that fits, which the config now ships."""
    shipped = load_config(TrainConfig, REPO / "configs/search-r1-qwen2.5-3b.yaml", [])
    shape = model_shape(shipped.model.path)
    eight = plan_memory(shipped, shape, gpu_gib=80, gpus=8)
    (buckets,) = [x for x in eight.lines if x.component.startswith("DDP gradient buckets")]
    assert buckets.gib * GIB == 4 * 3_085_938_688 and buckets.phases == PHASES
    assert not [x for x in eight.lines if x.component.startswith("fp32 gradients")]
    one = plan_memory(shipped, shape, gpu_gib=80, gpus=1)
    for phase in PHASES:  # 8 GPUs: one process's memory plus the buckets and NCCL's buffers
        grads = 4 * 3_085_938_688 / GIB if phase != "update" else 0.0
        assert eight.total(phase) == pytest.approx(one.total(phase) + grads + 0.5)
    assert eight.refusal() is None and eight.peak == ("rollout", pytest.approx(73.23, abs=0.01))
    old_share = load_config(
        TrainConfig, REPO / "configs/search-r1-qwen2.5-3b.yaml",
        ["generation.gpu_memory_utilization=0.35"],
    )  # fmt: skip
    before = plan_memory(old_share, shape, gpu_gib=80, gpus=8)
    assert before.total("rollout") - buckets.gib == pytest.approx(69.74, abs=0.01)  # the old plan
    assert before.refusal() == (
        "the rollout phase needs 81.2 GiB per GPU, over the 76.0 GiB usable of 80; the largest"
        " part a setting shrinks is vLLM engine: gpu_memory_utilization 0.35 of the GPU"
        " (28.0 GiB): generation.gpu_memory_utilization=0.25"
    )
    assert shipped.generation.gpu_memory_utilization == 0.25


TRL_8GPU = REPO / "configs/trl/qwen2.5-3b-8gpu.yaml"


def trl_plan(*overrides: str, gpu_gib: float = 80):
    pytest.importorskip("trl")
    from trainer.integrations.trl_memory import plan_trl

    plan, _ = plan_trl(TRL_8GPU, list(overrides), gpu_gib, 7, 400.0)
    return plan, {line.component.split(":")[0].split(" (")[0]: line for line in plan.lines}


def test_the_trl_8gpu_plan_by_hand_and_what_each_setting_moves():
    """`hdr trl-train`'s 8-GPU config: ZeRO-3 shards over 7 processes, micro-batches of 16
    fresh + 8 replayed rows (56 groups of 8 over 7 processes, in 8 micro-batches) of 1,024 +
    4,096 tokens; each phase's total is its parts; a setting moves its own line only."""
    plan, lines = trl_plan()
    P = 3_085_938_688
    assert lines["bf16 weights, ZeRO-3 shard"].gib == pytest.approx(2 * P / 7 / GIB)
    master = lines["fp32 master weights + AdamW moments, shard"]
    assert master.gib == pytest.approx(12 * P / 7 / GIB)
    assert lines["bf16 reference model, shard"].gib == pytest.approx(2 * P / 7 / GIB)  # beta 0.001
    update = lines["update activations"]
    assert update.component.startswith("update activations: 16 fresh + 8 replayed rows x 5120")
    # 24 rows x 5120 tokens x (36 layers x 2 x 2048 + 40*2048 + 14*11008 + 10*256 = 386,048 B)
    assert update.gib == pytest.approx(24 * 5120 * 386_048 / GIB)
    # TRL's fused head: a bf16 tile, the fp32 head gradient, 24 x 4096 positions' hidden copy
    # (bf16) and fp32 gradient, 7 fp32 statistics each
    K = 24 * 4096
    head = 4096 * 32768 * 2 + 151_936 * 2048 * 4 + K * 2048 * 6 + K * 28
    assert lines["TRL's fused output layer"].gib == pytest.approx(head / GIB)
    for phase in ("rollout", "scoring", "update"):
        parts = [x.gib for x in plan.lines if phase in x.phases]
        assert plan.total(phase) == pytest.approx(sum(parts)) and len(parts) >= 6
    assert plan.peak[0] == "update" and plan.refusal() is None
    # half the fresh rows per micro-batch: the activations go to 16/24, the head's positions
    # too; the shards stay
    _, half = trl_plan("trl.per_device_train_batch_size=8")
    assert half["update activations"].gib == pytest.approx(update.gib * 16 / 24)
    assert half["bf16 weights, ZeRO-3 shard"].gib == lines["bf16 weights, ZeRO-3 shard"].gib
    # a larger scoring chunk makes hdr's no-grad forward the largest; the update is unmoved
    _, wide = trl_plan("replay.score_chunk=64")
    (no_grad,) = [x for x in wide.values() if x.component.startswith("largest no-grad")]
    assert "hdr's replay scoring, 64 rows" in no_grad.component and no_grad.knob == (
        "replay.score_chunk=32"
    )
    assert wide["update activations"].gib == update.gib
    # a shorter completion: the rows and the fused head's positions shrink
    _, short = trl_plan("trl.max_completion_length=2048")
    assert short["update activations"].component.endswith("x 3072 tokens, checkpointed")
    assert short["TRL's fused output layer"].gib < lines["TRL's fused output layer"].gib


def test_the_trl_8gpu_config_on_40_gb_is_refused_in_one_line_naming_the_micro_batch():
    pytest.importorskip("trl")
    done = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "plan-memory", "--config", str(TRL_8GPU),
         "--gpu-gb", "40", "--gpus", "7"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("hdr: error: ") and "the update phase needs 57.1 GiB" in line
    assert line.endswith("trl.per_device_train_batch_size=8")
    assert "| **total** |" in done.stdout and "| update (forward + backward) | 192 |" in done.stdout


def test_rollout_workers_are_planned_on_the_gpus_the_device_map_names():
    """Asynchronous rollout: each vLLM worker's CUDA context and engine share (0.3 of an 80 GiB
    card) in every phase, on the trainer's GPU when the map is empty; on GPUs of their own they
    leave the trainer's plan as it was and each GPU is checked alone."""
    on_gpu = CONFIG.model_copy(
        update={"model": CONFIG.model.model_copy(update={"device": "cuda:0"})}
    )
    shared = on_gpu.model_copy(update={"async_rollout": on_gpu.async_rollout.model_copy(
        update={"workers": 2, "max_lag": 1})})  # fmt: skip
    alone, beside = plan_memory(on_gpu, SHAPE, 80), plan_memory(shared, SHAPE, 80)
    for phase in ("rollout", "scoring", "update"):
        assert beside.total(phase) == pytest.approx(alone.total(phase) + 2 * (1 + 0.3 * 80))
    assert beside.refusal() == (
        "the rollout phase needs 88.0 GiB per GPU, over the 76.0 GiB usable of 80, with the 2"
        " rollout worker(s) mapped to the trainer's GPU taking 50.0 GiB of it: give them GPUs"
        " of their own, async_rollout.devices=[cuda:1,cuda:2]"
    )
    mapped = shared.model_copy(update={"async_rollout": shared.async_rollout.model_copy(
        update={"devices": ["cuda:1", "cuda:2"]})})  # fmt: skip
    apart = plan_memory(mapped, SHAPE, 80)
    assert [apart.total(p) for p in PHASES] == [alone.total(p) for p in PHASES]
    assert {gpu: sum(x.gib for x in lines) for gpu, lines in apart.other_gpus.items()} == {
        "cuda:1": pytest.approx(25.0), "cuda:2": pytest.approx(25.0)
    }  # fmt: skip
    assert apart.refusal() is None and "cuda:1: 25.0 GiB in every phase" in apart.table()
    # hf workers: the fp32 copy 4e9 + bf16 casts 2e9 bytes and a KV cache each; 13 on one GPU
    # overflow it
    crowded = mapped.model_copy(update={
        "generation": mapped.generation.model_copy(update={"backend": "hf", "max_batch": 4}),
        "async_rollout": mapped.async_rollout.model_copy(
            update={"workers": 13, "devices": ["cuda:1"] * 13}),
    })  # fmt: skip
    refused = plan_memory(crowded, SHAPE, 80).refusal()
    assert (
        refused.startswith("cuda:1 holds ") and "of rollout workers, over the 76.0 GiB" in refused
    )
    # without max_batch an hf worker generates a whole shard of a step at once: with one shard
    # every fresh row of the step, however many workers share the steps
    whole = crowded.model_copy(update={
        "generation": crowded.generation.model_copy(update={"max_batch": None}),
        "async_rollout": crowded.async_rollout.model_copy(
            update={"workers": 2, "devices": ["cuda:1", "cuda:2"]}),
    })  # fmt: skip
    rows = whole.grpo.fresh_rows // whole.distributed.rollout_shards
    names = [line.component for line in plan_memory(whole, SHAPE, 80).other_gpus["cuda:1"]]
    assert any(name.endswith(f"KV cache of {rows} rows") for name in names), names


def test_the_3b_config_with_two_engine_workers_on_its_gpu_is_refused_in_one_line(tmp_path):
    """`hdr plan-memory`, and the same arithmetic at `hdr train`'s start (`placement_refusal`
    before any worker is spawned): two vLLM workers beside the trainer on one 80 GB GPU do not
    fit; a GPU each does."""
    from trainer.tools.memory_plan import placement_refusal

    args = ["async_rollout.workers=2", "async_rollout.max_lag=1", "grpo.tis_cap=null"]
    config = load_config(TrainConfig, REPO / "configs/search-r1-qwen2.5-3b.yaml", args)
    shape = model_shape(config.model.path)
    line = placement_refusal(config, shape, 80)
    assert line.endswith("give them GPUs of their own, async_rollout.devices=[cuda:1,cuda:2]")
    apart = load_config(TrainConfig, REPO / "configs/search-r1-qwen2.5-3b.yaml",
                        [*args, "async_rollout.devices=[cuda:1,cuda:2]"])  # fmt: skip
    assert placement_refusal(apart, shape, 80) is None
    done = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "plan-memory", "--config",
         str(REPO / "configs/search-r1-qwen2.5-3b.yaml"), "--gpu-gb", "80", *args],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    (refusal,) = done.stderr.strip().splitlines()
    assert refusal.startswith("hdr: error: ") and refusal.endswith(line)
    # a trainer that does not fit alone is plan-memory's to say, not the placement's
    assert placement_refusal(config, shape, 40) is None
