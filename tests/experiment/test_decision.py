"""The replay comparison's decision rule (experiment/decision.py) on synthetic per-question
results whose answers are known, through the same summary code as a real experiment."""

from __future__ import annotations

import numpy as np
import pytest
from test_experiment import _metrics, _report

from evaluation.statistics import crossed_interval, greater
from experiment.config import experiment_config
from experiment.decision import decide
from experiment.report import results_markdown
from experiment.runs import RunResult
from experiment.summary import summarize

SEEDS, QUESTIONS, K = (1, 2, 3, 4, 5), 300, 5


def base(seed: int) -> np.ndarray:
    return (np.random.default_rng(seed).random((QUESTIONS, K)) < 0.3).astype(int)


def solved(correct: np.ndarray, share: float, seed: int) -> np.ndarray:
    """`correct` with a `share` of its questions answered right in every sample."""
    out = correct.copy()
    rows = np.random.default_rng(100 + seed).random(QUESTIONS) < share
    out[rows] = 1
    return out


def flipped(correct: np.ndarray, n: int, seed: int) -> np.ndarray:
    """`correct` with `n` single samples flipped (a difference of noise, not of effect)."""
    out = correct.copy()
    rng = np.random.default_rng(200 + seed)
    for q, s in zip(rng.integers(0, QUESTIONS, n), rng.integers(0, K, n), strict=True):
        out[q, s] = 1 - out[q, s]
    return out


def runs(tmp_path, arm: str, make) -> list[RunResult]:
    out = []
    for s in SEEDS:
        c = make(s)
        report = _report(c, c[:, 0])
        out.append(
            RunResult(arm, s, tmp_path / arm / f"seed-{s}", report, _metrics(2, 1, False), 40)
        )
    return out


def answers(tmp_path, fresh, replay, naive, larger):
    cfg = experiment_config("smollm2-replay-comparison")
    results = [
        *runs(tmp_path, "on_policy", fresh),
        *runs(tmp_path, "headroom_drift", replay),
        *runs(tmp_path, "replay_recency", naive),
        *runs(tmp_path, "on_policy_larger", larger),
    ]
    summary = summarize(results, cfg.references, cfg=cfg)
    return [a.answer for a in decide(cfg.decision, summary.contrasts)], summary, cfg


def test_replay_that_adds_and_beats_both_references(tmp_path):
    got, summary, cfg = answers(
        tmp_path,
        fresh=base,
        replay=lambda s: solved(base(s), 0.3, s),
        naive=lambda s: flipped(base(s), 40, s),
        larger=lambda s: solved(base(s), 0.1, s),
    )
    assert got == [
        "yes, it adds quality",
        "yes, it beats naive replay",
        "yes, it beats 1.5x the fresh prompts",
    ]
    text = results_markdown(summary, cfg)
    assert "yes, it adds quality**: headroom_drift - on_policy +" in text


def test_no_worse_and_a_match_only_where_the_dose_is_shown(tmp_path):
    # replay equals fresh up to noise; 1.5x fresh is clearly better than fresh: replay
    # neither adds nor matches it (it is far below)
    got, *_ = answers(
        tmp_path,
        fresh=base,
        replay=lambda s: flipped(base(s), 4, s),
        naive=lambda s: flipped(base(s), 6, s + 50),
        larger=lambda s: solved(base(s), 0.2, s),
    )
    assert got == ["no worse, within the margin", "no difference shown", "not shown"]
    # replay as good as 1.5x fresh, which beats fresh: "matches"
    got, *_ = answers(
        tmp_path,
        fresh=base,
        replay=lambda s: flipped(solved(base(s), 0.2, s), 4, s),
        naive=lambda s: solved(base(s), 0.2, s),
        larger=lambda s: solved(base(s), 0.2, s),
    )
    assert got[2] == "it matches 1.5x the fresh prompts, within the margin"
    # the same, but 1.5x fresh does not beat fresh: no "matches" (no dose to match)
    got, *_ = answers(
        tmp_path, fresh=base, replay=lambda s: flipped(base(s), 4, s),
        naive=base, larger=lambda s: flipped(base(s), 5, s + 9),
    )  # fmt: skip
    assert got[2] == "not shown"


def test_replay_that_costs_quality_and_an_unmeasured_question(tmp_path):
    got, summary, cfg = answers(
        tmp_path,
        fresh=lambda s: solved(base(s), 0.3, s),
        replay=base,
        naive=lambda s: solved(base(s), 0.3, s),
        larger=lambda s: solved(base(s), 0.3, s),
    )
    assert got == ["no, it costs quality", "no, naive replay is better", "not shown"]
    one_seed = [c for c in summary.contrasts if c.reference != "replay_recency"]
    assert [a.answer for a in decide(cfg.decision, one_seed)][1] == "not measured"


def test_the_one_sided_test_halves_the_p_value_in_its_direction():
    d = np.random.default_rng(0).normal(0.01, 0.05, (5, 300))
    two = crossed_interval(d)
    one = greater(two)
    assert one.p == pytest.approx(two.p / 2)
    assert greater(crossed_interval(-d)).p == pytest.approx(1 - two.p / 2)
    assert (one.low, one.high) == (two.low, two.high)


def test_the_interim_look_restates_the_mde_at_the_declared_seeds(tmp_path):
    # at 2 of the 5 declared seeds the report gives each contrast's variance components and
    # the MDE they give at 5 seeds (smaller than at 2), and calls the verdict pending; with
    # every seed in, no interim table and the verdict
    from evaluation.statistics import minimum_detectable_effect

    cfg = experiment_config("smollm2-replay-comparison")
    arms = {"on_policy": 0, "headroom_drift": 30, "replay_recency": 60, "on_policy_larger": 45}
    results = [
        r
        for arm, n in arms.items()
        for r in runs(tmp_path, arm, lambda s, n=n: flipped(base(s), n, s + n))
    ]
    whole = results_markdown(summarize(results, cfg.references, cfg=cfg), cfg)
    assert "Interim look" not in whole and "**The replay comparison's verdict** (" in whole
    two = summarize([r for r in results if r.seed <= 2], cfg.references, cfg=cfg)
    text = results_markdown(two, cfg)
    assert "Interim look, before all 5 declared seeds" in text
    assert "verdict: pending** (2 of 5 declared seeds" in text
    assert len(two.contrasts) == 4
    for c in two.contrasts:
        planned = minimum_detectable_effect(c.components, 5, QUESTIONS, K, cfg.alpha, cfg.power)
        assert 0 < planned < c.mde
        assert f"| {c.arm} − {c.reference} | Mean@5 | 2 of 5 |" in text
        assert f"| {c.mde:.4f} | {planned:.4f} |" in text
