"""Seed-level statistics on hand-made cases: the t-interval over seeds and the two-way
bootstrap over seeds x questions."""

from __future__ import annotations

import math

import numpy as np
import pytest

from evaluation.metrics import (
    Interval,
    bootstrap_seeds_questions,
    paired_verdict,
    seed_t_interval,
)


def test_t_interval_hand_values():
    # d = 1, 2, 3: mean 2, std 1, se 1/sqrt(3), t(0.975, 2 df) = 4.302653
    got = seed_t_interval([1.0, 2.0, 3.0])
    half = 4.302653 / math.sqrt(3)
    assert got.mean == pytest.approx(2.0)
    assert (got.low, got.high) == pytest.approx((2 - half, 2 + half), abs=1e-5)
    assert got.n == 3 and not got.excludes_zero  # 3 seeds: t = 4.30 makes it wide
    assert seed_t_interval([1.0, 1.1, 0.9]).excludes_zero
    five = seed_t_interval([0.01, -0.02, 0.03, 0.0, -0.01])  # straddles 0
    assert not five.excludes_zero and five.low < five.mean < five.high
    one = seed_t_interval([0.5])
    assert one.mean == 0.5 and math.isnan(one.low) and math.isnan(one.high)


def test_bootstrap_constant_difference_has_a_point_interval():
    a = np.full((3, 40), 0.7)
    got = bootstrap_seeds_questions(a, a - 0.2, resamples=200)
    assert (got.mean, got.low, got.high) == pytest.approx((0.2, 0.2, 0.2))


def test_bootstrap_carries_the_variance_between_seeds():
    # every question agrees within a seed; the seeds disagree (+0.1 and +0.3): resampling
    # questions alone would give a point, resampling seeds spreads the interval over both
    b = np.zeros((2, 50))
    a = np.array([[0.1] * 50, [0.3] * 50])
    got = bootstrap_seeds_questions(a, b, resamples=2000, seed=1)
    assert got.mean == pytest.approx(0.2)
    assert got.low == pytest.approx(0.1) and got.high == pytest.approx(0.3)
    assert bootstrap_seeds_questions(a, b, seed=1) == got  # seeded


def test_a_verdict_needs_both_intervals_to_exclude_zero():
    """Three seeds with the same difference give a zero-width t-interval; the bootstrap, which
    also resamples questions, can still span 0, and then no difference is claimed."""
    same = seed_t_interval([0.028, 0.028, 0.028])
    assert (same.low, same.high) == pytest.approx((0.028, 0.028))
    questions = np.array([[1, 0, 0, 0, 0] * 7] * 3, dtype=float)  # (S, Q): differences per question
    spans_zero = bootstrap_seeds_questions(questions, np.full_like(questions, 0.172))
    assert spans_zero.low < 0 < spans_zero.high
    assert paired_verdict(same, spans_zero) == "0"
    clear = bootstrap_seeds_questions(np.ones((3, 35)), np.zeros((3, 35)))
    assert paired_verdict(same, clear) == "+"
    below = Interval(-1.0, -1.2, -0.8, 105, 0.95)
    assert paired_verdict(seed_t_interval([-0.1, -0.2, -0.15]), below) == "−"
    assert paired_verdict(seed_t_interval([-0.1, -0.2, -0.15]), clear) == "0"  # opposite sides
    assert paired_verdict(seed_t_interval([0.1]), clear) == "n/a"
    assert paired_verdict(seed_t_interval([-0.1, 0.2, 0.05]), clear) == "0"
