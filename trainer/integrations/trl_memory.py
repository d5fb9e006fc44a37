"""`hdr plan-memory` for a TRL run config (`hdr trl-train`'s, configs/trl/*.yaml): the GPU
memory of one training process under DeepSpeed ZeRO-3 over `processes` processes, by component
and phase, and the step's compute, from the config, TRL's resolved `GRPOConfig` and the
model's shape. Arithmetic, not a measurement: no GPU has run it.

The phases are TRL's step with hdr's replay: the rollout (generation: vLLM server mode holds
nothing on the training GPUs but the weight push, one parameter gathered at a time; colocate
mode keeps its engine's share of the card in every phase, sleep mode being refused), the
no-grad scoring (TRL's old log-probs under its vLLM importance-sampling correction and the
reference's, `per_device_train_batch_size` rows per forward; hdr's behaviour scoring, scan
and reference scoring of replayed groups, `replay.score_chunk` rows per forward; the larger
one counts, they run one after another), and the update (one forward and backward per
micro-batch of fresh + replayed rows, then the optimizer step).

Exact arithmetic on the parameter count P (bytes), ZeRO-3 partitioning everything over the
N processes (the ZeRO paper's mixed-precision Adam): bf16 weights 2P/N, bf16 gradients 2P/N,
fp32 master weights and AdamW's two moments 12P/N; a bf16 reference 2P/N when `beta > 0`
(TRL prepares it with the same DeepSpeed config). A micro-batch holds
`per_device_train_batch_size` fresh rows and its share of the replayed groups (`budget / N`
groups per process, round-robin, spread over `steps_per_generation` micro-batches); a row is
at most a 1,024-token prompt allowance plus `max_completion_length`.

Estimates (as trainer/tools/memory_plan.py states them): the per-token activation bytes of a layer
for the backward, the no-grad forward's, gradient checkpointing keeping each layer's input
(bf16 under DeepSpeed's bf16: 2h per layer); ZeRO-3's gathered parameters in flight taken as
the largest module (the embedding or output layer) plus one decoder layer, twice (the one
computing and the one prefetched). TRL 1.16's fused output layer
(`trl.trainer.utils.add_fused_lm_head`) scores only the completion positions, in tiles of
4,096 positions x 32,768 vocabulary entries (bf16), and its backward accumulates the head's
gradient in fp32 `[V, H]` and the positions' hidden gradient in fp32 `[K, H]`; hdr's scoring
slices the output layer by `HEAD_SLICE` positions (6 bytes a logit without grad).

The step's compute is counted as 2 FLOPs per parameter and token forward (plus causal
attention, 2 x layers x row length x h per token), backward twice that, and one more forward
with gradient checkpointing; the time is that count divided by a sustained rate per GPU
(`--tflops`), generation taken as compute-bound on the server GPU (a lower bound: decoding is
often bound by memory bandwidth instead). The candidate scan is counted at `budget` groups
(every candidate admitted: the fewest scanned).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

from trainer.scoring import HEAD_SLICE
from trainer.tools.memory_plan import (
    CONTEXT_GIB,
    GIB,
    NCCL_GIB,
    PROMPT_ALLOWANCE,
    Line,
    MemoryPlan,
    ModelShape,
)

TOKEN_TILE, VOCAB_TILE = 4096, 32768  # TRL 1.16's fused output layer


@dataclass(frozen=True)
class TRLSizes:
    """What the plan reads of a TRL run: the sizes that set memory and compute."""

    processes: int
    micro_rows_fresh: int  # per_device_train_batch_size
    micro_rows_replayed: int  # this process's replayed rows per micro-batch (most)
    micro_batches: int  # steps_per_generation == gradient_accumulation_steps
    group_size: int  # num_generations
    row_tokens: int
    completion_tokens: int
    score_chunk: int
    budget: int  # replayed groups per step, over all processes
    beta: float
    checkpointing: bool
    old_logprobs: bool  # TRL computes them: its vLLM importance-sampling correction
    colocate_share: float | None  # vLLM colocate mode's share of the card (None: server)
    max_response_tokens: int  # the rollout's response budget (policy + environment tokens)
    policy_tokens: int  # the most policy tokens a trajectory generates

    @property
    def fresh_rows(self) -> int:
        return self.micro_rows_fresh * self.micro_batches

    @property
    def replayed_rows(self) -> int:
        return self.micro_rows_replayed * self.micro_batches

    @property
    def micro_rows(self) -> int:
        return self.micro_rows_fresh + self.micro_rows_replayed


def trl_sizes(config, args, processes: int) -> TRLSizes:
    """`config`: a `TRLRunConfig`; `args`: its resolved `GRPOConfig`."""
    G = args.num_generations
    share = math.ceil(config.replay.replay.budget / processes) * G  # rows, the busiest process
    rollout = config.rollout
    return TRLSizes(
        processes=processes,
        micro_rows_fresh=args.per_device_train_batch_size,
        micro_rows_replayed=math.ceil(share / args.steps_per_generation),
        micro_batches=args.steps_per_generation,
        group_size=G,
        row_tokens=PROMPT_ALLOWANCE + args.max_completion_length,
        completion_tokens=args.max_completion_length,
        score_chunk=config.replay.score_chunk,
        budget=config.replay.replay.budget,
        beta=args.beta,
        checkpointing=args.gradient_checkpointing,
        old_logprobs=bool(args.use_vllm and args.vllm_importance_sampling_correction),
        colocate_share=args.vllm_gpu_memory_utilization
        if args.use_vllm and args.vllm_mode == "colocate"
        else None,
        max_response_tokens=rollout.max_response_tokens,
        policy_tokens=min(
            rollout.max_turns * rollout.max_tokens_per_turn, args.max_completion_length
        ),
    )


def trl_memory_plan(
    sizes: TRLSizes, shape: ModelShape, gpu_gib: float, name: str = "config"
) -> MemoryPlan:
    """One training process's GPU memory (GiB) by component and phase."""
    P, N, s = shape.parameters, sizes.processes, sizes
    H, V, T = shape.hidden, shape.vocab, s.row_tokens

    def gib(n_bytes: float) -> float:
        return n_bytes / GIB

    every = ("rollout", "scoring", "update")
    lines = [
        Line(f"bf16 weights, ZeRO-3 shard (1/{N})", gib(2 * P / N), every),
        Line(f"fp32 master weights + AdamW moments, shard (1/{N})", gib(12 * P / N), every),
        Line(f"bf16 gradients, shard (1/{N})", gib(2 * P / N), ("update",)),
    ]
    if s.beta > 0:
        lines.append(Line(f"bf16 reference model, shard (1/{N})", gib(2 * P / N), every,
                          "trl.beta=0"))  # fmt: skip
    batch_rows = s.fresh_rows + s.replayed_rows
    layer = (P - V * H) / shape.layers  # one decoder layer's parameters (tied head counted once)
    lines += [
        Line(
            "ZeRO-3 gathered parameters in flight (largest module + a layer, x2)",
            gib(2 * 2 * (V * H + layer)),
            every,
        ),
        Line("CUDA context and workspaces", CONTEXT_GIB, every),
        Line("NCCL buffers", NCCL_GIB if N > 1 else 0.0, every),
        Line(
            f"the step's batch on the device: {batch_rows} rows",
            gib(batch_rows * (T * (8 + 8) + 6 * 4 * s.completion_tokens)),  # ids, masks; 6 fp32
            ("scoring", "update"),
        ),
    ]
    trl_rows = s.micro_rows_fresh  # TRL's no-grad forwards take per_device_train_batch_size
    trl_no_grad = trl_rows * T * shape.no_grad_bytes_per_token() + trl_rows * s.completion_tokens \
        * H * 2 + TOKEN_TILE * VOCAB_TILE * 2  # fmt: skip
    hdr_no_grad = s.score_chunk * T * shape.no_grad_bytes_per_token() + HEAD_SLICE * V * 6
    if s.old_logprobs or s.beta > 0:
        no_grad, which, knob = trl_no_grad, f"TRL's, {trl_rows} rows", None
    else:
        no_grad, which, knob = hdr_no_grad, f"hdr's, {s.score_chunk} rows", None
    if hdr_no_grad > no_grad:
        no_grad, which = hdr_no_grad, f"hdr's replay scoring, {s.score_chunk} rows"
        knob = f"replay.score_chunk={s.score_chunk // 2}" if s.score_chunk > 1 else None
    lines.append(Line(f"largest no-grad forward ({which} x {T} tokens)", gib(no_grad),
                      ("scoring",), knob))  # fmt: skip
    rows = s.micro_rows
    if s.checkpointing:
        per_token = shape.layers * 2 * H + shape.saved_bytes_per_token()
        knob = f"trl.per_device_train_batch_size={s.micro_rows_fresh // 2}"
    else:
        per_token = shape.layers * shape.saved_bytes_per_token()
        knob = "trl.gradient_checkpointing=true"
    lines.append(
        Line(
            f"update activations: {s.micro_rows_fresh} fresh + {s.micro_rows_replayed} replayed"
            f" rows x {T} tokens" + (", checkpointed" if s.checkpointing else ""),
            gib(rows * T * per_token),
            ("update",),
            knob,
        )
    )
    K = rows * s.completion_tokens  # completion positions the fused head scores
    lines.append(
        Line(
            f"TRL's fused output layer: {TOKEN_TILE} x {VOCAB_TILE} tiles, fp32 gradients of"
            f" the head and of {K} positions",
            gib(TOKEN_TILE * VOCAB_TILE * 2 + V * H * 4 + K * H * (2 + 4) + K * 7 * 4),
            ("update",),
            f"trl.max_completion_length={s.completion_tokens // 2}",
        )
    )
    if s.colocate_share is not None:
        lines.append(
            Line(
                f"vLLM colocated engine: gpu_memory_utilization {s.colocate_share:g}",
                s.colocate_share * gpu_gib,
                every,
                "trl.vllm_mode=server",
                gpu_fraction=s.colocate_share,
            )
        )
    return MemoryPlan(name, shape, gpu_gib, N, lines, None, None)


@dataclass(frozen=True)
class StepCompute:
    """One step's compute (FLOPs): per training process by kind of pass, and generation."""

    passes: dict[str, tuple[int, float]]  # name -> (rows, FLOPs), per training process
    generation: float  # FLOPs on the generation GPU (server), or on each process (colocated)
    colocated: bool = False

    @property
    def training(self) -> float:
        return sum(f for _, f in self.passes.values())


def step_compute(sizes: TRLSizes, shape: ModelShape) -> StepCompute:
    """The step's FLOPs at full row length (an upper bound on the tokens)."""
    s, P, T = sizes, shape.parameters, sizes.row_tokens
    forward = 2 * P + 2 * shape.layers * T * shape.hidden  # per token, causal attention
    update = (3 + (1 if s.checkpointing else 0)) * forward
    fresh, replayed = s.fresh_rows, s.replayed_rows
    scan_rows = math.ceil(s.budget / s.processes) * s.group_size
    passes = {"update (forward + backward)": (fresh + replayed, (fresh + replayed) * T * update)}
    # the fresh rows' behaviour log-probs: TRL's old log-probs where its vLLM importance-
    # sampling correction computes them (hdr stores those), else hdr's own pass
    if s.old_logprobs:
        passes["TRL: old log-probs (vLLM IS correction), hdr's behaviour too"] = (
            fresh, fresh * T * forward,
        )  # fmt: skip
    else:
        passes["hdr: behaviour scoring of the fresh rows"] = (fresh, fresh * T * forward)
    passes["hdr: candidate scan (its share, budget groups)"] = (scan_rows, scan_rows * T * forward)
    if s.beta > 0:
        passes["TRL: reference log-probs of the fresh rows"] = (fresh, fresh * T * forward)
        passes["hdr: reference log-probs of its replayed share"] = (
            replayed, replayed * T * forward,
        )  # fmt: skip
    # prefill + decode of every row once: all processes' on the server's GPU, or each
    # process's own on its colocated engine
    colocated = s.colocate_share is not None
    trajectories = s.fresh_rows * (1 if colocated else s.processes)
    return StepCompute(passes, trajectories * T * forward, colocated)


def step_table(compute: StepCompute, tflops: float, processes: int) -> str:
    rate = tflops * 1e12
    rows = ["| pass (per training process) | rows | TFLOPs | s |", "| --- | ---: | ---: | ---: |"]
    for name, (n, flops) in compute.passes.items():
        rows.append(f"| {name} | {n} | {flops / 1e12:.0f} | {flops / rate:.1f} |")
    train = compute.training
    rows.append(f"| **training, per process** | | **{train / 1e12:.0f}** | **{train / rate:.1f}**"
                " |")  # fmt: skip
    gen = compute.generation
    where = "this process's rows, colocated" if compute.colocated else (
        f"all {processes} processes' rows, the server's GPU"
    )  # fmt: skip
    rows.append(f"| generation, {where} | | {gen / 1e12:.0f} | {gen / rate:.1f} |")
    trained = compute.passes["update (forward + backward)"]
    no_grad = train - trained[1]
    tail = (
        f"step at {tflops:g} TFLOP/s sustained per GPU: {(train + gen) / rate:.0f} s"
        f" (generation then training, as TRL runs them); no-grad passes are"
        f" {no_grad / train:.0%} of a training process's compute"
    )
    return "\n".join([*rows, "", tail])


def is_trl_config(path) -> bool:
    """Whether the YAML file at `path` is a TRL run config (it has a `trl:` section)."""
    import yaml

    from core.errors import UserError

    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as err:
        raise UserError(f"cannot read {path}: {err.strerror}") from None
    return isinstance(raw, dict) and "trl" in raw


def plan_trl(path, overrides: list[str], gpu_gib: float, processes: int, tflops: float):
    """The memory plan and the step-compute table of the TRL run config at `path`."""
    from core.config import load_config
    from trainer.integrations.trl_run import TRLRunConfig, grpo_args
    from trainer.tools.memory_plan import model_shape

    config = load_config(TRLRunConfig, path, overrides)
    # TRL's dataclass resolves the sizes (steps_per_generation, ...); bf16 is the recipe's
    # (DeepSpeed bf16) whatever this machine's, whose lack of a GPU TRL would refuse
    resolved = config.model_copy(update={"trl": {**config.trl, "bf16": False}})
    with warnings.catch_warnings():  # transformers' renaming notices, not about this plan
        warnings.simplefilter("ignore", FutureWarning)
        args = grpo_args(resolved)
    sizes = trl_sizes(config, args, processes)
    shape = model_shape(config.model)
    plan = trl_memory_plan(sizes, shape, gpu_gib, name=str(path))
    return plan, step_table(step_compute(sizes, shape), tflops, processes)
