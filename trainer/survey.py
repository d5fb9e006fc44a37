"""The replay survey (`replay.survey`): what the stored groups look like to the current policy,
logged beside the step without changing it.

At each step, before the selection and at its weights, stored groups are scored teacher-forced
without gradient, off the cost ledger, and nothing is admitted or refreshed
(`GroupReplay.survey`):

- `newest`: the `budget` newest eligible groups, which `replay_recency` would replay from the
  same buffer. Beside what the step's rule chose (`survey_chosen_*`), this is the paper's
  same-buffer counterfactual: which of the two choices has less drift and more headroom;
- `buffer`: every eligible group: the admissible pool at any tau, its ages, acceptance over
  the whole buffer (the calibration of a replay setting).

The record's `survey_*` lists are one entry per surveyed group, newest first.
"""

from __future__ import annotations

import time
from typing import Any

from headroom_drift import Candidate, Selection
from trainer.run import Run


def survey_candidates(run: Run, step: int) -> tuple[list[Candidate], float] | None:
    """The surveyed groups and the seconds it took; None when the survey is off or the rule
    replays nothing."""
    mode, replay = run.config.replay.survey, run.config.replay
    if mode == "off" or not replay.replays:
        return None
    started = time.perf_counter()
    newest = replay.budget if mode == "newest" else None
    candidates = run.replay.survey(
        step, lambda groups: run.score(groups, with_grad=False), newest=newest
    )
    return candidates, time.perf_counter() - started


def survey_record(surveyed: tuple[list[Candidate], float], selection: Selection) -> dict[str, Any]:
    """The step record's `survey_*` keys: each surveyed group's id, age, drift, headroom now
    and initial headroom; the chosen groups' drift and refreshed headroom; the seconds."""
    candidates, seconds = surveyed
    return {
        "survey_group_ids": [c.group_id for c in candidates],
        "survey_ages": [c.age for c in candidates],
        "survey_drift": [c.drift for c in candidates],
        "survey_headroom": [c.headroom for c in candidates],
        "survey_initial_headroom": [c.initial_headroom for c in candidates],
        "survey_chosen_drift": list(selection.drift_admitted),
        "survey_chosen_headroom": list(selection.headroom_refreshed),
        "time_survey": seconds,
    }
