"""Run logs: metrics.jsonl (one object per step), eval.jsonl, groups.jsonl, and optionally
TensorBoard and Weights & Biases (`log.wandb`).

Scalar metrics become TensorBoard and W&B scalars under their own names (`train/<key>`,
`eval/<key>`); quantile lists (`*_q`, the 10/50/90% quantiles) become `name/p10`,
`name/p50`, `name/p90`; other lists (replay ages, replay counts, stored and refreshed
headroom) become histograms. On resume the files are cut back to the checkpoint's step, and
TensorBoard purges the later events, so a resumed run's logs read as if it had never stopped.
W&B cannot purge: each start of a run (a resume too) is a W&B run of its own, in a group
named after the run directory.
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import numpy as np

from core.errors import UserError
from trainer.config import WandbConfig
from trainer.frozen_bottom import attached
from trainer.scoring import distinct_tokens

QUANTILES = (0.1, 0.5, 0.9)


def quantiles(values: list[float]) -> list[float]:
    """The 10/50/90% quantiles of `values`; `[]` when empty."""
    if not values:
        return []
    return [float(q) for q in np.quantile(np.asarray(values, dtype=float), QUANTILES)]


@dataclass
class StepCost:
    """The cost ledger of one training step; logged as `cost_<field>` in metrics.jsonl.

    Counts (tokens, calls, groups) are machine-independent: the same config and seed give
    the same counts on any machine, except the split of search calls into billed and cached,
    which the retrieval server's cache decides. Seconds are not: `env_wait_s` is wall time
    waiting on the retrieval server, `cpu_*_s` are process CPU seconds (every thread) by phase.
    Teacher-forced tokens are the real (attention-mask) tokens of the rows a phase runs
    through the model; the no-grad phases score exact-duplicate rows once, so they count
    distinct rows; the update counts every row once per optimizer pass (forward + backward).
    """

    prompt_tokens: int = 0  # prompts of the fresh trajectories (refills included)
    generated_tokens: int = 0  # tokens the policy sampled (loss mask 1), refills included
    observation_tokens: int = 0  # environment text appended to responses (loss mask 0)
    behaviour_tf_tokens: int = 0  # scoring the kept fresh groups' behaviour log-probs
    scan_tf_tokens: int = 0  # re-scoring replay candidates
    gate_tf_tokens: int = 0  # the staleness gate's pass over late groups (async rollout)
    update_tf_tokens: int = 0  # the update's forward + backward
    fresh_groups: int = 0  # groups rolled out (refills and dropped groups included)
    search_calls: int = 0  # tool calls (queries) sent to the environment
    # ... of which the server computed (searched, or forwarded to a paid upstream) and those
    # it answered without a computation (its result cache, an identical query in flight):
    # the environment's cost is the billed ones; both depend on the server's cache too
    billed_search_calls: int = 0
    cached_search_calls: int = 0
    env_requests: int = 0  # batched HTTP requests that carried them
    passages: int = 0  # passages the environment returned
    update_groups: int = 0  # groups in the update, fresh + replayed
    informative_groups: int = 0  # ... of which have some non-zero advantage
    informative_tokens: int = 0  # policy tokens of responses with non-zero advantage
    replayed_groups: int = 0
    scanned_groups: int = 0
    env_wait_s: float = 0.0
    cpu_rollout_s: float = 0.0  # generation and the client's side of retrieval
    cpu_scoring_s: float = 0.0
    cpu_selection_s: float = 0.0
    cpu_update_s: float = 0.0

    def record(self) -> dict[str, Any]:
        return {f"cost_{k}": v for k, v in asdict(self).items()}


COST_KEYS = tuple(f"cost_{f.name}" for f in fields(StepCost))


class PhaseClock:
    """The phases of one step (rollout, scoring, selection, update): each one's wall seconds
    (`seconds`), process CPU seconds (`cpu`, every thread) and the tokens a frozen bottom
    (`model.train_layers`) forwarded in it (`bottom_tokens`, with one only)."""

    def __init__(self, model: Any) -> None:
        self.bottom = attached(model)
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.bottom_tokens: dict[str, int] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        started, cpu = time.perf_counter(), time.process_time()
        before = self.bottom.computed_tokens if self.bottom is not None else 0
        try:
            yield
        finally:
            self.cpu[name] = self.cpu.get(name, 0.0) + time.process_time() - cpu
        self.seconds[name] = time.perf_counter() - started
        if self.bottom is not None:
            self.bottom_tokens[name] = self.bottom.computed_tokens - before

    def elapsed(self) -> float:
        """Wall seconds since the step began."""
        return time.perf_counter() - self.started


class CountedScore:
    """A replay `ScoreFn` that also counts the teacher-forced tokens it scored (distinct rows
    of each call, as the no-grad scoring forwards them): the step's scan tokens."""

    def __init__(self, score: Any) -> None:
        self.score, self.tokens = score, 0

    def __call__(self, groups: list) -> list:
        self.tokens += distinct_tokens(groups)
        return self.score(groups)


@dataclass
class StepRecord:
    """What one training step logs: one line of metrics.jsonl (`as_dict`), field for key."""

    step: int
    # the fresh rollout
    reward_mean: float
    em_mean: float
    entropy: float  # mean token entropy of the fresh policy tokens (teacher-forced)
    logprob_gap_mean: float | None  # |sampler - trainer| log-prob over fresh policy tokens
    logprob_gap_max: float | None
    # the update
    loss: float
    grad_norm: float
    kl: float
    lr: float
    # replay
    fresh_tokens: int
    replay_tokens: int
    replayed_groups: int
    scanned_groups: int
    acceptance_rate: float | None  # admitted / scanned; None for rules that do not scan
    drift_scanned_q: list[float]  # 10/50/90% quantiles
    drift_admitted_q: list[float]
    headroom_scanned_q: list[float]
    headroom_admitted_q: list[float]
    replay_ages: list[int]  # steps since entry, per replayed group
    replay_counts: list[int]  # times replayed so far, this step included
    headroom_stored: list[float]  # admitted groups' headroom before the refresh
    headroom_refreshed: list[float]
    buffer_size: int  # after ingress
    # the environment
    env_calls: int
    env_calls_total: int
    search_calls: int
    search_calls_total: int
    billed_search_calls_total: int  # the run's cost_billed_search_calls so far
    cached_search_calls_total: int
    dropped_groups: int
    retrieval_outage_s: float
    retrieval_outages: int
    retrieval_truncated_queries: int
    retrieval_failed_queries: int
    # wall seconds
    time_generation: float
    time_retrieval: float
    time_scoring: float
    time_selection: float
    time_update: float
    time_collectives: float
    time_step: float
    wall_time_total: float
    world_size: int
    fresh_group_ids: list[str]
    replayed_group_ids: list[str]
    cost: StepCost
    # truncated importance sampling of the fresh tokens (with `grpo.tis_cap` only)
    is_weight_mean: float | None = None
    is_capped_frac: float | None = None
    # asynchronous rollout (`headroom_drift.LateDecision.record`): each fresh group's
    # lag, the late groups' drift and admission, the staleness tau; None in the sync loop
    async_rollout: dict[str, Any] | None = None
    # an adaptive replay gate (`replay.gate: adaptive`): the tau the step's scan admitted by,
    # the tau after it, and what the gate measured; None with the fixed gate
    replay_gate: dict[str, Any] | None = None
    # the replay survey (`replay.survey`, trainer/survey.py); None when it is off
    survey: dict[str, Any] | None = None
    # tokens the frozen bottom forwarded per phase (`bottom_tokens_<phase>`); None without one
    frozen_bottom: dict[str, Any] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The metrics.jsonl line: every field, the ledger as `cost_*` keys, and the TIS
        fields only when TIS is on."""
        skip = ("cost", "async_rollout", "replay_gate", "survey", "frozen_bottom")
        record = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in skip}
        for name in ("is_weight_mean", "is_capped_frac"):
            if record[name] is None:
                del record[name]
        extra = {}
        for part in (self.async_rollout, self.replay_gate, self.survey, self.frozen_bottom):
            extra.update(part or {})
        return {**record, **extra, **self.cost.record()}


# what a server's result cache decides (a warm cache bills fewer of the same searches), not the
# run alone: left out of the counts two runs of one config must share
SERVER_STATE_KEYS = ("cost_billed_search_calls", "cost_cached_search_calls")
COUNT_KEYS = tuple(k for k in COST_KEYS if not k.endswith("_s") and k not in SERVER_STATE_KEYS)


def cost_totals(records: Iterable[dict[str, Any]]) -> dict[str, float]:
    """A run's ledger: every `cost_*` field summed over its steps' metrics records.

    A field missing from a record counts 0: metrics written before that field existed (such
    as `cost_gate_tf_tokens`, which only asynchronous rollout spends) did not spend it."""
    totals: dict[str, float] = dict.fromkeys(COST_KEYS, 0)
    for row in records:
        for key in COST_KEYS:
            totals[key] += row.get(key, 0)
    return totals


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

    def __init__(
        self,
        run_dir: Path,
        tensorboard: bool,
        purge_step: int | None = None,
        wandb: WandbConfig | None = None,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.run_dir = run_dir
        self._files = {
            name: (run_dir / f"{name}.jsonl").open("a") for name in ("metrics", "eval", "groups")
        }
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"), purge_step=purge_step)
        self.wandb = None
        if wandb is not None and wandb.mode != "off":
            self.wandb = start_wandb(run_dir, wandb, config)

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
        """The record to TensorBoard and W&B, each value under its tag (`tagged`)."""
        if self.tb is None and self.wandb is None:
            return
        step, values = record["step"], dict(tagged(prefix, record))
        for tag, value in values.items() if self.tb is not None else ():
            if isinstance(value, np.ndarray):
                self.tb.add_histogram(tag, value, step)
            else:
                self.tb.add_scalar(tag, value, step)
        if self.wandb is not None:
            import wandb

            self.wandb.log(
                {t: wandb.Histogram(v) if isinstance(v, np.ndarray) else v
                 for t, v in values.items()},
                step=step,
            )  # fmt: skip

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
        if self.wandb is not None:
            self.wandb.finish()
            self.wandb = None


def tagged(prefix: str, record: dict[str, Any]) -> Iterator[tuple[str, float | np.ndarray]]:
    """A record's loggable values under their tags (`prefix/key`): numbers as they are, a
    quantile list as its three quantiles (`/p10`, `/p50`, `/p90`), another list of numbers as
    an array (a histogram); the step, None, strings and empty lists are left out."""
    for key, value in record.items():
        if key == "step" or value is None:
            continue
        tag = f"{prefix}/{key}"
        if isinstance(value, list):
            if key.endswith("_q") and len(value) == len(QUANTILES):
                for q, v in zip(QUANTILES, value, strict=True):
                    yield f"{tag}/p{round(q * 100)}", v
            elif value and all(isinstance(v, (int, float)) for v in value):
                yield tag, np.asarray(value, dtype=float)
        elif isinstance(value, (int, float)):
            yield tag, value


def start_wandb(run_dir: Path, settings: WandbConfig, config: dict[str, Any] | None) -> Any:
    """A W&B run for this start of the run, its files under `run_dir/wandb/`: no console
    capture, no system metrics, no code or git state saved."""
    require_wandb(settings)
    import wandb

    quiet = wandb.Settings(
        console="off", silent=True, x_disable_stats=True, disable_git=True, save_code=False
    )
    return wandb.init(
        project=settings.project, name=settings.name or run_dir.name, group=run_dir.name,
        dir=str(run_dir), mode=settings.mode, config=config, settings=quiet,
    )  # fmt: skip


def require_wandb(settings: WandbConfig) -> None:
    """One line when W&B is asked for and the wandb package is not installed."""
    if settings.mode != "off" and importlib.util.find_spec("wandb") is None:
        raise UserError(
            f"log.wandb.mode={settings.mode} needs the wandb package:"
            ' pip install -e ".[wandb]" (or log.wandb.mode=off)'
        )
