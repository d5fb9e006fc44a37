"""The replay comparison's decision rule, declared in its preset before any run
(`ExperimentConfig.decision`), applied to the measured contrasts.

Three questions, each answered by one declared contrast on Mean@k (`experiment.summary`):

- does replay add quality at the same billed search calls? `replay` - `fresh` (primary,
  two-sided): "adds" / "costs" when significant; otherwise "no difference shown", and "no
  worse than" only where its TOST puts the difference inside the declared margin;
- does the selection beat naive replay at the same replay budget? `replay` - `naive`
  (secondary, Holm): "beats" / "loses to" / "no difference shown";
- does it beat 1.5x the fresh prompts? `replay` - `larger` (secondary, Holm, one-sided
  greater): "beats" when significant; "matches" only where the dose itself is shown
  (`larger` - `fresh` significant and positive) and the TOST of `replay` - `larger` lies
  inside the margin; otherwise "not shown".

A question whose contrast has not been measured (fewer than two seeds of either arm) is
answered "not measured".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pydantic import Field

from core.config import StrictModel

if TYPE_CHECKING:  # the summary imports the config, which holds a DecisionRule
    from experiment.summary import ContrastResult


class DecisionRule(StrictModel):
    """The arms of the replay comparison's three questions and the margin of its "no worse"
    and "matches" claims (Mean@k), declared before the runs."""

    replay: str = Field("headroom_drift", description="The replay arm under test.")
    fresh: str = Field("on_policy", description="The same fresh prompts, no replay.")
    naive: str = Field("replay_recency", description="Naive replay at the same budget.")
    larger: str = Field("on_policy_larger", description="1.5x the fresh prompts, no replay.")
    margin: float = Field(gt=0, description="Equivalence margin on Mean@k (TOST).")


@dataclass(frozen=True)
class Answer:
    question: str
    answer: str
    contrast: ContrastResult | None

    def line(self) -> str:
        c = self.contrast
        if c is None:
            return f"- {self.question} **{self.answer}**."
        return (
            f"- {self.question} **{self.answer}**: {c.arm} - {c.reference}"
            f" {c.estimate:+.4f} [{c.low:+.4f}, {c.high:+.4f}], MDE {c.mde:.4f},"
            f" {len(c.seeds)} seeds x {c.questions} questions."
        )


def find(contrasts: Sequence[ContrastResult], arm: str, reference: str) -> ContrastResult | None:
    for c in contrasts:
        if c.arm == arm and c.reference == reference and c.metric == "mean_at_k":
            return c
    return None


def inside_margin(c: ContrastResult) -> bool:
    return c.equivalence is not None and c.equivalence.equivalent


def decide(rule: DecisionRule, contrasts: Sequence[ContrastResult]) -> list[Answer]:
    """The three answers, in the order the module docstring gives them."""
    answers = []
    adds = find(contrasts, rule.replay, rule.fresh)
    if adds is None:
        text = "not measured"
    elif adds.verdict == "+":
        text = "yes, it adds quality"
    elif adds.verdict == "−":
        text = "no, it costs quality"
    else:
        text = "no worse, within the margin" if inside_margin(adds) else "no difference shown"
    q = "At the same billed search calls, does replay add quality?"
    answers.append(Answer(q, text, adds))

    naive = find(contrasts, rule.replay, rule.naive)
    verdicts = {"+": "yes, it beats naive replay", "−": "no, naive replay is better"}
    text = "not measured" if naive is None else verdicts.get(naive.verdict, "no difference shown")
    q = "At the same replay budget, does the selection beat naive replay?"
    answers.append(Answer(q, text, naive))

    larger = find(contrasts, rule.replay, rule.larger)
    dose = find(contrasts, rule.larger, rule.fresh)
    if larger is None:
        text = "not measured"
    elif larger.verdict == "+":
        text = "yes, it beats 1.5x the fresh prompts"
    elif dose is not None and dose.verdict == "+" and inside_margin(larger):
        text = "it matches 1.5x the fresh prompts, within the margin"
    else:
        text = "not shown"
    q = "Does it beat 1.5x the fresh prompts?"
    answers.append(Answer(q, text, larger))
    return answers


def decision_lines(
    rule: DecisionRule, contrasts: Sequence[ContrastResult], declared_seeds: int
) -> list[str]:
    """results.md's verdict paragraph: the rule's three answers; while a contrast has fewer
    than the `declared_seeds`, the verdict is pending and the answers are the rule applied to
    the seeds so far (the comparison never stops on them)."""
    answers = decide(rule, contrasts)
    run = min((len(a.contrast.seeds) for a in answers if a.contrast), default=declared_seeds)
    if run < declared_seeds:
        head = (
            f"**The replay comparison's verdict: pending** ({run} of {declared_seeds} declared"
            " seeds; below, the decision rule declared before the runs applied to the seeds so"
            f" far, which decides nothing: every declared seed runs; margin {rule.margin}"
            " Mean@k):"
        )
    else:
        head = (
            "**The replay comparison's verdict** (decision rule declared before the runs;"
            f" margin {rule.margin} Mean@k):"
        )
    return [head, *(a.line() for a in answers), ""]
