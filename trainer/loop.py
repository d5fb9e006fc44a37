"""The GRPO training loop with Headroom-Drift Replay: `train(config, resume=None) -> run_dir`.

One step, top to bottom (docs/design.md):
1. rollout: `b` prompts, `G` responses each, through agent_env's multi-turn loop against the
   retrieval server(s);
2. reward: exact match, computed by agent_env per response;
3. behaviour log-probs: every fresh token teacher-forced under the current weights
   (`gen_logprobs`), and the group advantages;
4. replay selection: the arm's registered selector picks up to `R` stored groups, re-scoring
   candidates teacher-forced (no generation, no retrieval);
5. one update on fresh + replayed rows (token-mean clipped loss, AdamW, gradient clipping,
   warmup), `grpo.updates_per_step` passes (1 by default); fresh tokens optionally weighted
   by truncated importance sampling of the sampler/trainer gap (`grpo.tis_cap`);
6. ingress: the step's fresh groups enter the FIFO buffer after the update;
7. telemetry (metrics.jsonl, TensorBoard), a periodic held-out evaluation (eval.jsonl), a
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
`hdr eval`. `on_policy_larger` is not an arm but a config (`grpo.batch_prompts` 1.5x,
`arm: on_policy`); `on_policy_filtered` is `grpo.dynamic_sampling` (DAPO-style: zero-variance
groups dropped and refilled by extra fresh prompts, which count as fresh cost) with
`arm: on_policy`.

Every step logs its cost ledger (`trainer.telemetry.StepCost`, `cost_*` keys): tokens by
phase, environment calls and passages, informative groups and tokens, CPU seconds by phase.
"""

from __future__ import annotations

import contextlib
import random
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from hdr.config import dump_config, load_config
from hdr.errors import RunInterrupted, UserError
from hdr.paths import RUN, check_output, local_model
from hdr.progress import progress, say
from trainer import distributed
from trainer.checkpoint import (
    Checkpoint,
    TrainState,
    list_checkpoints,
    open_checkpoint,
    save_checkpoint,
    save_model,
)
from trainer.config import TrainConfig
from trainer.grpo import (
    group_advantages,
    kl_k3,
    logprob_gap,
    masked_mean,
    policy_loss,
    truncated_is_weights,
)
from trainer.replay import (
    SELECTORS,
    ReplayBuffer,
    Selection,
    StoredGroup,
    headroom,
    make_group,
    policy_drift,
)
from trainer.scoring import (
    align,
    concat_left_padded,
    distinct_tokens,
    forward_logprobs,
    forwarded_tokens,
    left_pad,
    score_groups,
    token_logprobs,
)
from trainer.telemetry import RunLogs, StepCost, quantiles


@dataclass
class Run:
    """Everything a step touches. Built by `setup_run`, mutated by `train_step`."""

    config: TrainConfig
    run_dir: Path
    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    buffer: ReplayBuffer
    generator: Any
    client: Any
    train_examples: list
    eval_examples: list
    logs: RunLogs
    ref_model: Any = None
    cost: StepCost = field(default_factory=StepCost)  # the current step's ledger
    dist: distributed.Dist = field(default_factory=distributed.Dist)
    policy: Any = None  # the update's forward module (DDP/FSDP-wrapped across processes)
    counters: dict[str, Any] = field(
        default_factory=lambda: {
            "env_calls_total": 0,
            "search_calls_total": 0,
            "wall_time_total": 0.0,
        }
    )

    def score(self, groups: list[StoredGroup]) -> list[torch.Tensor]:
        """The replay `ScoreFn`: current-policy log-probs of stored groups; across processes
        each rank scores its round-robin share and every rank gets all of them. With
        `replay.reuse_scan_forward` (one process) the log-probs keep their graphs."""
        self.cost.scan_tf_tokens += distinct_tokens(groups)
        with self.autocast():
            return self.dist.split_map(
                groups,
                lambda part: score_groups(
                    self.model,
                    part,
                    self.config.grpo.score_chunk,
                    self.config.rollout.temperature,
                    with_grad=self.reuses_scan_forward,
                ),
            )

    @property
    def reuses_scan_forward(self) -> bool:
        return self.config.replay.reuse_scan_forward and self.dist.world == 1

    def scan_graphs(self, selection: Selection) -> list[torch.Tensor] | None:
        """What `update_policy` takes as `scanned`: the admitted groups' scan log-probs with
        their graphs, when this run reuses the scan's forward and the selector scored every
        group it admitted (the sampling and recency selectors score none); else None."""
        admitted = selection.groups
        if self.reuses_scan_forward and admitted and len(selection.scored) == len(admitted):
            return selection.scored
        return None

    def autocast(self):
        """bf16 compute on the float32 master weights when `model.compute_dtype` asks."""
        if self.config.model.compute_dtype == "float32":
            return contextlib.nullcontext()
        device = next(self.model.parameters()).device.type
        return torch.autocast(device, dtype=getattr(torch, self.config.model.compute_dtype))


# --- setup -----------------------------------------------------------------------------


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def lr_lambda(config: TrainConfig):
    """Linear warmup over `warmup_steps`, then constant or cosine to 0 at the last step."""
    warmup, total, cosine = config.grpo.warmup_steps, config.steps, config.grpo.schedule == "cosine"

    def factor(done: int) -> float:  # `done` optimizer steps taken so far
        if done < warmup:
            return (done + 1) / (warmup + 1)
        if not cosine:
            return 1.0
        progress = (done - warmup) / max(1, total - warmup)
        return 0.5 * (1.0 + np.cos(np.pi * min(progress, 1.0)))

    return factor


def sample_prompts(examples: list, seed: int, step: int, b: int) -> list:
    """The `b` prompts of `step` (1-based): epochs of seeded permutations, read in order.
    A pure function of (seed, step), so a resumed run draws what the original would."""
    n = len(examples)
    out = []
    for j in range((step - 1) * b, step * b):
        epoch, pos = divmod(j, n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        out.append(examples[int(perm[pos])])
    return out


def refill_prompts(examples: list, seed: int, step: int, round_: int, n: int) -> list:
    """`n` extra prompts for dynamic sampling's refill `round_` of `step`: distinct, drawn from
    a stream of their own, a pure function of (seed, step, round)."""
    rng = np.random.default_rng([seed, step, round_, 7_919])
    picks = rng.choice(len(examples), size=min(n, len(examples)), replace=False)
    return [examples[int(i)] for i in picks]


def heldout_subset(examples: list, seed: int, size: int) -> list:
    """A fixed held-out subset: the first `size` of a seeded shuffle."""
    perm = np.random.default_rng([seed, 10_007]).permutation(len(examples))
    return [examples[int(i)] for i in perm[:size]]


def load_policy(model_dir: str | Path, config: TrainConfig, frozen: bool = False):
    """Model and tokenizer from a directory. Trained weights load in `model.dtype` (fp32
    master weights); a `frozen` one (the KL reference) in `model.compute_dtype`."""
    from transformers import AutoModelForCausalLM

    from agent_env.runner import load_tokenizer

    path = str(model_dir)
    dtype = getattr(torch, config.model.compute_dtype if frozen else config.model.dtype)
    try:  # a local directory, or a Hub id (Qwen/Qwen2.5-3B-Instruct) when online or cached
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except OSError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"cannot load model {path}: {first}") from None
    model = model.to(config.model.device).eval()
    if config.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model, load_tokenizer(path)


def build_optimizer(model, config: TrainConfig):
    g = config.grpo
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=g.lr, betas=g.betas, weight_decay=g.weight_decay
    )
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(config))
    return optimizer, scheduler


RUN_FILES = ("config.yaml", "metrics.jsonl", "eval.jsonl", "groups.jsonl")
RUN_DIRS = ("tb", "checkpoints", "final")
"""What `hdr train` writes into a run directory (what starting over removes, and only that)."""


def clear_run(run_dir: Path) -> None:
    """Remove a run's own files and folders from `run_dir`; anything else stays."""
    for name in RUN_FILES:
        (run_dir / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        shutil.rmtree(run_dir / name, ignore_errors=True)


def check_run_dir(config: TrainConfig, force: bool = False) -> Path:
    """`out_dir` may take a new run (writes nothing): it is new, empty or an earlier run, and
    never the model it trains. An earlier run with checkpoints or a final model is started over
    only with `force`; one that never reached a checkpoint (stopped by a missing server, a
    crash) is simply started over. One UserError line otherwise."""
    run_dir = check_output(
        config.out_dir, RUN, reuse=True, inputs=[config.model.path], option="out_dir"
    )
    found = list_checkpoints(run_dir / "checkpoints")
    if found and not force:
        raise UserError(
            f"run directory {run_dir} already holds a run (checkpoint at step {found[-1][0]});"
            f" continue it with `hdr train --resume {run_dir}`, start it over with --force, or"
            " choose another out_dir"
        )
    if (run_dir / "final").exists() and not force:
        raise UserError(
            f"run directory {run_dir} holds a finished run; start it over with --force or"
            " choose another out_dir"
        )
    return run_dir


def prepare_run_dir(config: TrainConfig, ckpt: Checkpoint | None, force: bool = False) -> Path:
    """The run directory: the checkpoint's on resume; else `out_dir` as `check_run_dir` allows
    it, an earlier run's own files removed (and nothing else)."""
    if ckpt is not None:
        run_dir = ckpt.run_dir
        # a step-0 checkpoint (stopped before the first step) evaluates step 0 again
        RunLogs.truncate_after(run_dir, ckpt.step if ckpt.step > 0 else -1)
        return run_dir
    run_dir = check_run_dir(config, force)
    if RUN.recognise(run_dir):
        if not list_checkpoints(run_dir / "checkpoints") and not (run_dir / "final").exists():
            say(f"hdr train: {run_dir} holds a run that never reached a checkpoint; starting over")
        clear_run(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run_dir


def setup_run(
    config: TrainConfig, resume: str | Path | None = None, force: bool = False
) -> tuple[Run, int]:
    """Build the run (fresh or from a checkpoint); returns it and the first step to run.
    Nothing is written before the model, the output folder and the server are checked."""
    from agent_env.data import load_task
    from agent_env.generation import build_generator
    from agent_env.retrieval_client import connect

    dist, config = distributed.init_distributed(config)
    seed_everything(config.seed)
    ckpt = open_checkpoint(resume) if resume is not None else None

    if ckpt is None:  # the model, then the run dir: one line, before any hub is asked
        local_model(
            config.model.path,
            f"`hdr sft --config FILE` writes it ({config.sft.epochs}"
            " epochs of supervised warm start from sft.init_model)",
        )
        dist.on_main(lambda: check_run_dir(config, force))

    def make_run_dir() -> Path:
        run_dir = prepare_run_dir(config, ckpt, force)
        (run_dir / "config.yaml").write_text(dump_config(config))
        return run_dir

    client = connect(config.retrieval, seed=config.seed)  # before anything is written or loaded
    run_dir = dist.on_main(make_run_dir)  # rank 0 alone writes the run directory
    model, tokenizer = load_policy(ckpt.model_dir if ckpt else config.model.path, config)
    policy = distributed.wrap_policy(model, dist, config.distributed.strategy)
    optimizer, scheduler = build_optimizer(model, config)
    buffer = ReplayBuffer(config.replay.capacity)
    ref_model = None
    if config.grpo.beta > 0:
        ref_model, _ = load_policy(config.model.path, config, frozen=True)
        ref_model.requires_grad_(False)
    generator = build_generator(
        config.generation,
        model_dir=ckpt.model_dir if ckpt else config.model.path,
        tokenizer=tokenizer,
        prompt=config.rollout.prompt,
        model=model if config.generation.backend == "hf" else None,
    )
    run = Run(
        config=config,
        run_dir=run_dir,
        model=model,
        tokenizer=tokenizer,
        optimizer=optimizer,
        scheduler=scheduler,
        buffer=buffer,
        generator=generator,
        client=client,
        train_examples=load_task(config.data.train, config.data.train_split),
        eval_examples=heldout_subset(
            load_task(config.data.eval, config.data.eval_split),
            config.seed,
            config.eval.num_questions,
        ),
        logs=RunLogs(run_dir, config.log.tensorboard, purge_step=ckpt.step + 1 if ckpt else None)
        if dist.is_main
        else distributed.SilentLogs(),
        ref_model=ref_model,
        dist=dist,
        policy=policy,
    )
    if not run.train_examples:
        raise UserError(f"training task {config.data.train!r} has no questions")
    start = 1
    if ckpt is not None:
        distributed.load_optimizer_state(run, ckpt.optimizer_state())
        scheduler.load_state_dict(ckpt.scheduler_state())
        run.buffer = ckpt.buffer()
        run.counters = {k: v for k, v in ckpt.counters().items() if k != "step"}
        ckpt.restore_rng(dist.rank, dist.world)
        start = ckpt.step + 1
    return run, start


# --- the step ----------------------------------------------------------------------------


def trajectory_rows(groups: list[list]) -> tuple[torch.Tensor, ...]:
    """Left-padded `input_ids`, `attention_mask`, `loss_mask` `[b*G, T]` of prompt+response."""
    trajs = [t for group in groups for t in group]
    ids = left_pad([t.prompt_ids + t.response_ids for t in trajs])
    attn = left_pad([[1] * (len(t.prompt_ids) + len(t.response_ids)) for t in trajs])
    mask = left_pad([[0] * len(t.prompt_ids) + list(t.loss_mask) for t in trajs])
    return ids, attn, mask


def behaviour_groups(
    run: Run, groups: list[list], step: int, indices: list[int] | None = None
) -> tuple[list[StoredGroup], float]:
    """Teacher-forced behaviour log-probs (`gen_logprobs`) and advantages of the fresh groups;
    returns them as StoredGroups (not yet in the buffer) and the mean token entropy.
    `indices`: each group's index in the step (its id), by default its position here."""
    if not groups:
        return [], 0.0
    indices = list(range(len(groups))) if indices is None else indices
    ids, attn, mask = trajectory_rows(groups)
    run.cost.behaviour_tf_tokens += forwarded_tokens(ids, attn, mask)
    with torch.no_grad(), run.autocast():
        lp, ent = token_logprobs(
            run.model,
            ids,
            attn,
            mask,
            run.config.grpo.score_chunk,
            run.config.rollout.temperature,
            with_entropy=True,
        )
    gen, ent = align(lp) * mask, align(ent)  # (b*G, T)
    rewards = torch.tensor([[t.reward for t in group] for group in groups])  # (b, G)
    advantages = group_advantages(rewards)
    fresh, G = [], run.config.grpo.group_size
    for k, group in enumerate(groups):
        rows = slice(k * G, (k + 1) * G)
        width = int(attn[rows].sum(dim=1).max())  # trim the group to its own longest row
        cut = (rows, slice(ids.shape[1] - width, None))
        gid = f"s{step}/{indices[k]}/{group[0].example.id}"
        fresh.append(
            make_group(
                gid, ids[cut], attn[cut], mask[cut], gen[cut], rewards[k], advantages[k], step
            )
        )
    return fresh, float(masked_mean(ent, mask))


@dataclass
class UpdateStats:
    loss: float
    grad_norm: float
    kl: float
    replay_drift: list[float]  # per replayed group, under the pre-update weights
    replay_headroom: list[float]


def sampler_logprobs(groups: list[list], fresh: list[StoredGroup]) -> list[torch.Tensor]:
    """Each fresh group's sampler-reported log-probs, aligned with its `input_ids` `[G, T_g]`
    (0 off the policy tokens)."""
    out = []
    for group, stored in zip(groups, fresh, strict=True):
        rows = [[0.0] * len(t.prompt_ids) + list(t.sampler_logprobs) for t in group]
        out.append(left_pad(rows, dtype=torch.float32)[:, -stored.input_ids.shape[1] :])
    return out


def sampler_gap(
    fresh: list[StoredGroup], sampled: list[torch.Tensor], tis_cap: float | None
) -> tuple[dict[str, float | None], list[torch.Tensor] | None]:
    """The step's sampler/trainer log-prob gap (metrics; None without fresh groups) and, with
    `tis_cap`, each fresh group's truncated importance weights `[G, T_g]`."""
    if not fresh:
        return {"logprob_gap_mean": None, "logprob_gap_max": None}, [] if tis_cap else None
    trainer_lp = concat_left_padded([g.gen_logprobs for g in fresh])
    sampler_lp = concat_left_padded(sampled)
    mask = concat_left_padded([g.loss_mask for g in fresh])
    mean, worst = logprob_gap(trainer_lp, sampler_lp, mask)
    metrics = {"logprob_gap_mean": float(mean), "logprob_gap_max": float(worst)}
    if tis_cap is None:
        return metrics, None
    weights = [
        truncated_is_weights(g.gen_logprobs, s, g.loss_mask, tis_cap)
        for g, s in zip(fresh, sampled, strict=True)
    ]
    w = concat_left_padded(weights)
    metrics["is_weight_mean"] = float(masked_mean(w, mask))
    metrics["is_capped_frac"] = float(masked_mean((w >= tis_cap).float(), mask))
    return metrics, weights


def update_policy(
    run: Run,
    fresh: list[StoredGroup],
    replayed: list[StoredGroup],
    weights: list[float] | None = None,
    fresh_weights: list[torch.Tensor] | None = None,
    scanned: list[torch.Tensor] | None = None,
) -> UpdateStats:
    """`updates_per_step` optimizer passes over fresh + replayed rows, in chunks of
    `micro_batch` rows whose gradients add up to the token mean over the whole batch.
    `weights` (one per replayed group, importance weights of a sampling selector) scale that
    group's advantages, which scales its loss terms exactly since a weight is positive.
    `fresh_weights` (truncated IS, one `[G, T_g]` per fresh group) scale the fresh tokens'
    surrogate; replayed tokens keep token weight 1. Across processes each trains on its
    round-robin share of the groups and the gradients are summed over processes, so the
    update is the whole batch's (trainer/distributed.py). `scanned` (one process only): the
    replayed groups' log-probs from the replay scan, with their graphs, under the same
    parameters; the first pass backpropagates through them instead of a second forward."""
    cfg, groups = run.config.grpo, fresh + replayed
    if not groups:  # dynamic sampling kept nothing and nothing was replayed
        run.scheduler.step()
        return UpdateStats(0.0, 0.0, 0.0, [], [])
    weights = [1.0] * len(fresh) + (weights or [1.0] * len(replayed))
    run.cost.update_tf_tokens += sum(int(g.attention_mask.sum()) for g in groups) * (
        cfg.updates_per_step
    )
    total = torch.stack([g.loss_mask.sum() for g in groups]).sum().clamp(min=1.0)  # global
    mine = run.dist.share(len(groups))
    share = 1.0 if mine else 0.0  # a process dealt no group joins the all-reduce with zeros
    local = mine or [0]
    ids = concat_left_padded([groups[j].input_ids for j in local])
    attn = concat_left_padded([groups[j].attention_mask for j in local])
    mask = concat_left_padded([groups[j].loss_mask for j in local])
    old = concat_left_padded([groups[j].gen_logprobs for j in local])
    adv = torch.cat(
        [
            groups[j].advantages if j < len(fresh) else groups[j].advantages * weights[j]
            for j in local
        ]
    )  # (n,)
    token_weights = None
    if fresh_weights is not None:
        per_group = [
            fresh_weights[j] if j < len(fresh) else torch.ones_like(groups[j].gen_logprobs)
            for j in local
        ]
        token_weights = concat_left_padded(per_group)  # (n, T)
        token_weights = torch.where(mask.bool(), token_weights, torch.ones_like(token_weights))
    chunks = micro_batches(attn, cfg.micro_batch)
    reused = []  # the replayed rows and their scan log-probs, one chunk for the first pass
    if scanned:
        if len(scanned) != len(replayed):
            raise ValueError(f"{len(scanned)} scanned log-probs for {len(replayed)} groups")
        fresh_rows = sum(len(g.input_ids) for g in fresh)
        chunks = micro_batches(attn[:fresh_rows], cfg.micro_batch)
        # one chunk: the scan scored groups together, so their graphs share a forward that
        # only one backward may run through
        width = ids.shape[1]
        padded = [F.pad(lp, (width - lp.shape[1], 0)) for lp in scanned]  # keeps the graphs
        reused = [(torch.arange(fresh_rows, len(ids)), torch.cat(padded))]
    first_pass = torch.zeros_like(old)
    run.model.train()
    loss_sum = kl_sum = 0.0
    for p in range(cfg.updates_per_step):
        run.optimizer.zero_grad(set_to_none=True)
        if p == 1 and reused:  # the parameters moved: every row is forwarded again
            chunks, reused = micro_batches(attn, cfg.micro_batch), []
        work = [(rows, None) for rows in chunks] + reused
        for c, (rows, logprobs) in enumerate(work):
            part = share * float(mask[rows].sum() / total)
            w = None if token_weights is None else token_weights[rows]
            with distributed.accumulate(run.policy, sync=c == len(work) - 1):
                loss, kl, lp = chunk_loss(
                    run, ids[rows], attn[rows], mask[rows], old[rows], adv[rows], w, logprobs
                )
                (loss * mask[rows].sum() / total * share).backward()
            loss_sum += float(loss.detach()) * part / cfg.updates_per_step
            kl_sum += kl * part / cfg.updates_per_step
            if p == 0:
                first_pass[rows] = lp
        grad_norm = distributed.clip_grad_norm(run.model, cfg.grad_clip)
        run.optimizer.step()
    run.scheduler.step()
    run.model.eval()
    trained = [(j, groups[j]) for j in mine]
    drift, room = replay_telemetry(run, len(fresh), trained, first_pass)
    sums = run.dist.sum({"loss": loss_sum, "kl": kl_sum})
    return UpdateStats(sums["loss"], grad_norm, sums["kl"], drift, room)


def replay_telemetry(
    run: Run, num_fresh: int, trained: list[tuple[int, StoredGroup]], first_pass: torch.Tensor
) -> tuple[list[float], list[float]]:
    """Drift and headroom of each replayed group under the pre-update policy (the update's
    first pass), in selection order; each process measures the groups it trained on."""
    found, row = [], 0
    for j, g in trained:
        G, T = g.input_ids.shape
        if j >= num_fresh:
            lp = first_pass[row : row + G, first_pass.shape[1] - T :]
            norm = run.config.replay.drift_norm
            drift = float(policy_drift(lp, g.gen_logprobs, g.loss_mask, norm))
            found.append((j, drift, float(headroom(lp, g.loss_mask, g.advantages))))
        row += G
    found = sorted(t for part in run.dist.all_gather(found) for t in part)
    return [d for _, d, _ in found], [h for _, _, h in found]


def micro_batches(attention_mask: torch.Tensor, size: int) -> list[torch.Tensor]:
    """Row indices in chunks of `size`, shortest rows first (chunks pad little)."""
    order = torch.argsort(attention_mask.sum(dim=1), stable=True)
    return [order[lo : lo + size] for lo in range(0, len(order), size)]


def chunk_loss(
    run: Run, ids, attn, mask, old, adv, weights=None, logprobs=None
) -> tuple[torch.Tensor, float, torch.Tensor]:
    """Clipped policy loss (+ beta * k3 KL) of one chunk, its token mean; with grad.
    `logprobs`: the chunk's `[n, T]` aligned log-probs with their graph, already computed
    under the current parameters (the replay scan's), instead of a forward here."""
    cfg, device = run.config.grpo, next(run.model.parameters()).device
    ids, attn, mask, old, adv = (x.to(device) for x in (ids, attn, mask, old, adv))
    weights = None if weights is None else weights.to(device)
    temperature = run.config.rollout.temperature
    if logprobs is None:
        with run.autocast():
            lp, _ = run.policy(ids, attn, mask, temperature)
        lp = align(lp).float()  # (n, T)
    else:
        lp = logprobs.to(device).float()
    loss = policy_loss(lp, old, adv, mask, cfg.eps_low, cfg.eps_high, weights)
    kl = 0.0
    if run.ref_model is not None:
        with torch.no_grad(), run.autocast():
            ref, _ = forward_logprobs(run.ref_model, ids, attn, mask, temperature)
        kl_t = kl_k3(lp, align(ref), mask)
        loss = loss + cfg.beta * kl_t
        kl = float(kl_t.detach())
    return loss, kl, lp.detach().float().cpu()


@dataclass
class FreshBatch:
    """The step's fresh groups for the update, and every rollout made to get them."""

    groups: list[list]  # kept groups (b, or fewer after dynamic sampling's filter)
    rollouts: list  # RolloutResult of the step's batch and of each refill
    passages: int  # documents the environment returned over all of them

    @property
    def trajectories(self) -> list:
        """The trajectories rolled out this step (refills included, dropped groups not)."""
        return [t for r in self.rollouts for g in r.groups for t in g]

    @property
    def spent(self) -> list:
        """Every trajectory that cost a rollout: refills and dropped groups included."""
        return [t for r in self.rollouts for g in [*r.groups, *r.dropped] for t in g]


def has_reward_variance(group: list) -> bool:
    """Whether a group's rewards differ (else every advantage is 0: no gradient)."""
    return len({t.reward for t in group}) > 1


def rollout_fresh(run: Run, step: int) -> FreshBatch:
    """Roll out the step's `b` prompts. With `grpo.dynamic_sampling` (DAPO-style), groups
    whose rewards are all equal are dropped and refilled with extra prompts, up to
    `refill_rounds` times; the kept groups are capped at `b`. Across processes each rolls
    out its shards of every batch and all of them receive every group (trainer/distributed.py),
    so what follows is the same on every process."""
    cfg = run.config
    b = cfg.grpo.batch_prompts
    passages_before = run.client.stats.passages

    def roll(examples: list, round_: int):
        return distributed.rollout_sharded(run, examples, step, round_)

    rollouts = [roll(sample_prompts(run.train_examples, cfg.seed, step, b), 0)]
    kept = rollouts[0].groups
    if cfg.grpo.dynamic_sampling:
        kept = [g for g in kept if has_reward_variance(g)]
        for round_ in range(1, cfg.grpo.refill_rounds + 1):
            if len(kept) >= b:
                break
            extra = refill_prompts(run.train_examples, cfg.seed, step, round_, b - len(kept))
            rollouts.append(roll(extra, round_))
            kept += [g for g in rollouts[-1].groups if has_reward_variance(g)]
        kept = kept[:b]
    if not any(r.groups for r in rollouts):
        raise UserError(
            f"step {step}: every rollout failed to reach the retrieval server"
            f" ({', '.join(cfg.retrieval.urls)}); is it running? (hdr serve --index DIR)"
        )
    passages = run.dist.sum({"passages": run.client.stats.passages - passages_before})
    return FreshBatch(kept, rollouts, int(passages["passages"]))


def train_step(run: Run, step: int) -> dict[str, Any]:
    """One GRPO step with replay; returns its metrics record."""
    from agent_env.rewards import exact_match

    cfg, t_start, run.cost = run.config, time.perf_counter(), StepCost()
    client_before = replace(run.client.stats)  # a copy of the counters
    # 1-2. rollout of b prompts x G responses, each rewarded by agent_env
    with run.cost.cpu("rollout"), distributed.gathered_weights(run):
        batch = rollout_fresh(run, step)
    # 3. behaviour log-probs and advantages (each process scores its share)
    t0 = time.perf_counter()
    with run.cost.cpu("scoring"), distributed.gathered_weights(run):
        fresh, entropy = distributed.split_behaviour(run, batch.groups, step, behaviour_groups)
        gap, is_weights = sampler_gap(
            fresh, sampler_logprobs(batch.groups, fresh), cfg.grpo.tis_cap
        )
    t1 = time.perf_counter()
    # 4. replay selection: one decision, the same on every process
    with run.cost.cpu("selection"), distributed.gathered_weights(run):
        selector = SELECTORS.get(cfg.arm)
        selection = selector(run.buffer, step, cfg.select_params, run.score, fresh=fresh)
    run.dist.agree(
        ([g.group_id for g in selection.groups], selection.swap_out),
        f"step {step}'s replay selection: selector {cfg.arm!r} is not a deterministic function"
        " of the buffer, the scores and the shared RNG, so it cannot run across processes;"
        " run it in one process",
    )
    t2 = time.perf_counter()
    # 5. one update on fresh + replayed (a swap selector leaves some fresh groups out)
    swapped = set(selection.swap_out)
    trained = [g for k, g in enumerate(fresh) if k not in swapped]
    if is_weights is not None:
        is_weights = [w for k, w in enumerate(is_weights) if k not in swapped]
    with run.cost.cpu("update"):
        scanned = run.scan_graphs(selection)
        update = update_policy(
            run, trained, selection.groups, selection.weights, is_weights, scanned
        )
        run.generator.sync_weights(run.model)
    t3 = time.perf_counter()
    # 6. ingress after the update
    for group in selection.groups:
        group.replay_count += 1
    evicted = run.buffer.ingest(fresh, cfg.replay.store_zero_advantage)
    run.logs.groups_left(evicted, step)
    # 7. metrics
    trajs = batch.trajectories
    record_cost(run.cost, batch, trained, selection)
    env_calls = sum(r.env_calls for r in batch.rollouts)
    run.counters["env_calls_total"] += env_calls
    run.counters["search_calls_total"] += run.cost.search_calls
    run.counters["wall_time_total"] += time.perf_counter() - t_start
    return {
        "step": step,
        "reward_mean": float(np.mean([t.reward for t in trajs])),
        "em_mean": float(np.mean([exact_match(t.answer, t.example.golden_answers) for t in trajs])),
        "entropy": entropy,
        **gap,
        "loss": update.loss,
        "grad_norm": update.grad_norm,
        "kl": update.kl,
        "lr": run.scheduler.get_last_lr()[0],
        **replay_metrics(run, step, fresh, selection, update),
        "env_calls": env_calls,
        "env_calls_total": run.counters["env_calls_total"],
        "search_calls": run.cost.search_calls,
        "search_calls_total": run.counters["search_calls_total"],
        "dropped_groups": sum(len(r.dropped) for r in batch.rollouts),
        **retrieval_metrics(client_before, run.client.stats),
        "time_generation": sum(r.gen_time for r in batch.rollouts),
        "time_retrieval": sum(r.retrieval_time for r in batch.rollouts),
        "time_scoring": t1 - t0,
        "time_selection": t2 - t1,
        "time_update": t3 - t2,
        "time_collectives": run.dist.take_collective_time(),
        "time_step": time.perf_counter() - t_start,
        "wall_time_total": run.counters["wall_time_total"],
        "world_size": run.dist.world,
        "fresh_group_ids": [g.group_id for g in fresh],
        "replayed_group_ids": [g.group_id for g in selection.groups],
        **run.cost.record(),
    }


def record_cost(
    cost: StepCost, batch: FreshBatch, trained: list[StoredGroup], sel: Selection
) -> None:
    """Fill the step's ledger from what was rolled out, updated on and selected (the
    teacher-forced tokens and CPU seconds were counted as they happened)."""
    trajs = batch.spent
    cost.prompt_tokens = sum(len(t.prompt_ids) for t in trajs)
    cost.generated_tokens = sum(sum(t.loss_mask) for t in trajs)
    cost.observation_tokens = sum(len(t.loss_mask) - sum(t.loss_mask) for t in trajs)
    cost.fresh_groups = sum(len(r.groups) + len(r.dropped) for r in batch.rollouts)
    cost.search_calls = sum(t.searches for t in trajs)
    cost.env_requests = sum(r.env_calls for r in batch.rollouts)
    cost.passages = batch.passages
    cost.env_wait_s = sum(r.retrieval_time for r in batch.rollouts)
    groups = trained + sel.groups
    cost.update_groups = len(groups)
    cost.informative_groups = sum(not g.all_zero_advantage for g in groups)
    cost.informative_tokens = sum(
        int(g.loss_mask[g.advantages != 0].sum()) for g in groups
    )  # rows with A != 0
    cost.replayed_groups = len(sel.groups)
    cost.scanned_groups = sel.scanned


def retrieval_metrics(before, after) -> dict[str, float]:
    """This step's retrieval trouble, from the client's counters: time paused in outages (the
    server was unreachable; the step waited and lost nothing), queries cut to length, and
    queries that failed (their trajectories are marked failed)."""
    return {
        "retrieval_outage_s": after.outage_s - before.outage_s,
        "retrieval_outages": after.outages - before.outages,
        "retrieval_truncated_queries": after.truncated_queries - before.truncated_queries,
        "retrieval_failed_queries": after.failed_queries - before.failed_queries,
    }


def replay_metrics(
    run: Run, step: int, fresh: list[StoredGroup], sel: Selection, update: UpdateStats
) -> dict[str, Any]:
    """Replay telemetry. Arms that do not scan (replay_recency) get the admitted groups'
    drift and refreshed headroom from the update's first forward pass (same weights)."""
    scanned = sel.scanned > 0
    return {
        "fresh_tokens": sum(g.num_tokens for g in fresh),
        "replay_tokens": sum(g.num_tokens for g in sel.groups),
        "replayed_groups": len(sel.groups),
        "scanned_groups": sel.scanned,
        "acceptance_rate": sel.acceptance_rate if scanned else None,
        "drift_scanned_q": quantiles(sel.drift_scanned),
        "drift_admitted_q": quantiles(sel.drift_admitted if scanned else update.replay_drift),
        "headroom_scanned_q": quantiles(sel.headroom_scanned),
        "headroom_admitted_q": quantiles(
            sel.headroom_refreshed if scanned else update.replay_headroom
        ),
        "replay_ages": [step - g.entered_step for g in sel.groups],
        "replay_counts": [g.replay_count for g in sel.groups],
        "headroom_stored": sel.headroom_stored,
        "headroom_refreshed": sel.headroom_refreshed if scanned else update.replay_headroom,
        "buffer_size": len(run.buffer),
    }


# --- the run -----------------------------------------------------------------------------


def train(config: TrainConfig, resume: str | Path | None = None, force: bool = False) -> Path:
    """Run (or continue) training; returns the run directory. Under torchrun every process
    runs this; rank 0 alone logs, evaluates and writes checkpoints. `force` starts a run
    with checkpoints or a final model in `out_dir` over (`prepare_run_dir`).

    SIGINT or SIGTERM (Ctrl-C, `kill`, a scheduler's preemption) stops the run after the
    current step, with a checkpoint of that step (step 0 when it comes before the first), and
    raises RunInterrupted saying how to continue; a second signal stops at once."""
    with StopSignals() as stop:
        run, start = setup_run(config, resume, force)
        try:
            train_steps(run, start, stop)
        finally:
            distributed.shutdown(run.dist)
    return run.run_dir


def train_steps(run: Run, start: int, stop: StopSignals) -> None:
    """The steps from `start` with their evaluations and checkpoints, then `final/`."""
    config, main = run.config, run.dist.is_main  # config localised per process (its device)
    stop.check(run, start - 1)  # a signal while loading: stop before the first evaluation
    if main and start == 1 and config.eval.every and config.eval.at_start:
        log_heldout(run, 0)
        stop.check(run, 0)
    bar = progress(
        range(start, config.steps + 1),
        initial=start - 1,
        total=config.steps,
        desc=f"train {config.arm}",
        unit="step",
        enabled=config.log.progress and main,
    )
    for step in bar:
        record = step_or_stop(run, step)
        run.logs.step(record)
        bar.set_postfix(reward=f"{record['reward_mean']:.3f}", replay=record["replayed_groups"])
        if main and config.eval.every and step % config.eval.every == 0:
            log_heldout(run, step)
        saved = None
        if config.checkpoint.save_every and step % config.checkpoint.save_every == 0:
            saved = save(run, step)
        stop.check(run, step, saved)
    bar.close()
    run.logs.groups_left(run.buffer.groups(), None)
    save_final(run)
    run.logs.close()


def step_or_stop(run: Run, step: int) -> dict[str, Any]:
    """`train_step`; a retrieval outage longer than `retrieval.outage_grace_s` (the client has
    paused and polled that long) stops the run with one line naming its last checkpoint,
    which the stop leaves as it was."""
    from agent_env.retrieval_client import RetrievalUnavailable

    try:
        return train_step(run, step)
    except RetrievalUnavailable as err:
        run.logs.flush()
        found = list_checkpoints(run.run_dir / "checkpoints")
        where = (
            f"last checkpoint: step {found[-1][0]}; continue with --resume {run.run_dir}"
            if found
            else "no checkpoint yet"
        )
        raise UserError(f"step {step} stopped: {err}; {where}") from None


def log_heldout(run: Run, step: int) -> dict[str, Any] | None:
    """The periodic held-out evaluation: logged to eval.jsonl and printed as one line."""
    from trainer.heldout import heldout_eval

    cfg = run.config.eval
    if run.config.log.progress:
        say(f"held-out evaluation at step {step}: {len(run.eval_examples)} questions, k={cfg.k}")
    record = heldout_eval(run, step)
    if record is None:
        return None
    run.logs.eval(record)
    k, greedy = record["k"], record["greedy_em"]
    say(
        f"step {step} held-out ({record['num_questions']} questions): Mean@{k}"
        f" {record['mean_at_k']:.3f}, Best@{k} {record['best_at_k']:.3f}"
        + (f", greedy EM {greedy:.3f}" if greedy is not None else "")
    )
    return record


class StopSignals:
    """SIGINT/SIGTERM as a request to stop at the next step boundary (see `train`). Outside
    the main thread (no signal handlers there) it does nothing."""

    SIGNALS = ("SIGINT", "SIGTERM")

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second one: stop now, without a checkpoint
            raise KeyboardInterrupt
        self.signum = signum
        say("hdr train: stopping after this step with a checkpoint (again to stop at once)")

    def __enter__(self) -> StopSignals:
        import signal
        import threading

        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                number = getattr(signal, name)
                self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        import signal

        for number, handler in self._previous.items():
            signal.signal(number, handler)

    def check(self, run: Run, step: int, saved: Path | None = None) -> None:
        """After `step`: when a stop was requested, checkpoint the step and raise."""
        if self.signum is None:
            return
        import signal

        path = saved or save(run, step)
        run.logs.close()
        name = signal.Signals(self.signum).name
        raise RunInterrupted(
            f"stopped by {name} after step {step} of {run.config.steps}; checkpoint {path};"
            f" continue with: hdr train --resume {run.run_dir}",
            self.signum,
        )


def save(run: Run, step: int) -> Path | None:
    """Every process hands rank 0 its RNG state (and, under FSDP, its weight shards); rank 0
    writes the checkpoint."""
    rng_states = distributed.gather_rng_states(run.dist)
    model_state, optimizer_state = distributed.full_states(run)
    if not run.dist.is_main:
        return None
    state = TrainState(
        model=run.model,
        tokenizer=run.tokenizer,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        buffer=run.buffer,
        counters=run.counters,
        config_yaml=dump_config(run.config),
        model_files=model_files(run.config),
        rng_states=rng_states,
        model_state=model_state,
        optimizer_state=optimizer_state,
    )
    run.logs.flush()
    return save_checkpoint(
        run.run_dir / "checkpoints", step, state, run.config.checkpoint.keep_last
    )


def model_files(config: TrainConfig) -> dict[str, str]:
    """Saved beside every model of the run: the prompt and rollout settings it is trained with."""
    from agent_env.policy_settings import SETTINGS_FILE, settings_yaml

    return {SETTINGS_FILE: settings_yaml(config.rollout, config.retrieval)}


def save_final(run: Run) -> Path | None:
    """`final/`: model and tokenizer, loadable with from_pretrained, and the rollout settings
    (written atomically, by rank 0)."""
    model_state, _ = distributed.full_states(run)
    if not run.dist.is_main:
        return None
    return save_model(
        run.model, run.tokenizer, run.run_dir / "final", model_files(run.config), model_state
    )


def load_train_config(path: str | None, overrides: list[str], resume: str | None) -> TrainConfig:
    """The config of `hdr train`: the file with overrides, or on resume the checkpoint's
    config with the overrides applied on top."""
    if resume is None:
        if path is None:
            raise UserError("hdr train needs --config FILE (or --resume DIR)")
        return load_config(TrainConfig, path, overrides)
    if path is not None:
        raise UserError("--resume continues a run with its own config; drop --config")
    return load_config(TrainConfig, open_checkpoint(resume).path / "config.yaml", overrides)
