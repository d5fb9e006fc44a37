"""The bed diagnostics (experiment/diagnostics.py) on cases worked by hand: the
pool-size check's gains, their difference, the equivalence test and the three verdicts, and
the dose screen's log-dose arithmetic."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from evaluation.statistics import crossed_interval
from experiment.diagnostics import DoseScreen, PoolCheck, dose_screen, pool_check

START = np.array([0.0, 0.5, 0.25, 1.0])
FULL = np.array([[0.5, 0.75, 0.5, 1.0]])
POOL = np.array([[0.25, 0.5, 0.5, 1.0]])


def test_the_pool_check_with_one_seed_by_hand():
    # full - pool = [0.25, 0.25, 0, 0]: mean 0.125, sd sqrt(4 x 0.125^2 / 3) = 0.144338,
    # se 0.072169; 95%: t(0.975, 3) = 3.182446 -> half 0.229676; 90% (TOST at 0.05):
    # t(0.95, 3) = 2.353363 -> half 0.169840, so [-0.0448, +0.2948] lies inside +-0.5
    result = pool_check(FULL, POOL, START, [1], PoolCheck(arm="a", pool_arm="p", margin=0.5))
    se = math.sqrt(4 * 0.125**2 / 3) / 2
    assert result.difference.se == pytest.approx(se) and result.difference.df == 3
    assert result.difference.estimate == pytest.approx(0.125)
    half = stats.t.ppf(0.975, 3) * se
    assert (result.difference.low, result.difference.high) == pytest.approx(
        (0.125 - half, 0.125 + half)
    )
    assert result.full_gain.estimate == pytest.approx(0.25)  # [0.5, 0.25, 0.25, 0]
    assert result.pool_gain.estimate == pytest.approx(0.125)  # [0.25, 0, 0.25, 0]
    assert result.equivalence.equivalent
    assert (result.equivalence.low, result.equivalence.high) == pytest.approx(
        (-0.04484, 0.29484), abs=1e-5
    )
    assert result.verdict.startswith("gains match within +-0.5") and "drop it" in result.verdict
    assert "one seed" in result.difference.method and result.seeds == [1]


def test_the_pool_checks_other_verdicts():
    narrow = PoolCheck(arm="a", pool_arm="p", margin=0.1)
    assert pool_check(FULL, POOL, START, [1], narrow).verdict.startswith("inconclusive")
    full = np.array([[0.5, 0.75, 0.75, 0.5, 0.5, 1.0]])
    pool = full - np.array([[0.25, 0.25, 0.5, 0.25, 0.25, 0.5]])
    start = np.zeros(6)
    more = pool_check(full, pool, start, [1], narrow)
    assert more.difference.low > 0 and more.verdict.startswith("fresh data can matter")
    less = pool_check(pool, full, start, [1], narrow)
    assert less.difference.high < 0 and less.verdict.startswith("the small pool gains more")


def test_with_two_seeds_the_difference_takes_the_crossed_interval():
    full = np.array([[0.5, 0.75, 0.5, 1.0], [0.25, 0.75, 0.75, 1.0]])
    pool = np.array([[0.25, 0.5, 0.5, 1.0], [0.25, 0.25, 0.5, 0.75]])
    result = pool_check(full, pool, START, [1, 2], PoolCheck(arm="a", pool_arm="p", margin=0.5))
    assert result.difference == crossed_interval(full - pool)
    assert result.full_gain == crossed_interval(full - START[None, :])
    assert result.seeds == [1, 2]


def test_the_dose_screen_by_log_dose_arithmetic():
    # b16 - b4 = 0.06 on every question: 2 doublings, 0.03 each; a 1.5x step buys
    # 0.03 x log2(1.5) = 0.017549, above a threshold of 0.0165 and below one of 0.018
    low = np.full((1, 5), 0.3) + np.array([0.0, 0.1, 0.0, 0.1, 0.0])
    high = low + 0.06 + np.array([0.0, 0.01, -0.01, 0.0, 0.0])
    screen = DoseScreen(arm="b16", reference="b4", dose_ratio=4, needed=0.0165)
    result = dose_screen(high, low, [1], screen)
    assert result.gain.estimate == pytest.approx(0.06)
    assert result.per_doubling == pytest.approx(0.03)
    assert result.projected_step == pytest.approx(0.03 * math.log2(1.5))
    assert result.passes and result.verdict.startswith("on to the pilot")
    share = math.log2(1.5) / 2
    assert result.projected_interval == pytest.approx(
        (result.gain.low * share, result.gain.high * share)
    )
    strict = screen.model_copy(update={"needed": 0.018})
    assert not dose_screen(high, low, [1], strict).passes
