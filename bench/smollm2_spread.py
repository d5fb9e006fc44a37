"""How far a held-out score moves without training: the same model evaluated under other
sampling seeds and CPU settings, beside a trained model evaluated alike. RL's rise counts only
where it is larger than that spread.

    .venv/bin/hdr serve --index data/index --port 8000 &
    .venv-vllm/bin/python bench/smollm2_spread.py --start data/smollm2-sft \
        --trained runs/smollm2-hd/final

Each model is evaluated by `hdr eval` under the rollout, generation and retrieval settings of
`--settings` (configs/smollm2-cpu.yaml: its prompt, vLLM's CPU engine) on the first
`--questions` test questions at k = `--k` plus greedy, once per run of `--runs`:
`<kernels>-t<threads>-s<seed>`, kernels `native` (the machine's best) or `avx2`
(`ATEN_CPU_CAPABILITY=avx2`: torch's own kernels; oneDNN's matrix products keep the native
ISA, since held to AVX2 with `ONEDNN_MAX_CPU_ISA` the engine's bf16 ran 13x slower), threads
through `taskset` and `OMP_NUM_THREADS`, the evaluation's sampling seed. A model's spread is
its highest minus its lowest score over the runs; the rise is the trained model's score minus
the start's in the same run (same questions, settings and seed), and it "exceeds the spread"
when its smallest value is above the larger of the two models' spreads. Writes
bench/results/smollm2_spread.json (each evaluation's own files under `--evals`) and prints a
table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HDR = str(Path(sys.executable).with_name("hdr"))
METRICS = ("mean_at_k", "best_at_k", "greedy_em")
RUNS = "native-t2-s0,native-t2-s1,native-t2-s2,avx2-t2-s0,native-t1-s0"


def environment(run: str) -> tuple[dict[str, str], str, int]:
    """The environment, the cores (taskset) and the seed of a run name."""
    kernels, threads, seed = run.split("-")
    count = int(threads.removeprefix("t"))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(count)}
    if kernels == "avx2":
        env["ATEN_CPU_CAPABILITY"] = "avx2"
    elif kernels != "native":
        raise SystemExit(f"unknown kernels {kernels!r} in {run!r}: native or avx2")
    return env, ",".join(str(c) for c in range(count)), int(seed.removeprefix("s"))


def evaluate(model: str, run: str, questions: int, k: int, settings: str, out: Path) -> dict:
    env, cores, seed = environment(run)
    command = ["taskset", "-c", cores, HDR, "eval", "--model", model, "--data", "wiki-vital",
               "--train-config", settings,
               "--k", str(k), "--out", str(out), f"max_questions={questions}", f"seed={seed}",
               "progress=false"]  # fmt: skip
    with (out.parent / f"{out.name}.log").open("a") as log:
        done = subprocess.run(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    if done.returncode != 0:
        raise SystemExit(f"hdr eval of {model} ({run}) failed; see {out.parent}/{out.name}.log")
    report = json.loads((out / "eval.json").read_text())
    row = {m: report["average"][m] for m in METRICS}
    row["behaviour"] = report["datasets"][0].get("behaviour") is not None
    row["rollout_s"] = round(report["wall_time"], 1)  # its own, also when reused or resumed
    return row


def spread(rows: dict[str, dict], metric: str) -> float:
    values = [r[metric] for r in rows.values()]
    return max(values) - min(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--start", required=True, help="The untrained model (an SFT start).")
    ap.add_argument("--trained", help="A model trained from it (optional).")
    ap.add_argument("--runs", default=RUNS, help="Comma-separated <kernels>-t<n>-s<seed>.")
    ap.add_argument(
        "--settings",
        default="configs/smollm2-cpu.yaml",
        help="The training config whose rollout, generation and retrieval settings both models"
        " are evaluated under (a bare SFT start has none of its own: hdr eval would fall back"
        " to the hf backend's defaults).",
    )
    ap.add_argument("--questions", type=int, default=300)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--out", default="bench/results/smollm2_spread.json")
    ap.add_argument(
        "--evals",
        default="runs/smollm2-spread",
        help="Folder for the evaluations' files; a rerun resumes there.",
    )
    args = ap.parse_args()
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    models = {"start": args.start, **({"trained": args.trained} if args.trained else {})}
    scores: dict[str, dict[str, dict]] = {name: {} for name in models}
    evals = Path(args.evals)
    # an interrupted bench goes on where it stopped: hdr eval resumes an unfinished evaluation
    # and returns a finished one as it is, so nothing written is overwritten
    evals.mkdir(parents=True, exist_ok=True)
    for run in runs:  # run by run, both models: a slow neighbour hits both alike
        for name, model in models.items():
            scores[name][run] = evaluate(
                model, run, args.questions, args.k, args.settings, evals / f"{name}-{run}"
            )
            print(name, run, scores[name][run], flush=True)
    summary: dict = {
        m: {f"{n}_spread": round(spread(scores[n], m), 4) for n in models} for m in METRICS
    }
    if "trained" in models:
        for m in METRICS:
            rises = [scores["trained"][r][m] - scores["start"][r][m] for r in runs]
            widest = max(summary[m][f"{n}_spread"] for n in models)
            summary[m] |= {"rise_min": round(min(rises), 4), "rise_max": round(max(rises), 4),
                           "rise_exceeds_spread": min(rises) > widest}  # fmt: skip
    report = {
        "command": "bench/smollm2_spread.py " + " ".join(sys.argv[1:]),
        "models": models,
        "settings": args.settings,
        "questions": args.questions,
        "k": args.k,
        "runs": runs,
        "scores": scores,
        "summary": summary,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    print(
        "| metric | " + " | ".join(f"{n} {r}" for n in models for r in runs) + " | spread | rise |"
    )
    print("|" + " --- |" * (2 + len(models) * len(runs) + 1))
    for m in METRICS:
        cells = [f"{scores[n][r][m]:.3f}" for n in models for r in runs]
        spreads = ", ".join(f"{summary[m][f'{n}_spread']:.3f}" for n in models)
        rise = ""
        if "trained" in models:
            rise = f"{summary[m]['rise_min']:+.3f} to {summary[m]['rise_max']:+.3f}"
        print(f"| {m} | " + " | ".join(cells) + f" | {spreads} | {rise} |")
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
