"""The checks of bench/gpu_smoke.sh that need CUDA torch only: what a GPU with no vLLM answers.

    python bench/gpu_smoke_torch.py train WORK BED URL BACKEND STEPS [PROCS [DEVICE]]
    python bench/gpu_smoke_torch.py scoring BED [DEVICE]
    python bench/gpu_smoke_torch.py memory WORK BED URL [DEVICE]

- train: `hdr train` (the CLI in a subprocess; under torchrun with PROCS > 1, one GPU each) of
  configs/search-r1-qwen2.5-3b.yaml shrunk to BED: its precision (fp32 master weights, bf16
  autocast), gradient checkpointing and k3 KL to a bf16 reference, BACKEND generation (`hf`,
  or `vllm` with sleep mode), STEPS steps of 4 prompts x 4 responses against the BM25 index
  served at URL, 4-row micro-batches (so DDP's no_sync path runs). PASS: every step logged
  with a finite loss and the world size asked for, the final model written, and the mean
  sampler/trainer log-prob gap of every step under the bf16 tolerance.
- scoring: hdr's hf sampler (`HFGenerator`, the trainer's module) against the trainer's own
  scoring (`trainer.scoring.score_groups`) of the same tokens, in float32 and under bf16
  autocast, within bench/gpu_smoke.py's TOLERANCES.
- memory: hdr's loop in this process (the train check's settings, hf backend) with
  `torch.cuda.max_memory_allocated` read over each phase of its second step (AdamW's moments
  exist from the first optimizer step), against `hdr plan-memory`'s plan of the same config and
  card: PASS when each phase's peak is at least the plan's exact lines (weights, AdamW's
  moments, gradients, the reference model) and at most the plan's total (the activation and
  overhead lines are upper-bound estimates). The measured and planned figures go to
  WORK/memory.json. On the CPU (DEVICE cpu) the loop runs and nothing is measured.

Each prints one `PASS: ...`, `FAIL: ...` or `SKIP: ...` line last and exits 0, 1 or 77.
"""

from __future__ import annotations

import contextlib
import json
import math
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from gpu_smoke import FAIL, PASS, TOLERANCES, say

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "search-r1-qwen2.5-3b.yaml"
GIB = 2**30
# the loop's phases (trainer/loop.py) as the planner's (trainer/tools/memory_plan.py) name them
PLANNED_AS = {
    "rollout": "rollout", "scoring": "scoring", "selection": "scoring", "update": "update",
}  # fmt: skip
# the plan's lines that are exact products of the parameter count (the rest are estimates)
EXACT = ("fp32 master weights", "AdamW moments", "fp32 gradients", "DDP gradient buckets",
         "bf16 KL reference model")  # fmt: skip


def train_overrides(bed, out, url, backend: str, steps: int, shards: int, device: str) -> list:
    """configs/search-r1-qwen2.5-3b.yaml's settings shrunk to the smoke bed: its precision,
    checkpointing, KL, sleep mode; small batches, one short turn, a local BM25 server."""
    return [
        f"model.path={bed}", f"out_dir={out}", f"retrieval.urls=[{url}]",
        "retrieval.expect_encoder=null", "retrieval.expect_documents=null",
        "retrieval.retriever=bm25", "data.train=wiki-vital", "data.eval=wiki-vital",
        f"steps={steps}", "grpo.batch_prompts=4", "grpo.group_size=4", "grpo.warmup_steps=1",
        "grpo.micro_batch=4", "grpo.score_chunk=8", "replay.budget=2", "replay.capacity=8",
        "replay.tau=1.0", "rollout.max_turns=1", "rollout.max_tokens_per_turn=32",
        "rollout.max_obs_tokens=128", "rollout.max_response_tokens=128",
        f"generation.backend={backend}", "generation.max_model_len=1024",
        "generation.gpu_memory_utilization=0.25", "generation.max_num_seqs=64",
        "eval.every=0", "eval.at_start=false", "checkpoint.save_every=0",
        "log.progress=false", "log.tensorboard=false", f"distributed.rollout_shards={shards}",
        f"model.device={device}", f"generation.device={device}",
    ]  # fmt: skip


def train(work, bed, url, backend, steps, procs="1", device="cuda:0") -> int:
    """`hdr train` as a user runs it, then its metrics and final model (module docstring)."""
    steps, procs = int(steps), int(procs)
    out = Path(work) / f"run-{backend}-{procs}"
    launcher = [sys.executable, "-m", "hdr.cli"]
    if procs > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(procs), "-m", "hdr.cli"]  # fmt: skip
    overrides = train_overrides(bed, out, url, backend, steps, max(procs, 2), device)
    done = subprocess.run([*launcher, "train", "--config", str(CONFIG), *overrides], cwd=ROOT)
    if done.returncode != 0:
        say("FAIL", f"hdr train exit {done.returncode} (its output above)")
        return FAIL
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["logprob_gap_mean"] for r in rows]
    problems = []
    if [r["step"] for r in rows] != list(range(1, steps + 1)):
        problems.append(f"steps logged {[r['step'] for r in rows]}")
    if any(r["world_size"] != procs or not math.isfinite(r["loss"]) for r in rows):
        problems.append(f"world sizes {[r['world_size'] for r in rows]}, losses not finite")
    if not (out / "final").is_dir():
        problems.append("no final model")
    if any(g is None or g >= TOLERANCES["bfloat16"][0] for g in gaps):
        problems.append(f"sampler/trainer gap {gaps} (bf16 tolerance {TOLERANCES['bfloat16'][0]})")
    line = f"{len(rows)} steps, world {procs}, {backend}, sampler/trainer gap per step "
    line += ", ".join(f"{g:.4f}" for g in gaps if g is not None)
    say("FAIL" if problems else "PASS", "; ".join(problems) if problems else line)
    return FAIL if problems else PASS


@dataclass
class Rows:
    """What `score_groups` reads of a group."""

    input_ids: object
    attention_mask: object
    loss_mask: object


def sampled_rows(contexts: list[list[int]], completions, pad: int):
    """Left-padded rows of context + completion, the completion's tokens on the loss mask."""
    import torch

    seqs = [c + done.token_ids for c, done in zip(contexts, completions, strict=True)]
    width = max(map(len, seqs))
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    attn, mask = torch.zeros(len(seqs), width), torch.zeros(len(seqs), width)
    for i, (context, seq) in enumerate(zip(contexts, seqs, strict=True)):
        ids[i, width - len(seq) :] = torch.tensor(seq)
        attn[i, width - len(seq) :] = 1
        mask[i, width - len(seq) + len(context) :] = 1
    return Rows(ids, attn.long(), mask)


def scoring(bed, device="cuda:0") -> int:
    """The hf sampler's log-probs against the trainer's scoring of the same tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env.generation.base import SamplingParams
    from agent_env.generation.hf import HFGenerator
    from trainer.scoring import score_groups

    tokenizer = AutoTokenizer.from_pretrained(bed)
    model = AutoModelForCausalLM.from_pretrained(bed, dtype=torch.float32).to(device).eval()
    texts = ["Question: who wrote it?", "<search> capital", "Paris is", "The answer:"] * 2
    contexts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    results, problems = [], []
    for dtype, cast in (("float32", None), ("bfloat16", torch.bfloat16)):
        torch.manual_seed(0)
        sampler = HFGenerator(model, tokenizer, autocast_dtype=cast)
        done = sampler.generate(contexts, SamplingParams(temperature=1.0, max_tokens=24))
        rows = sampled_rows(contexts, done, sampler.pad_id)
        autocast = torch.autocast(torch.device(device).type, dtype=cast, enabled=cast is not None)
        with autocast:
            (scored,) = score_groups(model, [rows], chunk_size=8)
        mask = rows.loss_mask.bool()
        sampled = torch.zeros_like(scored)
        sampled[mask] = torch.tensor([lp for c in done for lp in c.logprobs], dtype=scored.dtype)
        diff = (scored[mask].float().cpu() - sampled[mask].float().cpu()).abs()
        mean, most = float(diff.mean()), float(diff.max())
        results.append(f"{dtype} mean|max {mean:.2e}|{most:.2e} over {int(mask.sum())} tokens")
        if mean > TOLERANCES[dtype][0] or most > TOLERANCES[dtype][1]:
            problems.append(f"{dtype} outside {TOLERANCES[dtype]}")
    say("FAIL" if problems else "PASS", "; ".join(results + problems))
    return FAIL if problems else PASS


@contextlib.contextmanager
def phase_peaks(device):
    """Each phase of hdr's loop (`Run.phase`) with the allocator's peak over it: a list of
    (step, phase, bytes or None on the CPU), filled as the loop runs."""
    import torch

    from trainer.run import Run

    measured, original, cuda = [], Run.phase, torch.device(device).type == "cuda"
    steps = {"n": 0}

    @contextlib.contextmanager
    def phase(self, name):
        steps["n"] += name == "rollout"
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        with original(self, name):
            yield
        peak = torch.cuda.max_memory_allocated(device) if cuda else None
        measured.append((steps["n"], name, peak))

    Run.phase = phase
    try:
        yield measured
    finally:
        Run.phase = original


def compare(plan, measured) -> tuple[dict, list[str]]:
    """Per planner phase: the peak of steps 2 on, the plan's exact lines and its total (GiB)."""
    table, problems = {}, []
    for phase in ("rollout", "scoring", "update"):
        peaks = [b for step, name, b in measured if step >= 2 and PLANNED_AS.get(name) == phase]
        lines = [x for x in plan.lines if phase in x.phases]
        exact = sum(x.gib for x in lines if x.component.startswith(EXACT))
        peak = max(peaks) / GIB if peaks and None not in peaks else None
        table[phase] = {"measured_gib": peak, "exact_gib": exact, "planned_gib": plan.total(phase)}
        if not peaks:
            problems.append(f"no {phase} phase ran after step 1")
        elif peak is not None and not exact <= peak <= plan.total(phase):
            planned = plan.total(phase)
            problems.append(f"{phase} {peak:.2f} GiB outside [{exact:.2f}, {planned:.2f}]")
    return table, problems


def memory(work, bed, url, device="cuda:0") -> int:
    """The planner's figures against the allocator's peaks in a real run (module docstring)."""
    import torch

    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import train as train_loop
    from trainer.tools.memory_plan import model_shape, plan_memory

    out = Path(work) / "run-memory"
    overrides = train_overrides(bed, out, url, "hf", 2, 2, device)
    config = load_config(TrainConfig, CONFIG, overrides)
    card = torch.cuda.mem_get_info(device)[1] / GIB if device.startswith("cuda") else 80.0
    plan = plan_memory(config, model_shape(str(bed)), gpu_gib=card, gpus=1, name=str(CONFIG))
    with phase_peaks(device) as measured:
        train_loop(config)
    table, problems = compare(plan, measured)
    Path(work, "memory.json").write_text(json.dumps({"card_gib": card, "phases": table}, indent=1))
    print(plan.table(), flush=True)
    cells = [
        f"{p} {t['measured_gib']:.2f} GiB of {t['planned_gib']:.2f} planned (exact lines"
        f" {t['exact_gib']:.2f})"
        if t["measured_gib"] is not None
        else f"{p} ran (not measured on {device})"
        for p, t in table.items()
    ]
    say("FAIL" if problems else "PASS", "; ".join(problems or cells))
    return FAIL if problems else PASS


CHECKS = {"train": train, "scoring": scoring, "memory": memory}

if __name__ == "__main__":
    command, *args = sys.argv[1:]
    sys.exit(CHECKS[command](*args))
