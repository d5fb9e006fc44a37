"""`hdr plan-memory`: the GPU memory one training process needs, by component and phase,
worked out from the config and the model's shape before any GPU is touched.

A step has three phases with different residents (`trainer/step.py`): the rollout (the
vLLM engine awake), behaviour scoring and replay selection (no-grad forwards), and the update
(forward and backward of micro-batches, then the fused AdamW step). Under DDP every process
holds all of it, so the plan is per GPU whatever the number of GPUs; `--gpus` adds NCCL's
buffers and DDP's gradient buckets. A TRL run config (`hdr trl-train`'s) is planned by
trainer/integrations/trl_memory.py instead.

Exact arithmetic on the parameter count P (bytes): fp32 master weights 4P, AdamW's two fp32
moments 8P, a bf16 KL reference 2P when `grpo.beta > 0`, and under bf16 autocast the bf16
copies of the weights autocast caches for a forward and its backward, 2P (an upper bound:
embeddings are not cast). Gradients: in one process fp32 4P in the update only (dropped after
the optimizer step). Under DDP (`gradient_as_bucket_view=True`) torch's reducer allocates
buckets holding every trainable parameter's gradient in the parameter's dtype, 4P, once for
the life of the DDP module: held in every phase, the rollout with the vLLM engine awake
included. Their sizing (torch 2.13's `Reducer`): one bucket of every parameter at
construction; after the first synced backward, buckets of at most `bucket_cap_mb` (25 MiB; the
first at most 1 MiB, a parameter larger than the cap alone in its own), grouped by dtype and
device in gradient-ready order; each bucket is exactly its parameters' elements, so the caps
change the count of buckets, never their total. The gradients are views into them
(`trainer/distributed.py` keeps them so: `settle_buckets`, `zero_gradients`), so there is no
second copy. AdamW is fused on CUDA (no per-tensor temporaries). vLLM takes
`gpu_memory_utilization` of the card while awake (its weights, KV cache and own activations
live inside that share).

Asynchronous rollout workers (`async_rollout.workers`) are planned on the GPUs the device map
sends them to (`async_rollout.devices`, trainer/async_rollout/devices.py), and are held in every
phase, since they roll out while the trainer scores and updates: each its own CUDA context; a
vllm worker its engine's `gpu_memory_utilization` of the card (its module stays on the CPU); an
hf worker its fp32 copy of the policy (4P), autocast's bf16 copies while it generates (2P, bf16
compute) and its KV cache. Workers on the trainer's GPU join the trainer's lines; every other
GPU must hold its own workers (`other_gpus`).

Estimates, stated so they can be checked against a measurement (none was made: no GPU was
lent): a row is at most T tokens (`generation.max_model_len` with vLLM, else a 1,024-token
prompt plus `rollout.longest_response`); with hidden size h, MLP size i, K/V width k (KV
heads x head size) and L layers, bf16 autocast over an fp32 residual stream with SDPA
attention (no T x T scores) saves about 40h + 14i + 10k bytes per token and layer for the
backward; gradient checkpointing keeps the fp32 layer input (4h) per layer and recomputes one
layer at a time; a no-grad forward holds about 8h + 6i bytes per token (one layer's tensors);
the output layer runs in slices of `HEAD_SLICE` positions (6 bytes per logit without grad,
14 with). The CUDA context with cuBLAS workspaces is taken as 1 GiB (+0.5 GiB for NCCL with
several GPUs), an asleep vLLM engine's CUDA-graph pools as 1 GiB, and vLLM's own activations
and graphs inside its share as 2 GiB. 5% of the card is left for allocator fragmentation.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import UserError
from trainer.async_rollout.devices import worker_device, worker_placement
from trainer.config import TrainConfig
from trainer.scoring import HEAD_SLICE

GIB = 2**30
PHASES = ("rollout", "scoring", "update")
USABLE = 0.95  # of the card; the rest for allocator fragmentation
PROMPT_ALLOWANCE = 1024  # tokens, for the row length when no engine limit bounds it
CONTEXT_GIB, NCCL_GIB, ASLEEP_GIB, VLLM_OWN_GIB = 1.0, 0.5, 1.0, 2.0

# The published config.json values of the models hdr's configs name, so that the plan needs
# no download; any other model is read from its directory (or the Hugging Face cache).
PUBLISHED = {
    "Qwen/Qwen2.5-3B-Instruct": dict(
        model_type="qwen2",
        hidden_size=2048,
        intermediate_size=11008,
        num_hidden_layers=36,
        num_attention_heads=16,
        num_key_value_heads=2,
        vocab_size=151936,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
    ),
}


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a causal LM."""

    name: str
    parameters: int  # tied weights counted once
    hidden: int
    intermediate: int
    layers: int
    kv_width: int  # KV heads x head size
    vocab: int
    max_positions: int

    @property
    def kv_bytes_per_token(self) -> int:
        """A bf16 KV cache: K and V of every layer."""
        return 2 * self.layers * self.kv_width * 2

    def saved_bytes_per_token(self) -> int:
        """One layer's activations kept for the backward, per token (bf16 autocast)."""
        return 40 * self.hidden + 14 * self.intermediate + 10 * self.kv_width

    def no_grad_bytes_per_token(self) -> int:
        """A no-grad forward's live tensors in one layer, per token."""
        return 8 * self.hidden + 6 * self.intermediate


def model_shape(path: str) -> ModelShape:
    """The shape of `path`'s model: its config (a directory, the published values above, or
    the Hugging Face cache), parameters counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from core.paths import local_model

    local_model(path)  # a missing local folder: one line, no hub asked
    if path in PUBLISHED and not Path(path).is_dir():
        values = dict(PUBLISHED[path])
        config = AutoConfig.for_model(values.pop("model_type"), **values)
    else:
        try:
            config = AutoConfig.from_pretrained(path)
        except OSError:
            raise UserError(f"cannot read the model config of {path} (model.path)") from None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    heads = config.num_attention_heads
    head_size = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return ModelShape(
        name=path,
        parameters=sum(p.numel() for p in model.parameters()),
        hidden=config.hidden_size,
        intermediate=config.intermediate_size,
        layers=config.num_hidden_layers,
        kv_width=kv_heads * head_size,
        vocab=config.vocab_size,
        max_positions=config.max_position_embeddings,
    )


@dataclass(frozen=True)
class Line:
    """One component: its size, the phases that hold it, and per phase the setting that
    shrinks it there (a `knob` for every phase, or `knobs` phase by phase)."""

    component: str
    gib: float
    phases: tuple[str, ...]
    knob: str | None = None
    knobs: dict[str, str] = field(default_factory=dict)
    gpu_fraction: float = 0.0  # a share of the card (vLLM's), not a fixed size

    def knob_in(self, phase: str) -> str | None:
        return self.knobs.get(phase, self.knob)


@dataclass
class MemoryPlan:
    config_name: str
    shape: ModelShape
    gpu_gib: float
    gpus: int
    lines: list[Line]
    kv_cache_gib: float | None  # vLLM's KV cache inside its share (None: no vLLM)
    sequences_at_full_length: int | None  # how many max_model_len sequences it holds
    # GPUs other than the trainer's, by device, with the rollout workers mapped to them
    other_gpus: dict[str, list[Line]] = field(default_factory=dict)

    def total(self, phase: str) -> float:
        return sum(line.gib for line in self.lines if phase in line.phases)

    @property
    def usable_gib(self) -> float:
        return USABLE * self.gpu_gib

    @property
    def peak(self) -> tuple[str, float]:
        """The phase that needs the most, and how much."""
        phase = max(PHASES, key=self.total)
        return phase, self.total(phase)

    @property
    def minimum_gpu_gib(self) -> float:
        """The smallest card every phase fits on, vLLM keeping its share of the card."""
        return self._smallest_card(lambda line, phase: True)

    @property
    def floor_gpu_gib(self) -> float:
        """The smallest card for what no setting shrinks (weights, gradients, AdamW, ...)."""
        return self._smallest_card(lambda line, phase: not line.knob_in(phase))

    def _smallest_card(self, counts) -> float:
        need = 0.0
        for phase in PHASES:
            held = [x for x in self.lines if phase in x.phases and counts(x, phase)]
            fixed = sum(x.gib for x in held if not x.gpu_fraction)
            share = sum(x.gpu_fraction for x in held)
            need = max(need, fixed / (USABLE - share) if share < USABLE else math.inf)
        return need

    def table(self) -> str:
        head = (
            f"{self.config_name}: {self.shape.name} ({self.shape.parameters / 1e9:.2f} B"
            f" parameters), per GPU of {self.gpu_gib:g} GiB, {self.gpus} GPU(s)"
        )
        rows = ["| component | " + " | ".join(PHASES) + " |", "| --- |" + " ---: |" * 3]
        for line in self.lines:
            cells = [f"{line.gib:.2f}" if p in line.phases else "" for p in PHASES]
            rows.append(f"| {line.component} | " + " | ".join(cells) + " |")
        totals = [f"**{self.total(p):.2f}**" for p in PHASES]
        rows.append("| **total** | " + " | ".join(totals) + " |")
        phase, need = self.peak
        tail = [
            f"peak: {phase}, {need:.1f} GiB of {self.usable_gib:.1f} usable (95% of"
            f" {self.gpu_gib:g}); the smallest GPU it fits: {self.minimum_gpu_gib:.1f} GiB"
        ]
        if self.kv_cache_gib is not None:
            tail.append(
                f"vLLM KV cache: {self.kv_cache_gib:.1f} GiB, {self.sequences_at_full_length}"
                " sequences of max_model_len at once (shorter ones share it)"
            )
        for device, lines in self.other_gpus.items():
            parts = "; ".join(f"{x.component} {x.gib:.2f}" for x in lines)
            tail.append(f"{device}: {sum(x.gib for x in lines):.1f} GiB in every phase ({parts})")
        return "\n".join([head, "", *rows, "", *tail])

    def refusal(self) -> str | None:
        """Why the config cannot run on this GPU and the setting to turn (None: it fits)."""
        for phase in PHASES:
            need = self.total(phase)
            if need <= self.usable_gib:
                continue
            where = (
                f"the {phase} phase needs {need:.1f} GiB per GPU, over the"
                f" {self.usable_gib:.1f} GiB usable of {self.gpu_gib:g}"
            )
            workers = [x for x in self.lines if x.component.startswith("rollout worker")]
            if workers and need - sum(x.gib for x in workers) <= self.usable_gib:
                return (
                    f"{where}, with the {len({x.component.split(':')[0] for x in workers})}"
                    " rollout worker(s) mapped to the"
                    f" trainer's GPU taking {sum(x.gib for x in workers):.1f} GiB of it: give"
                    f" them GPUs of their own, {workers[0].knob}"
                )
            shrinkable = [x for x in self.lines if phase in x.phases and x.knob_in(phase)]
            fixed = need - sum(x.gib for x in shrinkable)
            if not shrinkable or fixed > self.usable_gib:
                return (
                    f"{where}, more than settings can save: what no setting shrinks needs a GPU"
                    f" of at least {math.ceil(self.floor_gpu_gib)} GiB; or train sharded"
                    " through the TRL integration"
                )
            largest = max(shrinkable, key=lambda x: x.gib)
            return (
                f"{where}; the largest part a setting shrinks is {largest.component}"
                f" ({largest.gib:.1f} GiB): {largest.knob_in(phase)}"
            )
        for device, lines in self.other_gpus.items():
            need = sum(x.gib for x in lines)
            if need > self.usable_gib:
                return (
                    f"{device} holds {need:.1f} GiB of rollout workers, over the"
                    f" {self.usable_gib:.1f} GiB usable of {self.gpu_gib:g}: map fewer workers"
                    " to it (async_rollout.devices) or lower generation.gpu_memory_utilization"
                )
        if self.sequences_at_full_length is not None and self.sequences_at_full_length < 1:
            return (
                f"vLLM's share leaves {self.kv_cache_gib:.1f} GiB of KV cache, less than one"
                " sequence of max_model_len: raise generation.gpu_memory_utilization or lower"
                " generation.max_model_len"
            )
        return None


def row_tokens(config: TrainConfig, shape: ModelShape) -> int:
    """The longest row the trainer forwards (and the engine holds)."""
    if config.generation.backend == "vllm" and config.generation.max_model_len is not None:
        return config.generation.max_model_len
    return min(PROMPT_ALLOWANCE + config.rollout.longest_response, shape.max_positions)


def activation_lines(config: TrainConfig, shape: ModelShape, gib) -> list[Line]:
    """The scoring, update and reference forwards' activations (estimates)."""
    g, T = config.grpo, row_tokens(config, shape)
    head_no_grad, head_grad = HEAD_SLICE * shape.vocab * 6, HEAD_SLICE * shape.vocab * 14
    tokens = g.micro_batch * T
    if config.model.gradient_checkpointing:
        per_token = shape.layers * 4 * shape.hidden + shape.saved_bytes_per_token()
        knob = f"grpo.micro_batch={g.micro_batch // 2}" if g.micro_batch > 1 else None
    else:
        per_token = shape.layers * shape.saved_bytes_per_token()
        knob = "model.gradient_checkpointing=true"
    lines = [
        Line(
            f"scoring activations: {g.score_chunk} rows x {T} tokens, no grad",
            gib(g.score_chunk * T * shape.no_grad_bytes_per_token() + head_no_grad),
            ("scoring",),
            f"grpo.score_chunk={g.score_chunk // 2}" if g.score_chunk > 1 else None,
        ),
        Line(
            f"update activations: {g.micro_batch} rows x {T} tokens"
            + (", checkpointed" if config.model.gradient_checkpointing else ""),
            gib(tokens * per_token + head_grad),
            ("update",),
            knob,
        ),
    ]
    if g.beta > 0:
        lines.append(
            Line(
                "KL reference forward, no grad",
                gib(tokens * shape.no_grad_bytes_per_token() + head_no_grad),
                ("update",),
                "grpo.beta=0",
            )
        )
    if config.replay.reuse_scan_forward and config.replays:
        rows = config.replay.budget * g.group_size
        lines.append(
            Line(
                f"replay scan graphs kept for the update: {rows} rows",
                gib(rows * T * shape.layers * shape.saved_bytes_per_token()),
                ("scoring", "update"),
                "replay.reuse_scan_forward=false",
            )
        )
    return lines


def gpu_of(device: str) -> str | None:
    """`cuda:N` of a torch device string (`cuda` is `cuda:0`); None for the CPU."""
    return f"cuda:{device.partition(':')[2] or 0}" if device.startswith("cuda") else None


def worker_lines(config: TrainConfig, shape: ModelShape, gpu_gib: float, gib) -> dict:
    """GPU -> the lines of the rollout workers mapped to it (module docstring)."""
    gen, a, P = config.generation, config.async_rollout, shape.parameters
    elsewhere = [f"cuda:{k}" for k in range(1, a.workers + 1)]
    knob = f"async_rollout.devices=[{','.join(elsewhere)}]"  # one GPU each, beside the trainer's
    out: dict[str, list[Line]] = {}
    for w in range(a.workers):
        gpu = gpu_of(worker_device(config, w))
        if gpu is None:
            continue
        held = [Line(f"rollout worker {w}: CUDA context", CONTEXT_GIB, PHASES, knob)]
        if gen.backend == "vllm":
            share = gen.gpu_memory_utilization
            name = f"rollout worker {w}: vLLM engine, {share:g} of the GPU"
            held.append(Line(name, share * gpu_gib, PHASES, knob, gpu_fraction=share))
        else:
            # hf generates one shard of a step at a time, whichever worker rolls it out
            rows = gen.max_batch or -(-config.grpo.fresh_rows // config.distributed.rollout_shards)
            kv = gib(rows * row_tokens(config, shape) * shape.kv_bytes_per_token)
            copies = 2 * P if config.model.compute_dtype == "bfloat16" else 0
            name = f"rollout worker {w}: fp32 policy copy, bf16 casts, KV cache of {rows} rows"
            held.append(Line(name, gib(4 * P + copies) + kv, PHASES, knob))
        out.setdefault(gpu, []).extend(held)
    return out


def placement_refusal(config: TrainConfig, shape: ModelShape, gpu_gib: float) -> str | None:
    """Why the rollout workers do not fit where `async_rollout.devices` puts them, in one
    line: the plan with them is refused where the trainer's alone fits (None otherwise; a
    trainer that does not fit alone is `hdr plan-memory`'s to say)."""
    alone = config.async_rollout.model_copy(update={"workers": 0, "devices": []})
    if plan_memory(config.model_copy(update={"async_rollout": alone}), shape, gpu_gib).refusal():
        return None
    return plan_memory(config, shape, gpu_gib).refusal()


def gradient_line(parameters: int, gpus: int, gib) -> Line:
    """The fp32 gradients: in one process during the update only; under DDP the reducer's
    buckets (the gradients are views into them), held in every phase (module docstring)."""
    if gpus == 1:
        return Line("fp32 gradients (freed after the step)", gib(4 * parameters), ("update",))
    return Line(
        "DDP gradient buckets (fp32; the gradients are views into them), held for the run",
        gib(4 * parameters),
        PHASES,
    )


def plan_memory(
    config: TrainConfig, shape: ModelShape, gpu_gib: float, gpus: int = 1, name: str = "config"
) -> MemoryPlan:
    """Every component of one process's GPU memory (GiB) and the phases that hold it."""
    P, gen = shape.parameters, config.generation

    def gib(n_bytes: float) -> float:
        return n_bytes / GIB

    every = PHASES
    lines = [
        Line("fp32 master weights", gib(4 * P), every),
        Line("AdamW moments (2 x fp32)", gib(8 * P), every),
        gradient_line(P, gpus, gib),
    ]
    if config.grpo.beta > 0:
        lines.append(Line("bf16 KL reference model", gib(2 * P), every, "grpo.beta=0"))
    if config.model.compute_dtype == "bfloat16":
        held = every if gen.backend == "hf" else ("scoring", "update")
        lines.append(Line("autocast's bf16 weight copies", gib(2 * P), held))
    lines.append(Line("CUDA context and workspaces", CONTEXT_GIB, every))
    if gpus > 1:
        lines.append(Line("NCCL buffers", NCCL_GIB, every))
    lines += activation_lines(config, shape, gib)
    kv_gib = sequences = None
    if gen.backend == "vllm":
        share = gen.gpu_memory_utilization * gpu_gib
        weights = gib((2 if gen.dtype != "float32" else 4) * P)
        engine_len = gen.max_model_len or shape.max_positions
        smallest = weights + VLLM_OWN_GIB + gib(engine_len * shape.kv_bytes_per_token)
        beside = sum(x.gib for x in lines if "rollout" in x.phases)  # what the rollout shares
        fit = math.floor(20 * (USABLE * gpu_gib - beside) / gpu_gib) / 20
        knobs = {}
        if fit * gpu_gib >= smallest:  # the engine still holds one full-length sequence
            knobs["rollout"] = f"generation.gpu_memory_utilization={fit:g}"
        if not gen.enable_sleep_mode:
            knobs |= {p: "generation.enable_sleep_mode=true" for p in ("scoring", "update")}
        lines.append(
            Line(
                f"vLLM engine: gpu_memory_utilization {gen.gpu_memory_utilization:g} of the GPU",
                share,
                ("rollout",) if gen.enable_sleep_mode else every,
                knobs=knobs,
                gpu_fraction=gen.gpu_memory_utilization,
            )
        )
        if gen.enable_sleep_mode:
            lines.append(Line("vLLM asleep: CUDA-graph pools", ASLEEP_GIB, ("scoring", "update")))
        kv_gib = share - weights - VLLM_OWN_GIB
        sequences = int(max(kv_gib, 0) * GIB // (engine_len * shape.kv_bytes_per_token))
    else:
        rows = gen.max_batch or config.grpo.fresh_rows // gpus
        lines.append(
            Line(
                f"hf generation KV cache: {rows} rows",
                gib(rows * row_tokens(config, shape) * shape.kv_bytes_per_token),
                ("rollout",),
                "generation.max_batch",
            )
        )
    workers = worker_lines(config, shape, gpu_gib, gib) if config.async_rollout.enabled else {}
    lines += workers.pop(gpu_of(config.model.device), [])
    return MemoryPlan(name, shape, gpu_gib, gpus, lines, kv_gib, sequences, workers)


def check_worker_placement(config: TrainConfig) -> None:
    """Refuse, in one line, a device map this process cannot honour: a GPU it does not see,
    or GPUs (the trainer's included) that cannot hold the workers mapped to them by
    `hdr plan-memory`'s arithmetic, with the cards' real size."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus = set()
    for w in range(config.async_rollout.workers):
        physical, _ = worker_placement(config, w, visible)
        if physical is not None:
            gpus.add(int(worker_device(config, w).partition(":")[2] or 0))
    if not gpus or not torch.cuda.is_available():  # no card to size: nothing to plan
        return
    if config.model.device.startswith("cuda"):
        gpus.add(torch.device(config.model.device).index or 0)
    card = min(torch.cuda.get_device_properties(k).total_memory for k in gpus) / GIB
    refusal = placement_refusal(config, model_shape(config.model.path), card)
    if refusal:
        raise UserError(f"async_rollout.devices: {refusal}")
