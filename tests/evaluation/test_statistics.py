"""The contrast statistics on synthetic data whose variances are known: the components are
recovered, the interval covers as stated, the minimum detectable effect is what a power
simulation finds, Holm and the matched-budget interpolation match hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evaluation.statistics import (
    Components,
    at_budgets,
    components,
    crossed_interval,
    holm,
    minimum_detectable_effect,
    sampling_noise,
    seed_t,
    verdict,
)


def synthetic(rng, seeds, questions, mu=0.0, seed_sd=0.02, question_sd=0.1, residual_sd=0.3):
    """d[s, q] = mu + a[s] + b[q] + e[s, q] with the given standard deviations."""
    a = rng.normal(0, seed_sd, (seeds, 1))
    b = rng.normal(0, question_sd, (1, questions))
    e = rng.normal(0, residual_sd, (seeds, questions))
    return mu + a + b + e


def test_components_are_recovered_from_a_large_table():
    d = synthetic(np.random.default_rng(0), seeds=60, questions=800)
    parts = components(d)
    assert parts.seed == pytest.approx(0.02**2, rel=0.5)
    assert parts.question == pytest.approx(0.1**2, rel=0.15)
    assert parts.residual == pytest.approx(0.3**2, rel=0.05)


def test_the_crossed_interval_covers_at_its_level_and_the_seed_interval_ignores_questions():
    rng = np.random.default_rng(1)
    covered, seed_covered = 0, 0
    reps = 400
    for _ in range(reps):
        d = synthetic(rng, seeds=4, questions=60, mu=0.05, seed_sd=0.01, question_sd=0.2)
        e = crossed_interval(d)
        covered += e.low <= 0.05 <= e.high
        t = seed_t(d)
        seed_covered += t.low <= 0.05 <= t.high
    assert 0.90 <= covered / reps <= 0.99
    # shared question effects move every seed together: the seed interval cannot see them
    assert seed_covered / reps < 0.85


def test_a_hand_computed_design_se_and_minimum_detectable_effect():
    parts = Components(
        seed=0.0004, question=0.01, residual=0.09, sampling_noise=0.03, seeds=3, questions=100, k=4
    )
    # k = 8 halves the sampling noise: residual 0.09 - 0.03 + 0.015 = 0.075
    se = math.sqrt(0.0004 / 5 + 0.01 / 900 + 0.075 / (5 * 900))
    assert parts.se(5, 900, 8) == pytest.approx(se)
    # t quantiles at 4 df: 2.7764 (0.975) and 0.9410 (0.8)
    assert minimum_detectable_effect(parts, 5, 900, 8) == pytest.approx(
        (2.7764 + 0.9410) * se, rel=1e-3
    )


def test_an_effect_of_one_mde_is_found_about_as_often_as_the_power_says():
    rng = np.random.default_rng(2)
    pilot = components(synthetic(rng, seeds=40, questions=300, seed_sd=0.015))
    mde = minimum_detectable_effect(pilot, seeds=5, questions=300)
    found = sum(
        crossed_interval(synthetic(rng, seeds=5, questions=300, mu=mde, seed_sd=0.015)).p < 0.05
        for _ in range(300)
    )
    assert found / 300 >= 0.75  # power 0.8 by design (conservative df: usually more)
    null = sum(
        crossed_interval(synthetic(rng, seeds=5, questions=300, seed_sd=0.015)).p < 0.05
        for _ in range(300)
    )
    assert null / 300 <= 0.1


def test_sampling_noise_is_the_binomial_variance_of_a_mean_of_k():
    # every question at p = 0.5 with k = 4: p (1 - p) / (k - 1) = 1/12 per arm
    half = np.tile(np.array([1, 0, 1, 0]), (2, 3, 1))  # (S=2, Q=3, k=4)
    assert sampling_noise(half, half) == pytest.approx(2 / 12)
    certain = np.ones((2, 3, 4))
    assert sampling_noise(certain, certain) == 0.0


def test_holm_adjusts_step_down_and_keeps_the_order():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5]) == [0.5]
    assert holm([0.001, 0.9]) == pytest.approx([0.002, 0.9])


def test_verdicts_follow_significance_and_sign():
    d = np.full((3, 50), 0.1) + np.random.default_rng(3).normal(0, 0.01, (3, 50))
    e = crossed_interval(d)
    assert verdict(e) == "+"
    assert verdict(e, p=0.2) == "0"  # an adjusted p-value can take it back
    assert verdict(crossed_interval(-d)) == "−"


def test_quality_at_budgets_interpolates_each_curve_and_never_extrapolates():
    # evaluated at costs 0, 100, 300: quality 0.30, 0.34, 0.36
    got = at_budgets([0, 100, 300], [0.30, 0.34, 0.36], [50, 100, 200, 400])
    assert got[:3] == pytest.approx([0.32, 0.34, 0.35])
    assert math.isnan(got[3])
