"""Modelled cost (evaluation/costs.py): the coefficients are the committed measurements, and
quality at matched modelled cost, as the env-to-compute ratio grows, on a case worked by hand."""

from __future__ import annotations

import pytest

from evaluation.costs import (
    CAVEAT,
    MEASURED_HERE,
    CostModel,
    billed_searches,
    cost_curve,
    matched_modelled_cost,
    measured_here,
    modelled_cost_markdown,
    step_cost,
)


def test_the_measured_coefficients_are_those_of_the_committed_files():
    got = measured_here()
    for field in ("search_call", "generated_token", "teacher_forced_token", "trained_token"):
        assert getattr(MEASURED_HERE, field) == pytest.approx(getattr(got, field), rel=1e-3)
    assert 5 < MEASURED_HERE.env_to_compute < 8  # a local BM25 call costs ~6 teacher-forced tokens


def _run(search, tf, quality_at_2, lift):
    metrics = [
        {"step": s, "cost_search_calls": search, "cost_scan_tf_tokens": tf,
         "cost_generated_tokens": 7, "cost_update_tf_tokens": 9}
        for s in (1, 2)
    ]  # fmt: skip
    evals = [{"step": 0, "mean_at_k": lift}, {"step": 2, "mean_at_k": quality_at_2 + lift}]
    return metrics, evals


def test_quality_at_matched_modelled_cost_as_the_ratio_grows_by_hand():
    # priced: a = rho x c, c = 1, b = d = 0. Per step, "replay" makes 2 searches and scans 40
    # teacher-forced tokens (2 rho + 40), "fresh" makes 3 searches (3 rho). After 2 steps:
    # replay 0.25 at 4 rho + 80, fresh 0.30 at 6 rho; the budget is the smaller total.
    #   rho 10:   replay 120, fresh 60: at 60, replay 0.25 x 60/120 = 0.125 -> -0.175
    #   rho 100:  replay 480, fresh 600: at 480, fresh 0.30 x 0.8 = 0.24   -> +0.010
    #   rho 1000: replay 4080, fresh 6000: fresh 0.30 x 0.68 = 0.204       -> +0.046
    model = CostModel(search_call=0, generated_token=0, teacher_forced_token=1, trained_token=0)
    curves = {
        "replay": {1: _run(2, 40, 0.25, 0.0), 2: _run(2, 40, 0.25, 0.02)},
        "fresh": {1: _run(3, 0, 0.30, 0.0), 2: _run(3, 0, 0.30, 0.02)},
    }
    assert cost_curve(*curves["replay"][1], model.at_ratio(10)) == ([0.0, 120.0], [0.0, 0.25])
    rows = matched_modelled_cost(curves, [("replay", "fresh")], model, [10, 100, 1000], [0.5, 1])
    paired = {r.rho: r for r in rows if r.reference == "fresh" and r.fraction == 1}
    assert paired[10].budget == 60 and paired[10].per_seed == pytest.approx([-0.175, -0.175])
    assert paired[100].budget == 480 and paired[100].estimate == pytest.approx(0.010)
    assert paired[1000].estimate == pytest.approx(0.046)
    half = next(r for r in rows if r.rho == 10 and r.fraction == 0.5 and r.arm == "fresh")
    assert half.budget == 30 and half.per_seed == pytest.approx([0.15, 0.17])  # 0.3 x 30/60
    md = modelled_cost_markdown(rows, model)
    assert CAVEAT in md and "| replay − fresh | -0.175 [-0.175, -0.175] | +0.010" in md


def test_the_environment_is_priced_by_its_billed_search_calls():
    """A search the server's cache answered costs the environment nothing; a row logged before
    the ledger had the split billed every call."""
    model = CostModel(search_call=10, generated_token=0, teacher_forced_token=1, trained_token=0)
    split = {"cost_search_calls": 8, "cost_billed_search_calls": 3, "cost_scan_tf_tokens": 5}
    before = {"cost_search_calls": 8, "cost_scan_tf_tokens": 5}
    assert billed_searches(split) == 3 and billed_searches(before) == 8
    assert step_cost(split, model) == 3 * 10 + 5
    assert step_cost(before, model) == 8 * 10 + 5
    assert "billed search calls" in modelled_cost_markdown(
        matched_modelled_cost(
            {a: {s: _run(3, 40 * (a == "replay"), 0.3, 0.0) for s in (0, 1)}
             for a in ("replay", "fresh")},
            [("replay", "fresh")], model, [10.0], [1.0],
        ),
        model,
    )  # fmt: skip
