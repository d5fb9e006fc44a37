"""The mechanism views (experiment/mechanism.py) on synthetic logs whose answers are known."""

from __future__ import annotations

import json
import math

import pytest

from experiment.mechanism import (
    acceptance_at,
    counterfactual,
    entropy_at_matched_score,
    lifetime_by_headroom,
    replay_ages,
    scan_acceptance,
    smoothed,
)


def step(n, chosen_d, chosen_h, recency_d, recency_h, chosen_ids=("a",), recency_ids=("b",)):
    return {
        "step": n,
        "replayed_group_ids": list(chosen_ids),
        "survey_group_ids": list(recency_ids),
        "survey_chosen_drift": chosen_d,
        "survey_chosen_headroom": chosen_h,
        "survey_drift": recency_d,
        "survey_headroom": recency_h,
    }


def test_counterfactual_counts_the_jointly_improved_steps_early_and_late():
    records = [
        step(1, [0.01], [0.5], [0.02], [0.4]),  # less drift, more headroom: improved
        step(2, [0.01, 0.03], [0.5, 0.5], [0.01], [0.4]),  # more drift (mean 0.02): not
        step(3, [0.01], [0.3], [0.02], [0.4]),  # less headroom: not
        step(4, [0.005], [0.9], [0.01], [0.2]),  # improved
        step(5, [], [], [0.01], [0.2]),  # nothing chosen: left out
        step(6, [0.01], [0.5], [0.01], [0.5], ("a",), ("a",)),  # the same choice: a tie
    ]
    cf = counterfactual(records)
    assert cf.steps == 5 and cf.same_choice == 1
    # early: steps 1-3 (1 of 3 improved), late: steps 4 and 6 (1 of 2)
    assert cf.improved_early == pytest.approx(1 / 3)
    assert cf.improved_late == pytest.approx(1 / 2)
    assert cf.drift_chosen == pytest.approx((0.01 + 0.02 + 0.01 + 0.005 + 0.01) / 5)
    assert cf.headroom_recency == pytest.approx((0.4 + 0.4 + 0.4 + 0.2 + 0.5) / 5)
    assert counterfactual([{"step": 1, "replay_ages": [1]}]) is None


def test_lifetime_concentration_by_initial_headroom():
    # 8 groups: the low half never replayed, the top quartile replayed 3 times each
    heads = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    counts = [0, 0, 0, 0, 1, 0, 3, 3]
    groups = [
        {"initial_headroom": h, "replay_count": c} for h, c in zip(heads, counts, strict=True)
    ]
    life = lifetime_by_headroom(groups, bins=4)
    assert [b.groups for b in life.bins] == [2, 2, 2, 2]
    assert [b.replayed_share for b in life.bins] == [0.0, 0.0, 0.5, 1.0]
    assert [b.mean_replays for b in life.bins] == [0.0, 0.0, 0.5, 3.0]
    assert life.top_bin_share == pytest.approx(6 / 7)
    assert life.bins[0].low == 0.1 and life.bins[-1].high == 0.8
    assert lifetime_by_headroom([]) is None


def test_ages_acceptance_and_the_scan_share():
    records = [
        {"replay_ages": [1, 3], "scanned_groups": 4, "replayed_groups": 2,
         "survey_drift": [0.001, 0.01, 0.1]},
        {"replay_ages": [5, 2], "scanned_groups": 2, "replayed_groups": 2,
         "survey_drift": [0.02]},
        {"replay_ages": [], "scanned_groups": 0, "replayed_groups": 0},
    ]  # fmt: skip
    ages = replay_ages(records)
    assert (ages.replayed, ages.median, ages.share_old) == (4, 2.5, 0.5)
    rates = acceptance_at(records, [0.001, 0.01, 0.1])
    assert [(a.surveyed, a.admissible) for a in rates] == [(4, 1), (4, 2), (4, 4)]
    assert rates[1].rate == 0.5
    assert scan_acceptance(records) == pytest.approx(4 / 6)
    assert math.isnan(replay_ages([]).median)


def test_entropy_is_read_where_both_runs_reach_the_same_training_reward():
    # run a climbs 0.0 -> 0.9 in 10 steps; run b twice as slowly; entropy falls with the step
    a = [{"step": s, "reward_mean": 0.1 * s, "entropy": 2.0 - 0.1 * s} for s in range(10)]
    b = [{"step": s, "reward_mean": 0.05 * s, "entropy": 3.0 - 0.1 * s} for s in range(10)]
    rows = entropy_at_matched_score({"a": a, "b": b}, levels=2, window=1)
    assert [round(level, 3) for level, _ in rows] == [0.225, 0.45]  # up to b's best
    _, at = rows[0]  # reward 0.225: a at step 3 (0.3), b at step 5 (0.25)
    assert at == {"a": pytest.approx(1.7), "b": pytest.approx(2.5)}
    assert list(smoothed([1, 2, 3, 4], 2)) == [1.0, 1.5, 2.5, 3.5]


def test_a_run_folder_gives_the_mechanism_table(tmp_path):
    from experiment.mechanism import mechanism_lines, summarize_mechanism
    from experiment.runs import RunResult

    run_dir = tmp_path / "runs" / "headroom_drift" / "seed-1"
    run_dir.mkdir(parents=True)
    groups = [{"initial_headroom": h, "replay_count": c} for h, c in [(0.1, 0), (0.9, 2)]]
    (run_dir / "groups.jsonl").write_text("".join(json.dumps(g) + "\n" for g in groups))
    metrics = [step(1, [0.01], [0.5], [0.02], [0.4]) | {"replay_ages": [4], "entropy": 1.0,
                                                        "reward_mean": 0.1}]  # fmt: skip
    runs = {"headroom_drift": [RunResult("headroom_drift", 1, run_dir, None, metrics, 40)],
            "on_policy": [RunResult("on_policy", 1, run_dir, None, [], 40)]}  # fmt: skip
    m = summarize_mechanism(runs)
    assert [a.arm for a in m.arms] == ["headroom_drift"]  # on_policy replays nothing
    assert m.arms[0].lifetime.top_bin_share == 1.0
    assert m.arms[0].ages.share_old == 1.0
    text = "\n".join(mechanism_lines(m))
    assert "| headroom_drift | 1 |" in text and "100% / –" in text
    assert "| *the paper* (Search-R1, Qwen2.5-3B) | – | 40.2% (middle tau) |" in text
