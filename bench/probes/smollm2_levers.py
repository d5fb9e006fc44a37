"""One-off probe: the seconds of each piece of one GRPO step on SmolLM2-135M-Instruct at the
issue's shape (8 prompts x 5 responses) on this CPU, under each candidate speed lever.

The token sequences are real: `--trajectories` is a JSONL of zero-shot trajectories that
bench/probes/smollm2_zero_shot.py wrote through hdr's rollout loop (prompt ids, response ids,
loss mask); the first 40 are the step's fresh rows (8 groups of 5 when grouped by question),
the next 40 the 8 stored groups a replay scan re-scores (`--groups 4` scores and scans 20 of
each on a crowded machine; the step's figures are then scaled to 40). What is timed (each
`--repeats` times after one small warm-up forward; min and median are reported):

- generation, one turn of 8 prompts x 5 (`gen_*`): transformers `generate` through hdr's `hf`
  backend (float32, bf16 autocast) and the real vLLM engine built for the CPU through hdr's
  `vllm` backend (in process, `enforce_eager`, prefix caching on/off, float32/bf16; each
  engine in its own subprocess of `--vllm-python`), both with the real stop strings; turn 1
  from the prompts, turn 2 from the stored contexts (prompt + turn 1 + observation). Also
  vLLM with `n=5` per prompt and a fixed 48 tokens (no stops) as the engine's plain figure;
- teacher-forced scoring of 40 rows, no grad (`score_*`, the behaviour pass and a replay
  scan's forward alike): trainer.scoring.forward_logprobs with the output layer at every
  position or only at policy tokens (hdr's), float32 or bf16 autocast; a group's shared
  prompt computed once (KV cache repeated over its 5 responses); the top K of 30 layers run
  from cached boundary hidden states (the output of layer 30-K, which a frozen bottom never
  changes). Log-prob gaps against float32 on policy tokens: mean and max |diff|, and the L2
  Policy Drift (docs/design.md) the gap alone would give each group;
- the update (`update_*`): forward + backward + AdamW on one micro-batch of 8 rows (the
  figure for 40 or 80 rows is x5 / x10: rows are similar in length), with the GRPO loss
  (headroom_drift.policy_loss): full fine-tune float32 / bf16; LoRA through peft (ranks 8 and
  32, attention-only or all linear layers); only the top K layers trainable (K = 4, 8) with
  the frozen bottom under no_grad; LoRA on the top K only; and the top K from cached boundary
  states (no bottom forward at all). Embeddings are tied to the output layer, so they are
  frozen in every top-K variant (else the cached states would go stale);
- the replay scan of 8 stored groups x 5: the scoring forward of the 40 stored rows plus the
  primitive's Headroom and Drift (headroom_drift), per variant;
- memory of the cached boundary states per token (bf16 and float32) and for a buffer.

    nice -n 19 .venv/bin/python bench/probes/smollm2_levers.py \\
        --trajectories runs/probes/zero_shot/system_full_example-T=1.jsonl \\
        --vllm-python .venv-vllm/bin/python --out bench/results/smollm2_levers.json

Writes JSON and prints a table. Timings on 2 shared cores move with the machine's load; the
load average is recorded beside each part.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
ROWS, GROUP, MICRO = 40, 5, 8


def load_rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.open()]
    # group by question, keep groups of 5 (the zero-shot file may hold k=4 per question:
    # then rows are taken in order and every 5 form a group)
    return rows


WARMUP = 0  # a tiny warm-up forward runs first (main); each piece then runs `repeats` times


def timed(fn, repeats: int, warmup: int | None = None) -> dict:
    for _ in range(WARMUP if warmup is None else warmup):
        fn()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    return {
        "min_s": min(seconds),
        "median_s": statistics.median(seconds),
        "runs": seconds,
        "load": os.getloadavg()[0],
    }


# ------------------------------------------------------------------------- tensors


def padded(rows: list[dict]):
    """Left-padded ids, attention mask and policy mask `[n, T]` (policy = loss_mask 1)."""
    import torch

    seqs = [r["prompt_ids"] + r["response_ids"] for r in rows]
    policy = [[0] * len(r["prompt_ids"]) + r["loss_mask"] for r in rows]
    width = max(map(len, seqs))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    attn = torch.zeros(len(seqs), width, dtype=torch.long)
    pol = torch.zeros(len(seqs), width, dtype=torch.long)
    for i, (s, p) in enumerate(zip(seqs, policy, strict=True)):
        ids[i, width - len(s) :] = torch.tensor(s)
        attn[i, width - len(s) :] = 1
        pol[i, width - len(s) :] = torch.tensor(p)
    return ids, attn, pol


def chunks(n: int, size: int):
    return [slice(lo, min(lo + size, n)) for lo in range(0, n, size)]


def autocast(dtype):
    import torch

    if dtype == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@contextlib.contextmanager
def layers_between(model, lo: int, hi: int):
    """The model with only decoder layers [lo, hi) in place (the library's own forward then
    runs just those; inputs_embeds carries the boundary states in)."""
    import torch

    inner = model.model
    saved = inner.layers
    inner.layers = torch.nn.ModuleList(list(saved)[lo:hi])
    try:
        yield model
    finally:
        inner.layers = saved


def boundary_states(model, ids, attn, cut: int, dtype: str):
    """The output of decoder layer `cut - 1` (the input of layer `cut`), `[n, T, H]`."""
    import torch

    from trainer.scoring import position_ids_for

    captured = {}

    def grab(_module, _args, output):
        captured["h"] = output[0] if isinstance(output, tuple) else output

    layer = model.model.layers[cut - 1]
    handle = layer.register_forward_hook(grab)
    try:
        with torch.no_grad(), autocast(dtype), layers_between(model, 0, cut):
            model.model(input_ids=ids, attention_mask=attn, position_ids=position_ids_for(attn))
    finally:
        handle.remove()
    return captured["h"]


def top_logprobs(model, hidden, ids, attn, pol, cut: int):
    """Log-probs `[n, T-1]` at policy targets from boundary states through layers [cut, 30),
    the final norm and the output layer (only at policy positions)."""
    import torch

    from trainer.scoring import position_ids_for

    with layers_between(model, cut, len(model.model.layers)):
        out = model.model(
            inputs_embeds=hidden.to(torch.float32) if hidden.dtype != torch.float32 else hidden,
            attention_mask=attn,
            position_ids=position_ids_for(attn),
        ).last_hidden_state
    wanted = pol[:, 1:].bool() & attn[:, 1:].bool() & attn[:, :-1].bool()
    picked, targets = out[:, :-1][wanted], ids[:, 1:][wanted]
    logits = model.get_output_embeddings()(picked).float()
    lp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    full = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=lp.dtype)
    full[wanted] = lp
    return full


def shared_prefix_logprobs(model, rows: list[dict], dtype: str):
    """Each group's prompt forwarded once, its KV cache repeated over the group's responses;
    log-probs at policy targets, laid out as `padded(rows)` lays them out."""
    import torch

    ids_all, _, pol_all = padded(rows)
    width = ids_all.shape[1]
    out = torch.zeros(len(rows), width - 1)
    head = model.get_output_embeddings()
    for lo in range(0, len(rows), GROUP):
        group = rows[lo : lo + GROUP]
        prompt = group[0]["prompt_ids"]
        if any(r["prompt_ids"] != prompt for r in group):
            raise ValueError("a group's rows do not share their prompt")
        P = len(prompt)
        with autocast(dtype):
            first = model.model(input_ids=torch.tensor([prompt]), use_cache=True)
        cache = first.past_key_values
        cache.batch_repeat_interleave(len(group))
        L = max(len(r["response_ids"]) for r in group)
        resp = torch.zeros(len(group), L, dtype=torch.long)
        rmask = torch.zeros(len(group), L, dtype=torch.long)
        for i, r in enumerate(group):
            resp[i, : len(r["response_ids"])] = torch.tensor(r["response_ids"])
            rmask[i, : len(r["response_ids"])] = 1
        mask = torch.cat([torch.ones(len(group), P, dtype=torch.long), rmask], 1)
        positions = (P + torch.arange(L))[None].expand(len(group), L)
        with autocast(dtype):
            hidden = model.model(
                input_ids=resp, attention_mask=mask, position_ids=positions,
                past_key_values=cache, use_cache=True,
            ).last_hidden_state  # fmt: skip
        # the state before response token j: the prompt's last one for j = 0, else hidden[j-1]
        before = torch.cat(
            [first.last_hidden_state[:, -1:].expand(len(group), 1, -1), hidden[:, :-1]], 1
        )
        for i, r in enumerate(group):
            n = len(r["response_ids"])
            policy = torch.tensor(r["loss_mask"]).bool()
            with autocast(dtype):
                logits = head(before[i, :n][policy]).float()
            lp = torch.log_softmax(logits, -1).gather(1, resp[i, :n][policy][:, None])[:, 0]
            row = torch.zeros(n)
            row[policy] = lp
            out[lo + i, width - 1 - n :] = row  # the response's targets end the padded row
    return out, pol_all


def gaps(lp, ref, pol, attn) -> dict:
    """|lp - ref| on policy targets, and the L2 drift the gap gives each group of 5."""
    wanted = (pol[:, 1:].bool() & attn[:, :-1].bool()).float()
    diff = (lp - ref).abs() * wanted
    per_group = []
    for lo in range(0, lp.shape[0], GROUP):
        w = wanted[lo : lo + GROUP]
        per_group.append(float(((lp - ref)[lo : lo + GROUP] ** 2 * w).sum() / w.sum().clamp(min=1)))
    return {
        "mean_abs": float(diff.sum() / wanted.sum()),
        "max_abs": float(diff.max()),
        "drift_l2_mean": statistics.fmean(per_group),
        "drift_l2_max": max(per_group),
        "tokens": int(wanted.sum()),
    }


# ---------------------------------------------------------------------------- parts


def part_scoring(model, fresh, stored, repeats: int) -> dict:
    import torch

    from headroom_drift import headroom, policy_drift
    from trainer.scoring import forward_logprobs

    res: dict = {}
    ids, attn, pol = padded(fresh)
    n_layers = len(model.model.layers)

    def score(dtype, target, rows=(ids, attn, pol), chunk=20):
        i, a, p = rows
        pieces = []
        with torch.no_grad(), autocast(dtype):
            for sl in chunks(len(i), chunk):
                lp, _ = forward_logprobs(model, i[sl], a[sl], p[sl] if target else None)
                pieces.append(lp.float())
        return torch.cat(pieces)

    with torch.no_grad():
        ref = score("float32", True)
    for dtype in ("float32", "bfloat16"):
        for target, name in ((False, "every_position"), (True, "policy_positions")):
            if dtype == "bfloat16" and not target:
                continue  # the head economy is the same lever in either dtype
            key = f"score_{dtype}_head_{name}"
            res[key] = timed(lambda d=dtype, t=target: score(d, t), repeats)
            print(f"{key}: {res[key]['median_s']:.1f}s", flush=True)
        lp = score(dtype, True)
        res[f"gap_{dtype}_vs_float32"] = gaps(lp, ref, pol, attn)
    for dtype in ("float32", "bfloat16"):
        key = f"score_{dtype}_shared_prefix"
        with torch.no_grad():
            res[key] = timed(lambda d=dtype: shared_prefix_logprobs(model, fresh, d), repeats)
            lp, _ = shared_prefix_logprobs(model, fresh, dtype)
        res[f"gap_{dtype}_shared_prefix_vs_float32"] = gaps(lp, ref, pol, attn)
        print(f"{key}: {res[key]['median_s']:.1f}s", flush=True)
    for k in (4, 8):
        cut = n_layers - k
        for dtype in ("float32", "bfloat16"):
            key = f"cache_build_bottom{cut}_{dtype}"
            if dtype == "bfloat16":  # float32 costs what the float32 forward costs
                res[key] = timed(
                    lambda c=cut, d=dtype: boundary_states(model, ids, attn, c, d), repeats
                )
            hidden = boundary_states(model, ids, attn, cut, dtype)
            for store in ("float32", "bfloat16"):
                cached = hidden.to(getattr(torch, store))
                key = f"score_top{k}_from_cache_{dtype}_stored_{store}"

                def run(c=cut, h=cached, d=dtype):
                    with torch.no_grad(), autocast(d):
                        return top_logprobs(model, h, ids, attn, pol, c)

                res[key] = timed(run, repeats) if store == dtype else None
                res[f"gap_top{k}_{dtype}_stored_{store}_vs_float32"] = gaps(
                    run().float(), ref, pol, attn
                )
                if res[key]:
                    print(f"{key}: {res[key]['median_s']:.1f}s", flush=True)
    # the replay scan: the same forward over the 8 stored groups, plus Headroom and Drift
    sids, sattn, spol = padded(stored)
    adv = torch.randn(len(stored))

    def scan(dtype, cached_cut=None, cached=None):
        with torch.no_grad(), autocast(dtype):
            if cached_cut is None:
                lp = score(dtype, True, (sids, sattn, spol))
            else:
                lp = top_logprobs(model, cached, sids, sattn, spol, cached_cut).float()
        m = spol[:, 1:].float()
        for lo in range(0, len(stored), GROUP):
            g = slice(lo, lo + GROUP)
            headroom(lp[g], m[g], adv[g])
            policy_drift(lp[g], lp[g] + 0.01, m[g])
        return lp

    for dtype in ("float32", "bfloat16"):
        res[f"scan_{dtype}"] = timed(lambda d=dtype: scan(d), repeats)
        print(f"scan_{dtype}: {res[f'scan_{dtype}']['median_s']:.1f}s", flush=True)
    for k in (4, 8):
        cut = n_layers - k
        cached = boundary_states(model, sids, sattn, cut, "bfloat16").to(torch.bfloat16)
        key = f"scan_top{k}_from_cache_bfloat16"
        res[key] = timed(lambda c=cut, h=cached: scan("bfloat16", c, h), repeats)
        print(f"{key}: {res[key]['median_s']:.1f}s", flush=True)
    tokens = int(attn.sum())
    res["cache_memory"] = {
        "bytes_per_token_bfloat16": model.config.hidden_size * 2,
        "bytes_per_token_float32": model.config.hidden_size * 4,
        "tokens_per_row": tokens / len(fresh),
        "mib_40_rows_bfloat16": ROWS * tokens / len(fresh) * model.config.hidden_size * 2 / 2**20,
        "mib_buffer_64_groups_bfloat16": 64 * GROUP * tokens / len(fresh)
        * model.config.hidden_size * 2 / 2**20,
    }  # fmt: skip
    return res


def part_update(model_dir: str, fresh, repeats: int, dtype_filter=None) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from headroom_drift import policy_loss
    from trainer.scoring import forward_logprobs

    rows = fresh[:MICRO]
    ids, attn, pol = padded(rows)
    adv = torch.randn(len(rows))
    res: dict = {}

    def fresh_model():
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).train()

    def loss_of(lp):
        m = pol[:, 1:].float() * attn[:, :-1].float()
        return policy_loss(lp, lp.detach(), adv, m)

    def make_step(model, params, dtype, cut=None, cached=None):
        opt = torch.optim.AdamW(params, lr=1e-6)

        def step():
            opt.zero_grad(set_to_none=True)
            with autocast(dtype):
                if cut is None:
                    lp, _ = forward_logprobs(model, ids, attn, pol)
                else:
                    h = (
                        cached
                        if cached is not None
                        else boundary_states(model, ids, attn, cut, dtype)
                    )
                    lp = top_logprobs(model, h.detach(), ids, attn, pol, cut)
            loss = loss_of(lp.float())
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()

        return step

    def record(key, model, params, dtype, cut=None, cached=None):
        trainable = sum(p.numel() for p in params)
        res[key] = timed(make_step(model, params, dtype, cut, cached), repeats)
        res[key]["trainable_parameters"] = trainable
        print(f"{key}: {res[key]['median_s']:.1f}s ({trainable / 1e6:.1f}M trainable)", flush=True)

    base = fresh_model()
    n_layers = len(base.model.layers)
    for dtype in ("float32", "bfloat16"):
        record(f"update_full_{dtype}", base, list(base.parameters()), dtype)
    del base

    from peft import LoraConfig, get_peft_model

    attention = ["q_proj", "k_proj", "v_proj", "o_proj"]
    linear = [*attention, "gate_proj", "up_proj", "down_proj"]
    for rank, targets, name in ((8, attention, "attn"), (8, linear, "all")):
        peft_model = get_peft_model(
            fresh_model(), LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets)
        )
        inner = peft_model.base_model.model  # the LlamaForCausalLM with adapters injected
        params = [p for p in inner.parameters() if p.requires_grad]
        record(f"update_lora_r{rank}_{name}_bfloat16", inner, params, "bfloat16")
        del peft_model, inner
    for k in (4, 8):
        cut = n_layers - k
        model = fresh_model()
        for p in model.parameters():
            p.requires_grad_(False)
        top = [p for layer in model.model.layers[cut:] for p in layer.parameters()]
        top += list(model.model.norm.parameters())
        for p in top:
            p.requires_grad_(True)
        if k == 4:  # the bottom under no_grad, recomputed at each update
            record(f"update_top{k}_bottom_no_grad_bfloat16", model, top, "bfloat16", cut=cut)
        cached = boundary_states(model, ids, attn, cut, "bfloat16").to(torch.bfloat16)
        record(f"update_top{k}_from_cache_bfloat16", model, top, "bfloat16", cut, cached)
        del model
        if k != 4:
            continue
        peft_model = get_peft_model(
            fresh_model(),
            LoraConfig(
                r=8, lora_alpha=16, target_modules=linear,
                layers_to_transform=list(range(cut, n_layers)),
            ),
        )  # fmt: skip
        inner = peft_model.base_model.model
        params = [p for p in inner.parameters() if p.requires_grad]
        cached = boundary_states(inner, ids, attn, cut, "bfloat16").to(torch.bfloat16)
        record(f"update_lora_r8_all_top{k}_from_cache_bfloat16", inner, params, "bfloat16", cut,
               cached)  # fmt: skip
        del peft_model, inner
    return res


# transformers' generate takes minutes a turn here: one timed run of turn 1 per dtype
HF_TURNS, HF_REPEATS = ("turn1",), 1


def part_generation_hf(model_dir: str, fresh, repeats: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env.generation.base import SamplingParams
    from agent_env.generation.hf import HFGenerator

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    turn1, turn2 = turn_contexts(fresh)
    params = SamplingParams(1.0, 1.0, 48)
    res = {}
    for dtype in ("float32", "bfloat16"):
        gen = HFGenerator(model, tokenizer, autocast_dtype=getattr(torch, dtype)
                          if dtype != "float32" else None)  # fmt: skip
        for name, contexts in (("turn1", turn1), ("turn2", turn2)):
            if name not in HF_TURNS:
                continue
            key = f"gen_hf_{dtype}_{name}"
            res[key] = timed(lambda g=gen, c=contexts: g.generate(c, params), HF_REPEATS, 0)
            out = gen.generate(contexts, params)
            res[key]["new_tokens"] = sum(len(c.token_ids) for c in out)
            print(f"{key}: {res[key]['median_s']:.1f}s", flush=True)
    return res


def turn_contexts(fresh):
    """Turn 1: the 40 prompts. Turn 2: prompt + everything up to the end of the first
    observation (where the answer turn starts), from the stored trajectories."""
    turn1 = [r["prompt_ids"] for r in fresh]
    turn2 = []
    for r in fresh:
        mask = r["loss_mask"]
        end = len(mask)
        seen_policy = False
        for j, m in enumerate(mask):  # the first policy run, then the env run after it
            if m:
                seen_policy = True
            elif seen_policy:
                end = j
                while end < len(mask) and not mask[end]:
                    end += 1
                break
        turn2.append(r["prompt_ids"] + r["response_ids"][:end])
    return turn1, turn2


def part_generation_vllm(model_dir: str, fresh, repeats: int, dtype: str, prefix: bool) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from transformers import AutoTokenizer
    from vllm import LLM
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    from agent_env.generation import GenerationConfig
    from agent_env.generation.base import SamplingParams
    from agent_env.generation.vllm import VLLMGenerator, engine_kwargs

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = GenerationConfig(
        backend="vllm", dtype=dtype, enforce_eager=True, max_model_len=2048, seed=0
    )
    kwargs = engine_kwargs(config, model_dir, 1)
    kwargs["enable_prefix_caching"] = prefix
    start = time.perf_counter()
    llm = LLM(**kwargs)
    res: dict = {"engine_start_s": time.perf_counter() - start}
    gen = VLLMGenerator(llm, {tokenizer.eos_token_id}, probe=None, dtype=dtype)
    turn1, turn2 = turn_contexts(fresh)
    params = SamplingParams(1.0, 1.0, 48)
    tag = f"{dtype}_prefix_{'on' if prefix else 'off'}"
    for name, contexts in (("turn1", turn1), ("turn2", turn2)):
        key = f"gen_vllm_{tag}_{name}"

        def run(c=contexts):
            if prefix:
                llm.reset_prefix_cache()  # each repeat computes the prompts afresh
            return gen.generate(c, params)

        res[key] = timed(run, repeats)
        res[key]["new_tokens"] = sum(len(c.token_ids) for c in run())
    prompts = [TokensPrompt(prompt_token_ids=p) for p in turn1[::GROUP]]
    fixed = VSamplingParams(n=GROUP, temperature=1.0, max_tokens=48, ignore_eos=True, top_k=0)

    def run_fixed():
        if prefix:
            llm.reset_prefix_cache()
        return llm.generate(prompts, fixed, use_tqdm=False)

    res[f"gen_vllm_{tag}_n5_fixed48"] = timed(run_fixed, repeats)
    return res


# ---------------------------------------------------------------------------- table


def projection(res: dict, rows: int = ROWS) -> list[dict]:
    """Whole-step seconds (generation of both turns + behaviour scoring of 40 + the scan of
    40 stored + the update on 40 fresh + 40 replayed) for a few combinations, from medians."""

    def s(key, factor=1.0):
        v = res.get(key)
        return None if not v else v["median_s"] * factor

    combos = [
        ("hdr today: hf fp32, full fine-tune fp32",
         # turn 2 taken as turn 1 again (transformers' turns take minutes here)
         ["gen_hf_float32_turn1", "gen_hf_float32_turn1"], "score_float32_head_policy_positions",
         "scan_float32", "update_full_float32", None),
        ("vLLM fp32 + bf16 full fine-tune",
         ["gen_vllm_float32_prefix_on_turn1", "gen_vllm_float32_prefix_on_turn2"],
         "score_bfloat16_head_policy_positions", "scan_bfloat16", "update_full_bfloat16", None),
        ("vLLM fp32 + bf16 LoRA r8 all",
         ["gen_vllm_float32_prefix_on_turn1", "gen_vllm_float32_prefix_on_turn2"],
         "score_bfloat16_head_policy_positions", "scan_bfloat16",
         "update_lora_r8_all_bfloat16", None),
        ("vLLM fp32 + top-8 from cache (bf16)",
         ["gen_vllm_float32_prefix_on_turn1", "gen_vllm_float32_prefix_on_turn2"],
         "cache_build_bottom22_bfloat16", "scan_top8_from_cache_bfloat16",
         "update_top8_from_cache_bfloat16", "score_top8_from_cache_bfloat16_stored_bfloat16"),
        ("vLLM fp32 + top-4 from cache (bf16)",
         ["gen_vllm_float32_prefix_on_turn1", "gen_vllm_float32_prefix_on_turn2"],
         "cache_build_bottom26_bfloat16", "scan_top4_from_cache_bfloat16",
         "update_top4_from_cache_bfloat16", "score_top4_from_cache_bfloat16_stored_bfloat16"),
    ]  # fmt: skip
    out = []
    scale = ROWS / rows  # scoring and scan measured on `rows` rows, the step has 40
    for name, gen, score, scan, update, top in combos:
        parts = {
            "generation": sum(x for x in (s(k) for k in gen) if x is not None)
            if all(s(k) is not None for k in gen) else None,
            "scoring": s(score, scale) if top is None else (s(score, scale) or 0)
            + (s(top, scale) or 0),
            "scan": s(scan, scale),
            "update_80_rows": s(update, (2 * ROWS) / MICRO),
        }  # fmt: skip
        total = None if None in parts.values() else sum(parts.values())
        out.append({"combination": name, **parts, "total_s": total})
    return out


def print_table(res: dict, rows: int = ROWS) -> None:
    print(f"\n{'piece':58s} {'min s':>8s} {'median s':>9s} {'load':>5s}")
    for key, v in res.items():
        if isinstance(v, dict) and "median_s" in v:
            print(f"{key:58s} {v['min_s']:8.2f} {v['median_s']:9.2f} {v['load']:5.1f}")
    print()
    for key, v in res.items():
        if key.startswith("gap_"):
            print(
                f"{key:58s} mean|d| {v['mean_abs']:.4f} max|d| {v['max_abs']:.3f}"
                f" drift L2 mean {v['drift_l2_mean']:.2e} max {v['drift_l2_max']:.2e}"
            )
    if "cache_memory" in res:
        print("\ncache memory:", json.dumps(res["cache_memory"]))
    print(
        f"\n{'combination':44s} {'gen':>6s} {'score':>6s} {'scan':>6s} {'upd80':>6s} {'total':>6s}"
    )
    for row in projection(res, rows):
        cells = [row[k] for k in ("generation", "scoring", "scan", "update_80_rows", "total_s")]
        print(f"{row['combination']:44s} " + " ".join(
            f"{c:6.1f}" if c is not None else f"{'-':>6s}" for c in cells))  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="data/smollm2")
    parser.add_argument("--trajectories", required=True)
    parser.add_argument("--parts", default="generation,scoring,update")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=None, help="the .venv-vllm python")
    parser.add_argument("--vllm-only", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "smollm2_levers.json"))
    parser.add_argument("--table", action="store_true", help="print the table of --out, no run")
    parser.add_argument(
        "--groups",
        type=int,
        default=ROWS // GROUP,
        help="groups of 5 scored and scanned (default 8: the step's 40 rows); fewer on a"
        " crowded machine, the step's figures then scaled by 40 / rows",
    )
    parser.add_argument(
        "--smoke", action="store_true", help="2 groups of each kind, 1 repeat: a quick check"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.table:
        data = json.loads(Path(args.out).read_text())
        print_table(data["results"], data["shape"]["fresh_rows"])
        return
    import torch

    torch.set_num_threads(args.threads)
    rows = load_rows(Path(args.trajectories))
    # groups of 5 that share a prompt: the file's rows of one question, 5 copies made of the
    # first 5 rows of a question when it holds fewer (k=4): row i of group g is question g's
    # row i % k
    by_q: dict[str, list[dict]] = {}
    for r in rows:
        by_q.setdefault(r["question"], []).append(r)
    groups = [[qs[i % len(qs)] for i in range(GROUP)] for qs in by_q.values()]
    n_groups = 2 if args.smoke else args.groups
    if args.smoke:
        args.repeats = 1
    step_rows = [r for g in groups[: ROWS // GROUP] for r in g]  # generation: 8 x 5
    fresh = [r for g in groups[:n_groups] for r in g]
    stored = [r for g in groups[n_groups : 2 * n_groups] for r in g]
    if len(stored) < len(fresh):
        raise SystemExit(f"{args.trajectories}: too few questions for {2 * n_groups} groups")
    if args.vllm_only:
        dtype, prefix = args.vllm_only.split(",")
        res = part_generation_vllm(args.model, fresh, args.repeats, dtype, prefix == "on")
        print("RESULT " + json.dumps(res))
        return
    out = Path(args.out)
    previous = json.loads(out.read_text()) if out.is_file() else {}
    res: dict = previous.get("results", {})
    parts = args.parts.split(",")
    if parts != ["generation"]:  # one small forward first: oneDNN's kernels get made
        from transformers import AutoModelForCausalLM

        warm = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        ids, attn, _ = padded(fresh[:2])
        for dtype in ("float32", "bfloat16"):
            with torch.no_grad(), autocast(dtype):
                warm(input_ids=ids, attention_mask=attn)
        del warm
    if "scoring" in parts:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
        res.update(part_scoring(model, fresh, stored, args.repeats))
        del model
    if "update" in parts:
        res.update(part_update(args.model, fresh, args.repeats))
    if "generation" in parts:
        res.update(part_generation_hf(args.model, step_rows, args.repeats))
        if args.vllm_python:
            for setting in ("float32,on", "float32,off", "bfloat16,on"):
                proc = subprocess.run(
                    [args.vllm_python, __file__, "--model", args.model, "--trajectories",
                     args.trajectories, "--repeats", str(args.repeats), "--vllm-only", setting,
                     *(["--smoke"] if args.smoke else [])],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
                line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
                if line:
                    res.update(json.loads(line[-1].removeprefix("RESULT ")))
                else:
                    res[f"gen_vllm_{setting}_error"] = proc.stderr.strip().splitlines()[-3:]
                print(f"vllm {setting}: done", flush=True)
    shape = {
        "fresh_rows": len(fresh),
        "stored_rows": len(stored),
        "prompt_tokens_mean": statistics.fmean(len(r["prompt_ids"]) for r in fresh),
        "policy_tokens_mean": statistics.fmean(sum(r["loss_mask"]) for r in fresh),
        "observation_tokens_mean": statistics.fmean(
            len(r["loss_mask"]) - sum(r["loss_mask"]) for r in fresh
        ),
    }
    from core.paths import write_json_atomic

    write_json_atomic(out, {
        "trajectories": args.trajectories, "model": args.model, "threads": args.threads,
        "repeats": args.repeats, "shape": shape, "results": res,
        "projection": projection(res, len(fresh)),
    })  # fmt: skip
    print_table(res, len(fresh))


if __name__ == "__main__":
    main()
