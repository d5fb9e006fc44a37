"""The experiment's data and retrieval server: the corpus and index under the data dir (built
by `hdr index` subcommands when missing) and a real `hdr serve` subprocess over them."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from core.errors import UserError
from experiment.config import ExperimentConfig
from experiment.train_configs import shared_train_config


def run_hdr_subcommand(*args: str, log: Path | None = None) -> None:
    """Run an `hdr` subcommand in a subprocess; a failure is a UserError with its last lines."""
    cmd = [sys.executable, "-m", "hdr.cli", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": os.environ.get("HF_HUB_OFFLINE", "1")}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if log is not None:
        with log.open("a") as fh:
            fh.write(f"$ hdr {' '.join(args)}\n{done.stdout}{done.stderr}\n")
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise UserError(f"hdr {' '.join(args[:2])} failed: {' | '.join(tail)}")


def ensure_index(cfg: ExperimentConfig, log: Path) -> Path:
    """`<data>/index` over `<data>/wiki-vital.jsonl` (quick: a subset) when it is built (dense
    + BM25, what `make index` makes); otherwise, for runs that retrieve with bm25, BM25 alone
    in `<data>/index-bm25` (nothing to encode: seconds instead of minutes), else the full one."""
    data = Path(cfg.data_dir)
    suffix = f"-{cfg.corpus_limit}" if cfg.corpus_limit else ""
    corpus, index = data / f"wiki-vital{suffix}.jsonl", data / f"index{suffix}"
    if (index / "manifest.json").is_file():
        return index
    bm25_only = shared_train_config(cfg).retrieval.retriever == "bm25"
    if bm25_only:
        index = data / f"index{suffix}-bm25"
        if (index / "manifest.json").is_file():
            return index
    data.mkdir(parents=True, exist_ok=True)
    if not corpus.is_file():  # prepare-wiki writes it whole or not at all
        print(f"experiment: preparing the corpus {corpus}", file=sys.stderr, flush=True)
        limit = ["--limit", str(cfg.corpus_limit)] if cfg.corpus_limit else []
        run_hdr_subcommand("index", "prepare-wiki", "--out", str(corpus), *limit, log=log)
    print(f"experiment: building the index {index}", file=sys.stderr, flush=True)
    dense = ["--no-dense"] if bm25_only else []
    run_hdr_subcommand(
        "index", "build", "--corpus", str(corpus), "--out", str(index), *dense, log=log
    )
    return index


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """In the child, before exec: on Linux, get SIGTERM when the parent dies, so a killed
    experiment never leaves its server behind. Elsewhere a no-op."""
    if sys.platform.startswith("linux"):
        import contextlib
        import ctypes
        import signal

        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@contextmanager
def serve(
    index: Path,
    retriever: str,
    log: Path,
    timeout_s: float = 300.0,
    settings: Sequence[str] = (),
) -> Iterator[str]:
    """A real `hdr serve` subprocess on a free loopback port (`settings`: its `--set`
    options); yields its URL, stops it after."""
    import httpx

    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "hdr.cli",
        "serve",
        "--index",
        str(index),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--retriever",
        retriever,
        "--no-access-log",
        *(arg for setting in settings for arg in ("--set", setting)),
    ]
    url = f"http://127.0.0.1:{port}"
    with log.open("a") as fh:
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, preexec_fn=die_with_parent
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                tail = log.read_text().strip().splitlines()[-3:]
                raise UserError(f"hdr serve exited with {proc.returncode}: {' | '.join(tail)}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise UserError(f"hdr serve did not answer /health within {timeout_s:.0f}s")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
