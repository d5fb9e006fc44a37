"""The training run's typed configuration: one model per concern, YAML files as instances.

`configs/tiny-cpu.yaml` and `configs/search-r1-qwen2.5-3b.yaml` are instances of
`TrainConfig`; `hdr train --config FILE a.b=value ...` loads one with dotted overrides
(`core.config.load_config`). Unknown keys are errors. Every default lives here and only here.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from agent_env.data import DataConfig
from agent_env.generation import GenerationConfig
from agent_env.retrieval_client import RetrievalConfig
from agent_env.rollout import RolloutConfig
from core.config import StrictModel, removed_in, renamed_in
from headroom_drift import (
    RULES,
    STALENESS_RULES,
    AdaptiveGate,
    FixedGate,
    Gate,
    GroupReplay,
    LateGroups,
    is_gated,
    rule_params,
)
from trainer.config_history import REMOVED_KEYS, RENAMED_KEYS


class ModelConfig(StrictModel):
    """The policy being trained."""

    path: str = Field(description="Model directory (save_pretrained / Hub layout) with tokenizer.")
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Parameters' dtype: the master weights AdamW steps. Only float32 is"
        " accepted; bfloat16 compute is `compute_dtype`.",
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Forward/backward matmuls under torch.autocast; parameters, gradients"
        " and optimizer state stay in `dtype` (float32 master weights).",
    )
    device: str = Field("cpu", description="torch device of the trained model (cpu, cuda:0).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (large models on a GPU)."
    )
    train_layers: int | None = Field(
        None,
        ge=1,
        description="Train only the top N decoder layers and the final norm (the embeddings and"
        " the layers below frozen), and keep the frozen bottom's output per stored group, so"
        " scans and updates run the top N layers only (trainer/frozen_bottom.py); None: train"
        " every parameter.",
    )
    bottom_cache_dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="train_layers: the dtype the frozen bottom's states are kept in."
    )
    bottom_cache_mib: int = Field(
        1024, ge=1, description="train_layers: most MiB of frozen-bottom states kept (LRU)."
    )

    @field_validator("dtype")
    @classmethod
    def _master_weights_in_fp32(cls, v: str) -> str:
        if v != "float32":
            raise ValueError(
                f"{v} parameters under plain AdamW lose every update smaller than their"
                " spacing (at lr 1e-6 nearly all); keep model.dtype=float32 and set"
                " model.compute_dtype=bfloat16 for bf16 compute on fp32 master weights"
            )
        return v


class GRPOConfig(StrictModel):
    """Fresh batch, objective and optimizer."""

    batch_prompts: int = Field(16, ge=1, description="b: fresh prompts per step.")
    group_size: int = Field(8, ge=2, description="G: sampled responses per prompt.")
    lr: float = Field(
        5e-5, ge=0, description="AdamW peak learning rate (0: a control run that never moves)."
    )
    warmup_steps: int = Field(3, ge=0, description="Linear warmup steps from 0 to `lr`.")
    schedule: Literal["constant", "cosine"] = Field(
        "constant", description="After warmup: constant, or cosine decay to 0 at the last step."
    )
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Clip the gradient's global L2 norm to this.")
    eps_low: float = Field(0.2, ge=0, lt=1, description="Ratio clip below: 1 - eps_low.")
    eps_high: float = Field(0.2, ge=0, description="Ratio clip above: 1 + eps_high.")
    beta: float = Field(0.0, ge=0, description="k3 KL coefficient to the initial policy (0: off).")
    updates_per_step: int = Field(1, ge=1, description="Optimizer passes over each step's batch.")
    micro_batch: int = Field(32, ge=1, description="Rows per forward/backward chunk (memory).")
    score_chunk: int = Field(64, ge=1, description="Rows per no-grad scoring chunk (memory).")
    dynamic_sampling: bool = Field(
        False,
        description="DAPO-style: drop groups whose rewards are all equal and refill the batch"
        " with extra fresh prompts (counted as fresh cost), up to `refill_rounds` times.",
    )
    refill_rounds: int = Field(3, ge=0, description="Most refill rollouts per step.")
    skip_zero_advantage: bool = Field(
        False,
        description="Forward no fresh row whose advantage is 0: a group whose G rewards are"
        " equal is not scored, and such rows stay out of the update's forwards. Their loss"
        " is 0, so the update is the same (up to float rounding); their tokens still count"
        " in the token mean. Needs grpo.beta=0, replay.store_zero_advantage=false and one"
        " process.",
    )
    tis_cap: float | None = Field(
        None,
        gt=0,
        description="Truncated importance sampling of fresh tokens: weight each by"
        " min(p_trainer/p_sampler, tis_cap) against the sampler/trainer mismatch (vLLM);"
        " None: off.",
    )

    @property
    def fresh_rows(self) -> int:
        """Responses rolled out per step: b * G."""
        return self.batch_prompts * self.group_size


class GateConfig(StrictModel):
    """An adaptive drift gate (`headroom_drift.AdaptiveGate`): the target it holds, and how fast
    its tau moves. One set of names for both of its uses: the replay scan's gate
    (`replay.adaptive_gate`, with `replay.gate: adaptive`) and the staleness gate of late
    groups (`async_rollout.adaptive_gate`, with `async_rollout.rule: adaptive_drift_gate`);
    each starts at its own section's `tau`. `build` is the one factory of both gates."""

    target_kind: Literal["acceptance", "drift_budget"] = Field(
        "acceptance",
        description="Hold the share of the groups scored that are admitted (acceptance), or"
        " the mean drift of the groups admitted (drift_budget).",
    )
    target: float = Field(
        0.5, gt=0, description="The acceptance rate (<= 1) or the drift budget to hold."
    )
    rate: float = Field(0.1, gt=0, description="Log-space step of tau per decision.")

    @model_validator(mode="after")
    def _acceptance_is_a_share(self) -> GateConfig:
        if self.target_kind == "acceptance" and self.target > 1:
            raise ValueError(f"target={self.target} is an acceptance rate: add one <= 1")
        return self

    def build(self, tau: float, adaptive: bool) -> Gate:
        """The gate a section names: an AdaptiveGate that starts at `tau` and holds this
        target, or (not `adaptive`) the paper's constant `FixedGate(tau)`."""
        if not adaptive:
            return FixedGate(tau)
        return AdaptiveGate(tau=tau, target=self.target, kind=self.target_kind, rate=self.rate)


class ReplayConfig(StrictModel):
    """The replay buffer and the selector's knobs (the selector itself is `arm`)."""

    budget: int = Field(8, ge=0, description="R: most stored groups replayed per step.")
    capacity: int = Field(64, ge=0, description="C: FIFO buffer capacity in groups.")
    tau: float = Field(
        0.05, ge=0, description="Drift gate: admit when D(g) <= tau (gate adaptive: the start)."
    )
    gate: Literal["fixed", "adaptive"] = Field(
        "fixed",
        description="The replay scan's drift gate: fixed (the paper's constant tau) or"
        " adaptive (tau moves each step to hold `adaptive_gate`'s target; logged per step as"
        " replay_tau).",
    )
    adaptive_gate: GateConfig = Field(
        default_factory=GateConfig,
        description="gate adaptive: the target the scan's tau holds (shares its names with"
        " async_rollout.adaptive_gate).",
    )
    drift_norm: Literal["l2", "l1"] = Field(
        "l2", description="Drift of the gate for headroom_drift and drift_only (l2: mean sq.)."
    )
    scan_chunk: int = Field(8, ge=1, description="Most groups scored per scan chunk.")
    tau_age: float = Field(
        500.0,
        gt=0,
        description="replay_freshness_per: age scale (steps) of the priority's decay"
        " exp(-age / tau_age); the published default is 500 steps.",
    )
    is_beta_start: float = Field(
        0.4, ge=0, le=1, description="replay_freshness_per: importance exponent at step 0 (-> 1)."
    )
    store_zero_advantage: bool = Field(
        False, description="Store groups whose advantages are all 0 (they carry no gradient)."
    )
    survey: Literal["off", "newest", "buffer"] = Field(
        "off",
        description="A diagnostic, off the cost ledger and timed apart (time_survey): each"
        " step, before the selection and at its weights, score stored groups without admitting"
        " them and log their age, drift and headroom (survey_*): `newest`, the `budget` newest"
        " (what replay_recency would replay from the same buffer: the counterfactual);"
        " `buffer`, every eligible group (the admissible pool at any tau: calibration).",
    )
    reuse_scan_forward: bool = Field(
        False,
        description="Score replay candidates with grad and keep the admitted groups' graphs,"
        " so the update's first pass backpropagates through the scan's forward instead of"
        " repeating it (one process only; memory: the graphs of up to R groups at once).",
    )

    @model_validator(mode="after")
    def _adaptive_tau_in_range(self) -> ReplayConfig:
        if self.gate == "adaptive" and not 1e-8 <= self.tau <= 1e4:
            raise ValueError(
                f"replay.gate=adaptive starts from replay.tau={self.tau}, outside the gate's"
                " range [1e-8, 1e4]: add a replay.tau inside it"
            )
        return self

    def make_gate(self) -> Gate:
        """The replay scan's drift gate (`GateConfig.build`), starting at `tau`."""
        return self.adaptive_gate.build(self.tau, adaptive=self.gate == "adaptive")

    def replays(self, arm: str) -> bool:
        """Whether rule `arm` replays at all under these settings (not `on_policy`, budget > 0,
        capacity > 0)."""
        return arm != "on_policy" and self.budget > 0 and self.capacity > 0

    def make_replay(
        self, arm: str, seed: int, total_steps: int, late: LateGroups | None = None
    ) -> GroupReplay:
        """The replay lifecycle these settings describe, for rule `arm` (budget 0 where it does
        not `replay`) in a run of `total_steps` seeded by `seed`; `late`: its staleness gate."""
        params = rule_params(
            arm,
            budget=self.budget if self.replays(arm) else 0,
            tau=self.tau,
            norm=self.drift_norm,
            chunk=self.scan_chunk,
            seed=seed,
            total_steps=total_steps,
            tau_age=self.tau_age,
            is_beta_start=self.is_beta_start,
        )
        return GroupReplay.from_params(
            self.capacity, arm, params, gate=self.make_gate(),
            store_zero_advantage=self.store_zero_advantage, late=late,
        )  # fmt: skip


class HeldoutConfig(StrictModel):
    """The periodic held-out evaluation during training."""

    every: int = Field(10, ge=0, description="Evaluate every this many steps (0: never).")
    num_questions: int = Field(64, ge=1, description="Size of the fixed held-out subset.")
    k: int = Field(5, ge=1, description="Samples per question for Mean@k / Best@k.")
    greedy: bool = Field(True, description="Also decode greedily for greedy EM.")
    at_start: bool = Field(True, description="Evaluate the starting policy as step 0.")


class CheckpointConfig(StrictModel):
    """Checkpoints for resuming."""

    save_every: int = Field(10, ge=0, description="Save every this many steps (0: never).")
    keep_last: int = Field(2, ge=1, description="Keep this many newest checkpoints.")


class LogConfig(StrictModel):
    """Telemetry."""

    tensorboard: bool = Field(True, description="Also write TensorBoard events under tb/.")
    progress: bool = Field(True, description="Show a progress bar on stderr.")


class DistributedConfig(StrictModel):
    """Data-parallel training under `torchrun` (trainer/distributed.py): every process holds the
    whole model (DistributedDataParallel); inert in one process. Sharded training (FSDP,
    ZeRO-3) is the TRL integration's (docs/integrations.md)."""

    rollout_shards: int = Field(
        1,
        ge=1,
        description="The step's prompts are rolled out in this many contiguous shards, each"
        " under its own seed (seed, step, shard); processes take whole shards, so a step's"
        " results do not depend on how many processes run it. Must be a multiple of the"
        " number of processes.",
    )
    timeout_s: float = Field(
        600.0,
        gt=0,
        description="A collective that waits longer than this fails the job (a dead or stuck"
        " process), instead of hanging; must exceed the held-out evaluation's duration.",
    )


class AsyncConfig(StrictModel):
    """Asynchronous rollout (trainer/async_rollout.py): rollout worker processes generate
    ahead of the trainer, and a staleness rule decides which late groups enter the update.
    The defaults (no workers, `max_lag` 0) are the synchronous loop."""

    workers: int = Field(
        0,
        ge=0,
        description="Rollout worker processes (each with its own copy of the weights, its own"
        " generator: hf, or a vLLM engine with generation.backend=vllm, and its own retrieval"
        " client), sharing the rollouts as `split` says."
        " 0: rollouts run in the trainer's process.",
    )
    split: Literal["steps", "shards"] = Field(
        "steps",
        description="How the workers share the rollouts: steps dealt round-robin (with"
        " max_lag >= 1 several steps roll out at once), or every step's"
        " `distributed.rollout_shards` split among them (a step's rollout in parallel; with"
        " max_lag 0, the synchronous loop issuing `workers` concurrent requests).",
    )
    max_lag: int = Field(
        0,
        ge=0,
        description="Queue bound and hard version cap k: step s's rollout may start once the"
        " weights of update s-1-k are published, so a group is at most k updates late"
        " (AReaL's max_head_offpolicyness). 0: every rollout waits for the last update, the"
        " synchronous loop.",
    )
    rule: str = Field(
        "version_bound",
        description="Staleness rule for late groups: " + ", ".join(STALENESS_RULES.names()),
    )
    tau: float = Field(
        0.05,
        gt=0,
        description="drift_gate: admit a late group when D(g) <= tau; adaptive_drift_gate: the"
        " starting tau. Same drift as the replay gate (`replay.drift_norm`).",
    )
    adaptive_gate: GateConfig = Field(
        default_factory=GateConfig,
        description="adaptive_drift_gate: the target the staleness tau holds over the late"
        " groups (shares its names with replay.adaptive_gate).",
    )
    start_timeout_s: float = Field(
        600.0, gt=0, description="Most seconds a worker may take to load and report ready."
    )
    worker_threads: int | None = Field(
        None,
        ge=1,
        description="torch threads per worker; None: the trainer's (what makes `max_lag` 0"
        " bit-identical to the synchronous loop). With more threads than cores over all"
        " processes, OpenMP's waiting threads slow every process down: give workers 1 each"
        " on a small machine.",
    )
    devices: list[str] = Field(
        default_factory=list,
        description="The device map: one device per worker (`cuda:N` among the GPUs this"
        " process sees, or `cpu`), where its generator runs (its vLLM engine, or its hf copy"
        " of the policy). Empty: every worker on `model.device`. `hdr plan-memory` counts each"
        " worker on its device, the trainer's included, and the run refuses a map that does"
        " not fit (docs/trainer.md, Asynchronous rollout).",
    )

    @field_validator("devices")
    @classmethod
    def _devices_are_cuda_or_cpu(cls, v: list[str]) -> list[str]:
        for device in v:
            if not re.fullmatch(r"cpu|cuda(:\d+)?", device):
                raise ValueError(f"async_rollout.devices: {device!r} is not cpu, cuda or cuda:N")
        return v

    @field_validator("rule")
    @classmethod
    def _known_rule(cls, v: str) -> str:
        STALENESS_RULES.get(v)  # a ValueError listing the valid names on a miss
        return v

    @property
    def enabled(self) -> bool:
        """Whether rollouts run in worker processes."""
        return self.workers > 0

    def late_groups(self, norm: str) -> LateGroups:
        """The staleness rule and its drift gate (`GateConfig.build`, starting at `tau`;
        adaptive for a rule that adapts it), under the replay gate's drift `norm`. A late
        group the rule rejects enters the replay buffer, where the replay gate decides."""
        adaptive = STALENESS_RULES.get(self.rule).adaptive
        gate = self.adaptive_gate.build(self.tau, adaptive=adaptive)
        return LateGroups(self.rule, gate, self.max_lag, norm, keep_rejected=True)


class SFTConfig(StrictModel):
    """The supervised warm start (`hdr sft`); reads the rest of the training config."""

    init_model: str = Field(
        "data/tiny-policy",
        description="Starting model dir; built with init-model defaults if absent.",
    )
    epochs: int = Field(8, ge=1, description="Passes over the scripted trajectories.")
    train_layers: int | None = Field(
        None,
        ge=1,
        description="Train only the top N decoder layers and the final norm, the frozen"
        " bottom's output computed once per trajectory (as `model.train_layers` in RL);"
        " None: every parameter.",
    )
    lr: float = Field(2e-3, gt=0, description="AdamW peak learning rate.")
    warmup_frac: float = Field(0.03, ge=0, lt=1, description="Share of updates in linear warmup.")
    batch_size: int = Field(32, ge=1, description="Trajectories per update.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient L2-norm clip.")
    max_examples: int | None = Field(
        None, ge=1, description="Use only the first N training questions (None: all)."
    )
    split: str | None = Field(
        None,
        description="Split of the training task the trajectories come from (None:"
        " data.train_split); `sft` keeps them apart from the `rl` questions RL then trains on.",
    )
    rollout_chunk: int = Field(512, ge=1, description="Questions per scripted rollout call.")
    query: Literal["verbatim", "shuffled", "subset", "mixed", "suffix"] = Field(
        "verbatim",
        description="The scripted search: the question verbatim, its words in a random order"
        " (shuffled), a random subset of its words in order, each kept with probability 1/2"
        " (subset), the question or such a subset, each half the time (mixed), or its words"
        " from a random one to the end (suffix); one draw per trajectory and epoch. The last four"
        " teach the format without settling which words come first; under"
        " `rollout.max_query_words` that is left to RL.",
    )
    answer: Literal["gold_if_seen", "doc1"] = Field(
        "gold_if_seen",
        description="The scripted answer: the gold title when the search retrieved it, else"
        " Doc 1's (gold_if_seen), or always Doc 1's title (doc1: a rule the policy can read"
        " off what it sees, where the gold at rank 2 or 3 can only be memorised).",
    )
    queries_per_question: int = Field(
        1,
        ge=1,
        description="Scripted trajectories per question, each with its own draw (`shuffled`"
        " or `subset` only): several random subsets of the question's words reach the"
        " retriever.",
    )
    length_batches: bool = Field(
        False,
        description="Batch trajectories of similar lengths (less padding, faster epochs; the"
        " demo's choice) instead of uniformly random batches.",
    )
    eval_questions: int = Field(
        200, ge=0, description="Held-out questions decoded greedily after each epoch (0: none)."
    )
    stop: Literal["epochs", "plateau"] = Field(
        "epochs",
        description="epochs: a cosine schedule over exactly `epochs`. plateau: a constant lr"
        " after warmup until the held-out loss (the scripted trajectories of the held-out"
        " questions) has not improved for `patience` epochs, at most `epochs`, then the best"
        " epoch's weights: a start that converges whenever copying begins.",
    )
    patience: int = Field(2, ge=1, description="plateau: epochs without improvement to stop.")
    min_improvement: float = Field(
        0.01, ge=0, description="plateau: the relative drop in held-out loss that counts."
    )

    @model_validator(mode="after")
    def _copies_need_shuffling(self) -> SFTConfig:
        if self.queries_per_question > 1 and self.query == "verbatim":
            raise ValueError(
                "sft.queries_per_question > 1 repeats the same verbatim trajectory: add"
                " sft.query=shuffled or sft.query=subset"
            )
        return self

    @model_validator(mode="after")
    def _plateau_needs_heldout(self) -> SFTConfig:
        if self.stop == "plateau" and self.eval_questions == 0:
            raise ValueError(
                "sft.stop=plateau watches the held-out loss: add sft.eval_questions=100 (or more)"
            )
        return self


EXPERIMENT_ONLY_ARMS = {
    "on_policy_larger": "arm=on_policy grpo.batch_prompts={larger} (1.5 x b fresh prompts)",
    "on_policy_lr0": "arm=on_policy grpo.lr=0 (the control: nothing is learned)",
    "on_policy_filtered": "arm=on_policy grpo.dynamic_sampling=true (DAPO-style refill)",
}
"""The experiment's arms that are settings of the `on_policy` selector, not selectors of their
own (experiment.arms defines them; the trainer cannot import it)."""


class TrainConfig(StrictModel):
    """A GRPO training run with (or without) Headroom-Drift Replay."""

    seed: int = Field(0, description="Seeds python, numpy, torch and the prompt order.")
    steps: int = Field(100, ge=1, description="Training steps.")
    arm: str = Field("headroom_drift", description="Replay rule: " + ", ".join(RULES.names()))
    out_dir: str = Field("runs/train", description="The run directory.")
    model: ModelConfig
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    replay: ReplayConfig = Field(default_factory=ReplayConfig)
    eval: HeldoutConfig = Field(default_factory=HeldoutConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    log: LogConfig = Field(default_factory=LogConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    sft: SFTConfig = Field(default_factory=SFTConfig)
    async_rollout: AsyncConfig = Field(default_factory=AsyncConfig)

    @model_validator(mode="before")
    @classmethod
    def _renamed_keys_named(cls, data: Any) -> Any:
        """A key of `RENAMED_KEYS` is answered with the key it is now, one of `REMOVED_KEYS`
        with why it went (not silently dropped, not as an unknown key)."""
        renamed = renamed_in(data, RENAMED_KEYS) or removed_in(data, REMOVED_KEYS)
        if renamed is not None:
            raise ValueError(renamed)
        return data

    @model_validator(mode="before")
    @classmethod
    def _experiment_arm_named(cls, data: Any) -> Any:
        """An experiment's arm name that is no selector (`arm=on_policy_larger`) is answered
        with what it means in a training config, computed from this config's b."""
        if not isinstance(data, dict) or data.get("arm") not in EXPERIMENT_ONLY_ARMS:
            return data
        grpo = data.get("grpo") if isinstance(data.get("grpo"), dict) else {}
        b = grpo.get("batch_prompts", GRPOConfig.model_fields["batch_prompts"].default)
        means = EXPERIMENT_ONLY_ARMS[data["arm"]].format(larger=round(1.5 * b) if b else "1.5b")
        raise ValueError(
            f"arm={data['arm']} names an arm of `hdr experiment`, not a replay selector; in a"
            f" training config it is {means} (this config's b is {b})"
        )

    @field_validator("arm")
    @classmethod
    def _known_arm(cls, v: str) -> str:
        RULES.get(v)  # a ValueError listing the valid names on a miss
        return v

    @model_validator(mode="after")
    def _steps_cover_warmup(self) -> TrainConfig:
        if self.grpo.warmup_steps >= self.steps and self.steps > 1:
            warmup = self.grpo.warmup_steps
            raise ValueError(
                f"steps={self.steps} leaves no step after grpo.warmup_steps={warmup} of warmup:"
                f" add grpo.warmup_steps={self.steps - 1} (or fewer), or more steps"
            )
        return self

    @model_validator(mode="after")
    def _sampling_the_trainer_can_score(self) -> TrainConfig:
        # teacher-forced log-probs divide by the temperature and nothing else: greedy or
        # nucleus samples would be scored under a distribution they were not drawn from
        if self.rollout.temperature <= 0:
            raise ValueError(
                "training samples, so rollout.temperature must be > 0 (0 is greedy): add"
                " rollout.temperature=1.0"
            )
        if self.rollout.top_p < 1:
            raise ValueError(
                "training scores the full distribution, so rollout.top_p must be 1 (the"
                " teacher-forced log-probs apply temperature only): add rollout.top_p=1"
            )
        return self

    @model_validator(mode="after")
    def _generation_seeded_by_the_run(self) -> TrainConfig:
        if self.generation.seed is None:
            self.generation.seed = self.seed
        return self

    @model_validator(mode="after")
    def _engine_holds_a_response(self) -> TrainConfig:
        limit, longest = self.generation.max_model_len, self.rollout.longest_response
        if self.generation.backend == "vllm" and limit is not None and limit <= longest:
            room = -(-(longest + 1024) // 1024) * 1024  # a 1,024-token prompt, rounded up
            raise ValueError(
                f"generation.max_model_len={limit} leaves no room for the prompt beside a"
                f" response of up to {longest} tokens (rollout.max_response_tokens +"
                f" max_tokens_per_turn + max_obs_tokens): add generation.max_model_len={room}"
            )
        return self

    @model_validator(mode="after")
    def _shards_hold_prompts(self) -> TrainConfig:
        if self.distributed.rollout_shards > self.grpo.batch_prompts:
            raise ValueError(
                f"distributed.rollout_shards={self.distributed.rollout_shards} exceeds"
                f" grpo.batch_prompts={self.grpo.batch_prompts} (a shard holds at least one"
                f" prompt): add distributed.rollout_shards={self.grpo.batch_prompts} or fewer"
            )
        return self

    @model_validator(mode="after")
    def _async_runs_what_it_supports(self) -> TrainConfig:
        a = self.async_rollout
        if a.max_lag > 0 and not a.enabled:
            raise ValueError(
                f"async_rollout.max_lag={a.max_lag} needs rollout workers:"
                " add async_rollout.workers=1"
            )
        if not a.enabled:
            return self
        refuse = [
            (
                self.generation.backend not in ("hf", "vllm"),
                "generation.backend=hf or vllm (the workers' generators)",
            ),
            (self.grpo.dynamic_sampling, "grpo.dynamic_sampling=false (no refills)"),
            (
                self.grpo.tis_cap is not None,
                "grpo.tis_cap=null (late groups train on the sampler's log-probs already)",
            ),
            (
                a.split == "shards" and self.distributed.rollout_shards % a.workers != 0,
                f"distributed.rollout_shards a multiple of async_rollout.workers={a.workers}",
            ),
            (
                bool(a.devices) and len(a.devices) != a.workers,
                f"one async_rollout.devices entry per worker ({a.workers}), not {len(a.devices)}",
            ),
        ]
        for broken, fix in refuse:
            if broken:
                raise ValueError(f"asynchronous rollout (async_rollout.workers > 0) needs {fix}")
        return self

    @model_validator(mode="after")
    def _skipped_rows_have_no_loss(self) -> TrainConfig:
        if not self.grpo.skip_zero_advantage:
            return self
        refuse = [
            (self.grpo.beta > 0, "grpo.beta=0 (the KL term of a skipped row is not 0)"),
            (
                self.replay.store_zero_advantage,
                "replay.store_zero_advantage=false (stored groups need their scores)",
            ),
            (self.async_rollout.enabled, "no rollout workers (late groups are gated by score)"),
        ]
        for broken, fix in refuse:
            if broken:
                raise ValueError(f"grpo.skip_zero_advantage needs {fix}")
        return self

    @model_validator(mode="after")
    def _adaptive_gate_has_a_tau(self) -> TrainConfig:
        if self.replay.gate == "adaptive" and not is_gated(self.arm):
            raise ValueError(
                f"replay.gate=adaptive adapts a drift gate, and arm {self.arm!r} has none:"
                " add replay.gate=fixed, or an arm that gates by drift (headroom_drift)"
            )
        return self

    @property
    def replays(self) -> bool:
        """Whether the arm replays at all (not `on_policy`, budget > 0, capacity > 0)."""
        return self.replay.replays(self.arm)

    def make_replay(self) -> GroupReplay:
        """The run's replay lifecycle: its arm's rule with the `replay` knobs, the replay gate,
        and the staleness gate of late groups (`async_rollout`)."""
        late = self.async_rollout.late_groups(self.replay.drift_norm)
        return self.replay.make_replay(self.arm, self.seed, self.steps, late)
