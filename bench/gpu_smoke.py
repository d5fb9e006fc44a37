"""The Python checks of bench/gpu_smoke.sh that need vLLM: hdr's vLLM backend on a GPU, offline.

    python bench/gpu_smoke.py sync BED                weight sync: vLLM log-probs vs torch's
    python bench/gpu_smoke.py engine MODEL_DIR        stop strings and finish reasons (vLLM)
    python bench/gpu_smoke.py bigram-bed BED OUT      a scripted model on Qwen2.5's tokenizer

The checks that need CUDA torch only are bench/gpu_smoke_torch.py's. Each check prints one
`PASS: ...`, `FAIL: ...` or `SKIP: ...` line last and exits 0, 1 or 77.

Tolerances, per dtype, of a sampler's log-probs against the trainer's teacher forcing of the same
tokens (mean | max absolute difference, nats): float32 1e-4 | 1e-3 (the vLLM tests on CUDA hold
1e-5 | 1e-4, with bench/gpu_smoke.sh's TRITON_F32_DEFAULT=ieee: Triton's fp32 dots default to
TF32 on Hopper, which vLLM's Triton attention would use), bfloat16 0.05 | 1.0 (bf16 rounds
each product to 8 bits of mantissa; a generation step and a whole-sequence forward round
differently).

The engine check needs a model whose next token is known, and a random model writes no stop
string. `bigram-bed` turns the tiny Qwen2 bed (`hdr init-model --arch qwen2`, random weights,
Qwen2.5's real tokenizer) into a bigram model with the same tokenizer: every layer's output
projections are zeroed, so the last hidden state is the normalised embedding of the last
token; a few chosen tokens get orthogonal embeddings and an untied output layer maps each to
its successor with a logit of 30 (probability 1 up to e^-30 per token). The chains:
`>` -> ` Paris</search>\\n\\n` (a stop string whose last token `>\\n\\n` overhangs it),
` Lyon` -> `<|im_end|>` (EOS), ` Berlin` -> ` Berlin` ... (the token limit). On the CPU the
same expectations hold for the hf backend (tests/hdr/test_gpu_smoke.py).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

PASS, FAIL, SKIP = 0, 1, 77
# (mean, max) absolute log-prob difference allowed between a sampler and teacher forcing
TOLERANCES = {"float32": (1e-4, 1e-3), "bfloat16": (0.05, 1.0)}
LOGIT = 30.0
CHAINS = [(">", " Paris</search>\n\n"), (" Lyon", "<|im_end|>"), (" Berlin", " Berlin")]


def say(status: str, message: str) -> None:
    print(f"{status}: {message}", flush=True)


def successors(tokenizer, chains=CHAINS) -> dict[int, int]:
    """token id -> the id that must follow it, from `chains` (each key one token)."""
    table = {}
    for key, follow in chains:
        (first,) = tokenizer.encode(key, add_special_tokens=False)
        ids = [first, *tokenizer.encode(follow, add_special_tokens=False)]
        for a, b in itertools.pairwise(ids):
            if table.get(a, b) != b:
                raise ValueError(f"token {a} would need two successors")
            table[a] = b
    return table


def build_bigram_bed(bed: str | Path, out: str | Path, chains=CHAINS, logit=LOGIT) -> Path:
    """The bigram model described above (its `chains`: (first token, what follows) pairs; each
    successor's `logit`), saved with the bed's tokenizer at `out`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(str(bed))
    source = AutoModelForCausalLM.from_pretrained(str(bed), dtype=torch.float32)
    config = AutoConfig.from_pretrained(str(bed))
    config.tie_word_embeddings = False
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(source.state_dict(), strict=False)
    table = successors(tokenizer, chains)
    d = config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:  # each block adds nothing to the residual stream
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for k, (a, b) in enumerate(sorted(table.items())):
            embed[a] = 0.0
            embed[a, k] = d**0.5  # RMS 1: the normalised hidden state is the same vector
            head[b] += logit / d * embed[a]  # logit of b after a: `logit` (h = embed[a])
    out = Path(out)
    model.generation_config = GenerationConfig.from_pretrained(str(bed))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def expected_completions(tokenizer):
    """(context text, max_tokens, token ids, finish reason, stop string) of each case."""
    ids = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    berlin = ids(" Berlin")
    return [
        ("Question: where?\n<search>", 16, ids(" Paris</search>\n\n"), "stop", "</search>"),
        ("The answer is Lyon", 16, [tokenizer.convert_tokens_to_ids("<|im_end|>")], "eos", None),
        ("The answer is Lyon", 1, [tokenizer.convert_tokens_to_ids("<|im_end|>")], "eos", None),
        ("Capital: Berlin", 6, berlin * 6, "length", None),
    ]


def check_completions(generator, tokenizer, temperature: float) -> list[str]:
    """What differs from `expected_completions` (empty: all as expected)."""
    from agent_env.generation import SamplingParams

    problems = []
    for text, limit, want_ids, reason, stop in expected_completions(tokenizer):
        context = tokenizer.encode(text, add_special_tokens=False)
        params = SamplingParams(temperature=temperature, max_tokens=limit)
        (got,) = generator.generate([context], params)
        found = (got.token_ids, got.finish_reason, got.stop_string)
        if found != (want_ids, reason, stop):
            problems.append(f"{text!r} (max {limit}): got {found}, want {(want_ids, reason, stop)}")
        elif min(got.logprobs) < -0.01:
            problems.append(f"{text!r}: log-probs {got.logprobs}, want about 0")
    return problems


def vllm_generator(model_dir, tokenizer, **settings):
    from agent_env.generation import GenerationConfig, build_generator
    from agent_env.prompts import PromptConfig

    config = GenerationConfig(
        backend="vllm", dtype="bfloat16", gpu_memory_utilization=0.25, max_model_len=1024,
        seed=0, **settings,
    )  # fmt: skip
    return build_generator(config, model_dir=model_dir, tokenizer=tokenizer, prompt=PromptConfig())


def needs_gpu_and_vllm() -> str | None:
    import importlib.util

    import torch

    if not torch.cuda.is_available():
        return "no CUDA GPU"
    if importlib.util.find_spec("vllm") is None:
        return "vLLM is not installed (pip install -e '.[gpu]')"
    return None


def engine(model_dir: str) -> int:
    """Stop strings and finish reasons through hdr's vLLM backend, greedy and sampled."""
    from transformers import AutoTokenizer

    if missing := needs_gpu_and_vllm():
        say("SKIP", missing)
        return SKIP
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    generator = vllm_generator(model_dir, tokenizer)
    problems = check_completions(generator, tokenizer, 0.0)
    problems += check_completions(generator, tokenizer, 1.0)
    if problems:
        say("FAIL", "; ".join(problems))
        return FAIL
    say("PASS", "stop string with overhang, EOS, EOS as the last allowed token, length")
    return PASS


def teacher_forced(model, contexts, completions):
    """torch's log-probs of each completion's tokens given its context (fp32)."""
    import torch

    out = []
    for context, done in zip(contexts, completions, strict=True):
        ids = torch.tensor([context + done.token_ids], device=model.device)
        with torch.no_grad():
            logits = model(ids).logits[0, len(context) - 1 : -1].float()
        picked = torch.log_softmax(logits, -1).gather(1, ids[0, len(context) :, None])[:, 0]
        out.append(picked.cpu())
    return out


def gap(a, b) -> tuple[float, float]:
    import torch

    diff = torch.cat([(x - torch.tensor(y)).abs() for x, y in zip(a, b, strict=True)])
    return float(diff.mean()), float(diff.max())


def sync(bed: str) -> int:
    """Sample with vLLM (bf16), teacher-force with torch (fp32): the log-probs agree within
    bf16 tolerance; put the engine to sleep, perturb torch's weights, sync (which wakes it),
    sample again: they agree with the new weights and not with the old."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agent_env.generation import SamplingParams

    if missing := needs_gpu_and_vllm():
        say("SKIP", missing)
        return SKIP
    tokenizer = AutoTokenizer.from_pretrained(bed)
    generator = vllm_generator(bed, tokenizer, enable_sleep_mode=True)
    model = AutoModelForCausalLM.from_pretrained(bed, dtype=torch.float32).cuda().eval()
    old = AutoModelForCausalLM.from_pretrained(bed, dtype=torch.float32).cuda().eval()
    texts = ["Question: who wrote it?", "<search> capital", "Paris is", "The answer:"]
    contexts = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    params = SamplingParams(temperature=1.0, max_tokens=16)
    before = generator.generate(contexts, params, seeds=[1, 2, 3, 4])
    start = gap(teacher_forced(model, contexts, before), [c.logprobs for c in before])
    generator.sleep()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * p.std() * 0.5)
    generator.sync_weights(model)
    after = generator.generate(contexts, params, seeds=[1, 2, 3, 4])
    sampled = [c.logprobs for c in after]
    new = gap(teacher_forced(model, contexts, after), sampled)
    stale = gap(teacher_forced(old, contexts, after), sampled)
    line = f"mean|max gap before {start[0]:.4f}|{start[1]:.3f}, after sync {new[0]:.4f}|"
    line += f"{new[1]:.3f}, against the old weights {stale[0]:.4f}|{stale[1]:.3f}"
    mean, most = TOLERANCES["bfloat16"]  # the engine samples in bf16
    ok = start[0] < mean and new[0] < mean and new[1] < most and stale[0] > 4 * max(new[0], 0.01)
    say("PASS" if ok else "FAIL", line)
    return PASS if ok else FAIL


def main(argv: list[str]) -> int:
    command, *args = argv
    if command == "bigram-bed":
        build_bigram_bed(*args)
        return PASS
    return {"engine": engine, "sync": sync}[command](*args)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
