"""Precision and sampling checks of the trainer: bf16 compute on fp32 master weights (and the
refusal of bf16 weights under plain AdamW), sampling settings the trainer can score, the
sampler/trainer log-prob gap and its truncated importance-sampling correction."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from conftest import TINY_CPU, tiny_llama, tiny_overrides

from core.config import load_config
from core.errors import UserError
from trainer.config import TrainConfig
from trainer.scoring import forward_logprobs


def changed_fraction(before: dict, model) -> float:
    after = model.state_dict()
    changed = sum(int((after[k].float() != v.float()).sum()) for k, v in before.items())
    return changed / sum(v.numel() for v in before.values())


def nll(model, ids, autocast: bool):
    attn = torch.ones_like(ids)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else torch.no_grad()
    if not autocast:
        ctx = torch.enable_grad()
    with ctx:
        lp, _ = forward_logprobs(model, ids, attn)
    return -lp.float().mean()


def test_adamw_at_lr_1e6_moves_fp32_master_weights_not_bf16_ones():
    """The reason for fp32 master weights: at weight size ~0.02 the bf16 spacing is ~1.2e-4,
    so AdamW's ~1e-6 steps round away on bf16 parameters and stay on fp32 ones (computed
    in bf16 under autocast either way)."""
    ids = torch.randint(0, 64, (4, 24), generator=torch.Generator().manual_seed(0))
    master = tiny_llama()
    plain_bf16 = copy.deepcopy(master).to(torch.bfloat16)
    for model in (master, plain_bf16):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)
        for _ in range(3):
            opt.zero_grad()
            nll(model, ids, autocast=model is master).backward()
            opt.step()
        model.fraction = changed_fraction(before, model)
    assert next(master.parameters()).dtype == torch.float32
    assert master.fraction > 0.9
    assert plain_bf16.fraction < 0.05


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("model.dtype=bfloat16", "keep model.dtype=float32 and set model.compute_dtype=bfloat16"),
        ("rollout.temperature=0", "rollout.temperature must be > 0"),
        ("rollout.top_p=0.9", "rollout.top_p must be 1"),
        ("generation.tensor_parallel_size=2", "tensor_parallel_size > 1 is not supported"),
    ],
)
def test_configs_the_trainer_cannot_honour_are_refused(override, message):
    with pytest.raises(UserError, match=message):
        load_config(TrainConfig, TINY_CPU, [override])


def test_generation_seed_follows_the_run_and_cli_refusal_is_one_line():
    assert load_config(TrainConfig, TINY_CPU, ["seed=7"]).generation.seed == 7
    assert load_config(TrainConfig, TINY_CPU, ["seed=7", "generation.seed=3"]).generation.seed == 3
    bad = subprocess.run(
        [
            sys.executable,
            "-m",
            "hdr.cli",
            "train",
            "--config",
            str(TINY_CPU),
            "model.dtype=bfloat16",
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and "model.compute_dtype=bfloat16" in lines[0]


def test_bf16_autocast_run_moves_the_weights_at_lr_1e6(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    """Two real steps (rollout, scoring, update) with bf16 compute on fp32 master weights."""
    from transformers import AutoModelForCausalLM

    from trainer.loop import train

    overrides = tiny_overrides(
        retrieval_url, sft_policy, small_qa, tmp_path / "run",
        "steps=2", "grpo.warmup_steps=0", "grpo.lr=1e-6", "replay.budget=0",
        "model.compute_dtype=bfloat16", "generation.dtype=bfloat16",
        "eval.every=0", "checkpoint.save_every=0",
    )  # fmt: skip
    run_dir = train(load_config(TrainConfig, TINY_CPU, overrides))
    start = AutoModelForCausalLM.from_pretrained(str(sft_policy), dtype=torch.float32)
    final = AutoModelForCausalLM.from_pretrained(str(run_dir / "final"), dtype=torch.float32)
    assert final.config.dtype in (torch.float32, "float32")  # the master weights are saved
    before = {k: v.clone() for k, v in start.state_dict().items()}
    assert changed_fraction(before, final) > 0.5
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["grad_norm"] > 0 for r in rows)
    # bf16 sampling vs bf16 teacher forcing: close, not equal (a real, logged gap)
    assert all(0 < r["logprob_gap_mean"] < 0.1 for r in rows)


def perturbed_copy(model, scale: float, seed: int = 1):
    """A sampler that is not the trainer: the same weights plus noise (a stale or low-precision
    inference engine, made deliberately)."""
    noisy = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * scale)
    return noisy


def test_truncated_is_corrects_a_perturbed_sampler(sft_policy, small_qa, retrieval_url, tmp_path):
    from agent_env.generation.hf import HFGenerator
    from trainer.record import step_record
    from trainer.run import setup_run
    from trainer.step import train_step

    def one_step(name: str, perturb: float | None, *extra: str) -> dict:
        overrides = tiny_overrides(
            retrieval_url, sft_policy, small_qa, tmp_path / name, "replay.budget=0",
            "eval.every=0", "checkpoint.save_every=0", *extra,
        )  # fmt: skip
        run, _ = setup_run(load_config(TrainConfig, TINY_CPU, overrides))
        if perturb is not None:
            run.generator = HFGenerator(perturbed_copy(run.model, perturb), run.tokenizer)
        before = {k: v.clone() for k, v in run.model.state_dict().items()}
        record = step_record(run, train_step(run, 1)).as_dict()
        record["moved"] = changed_fraction(before, run.model)
        run.client.close()
        return record

    exact = one_step("exact", None, "grpo.tis_cap=2.0")
    assert exact["logprob_gap_max"] < 1e-4  # hf in fp32 shares the trainer's module
    assert exact["is_weight_mean"] == pytest.approx(1.0, abs=1e-4)
    assert exact["is_capped_frac"] == 0.0
    off = one_step("off", 0.05)
    assert "is_weight_mean" not in off  # off by default
    on = one_step("on", 0.05, "grpo.tis_cap=2.0")
    for record in (off, on):
        assert record["logprob_gap_mean"] > 0.01  # the perturbation is visible in the log
        assert record["logprob_gap_max"] > record["logprob_gap_mean"]
    assert on["logprob_gap_mean"] == pytest.approx(off["logprob_gap_mean"])  # same samples
    assert 0 < on["is_weight_mean"] < 2.0 and on["is_weight_mean"] != pytest.approx(1.0)
    assert 0 < on["is_capped_frac"] < 1
    assert on["loss"] != pytest.approx(off["loss"], rel=1e-3)  # the weights enter the loss
    assert on["moved"] > 0 and off["moved"] > 0


def test_the_master_weights_dtype_offers_only_what_is_accepted():
    from typing import get_args

    from trainer.config import ModelConfig

    schema = ModelConfig.model_json_schema()["properties"]["dtype"]
    assert get_args(ModelConfig.model_fields["dtype"].annotation) == ("float32",)
    assert schema.get("const", schema.get("enum", [None])[0]) == "float32"
