"""No command loses a user's file: every writing command, pointed at a folder of other files,
at a file, at its own input or at a place it cannot write, answers one line with exit code 2
and leaves every file as it was (hashed before and after). Replacing an artifact of the same
kind needs --force and touches nothing else in its folder. A missing model path is one line
at once, and no model hub is asked (a listening socket stands in for the hub and a proxy)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

HDR = str(Path(sys.executable).with_name("hdr"))
REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "wiki18_sample.jsonl"
UNWRITABLE = Path("/proc/hdr-cannot-write-here/out")  # /proc takes no new files, even as root


def hdr(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HDR, *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        cwd=REPO,
        env=env or {**os.environ, "HF_HUB_OFFLINE": "1"},
    )


def tree(root: Path) -> dict[str, str]:
    """Every path under `root` with its content hash (folders as "dir")."""
    return {
        p.relative_to(root).as_posix(): (
            "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
        )
        for p in sorted(root.rglob("*"))
    }


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hdr: error: "), result.stderr[-2000:]
    return lines[0]


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """A user's folder: a corpus, a BM25 index of it, a tiny model, a finished-looking run, a
    training config pointing at them, and unrelated files of their own."""
    from core.config import dump_config, load_config
    from models.tiny import TinyPolicyConfig, init_tiny_policy
    from retrieval_server.index.build import build_index
    from trainer.config import TrainConfig

    root = tmp_path_factory.mktemp("work")
    shutil.copy(FIXTURE, root / "corpus.jsonl")
    build_index(root / "corpus.jsonl", root / "index", dense=False, show_progress=False)
    small = TinyPolicyConfig(
        vocab_size=300, hidden_size=16, num_layers=1, num_heads=2, intermediate_size=32
    )
    texts = [json.loads(line)["contents"] for line in FIXTURE.read_text().splitlines()]
    init_tiny_policy(root / "model", texts, small)
    config = load_config(
        TrainConfig,
        REPO / "configs" / "tiny-cpu.yaml",
        [f"model.path={root / 'model'}", f"sft.init_model={root / 'model'}", "steps=2",
         "grpo.warmup_steps=0", "retrieval.urls=http://127.0.0.1:9"],
    )  # fmt: skip
    (root / "train.yaml").write_text(dump_config(config))
    run = root / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_config(config))
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "acceptance_rate": 0.5}) + "\n")
    (root / "faiss.index").write_bytes(b"not read: the output is checked first")
    return root


# Each writing command as a user types it with its output at OUT (for the demo: RUNS/demo),
# and, where it reads an input, the same command with its output on that input.
Argv = Callable[[Path, Path], list[str]]
OwnInput = Callable[[Path], list[str]]
COMMANDS: dict[str, tuple[Argv, OwnInput | None]] = {
    "index prepare-wiki": (lambda w, out: ["index", "prepare-wiki", "--out", str(out)], None),
    "index build": (
        lambda w, out: ["index", "build", "--corpus", str(w / "corpus.jsonl"), "--out", str(out),
                        "--no-dense"],
        lambda w: ["index", "build", "--corpus", str(w / "corpus.jsonl"), "--out",
                   str(w / "corpus.jsonl"), "--no-dense"],
    ),
    "index convert": (
        lambda w, out: ["index", "convert", "--from", str(w / "index"), "--index-type", "Flat",
                        "--out", str(out)],
        lambda w: ["index", "convert", "--from", str(w / "index"), "--index-type", "Flat",
                   "--out", str(w / "index")],
    ),
    "index import": (
        lambda w, out: ["index", "import", "--faiss", str(w / "faiss.index"), "--corpus",
                        str(w / "corpus.jsonl"), "--encoder", "all-MiniLM-L6-v2", "--out",
                        str(out)],
        lambda w: ["index", "import", "--faiss", str(w / "faiss.index"), "--corpus",
                   str(w / "corpus.jsonl"), "--encoder", "all-MiniLM-L6-v2", "--out", str(w)],
    ),
    "init-model": (lambda w, out: ["init-model", "--out", str(out), "hidden_size=16"], None),
    "sft": (
        lambda w, out: ["sft", "--config", str(w / "train.yaml"), f"model.path={out}"],
        lambda w: ["sft", "--config", str(w / "train.yaml"), f"model.path={w / 'model'}"],
    ),
    "train": (
        lambda w, out: ["train", "--config", str(w / "train.yaml"), f"out_dir={out}"],
        lambda w: ["train", "--config", str(w / "train.yaml"), f"out_dir={w / 'model'}"],
    ),
    "calibrate": (
        lambda w, out: ["calibrate", "--config", str(w / "train.yaml"), "--out", str(out)],
        lambda w: ["calibrate", "--config", str(w / "train.yaml"), "--out", str(w / "model")],
    ),
    "eval": (
        lambda w, out: ["eval", "--model", str(w / "model"), "--data", "wiki-vital", "--out",
                        str(out), "max_questions=1"],
        lambda w: ["eval", "--model", str(w / "model"), "--data", "wiki-vital", "--out",
                   str(w / "model"), "max_questions=1"],
    ),
    "rollout": (
        lambda w, out: ["rollout", "--model", str(w / "model"), "--max-questions", "1", "--out",
                        str(out)],
        lambda w: ["rollout", "--model", str(w / "model"), "--max-questions", "1", "--out",
                   str(w / "model")],
    ),
    "plot": (
        lambda w, out: ["plot", str(w / "run"), "--out", str(out)],
        lambda w: ["plot", str(w / "run"), "--out", str(w / "run")],
    ),
    "experiment": (
        lambda w, out: ["experiment", "--quick", "--data-dir", str(w / "exp-data"), "--out",
                        str(out)],
        lambda w: ["experiment", "--quick", "--data-dir", str(w), "--out", str(w / "exp")],
    ),
    "demo": (
        lambda w, out: ["demo", "--data-dir", str(w / "exp-data"), "--out", str(out)],
        lambda w: ["demo", "--data-dir", str(w / "runs" / "demo"), "--out",
                   str(w / "runs" / "demo")],
    ),
}  # fmt: skip


@pytest.mark.parametrize("name", list(COMMANDS))
@pytest.mark.parametrize("case", ["folder of other files", "a file", "own input", "unwritable"])
def test_a_wrong_output_is_one_line_and_loses_nothing(work: Path, name: str, case: str) -> None:
    argv, own_input = COMMANDS[name]
    out = work / "place" / name.replace(" ", "-") / case.replace(" ", "-") / "demo"
    if case == "folder of other files":
        (out / "sub").mkdir(parents=True)
        (out / "notes.txt").write_text("mine\n")
        (out / "sub" / "data.bin").write_bytes(os.urandom(64))
        args = argv(work, out)
    elif case == "a file":
        out.parent.mkdir(parents=True)
        out.write_text("my own notes, not a corpus\n")
        args = argv(work, out)
    elif case == "own input":
        if own_input is None:
            pytest.skip(f"hdr {name} reads no input")
        args = own_input(work)
    else:
        args = argv(work, UNWRITABLE)
    before = tree(work)
    line = one_line(hdr(*args))
    assert tree(work) == before, f"hdr {name} changed files: {line}"
    expected = {  # a command that writes a file meets a folder: "is a folder"
        "folder of other files": ("holds other files", "is a folder"),
        "a file": ("is a file", "is another file"),
        "own input": ("input",),
        "unwritable": ("cannot write",),
    }[case]
    assert any(fragment in line for fragment in expected), line


def test_an_index_is_replaced_only_with_force_and_nothing_else_is_touched(work: Path) -> None:
    out = work / "forced" / "index"
    shutil.copytree(work / "index", out)
    (out / "README.txt").write_text("the user's note beside the index\n")
    before = tree(out)
    line = one_line(hdr("index", "build", "--corpus", str(work / "corpus.jsonl"), "--out",
                        str(out), "--no-dense"))  # fmt: skip
    assert "--force" in line and tree(out) == before
    done = hdr("index", "build", "--corpus", str(work / "corpus.jsonl"), "--out", str(out),
               "--no-dense", "--force")  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (out / "README.txt").read_text() == "the user's note beside the index\n"
    manifest = json.loads((out / "manifest.json").read_text())
    assert set(manifest["files"]) <= {p.relative_to(out).as_posix() for p in out.rglob("*")}
    assert not any(p.name.endswith((".partial", ".staging")) for p in out.parent.iterdir())


def test_a_model_is_replaced_only_with_force_and_other_files_stay(work: Path) -> None:
    out = work / "forced" / "policy"
    first = hdr("init-model", "--out", str(out), "hidden_size=16", "num_layers=1", "vocab_size=300")
    assert first.returncode == 0, first.stderr
    (out / "notes.md").write_text("mine\n")
    weights = (out / "model.safetensors").read_bytes()
    line = one_line(hdr("init-model", "--out", str(out), "hidden_size=24", "vocab_size=300"))
    assert "--force" in line and (out / "model.safetensors").read_bytes() == weights
    again = hdr("init-model", "--out", str(out), "hidden_size=24", "vocab_size=300", "--force")
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "config.json").read_text())["hidden_size"] == 24
    assert (out / "notes.md").read_text() == "mine\n"


def test_a_finished_run_is_started_over_only_with_force(work: Path, tmp_path: Path) -> None:
    from core.config import load_config
    from core.errors import UserError
    from trainer.config import TrainConfig
    from trainer.run import check_run_dir, clear_run

    run = tmp_path / "run"
    shutil.copytree(work / "run", run)
    (run / "final").mkdir()
    (run / "mine.txt").write_text("kept\n")
    config = load_config(TrainConfig, work / "train.yaml", [f"out_dir={run}"])
    with pytest.raises(UserError, match="finished run; start it over with --force"):
        check_run_dir(config)
    assert check_run_dir(config, force=True) == run.resolve()
    clear_run(run)
    assert sorted(p.name for p in run.iterdir()) == ["mine.txt"]


@pytest.fixture
def hub_trap():
    """A TCP listener standing in for the model hub and for any proxy: it records every
    connection made to it. Returns (environment without HF_HUB_OFFLINE, connections)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    server.settimeout(0.2)
    seen: list[tuple] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, addr = server.accept()
            except OSError:
                continue
            seen.append(addr)
            conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT=url, HTTP_PROXY=url, HTTPS_PROXY=url, ALL_PROXY=url, NO_PROXY="")
    yield env, seen
    stop.set()
    thread.join()
    server.close()


@pytest.mark.parametrize(
    "args",
    [
        ["train", "--config", "configs/tiny-cpu.yaml", "model.path=data/nope",
         "out_dir=runs/should-not-exist"],
        ["rollout", "--model", "data/nope", "--out", "runs/should-not-exist/t.jsonl"],
        ["eval", "--model", "data/nope", "--data", "wiki-vital", "--out",
         "runs/should-not-exist"],
    ],
    ids=["train", "rollout", "eval"],
)  # fmt: skip
def test_a_missing_model_path_is_one_line_at_once_without_a_hub(hub_trap, args) -> None:
    env, seen = hub_trap
    line = one_line(hdr(*args, env=env))
    assert "no model at data/nope" in line, line
    assert seen == [], f"a network connection was made: {seen}"
    assert not (REPO / "runs" / "should-not-exist").exists()


def test_runs_copied_for_an_experiment_to_reuse_are_taken_and_nothing_else_is(tmp_path):
    """docs/notebook/experiments.md's ablations copy finished runs (and the start's evaluation)
    into a new --out for `hdr experiment` to reuse: such a folder is an experiment's; a stray
    file is not."""
    from core.errors import UserError
    from core.paths import EXPERIMENT, check_output

    out = tmp_path / "ablations"
    run = out / "runs" / "headroom_drift" / "seed-1"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: {}\ngrpo: {}\nreplay: {rule: headroom_drift}\n")
    (out / "sft_start").mkdir()
    assert check_output(out, EXPERIMENT, reuse=True) == out.resolve()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds other files"):
        check_output(out, EXPERIMENT, reuse=True)
    (out / "notes.txt").unlink()
    (run / "config.yaml").write_text("not: a run\n")
    with pytest.raises(UserError, match="holds other files"):
        check_output(out, EXPERIMENT, reuse=True)
