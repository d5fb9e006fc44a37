"""One-off probe: where a replay scan's time goes on SmolLM2-135M-Instruct, and what keeping
the frozen linear layers' autocast casts (`trainer.frozen_bottom.cast_frozen_once`) saves.

    .venv/bin/python bench/probes/smollm2_scan_profile.py --model data/smollm2-sft-splitsft

Synthetic groups of the comparison's shape (5 rows of 162 tokens: a 45-token prompt, 22
policy tokens, 85 of retrieved text, 10 more policy tokens), the top 4 layers trained, bf16
autocast, the bottom's states kept (filled before timing). Scores `--groups` groups in chunks
of 4, as the scan does at R = 4: once with the kept casts, once with the layers' plain forward,
alternating `--repeats` times; checks the two give the same bits; then `torch.profiler`'s
table of one pass with the kept casts. Prints milliseconds per group (on a busy machine,
upper bounds: compare the two columns of one run, not across runs).
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import AutoModelForCausalLM

from headroom_drift import GroupTensors, make_group
from trainer.frozen_bottom import attach
from trainer.scoring import score_groups

PROMPT, POLICY, OBSERVATION, TAIL = 45, 22, 85, 10


def group(name: str, generator: torch.Generator, rows: int = 5):
    length = PROMPT + POLICY + OBSERVATION + TAIL
    ids = torch.randint(100, 40_000, (rows, length), generator=generator)
    mask = torch.zeros(rows, length)
    mask[:, PROMPT : PROMPT + POLICY] = 1
    mask[:, length - TAIL :] = 1
    rewards = torch.tensor([1.0, 0, 0, 1, 0])[:rows]
    advantages = (rewards - rewards.mean()) / (rewards.std() + 1e-6)
    lp = -torch.rand(rows, length, generator=generator) * mask
    attention = torch.ones(rows, length, dtype=torch.long)
    return make_group(name, GroupTensors(ids, attention, mask, lp, rewards, advantages), 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="data/smollm2-sft-splitsft")
    ap.add_argument("--groups", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    attach(model, 4, torch.bfloat16, 2**31)  # keeps the frozen layers' casts
    kept = [m for m in model.modules() if "forward" in m.__dict__]
    generator = torch.Generator().manual_seed(0)
    groups = [group(f"g{i}", generator) for i in range(args.groups)]
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731

    def scan() -> tuple[float, list[torch.Tensor]]:
        out, started = [], time.perf_counter()
        for lo in range(0, len(groups), 4):
            with autocast(), torch.no_grad():
                out += score_groups(model, groups[lo : lo + 4], 20)
        return 1000 * (time.perf_counter() - started) / len(groups), out

    def plain(on: bool) -> None:  # the plain nn.Linear forward, or the kept casts back
        for m in kept:
            if on:
                m.__dict__["_kept_forward"] = m.__dict__.pop("forward")
            else:
                m.__dict__["forward"] = m.__dict__.pop("_kept_forward")

    scan()  # fills the bottom's states and the casts
    times: dict[str, list[float]] = {"kept casts": [], "plain": []}
    for _ in range(args.repeats):
        ms, with_kept = scan()
        times["kept casts"].append(ms)
        plain(True)
        ms, without = scan()
        times["plain"].append(ms)
        plain(False)
        same = all(torch.equal(a, b) for a, b in zip(with_kept, without, strict=True))
        assert same, "the kept casts changed a score"
    for name, values in times.items():
        print(f"{name}: {', '.join(f'{v:.0f}' for v in values)} ms a group")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        scan()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
