"""`hdr calibrate`: choose the drift gate `tau` by a three-point log-spaced sweep.

As in the paper, each point is a short training run (same model, seed and data) with the
rule's gate at one `tau`; what is reported is each point's replay acceptance rate (admitted /
scanned groups over the run). The useful setting filters selectively: neither close to 0%
(the gate rejects nearly everything, so there is no replay) nor close to 100% (the gate
admits nearly everything, so it does not gate). The recommendation is the point whose rate
is nearest 50% among those between 15% and 85%, else the nearest 50% overall, flagged.

Default points: `replay.tau / 10`, `replay.tau`, `replay.tau * 10`. The replay rule must gate
(`headroom_drift`, `headroom_drift_l1` or `drift_only`); another rule is replaced by
`headroom_drift`. Point runs live in `OUT/tau-<value>/` and are replaced on a rerun.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from core.errors import UserError
from core.paths import CALIBRATION, check_output, local_model, write_json_atomic
from headroom_drift import is_gated
from trainer.config import TrainConfig

SELECTIVE = (0.15, 0.85)


@dataclass
class CalibrationPoint:
    tau: float
    scanned: int
    admitted: int
    acceptance_rate: float
    drift_scanned_median: float
    run_dir: str


@dataclass
class CalibrationReport:
    points: list[CalibrationPoint]
    recommended_tau: float
    selective: bool  # whether the recommended point lies in the selective band

    def table(self) -> str:
        lines = [
            "| tau | scanned | admitted | acceptance | median drift (scanned) | |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for p in self.points:
            mark = "recommended" if p.tau == self.recommended_tau else ""
            lines.append(
                f"| {p.tau:.3g} | {p.scanned} | {p.admitted} | {p.acceptance_rate:.1%} "
                f"| {p.drift_scanned_median:.3g} | {mark} |"
            )
        if not self.selective:
            lines.append(
                "\nno point filters selectively (15%-85%); widen or shift the sweep (--taus)"
            )
        return "\n".join(lines)


def log_spaced(center: float, factor: float = 10.0) -> list[float]:
    """Three points: center / factor, center, center * factor."""
    return [center / factor, center, center * factor]


def read_point(run_dir: Path, tau: float) -> CalibrationPoint:
    """Acceptance over a finished run's metrics.jsonl."""
    import numpy as np

    scanned = admitted = 0
    medians = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        scanned += row["scanned_groups"]
        admitted += row["replayed_groups"] if row["scanned_groups"] else 0
        if row["drift_scanned_q"]:
            medians.append(row["drift_scanned_q"][1])
    rate = admitted / scanned if scanned else math.nan
    median = float(np.median(medians)) if medians else math.nan
    return CalibrationPoint(tau, scanned, admitted, rate, median, str(run_dir))


def recommend(points: list[CalibrationPoint]) -> tuple[float, bool]:
    """The point nearest 50% acceptance within the selective band (else overall)."""
    rated = [p for p in points if not math.isnan(p.acceptance_rate)]
    if not rated:
        raise UserError("no calibration point scanned any group; run more --steps")
    band = [p for p in rated if SELECTIVE[0] <= p.acceptance_rate <= SELECTIVE[1]]
    best = min(band or rated, key=lambda p: abs(p.acceptance_rate - 0.5))
    return best.tau, bool(band)


def calibrate(
    config: TrainConfig,
    out: Path,
    steps: int = 10,
    taus: list[float] | None = None,
    force: bool = False,
) -> CalibrationReport:
    """Run one short training per tau under `out/` (new, empty, or an earlier calibration
    with `force`: `core.paths`), report and write `out/calibrate.json`."""
    from trainer.loop import train

    local_model(config.model.path)
    out = check_output(out, CALIBRATION, force=force, inputs=[config.model.path])
    taus = taus or log_spaced(config.replay.tau)
    if len(taus) < 2:
        raise UserError("calibrate needs at least two taus")
    rule = config.replay.rule if is_gated(config.replay.rule) else "headroom_drift"
    points = []
    for tau in taus:
        point_dir = out / f"tau-{tau:.3g}"
        point_cfg = config.model_copy(
            update={
                "steps": steps,
                "out_dir": str(point_dir),
                "replay": config.replay.model_copy(update={"tau": tau, "rule": rule}),
                "grpo": config.grpo.model_copy(
                    update={"warmup_steps": min(config.grpo.warmup_steps, steps - 1)}
                ),
                "eval": config.eval.model_copy(update={"every": 0}),
                "checkpoint": config.checkpoint.model_copy(update={"save_every": 0}),
            }
        )
        points.append(read_point(train(point_cfg, force=True), tau))  # an earlier point's run
    tau, selective = recommend(points)
    report = CalibrationReport(points, tau, selective)
    write_json_atomic(out / "calibrate.json", asdict(report))
    return report
