"""The trained weights of three short runs, as sha256 digests: the check that a refactoring of
the trainer left its arithmetic alone (same digests before and after).

    .venv/bin/python bench/train_hashes.py --data-dir D --out bench/results/train_hashes.json
    .venv/bin/python bench/train_hashes.py --data-dir D --check bench/results/train_hashes.json

It prepares, once per `--data-dir` D (kept for the next call), the embedded corpus, its BM25
index, a tiny policy (`hdr init-model` defaults) and two epochs of `hdr sft` from it on 2,000
questions; starts `hdr serve` on that index; then runs, each in a fresh folder:

- `sync`: `hdr train --config configs/tiny-cpu.yaml steps=4` with the F1 + format reward
  (held-out evaluation and a checkpoint every 2 steps, to walk those paths too);
- `async0`: the same with two rollout workers and `async_rollout.max_lag=0` (the synchronous
  loop in worker processes; its tokens equal the synchronous loop's);
- `trl`: `hdr trl-train --config configs/trl/tiny-cpu.yaml` for 2 steps (run twice: its digest
  counts only when both runs agree).

Each run's digest is the sha256 of its saved `model.safetensors`; a second digest covers the
deterministic fields of its `metrics.jsonl` (rewards, losses, group ids, ...: no times), so a
change that moves a metric but not the weights is seen too. Writes JSON and prints a table;
`--check FILE` compares with an earlier JSON and exits 1 on any difference. On the 2-core
machine at load 15-19 (other jobs) the three runs took 25, 56 and 2 x 8.5 minutes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
# F1 plus a format term (as the TRL recipe): rewards that vary for a barely trained policy, so
# the weights move and the replay buffer fills
TRAIN = ["--config", "configs/tiny-cpu.yaml", "steps=4", "eval.every=2", "eval.num_questions=32",
         "checkpoint.save_every=2", "log.progress=false", "log.tensorboard=false",
         "rollout.reward=f1", "rollout.format_weight=0.5"]  # fmt: skip
RUNS = {
    "sync": ["train", *TRAIN],
    "async0": ["train", *TRAIN, "async_rollout.workers=2", "async_rollout.max_lag=0"],
    "trl": ["trl-train", "--config", "configs/trl/tiny-cpu.yaml", "trl.max_steps=2"],
}
TIMING = ("time_", "wall_time", "cost_cpu_", "worker_", "retrieval_outage_s", "_s")


def hdr(args: list[str], log: Path) -> None:
    """`hdr ARGS` from the repository's code (this checkout), its output into `log`."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "PYTHONPATH": str(REPO)}  # fmt: skip
    with log.open("a") as out:
        out.write(f"$ hdr {' '.join(args)}\n")
        out.flush()
        done = subprocess.run([sys.executable, "-m", "hdr.cli", *args], cwd=REPO, env=env,
                              stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    if done.returncode:
        sys.exit(f"hdr {' '.join(args)} failed ({done.returncode}); see {log}")


def prepare(data: Path, url: str, log: Path) -> None:
    """The corpus, the BM25 index, the tiny policy and its SFT start (once per data dir)."""
    if not (data / "wiki-vital.jsonl").exists():
        hdr(["index", "prepare-wiki", "--out", str(data / "wiki-vital.jsonl")], log)
    if not (data / "index-bm25").exists():
        hdr(["index", "build", "--corpus", str(data / "wiki-vital.jsonl"),
             "--out", str(data / "index-bm25"), "--no-dense"], log)  # fmt: skip


def sft(data: Path, url: str, log: Path) -> None:
    if not (data / "tiny-policy").exists():
        hdr(["init-model", "--out", str(data / "tiny-policy")], log)
    if not (data / "tiny-sft").exists():
        hdr(["sft", "--config", "configs/tiny-cpu.yaml", f"model.path={data / 'tiny-sft'}",
             f"sft.init_model={data / 'tiny-policy'}", "sft.epochs=2", "sft.lr=3e-3",
             "sft.eval_questions=0", "sft.max_examples=2000", f"retrieval.urls=[{url}]",
             "log.progress=false"], log)  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve(index: Path, port: int, log: Path) -> subprocess.Popen:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    out = log.open("a")
    server = subprocess.Popen(
        [sys.executable, "-m", "hdr.cli", "serve", "--index", str(index), "--port", str(port)],
        cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
    )  # fmt: skip
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            sys.exit(f"hdr serve ended ({server.returncode}); see {log}")
        time.sleep(0.5)
    server.kill()
    sys.exit(f"hdr serve not up after 300 s; see {log}")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def metrics_digest(path: Path) -> str | None:
    """sha256 of the metrics' deterministic fields (times and CPU seconds left out)."""
    if not path.exists():
        return None
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    kept = [{k: v for k, v in r.items() if not any(t in k for t in TIMING)} for r in rows]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def one_run(name: str, data: Path, url: str, work: Path, log: Path) -> dict:
    out = work / name
    model = data / "tiny-sft"
    if name == "trl":
        args = [*RUNS[name], f"model={model}", f"trl.output_dir={out}", f"retrieval.urls=[{url}]"]
    else:
        args = [*RUNS[name], f"model.path={model}", f"out_dir={out}", f"retrieval.urls=[{url}]"]
    started = time.perf_counter()
    hdr(args, log)
    weights = out / "model.safetensors" if name == "trl" else out / "final" / "model.safetensors"
    if sha256(weights) == sha256(model / "model.safetensors"):
        sys.exit(f"{name}: the weights did not move from the SFT start; the check would be empty")
    return {
        "command": "hdr " + " ".join(args),
        "model_sha256": sha256(weights),
        "metrics_sha256": metrics_digest(out / "metrics.jsonl"),
        "seconds": round(time.perf_counter() - started, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=REPO / "data" / "train-hashes")
    parser.add_argument("--out", type=Path, help="Write the digests here (JSON).")
    parser.add_argument("--check", type=Path, help="Compare with this earlier JSON.")
    parser.add_argument("--runs", default=",".join(RUNS), help="Comma-separated: " + ",".join(RUNS))
    args = parser.parse_args()
    data = args.data_dir.resolve()
    data.mkdir(parents=True, exist_ok=True)
    log = data / "train_hashes.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    prepare(data, url, log)
    server = serve(data / "index-bm25", port, log)
    results: dict = {}
    try:
        sft(data, url, log)
        results["sft_start_sha256"] = sha256(data / "tiny-sft" / "model.safetensors")
        work = Path(tempfile.mkdtemp(prefix="train-hashes-"))
        for name in args.runs.split(","):
            results[name] = one_run(name, data, url, work, log)
            if name == "trl":  # deterministic only if a second run agrees
                again = one_run(name, data, url, work / "again", log)
                results[name]["deterministic"] = (
                    again["model_sha256"] == results[name]["model_sha256"]
                )
        shutil.rmtree(work, ignore_errors=True)
    finally:
        server.terminate()
        server.wait(timeout=30)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    report(results, args.check)


def report(results: dict, check: Path | None) -> None:
    earlier = json.loads(check.read_text()) if check else {}
    table = Table(title="trained weights (sha256, first 16 hex digits)")
    for col in ("run", "model", "metrics", "s", "same as --check"):
        table.add_column(col)
    differs = False
    for name, r in results.items():
        if not isinstance(r, dict):
            continue
        was = earlier.get(name)
        same = "" if was is None else str(
            was["model_sha256"] == r["model_sha256"]
            and was["metrics_sha256"] == r["metrics_sha256"]
        )  # fmt: skip
        differs |= same == "False" and r.get("deterministic", True)
        table.add_row(name, r["model_sha256"][:16], (r["metrics_sha256"] or "-")[:16],
                      str(r["seconds"]), same)  # fmt: skip
    Console().print(table)
    print(json.dumps(results, indent=2))
    if check and earlier.get("sft_start_sha256") != results["sft_start_sha256"]:
        print("the SFT start differs from --check's: the runs are not comparable")
        differs = True
    if differs:
        sys.exit(1)


if __name__ == "__main__":
    main()
