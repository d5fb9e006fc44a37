"""Reading rollout trajectories in tests: the runs of response ids under one mask value.

Import it as `from trajectories import masked_runs` (pytest puts `tests/` on sys.path).
"""

from __future__ import annotations


def masked_runs(traj, value: int = 0) -> list[list[int]]:
    """Maximal runs of `traj.response_ids` whose loss mask is `value` (0: the environment's
    text, 1: the policy's)."""
    runs, current = [], []
    for tok, m in zip(traj.response_ids, traj.loss_mask, strict=True):
        if m == value:
            current.append(tok)
        elif current:
            runs.append(current)
            current = []
    return [*runs, current] if current else runs
