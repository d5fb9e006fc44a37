"""Readers shared by the stack tests: paths, compose interpolation, the `hdr` executable."""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
REPLICAS = ROOT / "docker-compose.replicas.yml"
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
