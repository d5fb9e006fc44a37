"""One GRPO step with Headroom-Drift Replay: `train_step(run, step) -> StepOutcome`.

The method is the paper's ("Headroom-Drift Replay: A Primitive for Principled Replay Control
in GRPO", arXiv 2609.03941). One step, top to bottom (`train_step`; docs/design.md):
1. rollout: `b` prompts, `G` responses each, through agent_env's multi-turn loop against the
   retrieval server(s), from the run's fresh source (`trainer/fresh.py`: the trainer's own
   processes, or rollout workers running ahead, whose late groups pass a staleness rule);
2. reward: exact match, computed by agent_env per response;
3. behaviour log-probs: every fresh token teacher-forced under the current weights
   (`gen_logprobs`), and the group advantages;
4. replay selection: the run's `GroupReplay` (`headroom_drift`) picks up to `R` stored groups
   by the run's replay rule (`replay.rule`), re-scoring candidates teacher-forced (no
   generation, no retrieval);
5. one update on fresh + replayed rows (`headroom_drift.assemble_batch`, then
   `trainer.update.update_policy`: token-mean clipped loss, AdamW, gradient clipping, warmup),
   `grpo.updates_per_step` passes (1 by default); fresh tokens optionally weighted by
   truncated importance sampling of the sampler/trainer gap (`grpo.tis_cap`);
6. ingress: the step's fresh groups enter the FIFO buffer after the update;
7. the step's outcome: what happened (the batch, the fresh groups, the selection, the
   update's statistics, the phases' seconds), from which `trainer/record.py` derives, in one
   place, the record and the cost ledger it logs (metrics.jsonl, TensorBoard, W&B). Around
   the steps (`trainer/loop.py`): a periodic held-out evaluation (eval.jsonl) and a
   checkpoint every `checkpoint.save_every` steps.

Precision: parameters, gradients and AdamW state are float32 (master weights); with
`model.compute_dtype: bfloat16` every forward (rollout with the shared hf module, behaviour
log-probs, replay scoring, the update) runs under `torch.autocast` in bf16. The gap between
the sampler's log-probs and the teacher-forced ones is logged each step (`logprob_gap_mean`,
`logprob_gap_max` over policy tokens): ~1e-6 with hf in fp32, real with vLLM or bf16.

Departures from the paper's setup: the behaviour log-probs come from teacher forcing, not
from the sampler (they agree up to float error with the hf backend; with vLLM they avoid the
sampler/trainer mismatch, which `grpo.tis_cap` can also correct); the held-out evaluation
during training is a small fixed subset (Mean@k, Best@k, greedy EM), the full evaluation is
`hdr eval`. The experiment's `on_policy_larger` is no rule of its own but `replay.rule:
on_policy` at 1.5x `grpo.batch_prompts`; `on_policy_filtered` is `grpo.dynamic_sampling`
(DAPO-style: zero-variance groups dropped and refilled by extra fresh prompts, which count as
fresh cost) with `replay.rule: on_policy`.

The loop around the steps is `trainer/loop.py`; setup and checkpoints are `trainer/run.py`;
the fresh groups `trainer/fresh.py`; the behaviour log-probs `trainer/behaviour.py`; the update
`trainer/update.py`; the formulas and the replay lifecycle are the `headroom_drift` package;
several processes are `trainer/distributed.py`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from headroom_drift import LateDecision, Selection, StoredGroup, assemble_batch
from headroom_drift.staleness import on_time
from trainer.behaviour import behaviour, sampler_gap, sampler_logprobs
from trainer.fresh import FreshBatch
from trainer.run import Run
from trainer.survey import survey_candidates
from trainer.telemetry import CountedScore, PhaseClock
from trainer.update import UpdateStats, update_policy

if TYPE_CHECKING:
    from agent_env.retrieval_client import ClientStats
    from headroom_drift import Candidate


@dataclass
class StepOutcome:
    """What one step did: all its record and cost ledger are derived from
    (`trainer.record.step_record`)."""

    step: int
    batch: FreshBatch  # the rollouts (refills and dropped groups included), the kept groups
    scored: list[StoredGroup]  # the kept groups as scored, late ones before the staleness rule
    late: LateDecision  # the staleness rule's verdict (`trained`: the fresh groups that train)
    entropy: float
    gap: dict[str, float | None]  # sampler/trainer log-prob gap (and TIS) on on-time groups
    selection: Selection
    trained: list[StoredGroup]  # the fresh groups in the update (a swap rule leaves some out)
    update: UpdateStats
    evicted: list[StoredGroup]  # groups that left the buffer at ingress
    gate: tuple[float, float, float]  # replay gate: the tau admitted by, the next, measured
    survey: tuple[list[Candidate], float] | None  # `replay.survey`: the groups, its seconds
    clock: PhaseClock  # each phase's wall and CPU seconds and frozen-bottom tokens
    seconds: float  # the whole step's wall seconds
    behaviour_tokens: int  # teacher-forced for the behaviour log-probs (late groups too)
    scan_tokens: int  # teacher-forced re-scoring replay candidates
    retrieval: tuple[ClientStats, ClientStats]  # the client's counters before and after

    @property
    def fresh(self) -> list[StoredGroup]:
        """The fresh groups that may train: on time, or late and admitted."""
        return self.late.trained


def train_step(run: Run, step: int) -> StepOutcome:
    """One GRPO step with replay, top to bottom; returns what happened."""
    cfg, clock = run.config, PhaseClock(run.model)
    client_before = replace(run.client.stats)  # a copy of the counters
    # 1-2. rollout of b prompts x G responses, each rewarded by agent_env
    with clock.phase("rollout"):
        batch = run.fresh.collect(step)
    # 3. behaviour log-probs and advantages (each process scores its share); a vLLM engine in
    # sleep mode hands its GPU memory to the trainer until the weight sync wakes it
    with clock.phase("scoring"):
        run.generator.sleep()
        scored, entropy, behaviour_tokens = behaviour(run, batch.groups, step)
        sampled = sampler_logprobs(batch.groups, scored)
        gap, tis = sampler_gap(
            *on_time(scored, sampled, batch.lags), cfg.grpo.tis_cap, cfg.grpo.skip_zero_advantage
        )
        # late groups (asynchronous rollout) pass the staleness rule or go to the buffer
        if batch.lags is None:
            late = LateDecision(list(scored), [], 0, None)
        else:
            late = run.replay.admit_late(scored, sampled, batch.lags)
        fresh = late.trained
    # 4. replay selection: across processes rank 0's, taken by every process (a survey beside
    # it, at the same weights, changes nothing and is timed apart)
    surveyed = survey_candidates(run, step)
    with clock.phase("selection"):
        tau, score = run.replay.tau, CountedScore(run.score)
        agree = run.replay.decided_by(run.dist.broadcast) if run.dist.world > 1 else None
        selection = run.replay.select(step, score, fresh, agree=agree)
    # 5. one update on fresh + replayed (a swap rule leaves some fresh groups out)
    with clock.phase("update"):
        kept = [k for k in range(len(fresh)) if k not in set(selection.swap_out)]
        trained = [fresh[k] for k in kept]
        kept_tis = None if tis is None else [tis[k] for k in kept]
        update_batch = assemble_batch(trained, selection.groups, selection.weights, kept_tis)
        update = update_policy(run, update_batch, run.scan_graphs(selection))
        run.generator.sync_weights(run.model)  # wakes a sleeping engine
        published = time.perf_counter()
        run.fresh.publish(run.model, step)  # version `step`, for rollout workers if any
        clock.seconds["publish"] = time.perf_counter() - published
    # 6. ingress after the update; late groups over the staleness rule go beside the fresh
    evicted = run.replay.ingest([*fresh, *late.to_buffer])  # counts the replays, then stores
    # 7. what happened
    return StepOutcome(
        step=step, batch=batch, scored=scored, late=late, entropy=entropy, gap=gap,
        selection=selection, trained=trained, update=update, evicted=evicted,
        gate=(tau, run.replay.tau, run.replay.gate_measured), survey=surveyed, clock=clock,
        seconds=clock.elapsed(), behaviour_tokens=behaviour_tokens, scan_tokens=score.tokens,
        retrieval=(client_before, replace(run.client.stats)),
    )  # fmt: skip
