"""Run logs: metrics.jsonl (one object per step), eval.jsonl, groups.jsonl and TensorBoard.

Scalar metrics become TensorBoard scalars under their own names; quantile lists
(`*_q`, the 10/50/90% quantiles) become `name/p10`, `name/p50`, `name/p90`; other lists
(replay ages, replay counts, stored and refreshed headroom) become histograms. On resume the
files are cut back to the checkpoint's step, and TensorBoard purges the later events, so a
resumed run's logs read as if it had never stopped.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

QUANTILES = (0.1, 0.5, 0.9)


def quantiles(values: list[float]) -> list[float]:
    """The 10/50/90% quantiles of `values`; `[]` when empty."""
    if not values:
        return []
    return [float(q) for q in np.quantile(np.asarray(values, dtype=float), QUANTILES)]


def _filter_jsonl(path: Path, keep) -> None:
    if not path.exists():
        return
    lines = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if keep(row):
            lines.append(json.dumps(row))
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(line + "\n" for line in lines))
    os.replace(tmp, path)


class RunLogs:
    """Append-only JSONL logs and an optional TensorBoard writer in a run directory."""

    def __init__(self, run_dir: Path, tensorboard: bool, purge_step: int | None = None) -> None:
        self.run_dir = run_dir
        self._files = {
            name: (run_dir / f"{name}.jsonl").open("a") for name in ("metrics", "eval", "groups")
        }
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)

    @staticmethod
    def truncate_after(run_dir: Path, step: int) -> None:
        """Drop what was logged after `step` (a resumed run will log it again)."""
        _filter_jsonl(run_dir / "metrics.jsonl", lambda r: r.get("step", 0) <= step)
        _filter_jsonl(run_dir / "eval.jsonl", lambda r: r.get("step", 0) <= step)
        _filter_jsonl(
            run_dir / "groups.jsonl",
            lambda r: r.get("left_step") is not None and r["left_step"] <= step,
        )

    def _write(self, name: str, record: dict[str, Any]) -> None:
        self._files[name].write(json.dumps(record) + "\n")
        self._files[name].flush()

    def step(self, record: dict[str, Any]) -> None:
        self._write("metrics", record)
        self._tensorboard("train", record)

    def eval(self, record: dict[str, Any]) -> None:
        self._write("eval", record)
        self._tensorboard("eval", record)

    def groups_left(self, groups, step: int | None) -> None:
        """One line per group that left the buffer at `step` (None: still there at the end)."""
        for g in groups:
            self._write(
                "groups",
                {
                    "group_id": g.group_id,
                    "entered_step": g.entered_step,
                    "initial_headroom": g.initial_headroom,
                    "replay_count": g.replay_count,
                    "left_step": step,
                },
            )

    def _tensorboard(self, prefix: str, record: dict[str, Any]) -> None:
        if self.tb is None:
            return
        step = record["step"]
        for key, value in record.items():
            if key == "step" or value is None:
                continue
            tag = f"{prefix}/{key}"
            if isinstance(value, list):
                if key.endswith("_q") and len(value) == len(QUANTILES):
                    for q, v in zip(QUANTILES, value, strict=True):
                        self.tb.add_scalar(f"{tag}/p{round(q * 100)}", v, step)
                elif value:
                    self.tb.add_histogram(tag, np.asarray(value, dtype=float), step)
            elif isinstance(value, (int, float)):
                self.tb.add_scalar(tag, value, step)

    def flush(self) -> None:
        for f in self._files.values():
            f.flush()
        if self.tb is not None:
            self.tb.flush()

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        if self.tb is not None:
            self.tb.close()
