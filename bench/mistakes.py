"""Mistakes a new user makes, tried for real: what hdr answers and whether any file was lost.

Each row runs `hdr` as a user would, in a scratch folder holding a corpus, a tiny model and
files of the user's own, and records the exit code, hdr's first stderr line, the time it took
and whether every file that existed before is byte-identical after. Nothing here needs a
retrieval server: the mistakes are caught before one is contacted.

    .venv/bin/python bench/mistakes.py        # writes bench/results/mistakes.json, prints a table

docs/mistakes.md holds the table this printed, beside the mistakes that need a server, Docker
or a training run (those are shown by tests, named there).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parents[1]
HDR = str(Path(sys.executable).with_name("hdr"))
FIXTURE = REPO / "tests" / "fixtures" / "wiki18_sample.jsonl"

MISTAKES: list[tuple[str, list[str]]] = [
    ("index build --out a folder holding the corpus and a model of the user's",
     ["index", "build", "--corpus", "data/wiki.jsonl", "--out", "data", "--no-dense"]),
    ("index build --out the corpus file itself",
     ["index", "build", "--corpus", "data/wiki.jsonl", "--out", "data/wiki.jsonl", "--no-dense"]),
    ("index build --out an existing index, without --force",
     ["index", "build", "--corpus", "data/wiki.jsonl", "--out", "data/index", "--no-dense"]),
    ("init-model --out an existing model", ["init-model", "--out", "data/my-model"]),
    ("init-model --out a file", ["init-model", "--out", "data/wiki.jsonl"]),
    ("index prepare-wiki --out a folder", ["index", "prepare-wiki", "--out", "data"]),
    ("plot --out a file", ["plot", "runs/a", "--out", "data/wiki.jsonl"]),
    ("init-model --out an unwritable place", ["init-model", "--out", "/proc/hdr/out"]),
    ("train before sft (model.path data/tiny-sft missing), no HF_HUB_OFFLINE",
     ["train", "--config", "configs/tiny-cpu.yaml"]),
    ("rollout --model a path that does not exist, no HF_HUB_OFFLINE",
     ["rollout", "--model", "data/nope"]),
    ("train retrieval.urls=a bare URL (not a list) with an out_dir of other files",
     ["train", "--config", "configs/tiny-cpu.yaml", "model.path=data/my-model",
      "retrieval.urls=http://127.0.0.1:8765", "out_dir=data"]),
    ("eval --server without a scheme",
     ["eval", "--model", "data/my-model", "--data", "wiki-vital", "--server", "127.0.0.1:8765"]),
    ("train steps=2 (the warmup is 3 steps)", ["train", "--config", "configs/tiny-cpu.yaml",
                                               "steps=2"]),
    ("train --out x (an option that is a setting)", ["train", "--out", "x"]),
    ("train --steps 4", ["train", "--steps", "4"]),
    ("train -h", ["train", "-h"]),
    ("index build on a corpus with one Latin-1 byte on line 21",
     ["index", "build", "--corpus", "data/latin1.jsonl", "--out", "data/i1", "--no-dense"]),
    ("index build on a corpus whose ids repeat",
     ["index", "build", "--corpus", "data/twice.jsonl", "--out", "data/i2", "--no-dense"]),
    ("index build batch_size=8 (a KEY=VALUE on a subcommand without a config)",
     ["index", "build", "--corpus", "data/wiki.jsonl", "--out", "data/i3", "--no-dense",
      "batch_size=8"]),
    ("index prepare-wiki limitt=5", ["index", "prepare-wiki", "--out", "data/w.jsonl", "limitt=5"]),
    ("eval max_questions= (empty)",
     ["eval", "--model", "data/my-model", "--data", "wiki-vital", "max_questions="]),
    ("eval on a QA file with answer instead of golden_answers",
     ["eval", "--model", "data/my-model", "--data", "data/qa.jsonl"]),
    ("train replay.rule=on_policy_larger (an experiment's arm)",
     ["train", "--config", "configs/tiny-cpu.yaml", "replay.rule=on_policy_larger"]),
    ("train arm=headroom_drift (the key before replay.rule)",
     ["train", "--config", "configs/tiny-cpu.yaml", "arm=headroom_drift"]),
    ("rollout --task a.jsonl --data b.jsonl (old and new name)",
     ["rollout", "--model", "data/my-model", "--task", "a.jsonl", "--data", "b.jsonl"]),
]  # fmt: skip


def tree(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def scratch() -> Path:
    """A user's project folder: configs, a corpus, an index, a tiny model, a run, notes."""
    from models.tiny import TinyPolicyConfig, init_tiny_policy
    from retrieval_server.index.build import build_index

    root = Path(tempfile.mkdtemp(prefix="hdr-mistakes-"))
    shutil.copytree(REPO / "configs", root / "configs")
    (root / "data").mkdir()
    shutil.copy(FIXTURE, root / "data" / "wiki.jsonl")
    (root / "data" / "notes.md").write_text("the user's own notes\n")
    build_index(root / "data" / "wiki.jsonl", root / "data" / "index", dense=False,
                show_progress=False)  # fmt: skip
    texts = [json.loads(line)["contents"] for line in FIXTURE.read_text().splitlines()]
    small = TinyPolicyConfig(vocab_size=300, hidden_size=16, num_layers=1, num_heads=2,
                             intermediate_size=32)  # fmt: skip
    init_tiny_policy(root / "data" / "my-model", texts, small)
    lines = FIXTURE.read_bytes().splitlines(keepends=True)
    (root / "data" / "latin1.jsonl").write_bytes(
        b"".join(lines * 2) + b'{"id": "20", "contents": "\\"Caf\xe9\\"\\nau lait"}\n'
    )
    (root / "data" / "twice.jsonl").write_bytes(b"".join(lines) + lines[7])
    (root / "data" / "qa.jsonl").write_text('{"id": 0, "question": "q?", "answer": "a"}\n')
    (root / "runs" / "a").mkdir(parents=True)
    metrics = {"step": 1, "acceptance_rate": 0.5, "replay_ages": [1]}
    (root / "runs" / "a" / "metrics.jsonl").write_text(json.dumps(metrics) + "\n")
    return root


def try_mistake(root: Path, args: list[str]) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    before = tree(root)
    started = time.perf_counter()
    done = subprocess.run([HDR, *args], cwd=root, capture_output=True, text=True, env=env,
                          timeout=600, check=False)  # fmt: skip
    seconds = time.perf_counter() - started
    after = tree(root)
    changed = sorted(name for name, digest in before.items() if after.get(name) != digest)
    lines = (done.stderr.strip() or done.stdout.strip()).splitlines()
    return {
        "args": args,
        "exit_code": done.returncode,
        "stderr_lines": len(done.stderr.strip().splitlines()),
        "first_line": lines[0].strip() if lines else "",
        "seconds": round(seconds, 2),
        "files_changed_or_lost": changed,
    }


def main() -> None:
    root = scratch()
    try:
        rows = [{"mistake": what, **try_mistake(root, args)} for what, args in MISTAKES]
    finally:
        shutil.rmtree(root)
    out = REPO / "bench" / "results" / "mistakes.json"
    out.write_text(json.dumps(rows, indent=1) + "\n")
    table = Table(title="hdr's answer to each mistake")
    for column in ("mistake", "exit", "lines", "s", "files lost", "hdr says"):
        table.add_column(column)
    for row in rows:
        table.add_row(row["mistake"], str(row["exit_code"]), str(row["stderr_lines"]),
                      f"{row['seconds']:.1f}", str(len(row["files_changed_or_lost"])),
                      row["first_line"])  # fmt: skip
    Console(width=200).print(table)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
