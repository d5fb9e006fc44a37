"""Readers shared by the stack tests: paths, compose interpolation, the `hdr` executable."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
REPLICAS = ROOT / "docker-compose.replicas.yml"
ARTICLES = 150  # corpus size of the host runs
# s: corpus + index build + model load on a 2-core CPU (up to 3.5 min seen under load)
START_TIMEOUT = 420.0
ENTRYPOINTS = {
    "retrieval": ROOT / "docker" / "retrieval-entrypoint.sh",
    "trainer": ROOT / "docker" / "trainer-entrypoint.sh",
}
# Sourced by both entrypoints and copied beside each in its image.
SIGNALS_LIB = ROOT / "docker" / "entrypoint-signals.sh"
# Dotted overrides (as `docker compose run trainer key=value ...` passes them) that shrink
# configs/tiny-cpu.yaml's run and its SFT to a single small step.
SMALL_RUN = [
    "steps=1",
    "grpo.batch_prompts=2",
    "grpo.group_size=2",
    "grpo.warmup_steps=0",
    "eval.every=0",
    "eval.at_start=false",
    "checkpoint.save_every=0",
    "sft.max_examples=4",
    "sft.batch_size=4",
    "sft.epochs=1",
    "sft.eval_questions=0",
    "rollout.max_turns=1",
    "rollout.max_tokens_per_turn=16",
]
TRAIN_TIMEOUT = 420  # s: tiny policy + SFT + one step on a loaded 2-core CPU

# ${VAR}, ${VAR:-default}, ${VAR-default}, as compose writes them.
INTERPOLATION = re.compile(r"\$\{(?P<name>\w+)(?:(?P<op>:?-)(?P<default>[^}]*))?\}")


def interpolate(value: object, env: dict[str, str] | None = None) -> object:
    """A value of a compose file as compose resolves it when `env` is the environment."""
    env = env or {}
    if isinstance(value, dict):
        return {key: interpolate(item, env) for key, item in value.items()}
    if isinstance(value, list):
        return [interpolate(item, env) for item in value]
    if not isinstance(value, str):
        return value

    def resolve(match: re.Match[str]) -> str:
        name, op, default = match["name"], match["op"], match["default"] or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return INTERPOLATION.sub(resolve, value)


def hdr_executable() -> str:
    """The `hdr` console script of the Python running the tests (the project's venv)."""
    beside = Path(sys.executable).parent / "hdr"
    if beside.is_file():
        return str(beside)
    found = shutil.which("hdr")
    if found is None:
        pytest.fail("no `hdr` console script beside the test interpreter nor on PATH")
    return found


def base_env() -> dict[str, str]:
    """The host environment without HDR_* settings, `hdr` on PATH as in the images."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HDR_")}
    env.update(
        PATH=f"{Path(hdr_executable()).parent}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        HDR_API_TOKEN="",  # compose passes an empty token when none is set
    )
    return env


def trainer_env(runs_dir: Path, retrieval_url: str, **settings: str) -> dict[str, str]:
    """What compose gives the trainer container, on the host: the repository's
    configs/tiny-cpu.yaml, one retrieval server, runs under `runs_dir`; `settings` on top."""
    env = base_env()
    env.update(
        HDR_CONFIG=str(ROOT / "configs" / "tiny-cpu.yaml"),
        HDR_RETRIEVAL_URLS=retrieval_url,
        HDR_RUNS_DIR=str(runs_dir),
        **settings,
    )
    return env


def child_processes(pid: int) -> dict[int, str]:
    """The live children of process `pid`: pid -> command line (from /proc)."""
    children = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError, ValueError):
            continue  # ended while we looked
        if parent == pid:
            children[int(stat.parent.name)] = cmdline.replace(b"\0", b" ").decode().strip()
    return children


def wait_for_child(proc: subprocess.Popen, marker: str, timeout: float = START_TIMEOUT) -> int:
    """The pid of the first child of `proc` whose command line holds `marker`, once it runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"exited {proc.returncode} before running {marker!r}"
        for child, cmdline in child_processes(proc.pid).items():
            if marker in cmdline:
                return child
        time.sleep(0.02)
    pytest.fail(f"no child running {marker!r} within {timeout:.0f}s")


def process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def container_env(data_dir: Path, port: int) -> dict[str, str]:
    """What compose gives the retrieval container, with a small corpus and a free port."""
    env = base_env()
    env.update(
        HDR_DATA_DIR=str(data_dir),
        HDR_CORPUS_LIMIT=str(ARTICLES),
        HDR_HOST="127.0.0.1",
        HDR_PORT=str(port),
    )
    return env


class Entrypoint:
    """The entrypoint script as a child process in its own session, with its log."""

    def __init__(self, env: dict[str, str], log: Path) -> None:
        self.log = log
        self.port = int(env["HDR_PORT"])
        with log.open("w") as out:
            self.proc = subprocess.Popen(
                ["bash", str(ENTRYPOINTS["retrieval"])],
                env=env,
                cwd=log.parent,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def output(self) -> str:
        return self.log.read_text()

    def wait_healthy(self, timeout: float = START_TIMEOUT) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"entrypoint exited {self.proc.returncode}:\n{self.output()}")
            try:
                response = httpx.get(self.url("/health"), timeout=2.0)
                if response.status_code == 200:
                    return response.json()
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pytest.fail(f"no /health within {timeout:.0f}s:\n{self.output()}")

    def stop(self) -> None:
        """SIGTERM, as `docker stop` sends it; the server must shut down gracefully."""
        self.proc.send_signal(signal.SIGTERM)
        status = self.proc.wait(timeout=30)
        # uvicorn re-raises the signal after its graceful shutdown (docker reports 143).
        assert status in (0, -signal.SIGTERM), status
        assert "Application shutdown complete" in self.output()

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)
