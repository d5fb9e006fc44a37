"""The dose-response gate (experiment/precondition.py) on a hand case, and the
pilot preset that declares it, through the summary into results.md."""

from __future__ import annotations

import numpy as np
import pytest
from test_experiment import _runs

from core.errors import UserError
from experiment.config import experiment_config
from experiment.precondition import gate
from experiment.report import results_markdown
from experiment.summary import summarize
from experiment.train_configs import shared_train_config

# 2 seeds x 4 questions: seed and question means all 0.1, so MS_S = MS_Q = 0; the residuals
# are 0, -0.1, 0.1, 0 and 0, 0.1, -0.1, 0: SS_E = 0.04 over 3 df, MS_E = 0.04 / 3
GAIN = np.array([[0.1, 0.0, 0.2, 0.1], [0.1, 0.2, 0.0, 0.1]])


def test_the_gate_by_hand():
    # components: seed 0, question 0, residual 0.04 / 3. Planned 5 seeds x 100 questions:
    # SE = sqrt(0.013333 / 500) = 0.0051640; MDE = (t_.975,4 + t_.8,4) SE = 3.7174 x SE = 0.019197
    gain, parts, mde, go = gate(GAIN, 0.0, 2, (5, 100, 2))
    assert (parts.seed, parts.question, parts.residual) == pytest.approx((0, 0, 0.04 / 3))
    assert mde == pytest.approx(0.019197, rel=1e-3)
    assert gain.estimate == pytest.approx(0.1) and go  # 0.1 >= 2 x 0.0192
    # at 5 seeds x 4 questions: SE = sqrt(0.013333 / 20) = 0.025820, MDE 0.095983: 2 x is 0.19
    _, _, small_mde, small_go = gate(GAIN, 0.0, 2, (5, 4, 2))
    assert small_mde == pytest.approx(0.095983, rel=1e-3) and not small_go
    # the ratio is the declared one
    assert gate(GAIN, 0.0, 2, (5, 4, 2), ratio=1.0)[3]


def test_the_pilot_preset_declares_the_gate_and_results_carry_it(tmp_path):
    cfg = experiment_config("pilot-dose-response", overrides=["seeds=[1,2,3]"])
    assert cfg.precondition.arm == "on_policy_b12" and cfg.precondition.reference == "on_policy_b8"
    assert [b.name for b in cfg.precondition.beds][:2] == ["base", "longer"]
    assert cfg.arm("on_policy_b4").overrides == ("grpo.batch_prompts=4",)
    assert cfg.final_questions is None and cfg.final_k == 8  # the whole test split
    longer = experiment_config("pilot-dose-response", overrides=["pilot_bed=longer"])
    assert longer.train["steps"] == 240
    with pytest.raises(UserError, match="unknown pilot_bed 'nope'; declared beds: base"):
        experiment_config("pilot-dose-response", overrides=["pilot_bed=nope"])
    doses = (("on_policy_b4", 0.0), ("on_policy_b6", 0.01), ("on_policy_b8", 0.02),
             ("on_policy_b12", 0.5), ("on_policy_b16", 0.55))  # fmt: skip
    results = [run for name, shift in doses for run in _runs(tmp_path, name, shift)]
    summary = summarize(results, cfg.references, cfg=cfg)
    pre = summary.precondition
    assert pre is not None and pre.seeds == [1, 2, 3] and pre.design == (5, 40, 8)
    expected = gate(pre_table(results), pre.components.sampling_noise, 4, (5, 40, 8))
    assert pre.mde == pytest.approx(expected[2]) and pre.go == expected[3]
    assert pre.gain.estimate > 0.35 and pre.go  # a large dose step passes
    md = results_markdown(summary, cfg)
    assert md.startswith("**Precondition (declared before the runs): GO:")


def pre_table(results):
    by = {(r.arm, r.seed): r.report.per_question("mean") for r in results}
    return np.stack([by["on_policy_b12", s] - by["on_policy_b8", s] for s in (1, 2, 3)])


def test_the_replay_comparison_is_the_gated_design_on_any_bed():
    """The comparison a passing bed runs was declared beside the pilot: its design is the one
    the gate's MDE was computed for, its 1.5x arm is the gate's arm, every "matches" has a
    margin, and a bed's overrides laid over it reach the runs."""
    pilot = experiment_config("pilot-dose-response")
    comparison = experiment_config("replay-comparison")
    pre = pilot.precondition
    assert len(comparison.seeds) == pre.planned_seeds and comparison.final_k == pre.planned_k
    assert comparison.final_questions == pre.planned_questions  # None: the whole test split
    gate_fresh = [o for o in pilot.arm(pre.arm).overrides if o.startswith("grpo.batch_prompts=")]
    b = comparison.train["grpo"]["batch_prompts"]
    larger = comparison.arm("on_policy_larger").fresh * b
    assert gate_fresh == [f"grpo.batch_prompts={round(larger)}"]
    assert pilot.arm(pre.reference).overrides == (f"grpo.batch_prompts={b}",)
    pairs = {(c.arm, c.reference, c.metric): c for c in comparison.contrasts}
    assert ("headroom_drift", "on_policy", "mean_at_k") in pairs  # equal fresh rollouts
    primary = pairs[("headroom_drift", "on_policy_larger", "mean_at_k")]
    assert primary.primary and primary.equivalence_margin == 0.0075
    for bed in pre.beds:
        on_bed = experiment_config("replay-comparison", overrides=bed.overrides)
        on_pilot = experiment_config("pilot-dose-response", overrides=[f"pilot_bed={bed.name}"])
        changed = {o.split("=")[0].split(".")[0] for o in bed.overrides} - {"train"}
        for key in changed | {"policy"}:
            assert getattr(on_bed, key) == getattr(on_pilot, key), (bed.name, key)
        bed_train, pilot_train = shared_train_config(on_bed), shared_train_config(on_pilot)
        for key in ("steps", "grpo", "rollout", "data"):  # the pilot's arms do not replay
            assert getattr(bed_train, key) == getattr(pilot_train, key), (bed.name, key)
