"""The staleness rules on hand-made drifts, and the adaptive gate on synthetic drift streams."""

from __future__ import annotations

import math

import pytest
import torch

from headroom_drift.gates import AdaptiveGate, Gate, adapt_tau
from headroom_drift.staleness import as_tensors, decide, staleness_rule

# five groups: on time, then late by 1, 1, 2 and 3 updates
DRIFTS, LAGS = as_tensors([0.30, 0.01, 0.20, 0.02, 0.001], [0, 1, 1, 2, 3])


class Fixed:
    def __init__(self, tau: float) -> None:
        self.tau, self.seen = tau, []

    def update(self, drifts, admitted) -> None:
        self.seen.append((drifts.tolist(), admitted.tolist()))


def test_version_bound_admits_by_lag_alone():
    rule = staleness_rule("version_bound")
    assert rule.admit(DRIFTS, LAGS, 0.0, 2).tolist() == [True, True, True, True, False]
    assert rule.admit(DRIFTS, LAGS, 0.0, 0).tolist() == [True, False, False, False, False]


def test_drift_gate_admits_late_groups_under_tau_within_the_version_cap():
    rule = staleness_rule("drift_gate")
    # the on-time group is admitted even over tau; the lag-3 group is under tau but over the cap
    assert rule.admit(DRIFTS, LAGS, 0.05, 2).tolist() == [True, True, False, True, False]
    assert rule.admit(DRIFTS, LAGS, 0.05, 3).tolist() == [True, True, False, True, True]
    assert rule.admit(DRIFTS, LAGS, 0.0, 3).tolist() == [True, False, False, False, False]
    assert rule.admit(DRIFTS, LAGS, 0.25, 3).tolist() == [True, True, True, True, True]


def test_a_drift_tie_is_admitted():
    rule = staleness_rule("drift_gate")
    drifts, lags = as_tensors([0.05], [1])
    assert rule.admit(drifts, lags, 0.05, 1).tolist() == [True]


def test_decide_uses_the_gates_tau_and_shows_it_only_the_late_groups():
    gate = Fixed(0.05)
    got = decide(staleness_rule("adaptive_drift_gate"), gate, DRIFTS, LAGS, 2)
    assert got.admitted.tolist() == [True, True, False, True, False]
    assert got.tau == 0.05 and got.late_admitted_share == 0.5
    assert gate.seen == [(pytest.approx([0.01, 0.20, 0.02, 0.001]), [True, False, True, False])]
    bound = decide(staleness_rule("version_bound"), Fixed(0.05), DRIFTS, LAGS, 2)
    assert bound.tau == math.inf and bound.late_admitted_share == 0.75


def test_unknown_rule_lists_the_valid_ones():
    with pytest.raises(ValueError, match="adaptive_drift_gate, drift_gate, version_bound"):
        staleness_rule("max_staleness")


def test_adapt_tau_moves_toward_the_target_and_stays_in_bounds():
    assert adapt_tau(0.1, 0.2, 0.5, 0.1, 1e-6, 1.0) > 0.1  # too few admitted: raise
    assert adapt_tau(0.1, 0.9, 0.5, 0.1, 1e-6, 1.0) < 0.1
    assert adapt_tau(0.1, 0.5, 0.5, 0.1, 1e-6, 1.0) == pytest.approx(0.1)
    assert adapt_tau(0.99, 0.0, 0.5, 1.0, 1e-6, 1.0) == 1.0
    # the relative error is clipped: one step is at most a factor exp(rate)
    assert adapt_tau(0.1, 1e9, 1e-3, 0.1, 1e-6, 1.0) == pytest.approx(0.1 * math.exp(-0.1))


def drift_stream(seed: int, n: int, batch: int) -> torch.Tensor:
    """`[n, batch]` log-normal drifts (median e^-4, the spread of a real run's late groups)."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(-4.0 + 1.0 * torch.randn(n, batch, generator=g))


def run_gate(gate: AdaptiveGate, stream: torch.Tensor) -> tuple[list[float], list[float]]:
    taus, measured = [], []
    for drifts in stream:
        admitted = drifts <= gate.tau
        gate.update(drifts, admitted)
        taus.append(gate.tau)
        measured.append(gate.last_measured)
    return taus, measured


@pytest.mark.parametrize("target", [0.3, 0.7])
def test_adaptive_gate_holds_a_target_acceptance_rate(target):
    gate = AdaptiveGate(tau=1.0, target=target, kind="acceptance", rate=0.05)
    taus, measured = run_gate(gate, drift_stream(0, 3000, 8))
    tail = slice(1000, None)
    assert sum(measured[tail]) / len(measured[tail]) == pytest.approx(target, abs=0.03)
    # tau settles at the drift distribution's target quantile (log-normal: exact)
    z = torch.distributions.Normal(0.0, 1.0).icdf(torch.tensor(target)).item()
    settled = math.exp(sum(math.log(t) for t in taus[tail]) / len(taus[tail]))
    assert settled == pytest.approx(math.exp(-4.0 + z), rel=0.15)
    assert taus[0] > 0.5  # it started far above and came down


def test_adaptive_gate_holds_a_drift_budget():
    budget = 0.01
    gate = AdaptiveGate(tau=1e-4, target=budget, kind="drift_budget", rate=0.05)
    taus, measured = run_gate(gate, drift_stream(1, 3000, 8))
    tail = slice(1000, None)
    # the tau whose admitted mean drift is the budget, from a large sample of the same stream
    big = drift_stream(2, 20000, 8).flatten().sort().values
    means = big.cumsum(0) / torch.arange(1, len(big) + 1)
    want = float(big[int((means <= budget).nonzero().max())])
    settled = math.exp(sum(math.log(t) for t in taus[tail]) / len(taus[tail]))
    assert settled == pytest.approx(want, rel=0.2)
    assert sum(measured[tail]) / len(measured[tail]) == pytest.approx(budget, rel=0.15)


def test_adaptive_gate_ignores_an_empty_decision_and_round_trips_its_state():
    gate = AdaptiveGate(tau=0.05, target=0.5)
    assert isinstance(gate, Gate)  # the lifecycle's gate interface
    gate.update(torch.zeros(0), torch.zeros(0, dtype=torch.bool))
    assert gate.tau == 0.05 and math.isnan(gate.last_measured)
    gate.update(torch.tensor([0.01, 0.1]), torch.tensor([True, False]))
    other = AdaptiveGate(tau=0.05, target=0.5)
    other.load_state_dict(gate.state_dict())
    assert other.tau == gate.tau and other.last_measured == 0.5


def test_adaptive_gate_refuses_a_target_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        AdaptiveGate(tau=0.05, target=1.5, kind="acceptance")
    with pytest.raises(ValueError, match="out of range"):
        AdaptiveGate(tau=0.05, target=0.0, kind="drift_budget")
