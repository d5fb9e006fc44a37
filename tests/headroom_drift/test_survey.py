"""`GroupReplay.survey` on hand-built groups: it reports each stored group's age, drift and
headroom under the current policy, newest first, and changes nothing."""

import math

import torch

from headroom_drift import GroupReplay, headroom, policy_drift


def group(replay: GroupReplay, step: int, shift: float):
    lp = torch.full((2, 3), math.log(0.5))
    mask = torch.tensor([[0.0, 1.0, 1.0], [0.0, 1.0, 1.0]])
    g = replay.make(step, torch.ones(2, 3, dtype=torch.long), torch.ones(2, 3, dtype=torch.long),
                    mask, lp * mask, torch.tensor([1.0, 0.0]))  # fmt: skip
    g.shift = shift  # how far the "current policy" has moved on this group (test only)
    return g


def test_survey_reports_without_changing_anything():
    replay = GroupReplay(capacity=8, rule="headroom_drift", budget=1, tau=0.005)
    stored = [group(replay, s, shift) for s, shift in enumerate([0.3, 0.01, 0.1])]
    replay.ingest(stored)
    before = [(g.headroom, g.replay_count) for g in stored]

    def score(groups):
        return [(g.gen_logprobs + g.shift) * g.loss_mask for g in groups]

    seen = replay.survey(3, score)
    assert [c.group_id for c in seen] == [g.group_id for g in reversed(stored)]
    assert [c.age for c in seen] == [1, 2, 3]
    for c, g in zip(seen, reversed(stored), strict=True):
        current = score([g])[0]
        assert c.drift == float(policy_drift(current, g.gen_logprobs, g.loss_mask, "l2"))
        assert c.headroom == float(headroom(current, g.loss_mask, g.advantages))
        assert c.stored_headroom == g.headroom
    assert [(g.headroom, g.replay_count) for g in stored] == before  # nothing refreshed
    assert replay.pending is None  # nothing selected
    assert [c.group_id for c in replay.survey(3, score, newest=2)] == [
        g.group_id for g in reversed(stored)
    ][:2]
    # the scan admits by the same drift: only the group moved 0.01 (drift 1e-4) passes tau 0.005
    picked = replay.select(3, score)
    passing = [c.group_id for c in seen if c.drift <= 0.005]
    assert [g.group_id for g in picked.groups] == passing == [stored[1].group_id]
    # groups that entered at the step or later are not eligible, as in the scan
    assert [c.group_id for c in replay.survey(1, score)] == [stored[0].group_id]
