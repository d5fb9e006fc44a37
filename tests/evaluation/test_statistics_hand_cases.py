"""The statistics layer against cases worked by hand: the crossed interval's mean squares,
Satterthwaite's df and the conservative fallback it takes below 3 df, the seed t-interval,
and two one-sided tests of equivalence (evaluation/statistics.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from evaluation.statistics import (
    Estimate,
    crossed_interval,
    equivalence,
    mean_squares,
    satterthwaite,
    seed_t,
    verdict,
)

# 3 seeds x 4 questions. Seed means 1, 2, 4; question means 4/3, 8/3, 10/3, 2; grand 7/3.
TABLE = np.array([[0.0, 1, 2, 1], [1, 3, 2, 2], [3, 4, 6, 3]])


def test_mean_squares_of_a_table_worked_by_hand():
    # MS_S = Q * sum((seed mean - grand)^2) / (S - 1) = 4 * (16/9 + 1/9 + 25/9) / 2 = 84/9
    # MS_Q = S * sum((question mean - grand)^2) / (Q - 1) = 3 * (1 + 1/9 + 1 + 1/9) / 3 = 20/9
    # SS_total = 94 - 12 * 49/9 = 86/3; SS_E = 86/3 - 2 * 84/9 - 3 * 20/9 = 10/3; MS_E = 10/18
    assert mean_squares(TABLE) == pytest.approx((84 / 9, 20 / 9, 10 / 18))


def test_the_crossed_interval_and_its_satterthwaite_df_by_hand():
    # Var = (MS_S + MS_Q - MS_E) / (S Q) = (84/9 + 20/9 - 5/9) / 12 = 11/12
    # df = (S Q Var)^2 / (MS_S^2 / 2 + MS_Q^2 / 3 + MS_E^2 / 6) = 121 / 45.2531 = 2.6739
    df = 121 / ((84 / 9) ** 2 / 2 + (20 / 9) ** 2 / 3 + (10 / 18) ** 2 / 6)
    assert df == pytest.approx(2.6739, abs=1e-4)
    got = crossed_interval(TABLE, min_df=2)  # allowed down to 2 df: no fallback
    half = stats.t.ppf(0.975, df) * math.sqrt(11 / 12)
    assert got.method == "crossed random effects" and got.df == pytest.approx(df)
    assert (got.estimate, got.se) == pytest.approx((7 / 3, math.sqrt(11 / 12)))
    assert (got.low, got.high) == pytest.approx((7 / 3 - half, 7 / 3 + half))
    assert got.p == pytest.approx(2 * stats.t.sf((7 / 3) / math.sqrt(11 / 12), df))


def test_below_three_df_the_interval_falls_back_to_the_stated_conservative_one():
    # the default floor is 3 df: 2.67 is below it. Fallback: Var = (MS_S + MS_Q) / (S Q) =
    # (104/9) / 12 = 0.96296 at the Satterthwaite df of MS_S + MS_Q:
    # (104/9)^2 / ((84/9)^2 / 2 + (20/9)^2 / 3) = 133.531 / 45.202 = 2.9541
    df = (104 / 9) ** 2 / ((84 / 9) ** 2 / 2 + (20 / 9) ** 2 / 3)
    assert df == pytest.approx(2.9541, abs=1e-4)
    got = crossed_interval(TABLE)
    assert "conservative" in got.method and got.df == pytest.approx(df)
    assert got.se == pytest.approx(math.sqrt(104 / 108))
    half = stats.t.ppf(0.975, df) * math.sqrt(104 / 108)  # t(0.975, 2.954) = 3.2106
    assert half == pytest.approx(3.1506, abs=1e-4)
    assert (got.low, got.high) == pytest.approx((7 / 3 - half, 7 / 3 + half))
    # its variance exceeds the one it replaces by MS_E / (S Q), never less; its df is that
    # variance's own (2.95 here against the crossed 2.67), so the interval may be the narrower
    trusted = crossed_interval(TABLE, min_df=2)
    assert got.se**2 - trusted.se**2 == pytest.approx((10 / 18) / 12)
    # 2 x 3, a seed mean square far above the rest: MS 13.5, 6.5, 1.5; df 342.25 / 204.5 =
    # 1.67 -> fallback: Var = 20 / 6 at 400 / (13.5^2 / 1 + 6.5^2 / 2) = 1.9668 df
    small = crossed_interval(np.array([[1.0, 2, 3], [3, 4, 8]]))
    assert mean_squares(np.array([[1.0, 2, 3], [3, 4, 8]])) == pytest.approx((13.5, 6.5, 1.5))
    assert small.df == pytest.approx(400 / 203.375)
    half = stats.t.ppf(0.975, 400 / 203.375) * math.sqrt(20 / 6)
    assert (small.low, small.high) == pytest.approx((3.5 - half, 3.5 + half))


def test_the_fallback_df_is_its_own_variances_not_the_fewest_terms():
    """Two seeds x 400 questions of pure residual noise (no seed or question effect, the
    pilots' case: arms that differ little question by question): the crossed variance
    MS_S + MS_Q - MS_E is nearly 0, its df collapses to 1, and the fallback takes the
    Satterthwaite df of MS_S + MS_Q computed directly (about 244, not min(S, Q) - 1 = 1), so
    its interval is t(0.975, 1) / t(0.975, 244) = 6.4 times narrower than the old one's."""
    d = 0.01 + np.random.default_rng(27).normal(0, 0.3, (2, 400))
    ms_s, ms_q, ms_e = mean_squares(d)
    crossed_df = satterthwaite(ms_s + ms_q - ms_e, [(ms_s, 1), (ms_q, 399), (-ms_e, 399)])
    assert crossed_df < 3
    got = crossed_interval(d)
    direct = (ms_s + ms_q) ** 2 / (ms_s**2 / 1 + ms_q**2 / 399)
    assert "conservative" in got.method and got.df == pytest.approx(direct)
    assert got.df == pytest.approx(243.6, abs=0.1)
    assert got.se == pytest.approx(math.sqrt((ms_s + ms_q) / 800))
    half = (got.high - got.low) / 2
    assert half == pytest.approx(stats.t.ppf(0.975, direct) * got.se)
    assert stats.t.ppf(0.975, 1) * got.se / half == pytest.approx(6.45, abs=0.01)


def test_a_large_design_keeps_satterthwaites_df():
    rng = np.random.default_rng(0)
    d = (
        0.05
        + rng.normal(0, 0.02, (6, 1))
        + rng.normal(0, 0.1, (1, 200))
        + rng.normal(0, 0.3, (6, 200))
    )
    got = crossed_interval(d)
    ms_s, ms_q, ms_e = mean_squares(d)
    total = ms_s + ms_q - ms_e
    assert got.method == "crossed random effects" and got.df >= 3
    assert got.se == pytest.approx(math.sqrt(total / (6 * 200)))
    assert got.df == pytest.approx(satterthwaite(total, [(ms_s, 5), (ms_q, 199), (-ms_e, 995)]))


def test_the_seed_t_interval_by_hand():
    # per-seed means 1, 2, 4: mean 7/3, sd sqrt(7/3), se sqrt(7/9); t(0.975, 2) = 4.302653
    got = seed_t(TABLE)
    se = math.sqrt(7 / 9)
    assert (got.estimate, got.se, got.df) == pytest.approx((7 / 3, se, 2))
    assert (got.low, got.high) == pytest.approx((7 / 3 - 4.302653 * se, 7 / 3 + 4.302653 * se))


def test_two_one_sided_tests_against_a_declared_margin():
    e = Estimate(0.002, 0.0, 0.0, se=0.001, df=10, p=0.1, level=0.95, method="hand")
    # margin 0.005: t_hi = (0.002 - 0.005) / 0.001 = -3, P(T_10 < -3) = 0.006671; t_lo = 7
    eq = equivalence(e, 0.005)
    assert eq.p_upper == pytest.approx(0.006671, abs=1e-6) and eq.p_lower < 1e-4
    assert eq.equivalent and eq.p == eq.p_upper
    # the 90% interval 0.002 +- 1.812461 x 0.001 lies inside +-0.005
    assert (eq.low, eq.high) == pytest.approx((0.002 - 0.0018125, 0.002 + 0.0018125), abs=1e-7)
    # margin 0.003: t_hi = -1, P(T_10 < -1) = 0.170447: not shown equivalent
    narrow = equivalence(e, 0.003)
    assert narrow.p == pytest.approx(0.170447, abs=1e-6) and not narrow.equivalent
    assert narrow.high > 0.003  # the same answer as the interval's
    # "no difference shown" is not "equivalent": a wide interval gives verdict 0 and no match
    wide = Estimate(0.0, -0.05, 0.05, se=0.02, df=4, p=1.0, level=0.95, method="hand")
    assert verdict(wide) == "0" and not equivalence(wide, 0.01).equivalent
    with pytest.raises(ValueError, match="positive"):
        equivalence(e, 0.0)
