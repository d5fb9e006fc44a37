"""The replay survey (`replay.survey`, trainer/survey.py) in a real short run: it logs what the
stored groups look like to the current policy and changes nothing the run trains on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY_CPU, tiny_overrides
from safetensors.torch import load_file

from core.config import load_config
from trainer.config import TrainConfig
from trainer.loop import train

SURVEY_KEYS = (
    "survey_group_ids", "survey_ages", "survey_drift", "survey_headroom",
    "survey_initial_headroom", "survey_chosen_drift", "survey_chosen_headroom", "time_survey",
)  # fmt: skip


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def run(sft_policy, small_qa, url, out: Path, *extra: str) -> Path:
    cfg = load_config(
        TrainConfig, TINY_CPU,
        tiny_overrides(url, sft_policy, small_qa, out, "steps=4", "eval.every=0",
                       "checkpoint.save_every=0", "replay.tau=0.05", *extra),
    )  # fmt: skip
    return train(cfg)


def test_the_survey_logs_the_buffer_and_changes_nothing_trained(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    plain = run(sft_policy, small_qa, retrieval_url, tmp_path / "plain")
    newest = run(sft_policy, small_qa, retrieval_url, tmp_path / "newest", "replay.survey=newest")
    whole = run(sft_policy, small_qa, retrieval_url, tmp_path / "buffer", "replay.survey=buffer")
    weights = [load_file(d / "final" / "model.safetensors") for d in (plain, newest, whole)]
    for other in weights[1:]:
        assert all((weights[0][k] == other[k]).all() for k in weights[0])  # same update
    base, cf, full = rows(plain), rows(newest), rows(whole)
    for a, b, c in zip(base, cf, full, strict=True):
        assert a["replayed_group_ids"] == b["replayed_group_ids"] == c["replayed_group_ids"]
        assert a["cost_scan_tf_tokens"] == b["cost_scan_tf_tokens"]  # off the ledger
        assert not any(k in a for k in SURVEY_KEYS)
    surveyed = [r for r in full if r.get("survey_group_ids")]
    assert surveyed, "no step had a stored group to survey"
    by_step = {r["step"]: r for r in cf}
    for r_full, r_cf in ((r, by_step[r["step"]]) for r in surveyed):
        assert all(k in r_full for k in SURVEY_KEYS)
        # buffer: every eligible group, newest first; newest: the budget's newest of them
        assert r_full["survey_ages"] == sorted(r_full["survey_ages"])
        assert all(age >= 1 for age in r_full["survey_ages"])
        assert r_cf["survey_group_ids"] == r_full["survey_group_ids"][:2]
        # (scored in other chunks, so equal up to the padding's rounding)
        assert r_cf["survey_drift"] == pytest.approx(r_full["survey_drift"][:2], rel=1e-5)
        # what the scan admitted is what the survey saw of the same groups, by the same tau
        seen = dict(zip(r_full["survey_group_ids"], r_full["survey_drift"], strict=True))
        for gid, drift in zip(r_full["replayed_group_ids"], r_full["survey_chosen_drift"],
                              strict=True):  # fmt: skip
            assert abs(seen[gid] - drift) < 1e-6 and drift <= 0.05
        admissible = sum(d <= 0.05 for d in r_full["survey_drift"])
        assert r_full["replayed_groups"] == min(2, admissible)
