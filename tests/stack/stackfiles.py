"""Readers shared by the stack tests: paths, compose interpolation, the `hdr` executable."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def base_env() -> dict[str, str]:
    """The host environment without HDR_* settings, `hdr` on PATH as in the images."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("HDR_")}
    env.update(
        PATH=f"{Path(hdr_executable()).parent}{os.pathsep}{env.get('PATH', '')}",
        HF_HUB_OFFLINE="1",
        HDR_API_TOKEN="",  # compose passes an empty token when none is set
    )
    return env


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
