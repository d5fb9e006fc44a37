"""TRL's `GRPOTrainer` training a Search-R1 agent with Headroom-Drift Replay (`hdr[trl]`).

Written against TRL 1.16 (`pip install -e ".[trl]"`); docs/integrations.md has the recipe.
Three pieces, each usable alone:

- `SearchR1Rollout` (`trainer/integrations/trl_rollout.py`): TRL's `rollout_func` hook, hdr's
  multi-turn Search-R1 loop against a Search-R1 retrieval server, generating with TRL's own
  engine (its transformers model, or its vLLM in colocate or server mode).
- `exact_match_reward`, `search_r1_reward(config)` (`trl_rollout.py` too): hdr's rewards as
  TRL reward functions.
- `ReplayGRPOTrainer`: a `GRPOTrainer` whose update also trains on replayed groups. After TRL
  has generated and scored a batch, `ReplayStep.extend` turns it into hdr's stored groups
  (behaviour log-probs teacher-forced under the current weights by `trainer.scoring`, TRL's
  rewards and advantages), lets the run's `headroom_drift.GroupReplay` pick stored groups (the
  same rules, scan, Headroom and Drift code as hdr's loop), assembles fresh + replayed rows
  with `headroom_drift.assemble_batch`, and hands TRL's loss a batch whose old log-probs
  are the fresh groups' behaviour log-probs and the replayed groups' stored ones. The fresh
  groups enter the buffer after the optimizer step (a callback), so a group is never replayed
  in the step that made it. A checkpoint holds the lifecycle's state in the format hdr's own
  checkpoints use (`replay.pt`, `GroupReplay.save`); one written before that format
  (`hdr_replay.safetensors` + `hdr_replay.json`) still resumes.

Departures from hdr's loop, all TRL's conventions (docs/integrations.md lists them with the
tests that pin them): TRL's advantages divide by `std + 1e-4` (hdr: `1e-6`) and follow its
`scale_rewards`; its loss normalisation is `loss_type` (`dapo`, the default, is hdr's token mean
over the whole update); a replayed group's advantages are those stored when it was made.
Across processes every process keeps the same buffer (the fresh groups are gathered), scores
a round-robin share of the candidates (gathered, so every process sees every score; each runs as
many forwards and output-layer calls as the busiest, which ZeRO-3 needs), takes the main
process's selection (broadcast) and trains on a share of the admitted groups that gives every
process as many groups (`balanced_shares`; TRL's per-row metric all-gathers need it). When TRL
has already run a no-grad pass over the fresh rows (its vLLM importance-sampling correction),
those log-probs are stored as the behaviour log-probs instead of scoring the rows again.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from pydantic import Field, field_validator, model_validator
from torch import Tensor
from transformers import TrainerCallback
from trl import GRPOTrainer

from core.config import StrictModel, renamed_in
from headroom_drift import (
    GroupReplay,
    GroupTensors,
    Selection,
    StoredGroup,
    assemble_batch,
    rule_params,
)
from trainer.checkpoint import REPLAY_STATE, legacy_replay_state
from trainer.config import ReplayConfig
from trainer.integrations.trl_layout import rows_from_trl, trl_inputs
from trainer.integrations.trl_processes import (
    ReplayStepError,
    balanced_shares,
    fresh_values,
    gather,
    keep_only,
    zero3_call_agreement,
)
from trainer.integrations.trl_rollout import (
    check_generation_settings,
    check_sampling_settings,
    check_vllm_settings,
)
from trainer.integrations.trl_vllm import route_colocate_sync
from trainer.scoring import (
    behaviour_logprobs,
    concat_left_padded,
    groups_of_rows,
    score_groups,
)

# --- replay ----------------------------------------------------------------------------------

TRL_RENAMED_KEYS = {"arm": "replay.rule"}
"""Keys of the `replay:` section an earlier hdr read, and where their values go now."""


class TRLReplayConfig(StrictModel):
    """hdr's replay inside TRL: its rule and knobs (hdr's `replay` section) and the scoring
    forward's rows."""

    replay: ReplayConfig = Field(
        default_factory=ReplayConfig, description="The rule, its buffer and its knobs."
    )
    score_chunk: int = Field(16, ge=1, description="Rows per teacher-forced scoring forward.")

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys_named(cls, data: Any) -> Any:
        renamed = renamed_in(data, TRL_RENAMED_KEYS)
        if renamed is not None:
            raise ValueError(renamed)
        return data

    @field_validator("replay")
    @classmethod
    def _no_scan_graphs(cls, v: ReplayConfig) -> ReplayConfig:
        if v.reuse_scan_forward:
            raise ValueError(
                "replay.reuse_scan_forward is hdr's loop only: TRL runs its own forward"
            )
        return v


@dataclass
class StepReplay:
    """One step's replay: its fresh groups and selection (held until ingress, and the latest
    step's kept as `ReplayStep.last`)."""

    step: int
    fresh: list[StoredGroup]  # every process's fresh groups, in process order
    selection: Selection
    trained_rows: int  # rows this process trained on (fresh kept + its replayed share)
    num_items: int  # policy tokens of the whole update (TRL's token-mean denominator)
    buffer: list[str] = field(default_factory=list)  # the buffer's groups the selector saw
    policy_tokens: list[int] = field(default_factory=list)  # per fresh row on this process
    response_tokens: list[int] = field(default_factory=list)  # the same rows' whole responses
    scored_rows: int = 0  # rows this process ran no-grad forwards over (fresh, scan, reference)

    def record(self) -> dict:
        """What the step did, JSON-ready and without tensors (`ReplayStep.history`)."""
        return {
            "step": self.step,
            "fresh": [g.group_id for g in self.fresh],
            "replayed": [g.group_id for g in self.selection.groups],
            "scanned": self.selection.scanned,
            "drift_scanned": self.selection.drift_scanned,
            "headroom_refreshed": self.selection.headroom_refreshed,
            "trained_rows": self.trained_rows,
            "num_items": self.num_items,
            "buffer": self.buffer,
            "policy_tokens": self.policy_tokens,
            "response_tokens": self.response_tokens,
            "scored_rows": self.scored_rows,
        }


@dataclass
class ReplayStep:
    """The replay state a `ReplayGRPOTrainer` carries: the FIFO buffer, the step awaiting
    ingress (then `last`), and a record per step."""

    config: TRLReplayConfig
    lifecycle: GroupReplay  # buffer, rule, gate, ingress and their state (headroom_drift)
    pending: StepReplay | None = None
    last: StepReplay | None = None
    history: list[dict] = field(default_factory=list)
    scored_rows: int = 0  # this step's no-grad scoring rows on this process, so far

    @classmethod
    def build(cls, config: TRLReplayConfig, seed: int, total_steps: int) -> ReplayStep:
        return cls(config, config.replay.make_replay(seed, total_steps))

    def extend(self, trainer: ReplayGRPOTrainer, batch: dict[str, Any], rewards: Tensor) -> dict:
        """TRL's fresh generation batch -> the update's batch: fresh rows as stored groups,
        the selector's replayed groups beside them, in TRL's layout."""
        if "pixel_values" in batch:
            raise ValueError("replay in TRL covers text models only")
        accelerator, step = trainer.accelerator, trainer.state.global_step + 1
        rank, world = accelerator.process_index, accelerator.num_processes
        rows = rows_from_trl(batch)
        G = trainer.num_generations
        b = len(rows.input_ids) // G
        names = [f"s{step}/{rank}/{k}" for k in range(b)]
        old = rows.per_token.get("old_per_token_logps")
        if old is not None:  # TRL's no-grad pass under the same weights (its vLLM IS
            # correction): the behaviour log-probs hdr would score, so not scored again
            behaviour = old * rows.loss_mask
            self.scored_rows = 0
        else:
            self.scored_rows = len(rows.input_ids)
            with self.scoring(trainer):
                behaviour, _, _ = behaviour_logprobs(
                    trainer.accelerator.unwrap_model(trainer.model), rows.input_ids,
                    rows.attention_mask, rows.loss_mask, self.config.score_chunk,
                    trainer.temperature, accelerator.autocast,
                    agree=zero3_call_agreement(accelerator),  # ZeRO-3 gathers per module call
                )  # fmt: skip
        tensors = GroupTensors(
            rows.input_ids, rows.attention_mask, rows.loss_mask, behaviour, rewards.cpu(),
            batch["advantages"].cpu().float(),
        )  # fmt: skip
        fresh = groups_of_rows(tensors, step, names)
        ratio = fresh_values(rows, fresh, range(b), "importance_sampling_ratio")
        for group, weights in zip(fresh, ratio or [None] * b, strict=True):
            group.token_weights = weights  # TRL's fresh-step weights travel with the group
        everyone = gather(fresh, world)
        known = asdict(self.lifecycle.params)  # the run's length is known once training starts
        self.lifecycle.params = rule_params(
            self.config.replay.rule, **{**known, "total_steps": trainer.state.max_steps}
        )
        buffered = [g.group_id for g in self.lifecycle.groups()]
        with self.scoring(trainer):
            selection = self.lifecycle.select(
                step, self.scorer(trainer), everyone, agree=self.decided_on_main(trainer)
            )
        swapped = set(selection.swap_out)
        kept_by = [[k for k in range(b) if p * b + k not in swapped] for p in range(world)]
        kept = kept_by[rank]  # global index of group k: rank * b + k
        shares = balanced_shares([len(k) for k in kept_by], len(selection.groups))
        keep_only(selection, sum(shares))  # what cannot be shared evenly waits in the buffer
        start = sum(shares[:rank])
        mine = slice(start, start + shares[rank])
        weights = selection.weights or [1.0] * len(selection.groups)
        replayed, replay_weights = selection.groups[mine], weights[mine]
        idle = [  # decided from the shared selection, so every process raises together
            p for p in range(world) if not kept_by[p] and not shares[p]
        ]  # fmt: skip
        if idle:
            raise ReplayStepError(f"step {step}: process(es) {idle} have no group to train on")
        update = assemble_batch(
            [fresh[k] for k in kept], replayed, replay_weights,
            fresh_values(rows, fresh, kept, "importance_sampling_ratio"),
        )  # fmt: skip
        r = update.rows()
        per_token = {}
        for key in ("sampling_per_token_logps", "ref_per_token_logps"):
            values = fresh_values(rows, fresh, kept, key)
            if values is not None:  # this process's share of the admitted groups
                stored = self.replayed_values(trainer, key, replayed)
                per_token[key] = concat_left_padded(values + stored)
        if r.token_weights is not None:
            per_token["importance_sampling_ratio"] = r.token_weights
        num_items = accelerator.gather(r.loss_mask.sum().to(accelerator.device)).sum()
        self.pending = StepReplay(
            step, everyone, selection, len(r.input_ids), int(num_items), buffered,
            [int(n) for n in rows.loss_mask.sum(dim=1)],
            [int(n) for n in batch["completion_mask"].sum(dim=1)], self.scored_rows,
        )  # fmt: skip
        self.history.append(self.pending.record())
        log_selection(trainer, self, selection)
        return trl_inputs(
            r.input_ids, r.attention_mask, r.loss_mask, r.advantages, r.gen_logprobs, num_items,
            per_token, accelerator.device,
        )  # fmt: skip

    def ingest(self) -> None:
        """Ingress after the optimizer step: the step's fresh groups enter the buffer, and the
        replayed ones count one more replay."""
        if self.pending is None:
            return
        self.lifecycle.ingest(self.pending.fresh)
        self.last, self.pending = self.pending, None

    def scorer(self, trainer: ReplayGRPOTrainer):
        """The replay `ScoreFn`: hdr's teacher-forced scoring under the current weights."""
        accelerator = trainer.accelerator
        model = accelerator.unwrap_model(trainer.model)
        chunk, agree = self.config.score_chunk, zero3_call_agreement(accelerator)
        rank, world = accelerator.process_index, accelerator.num_processes

        def score(groups: Sequence[StoredGroup]) -> list[Tensor]:
            # each process scores a round-robin share (the same forward counts everywhere,
            # `agree`) and every process gets every group's log-probs
            self.scored_rows += sum(len(g.input_ids) for g in groups[rank::world])
            with accelerator.autocast():
                mine = score_groups(model, groups[rank::world], chunk, trainer.temperature,
                                    agree=agree)  # fmt: skip
            if world == 1:
                return mine
            from accelerate.utils import gather_object

            found = dict(
                gather_object(list(zip(range(rank, len(groups), world), mine, strict=True)))
            )
            return [found[i] for i in range(len(groups))]

        return score

    def decided_on_main(self, trainer: ReplayGRPOTrainer):
        """The lifecycle's `agree` across processes (`GroupReplay.decided_by`, as hdr's loop
        takes it): the main process's selection, broadcast, taken by every process from its
        own copy of the buffer (None on one process)."""
        if trainer.accelerator.num_processes == 1:
            return None

        def broadcast(value):
            from accelerate.utils import broadcast_object_list

            box = [value]
            broadcast_object_list(box, from_process=0)
            return box[0]

        return self.lifecycle.decided_by(broadcast)

    def replayed_values(self, trainer, key: str, groups: list[StoredGroup]) -> list[Tensor]:
        """The per-token TRL tensor of the replayed groups this process trains on: their
        stored behaviour log-probs for the sampler's, their reference log-probs computed now
        for the KL's (each process its own share; as many forwards on all, for ZeRO-3)."""
        if key == "sampling_per_token_logps":
            return [g.gen_logprobs for g in groups]
        chunk, temperature = self.config.score_chunk, trainer.temperature
        self.scored_rows += sum(len(g.input_ids) for g in groups)
        with self.scoring(trainer), trainer.accelerator.autocast():
            return score_groups(trainer.ref_model, list(groups), chunk, temperature,
                                agree=zero3_call_agreement(trainer.accelerator))  # fmt: skip

    @staticmethod
    @contextlib.contextmanager
    def scoring(trainer):
        """No-grad forwards outside TRL's loss, with gradient checkpointing off as TRL's own."""
        from trl.models.utils import disable_gradient_checkpointing

        with (
            torch.no_grad(),
            disable_gradient_checkpointing(
                trainer.model, trainer.args.gradient_checkpointing_kwargs
            ),
        ):
            yield


def log_selection(trainer, replay: ReplayStep, selection: Selection) -> None:
    """The step's replay figures, averaged into TRL's logs beside its own metrics."""
    metrics = trainer._metrics["train"]  # TRL's per-step metric lists (logged and cleared)
    metrics["replay/replayed_groups"].append(len(selection.groups))
    metrics["replay/scanned_groups"].append(selection.scanned)
    metrics["replay/buffer_size"].append(len(replay.lifecycle))
    if selection.scanned:
        metrics["replay/acceptance_rate"].append(selection.acceptance_rate)


class ReplayIngress(TrainerCallback):
    """Ingress after the optimizer step (`on_step_end`), as hdr's loop does it."""

    def __init__(self, replay: ReplayStep) -> None:
        self.replay = replay

    def on_step_end(self, args, state, control, **kwargs):
        self.replay.ingest()


def check_schedule(args, num_generations: int) -> None:
    """Replay treats one generation as one step: one optimizer step per generated batch and
    whole groups on every process. Micro-batches do not hold whole groups: TRL shuffles the
    rows before it splits them (`shuffle_sequence_dict`), which the token-mean losses (dapo)
    do not mind; bnpo then divides each micro-batch by its own tokens (a per-micro-batch
    mean once gradient accumulation is above 1)."""
    if args.num_iterations != 1 or args.steps_per_generation != args.gradient_accumulation_steps:
        raise ValueError(
            "replay in TRL needs one optimizer step per generation: num_iterations=1 and"
            f" steps_per_generation == gradient_accumulation_steps (got {args.num_iterations},"
            f" {args.steps_per_generation}, {args.gradient_accumulation_steps})"
        )
    if num_generations % args.steps_per_generation:
        raise ValueError(
            f"replay in TRL splits the generation batch evenly into micro-batches: num_generations"
            f" ({num_generations}) must be a multiple of steps_per_generation"
            f" ({args.steps_per_generation})"
        )
    local = args.per_device_train_batch_size * args.steps_per_generation
    if local % num_generations:
        raise ValueError(
            f"replay in TRL keeps whole groups on each process: per_device_train_batch_size *"
            f" steps_per_generation ({local}) must be a multiple of num_generations"
            f" ({num_generations})"
        )


class ReplayGRPOTrainer(GRPOTrainer):
    """TRL's `GRPOTrainer` with hdr's replay (see the module docstring). Two overrides, each
    calling TRL's method first and adding to its result; nothing of TRL's is copied."""

    REPLAY_HISTORY = "replay_history.json"  # beside `replay.pt` in each checkpoint
    LEGACY_REPLAY_STATE = ("hdr_replay.safetensors", "hdr_replay.json")  # before replay.pt

    def __init__(self, *args, replay: TRLReplayConfig | None = None, **kwargs) -> None:
        if kwargs.get("args") is not None:
            check_vllm_settings(kwargs["args"])
            check_sampling_settings(kwargs["args"])
        super().__init__(*args, **kwargs)
        route_colocate_sync(self)  # TRL's colocated sync cannot load weights on vLLM's CPU build
        check_schedule(self.args, self.num_generations)
        check_generation_settings(self.args)
        if self.beta != 0.0 and self.ref_model is None:
            raise ValueError("replay with beta > 0 needs a reference model (PEFT is not covered)")
        config = replay or TRLReplayConfig()
        self.replay = ReplayStep.build(config, self.args.seed, self.args.max_steps)
        self._step_rewards: Tensor | None = None
        self.add_callback(ReplayIngress(self.replay))

    def _save_checkpoint(self, model, trial):
        """TRL's checkpoint, then the replay state beside it (every process holds the same
        buffer; the main one writes it), in hdr's one format (`replay.pt`), and each process's
        step records. Ingress ran at `on_step_end`, before TRL saves."""
        super()._save_checkpoint(model, trial)
        from accelerate.utils import gather_object

        # each process's own step records (rows, tokens), so each resumes with its own
        histories = gather_object([self.replay.history])
        if not self.args.should_save:
            return
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

        from core.paths import write_json_atomic

        folder = Path(self._get_output_dir(trial=trial)) / (
            f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        )
        self.replay.lifecycle.save(folder / REPLAY_STATE)  # whole files only, each
        write_json_atomic(folder / self.REPLAY_HISTORY, {"histories": histories})

    def _load_optimizer_and_scheduler(self, checkpoint):
        """TRL's resume, and the replay state its checkpoint holds (as TRL restores its own
        extra state here): `replay.pt`, or the files a checkpoint held before it."""
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        import json

        from safetensors.torch import load_file

        folder, rank = Path(checkpoint), self.accelerator.process_index
        legacy_tensors, legacy_meta = (folder / name for name in self.LEGACY_REPLAY_STATE)
        if (folder / REPLAY_STATE).is_file():
            self.replay.lifecycle.load(folder / REPLAY_STATE)
            histories = json.loads((folder / self.REPLAY_HISTORY).read_text())["histories"]
            self.replay.history = histories[rank]
        elif legacy_meta.is_file():
            meta = json.loads(legacy_meta.read_text())
            history = meta.pop("history", [])
            histories = meta.pop("histories", None)  # absent from the oldest checkpoints
            self.replay.history = histories[rank] if histories else history
            state = legacy_replay_state(load_file(legacy_tensors), meta)
            self.replay.lifecycle.load_state_dict(state)
        else:
            raise ValueError(f"{checkpoint} holds no replay state ({REPLAY_STATE}): not hdr's")

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        # TRL's batch keeps the advantages only; the buffer keeps the rewards too
        per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        self._step_rewards = per_func
        return per_func

    def _generate_and_score_completions(self, inputs):
        batch = super()._generate_and_score_completions(inputs)
        if not self.model.training:  # evaluation: TRL's batch as it is
            return batch
        return self.replay.extend(self, batch, self.local_rewards(len(inputs)))

    def local_rewards(self, n: int) -> Tensor:
        """This process's rewards `[n]`: TRL's weighted sum over its reward functions (NaN, a
        function's "no reward", counts as 0 as TRL counts it), sliced as TRL slices."""
        per_func = self._step_rewards
        weighted = (per_func * self.reward_weights.to(per_func.device).unsqueeze(0)).nansum(dim=1)
        rank = self.accelerator.process_index
        return weighted[rank * n : (rank + 1) * n].float()
