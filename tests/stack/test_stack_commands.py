"""Every command the containers run is a real `hdr` subcommand that takes the options given.

The commands are read out of the entrypoint scripts (the images' ENTRYPOINTs; the compose
file adds no `command:`), then `hdr <subcommand> --help` is run through the project's venv.
"""

from __future__ import annotations

import os
import re
import subprocess

import pytest
import yaml
from stackfiles import COMPOSE, ENTRYPOINTS, REPLICAS, ROOT, hdr_executable

EXPECTED = {
    "retrieval": {("index", "prepare-wiki"), ("index", "build"), ("serve",)},
    "trainer": {("init-model",), ("sft",), ("train",)},
}
OPTION = r"(?<![\w-])(--[a-z][\w-]*)"


def hdr_invocations(script: str) -> dict[tuple[str, ...], set[str]]:
    """{subcommand words: options} of every `"$HDR_BIN" ...` command in a bash script.

    Follows backslash continuations, bash array literals (`cmd=("$HDR_BIN" ...)`, which may
    span lines) and later appends to such an array (`cmd+=(--flag ...)`).
    """
    text = script.replace("\\\n", " ")
    calls: dict[tuple[str, ...], set[str]] = {}
    for match in re.finditer(r'(?:(\w+)=\()?"\$HDR_BIN"((?:[ \t]+[a-z][\w-]*)+)', text):
        array, words = match[1], tuple(match[2].split())
        end = text.index(")", match.end()) if array else text.find("\n", match.end())
        options = set(re.findall(OPTION, text[match.end() : end]))
        if array:
            options |= set(re.findall(rf"\b{array}\+=\({OPTION}", text))
        calls.setdefault(words, set()).update(options)
    return calls


def run_help(words: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "200", "NO_COLOR": "1", "TERM": "dumb"}
    return subprocess.run(
        [hdr_executable(), *words, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=ROOT,
    )


def test_the_parser_reads_arrays_appends_and_continuations():
    script = (
        'cmd=("$HDR_BIN" index build --corpus "$C"\n    --out "$D")\n'
        'cmd+=(--encoder "$E")\n'
        'exec "$HDR_BIN" serve --index "$I" \\\n    --port "$P" "$@"\n'
        'log "hdr train --config x"\n'
    )
    assert hdr_invocations(script) == {
        ("index", "build"): {"--corpus", "--out", "--encoder"},
        ("serve",): {"--index", "--port"},
    }


def test_compose_runs_only_the_entrypoints():
    for path in (COMPOSE, REPLICAS):
        for name, service in yaml.safe_load(path.read_text())["services"].items():
            assert "command" not in service, (path.name, name)
            assert "entrypoint" not in service, (path.name, name)


@pytest.mark.parametrize("image", sorted(EXPECTED))
def test_entrypoint_commands_are_real_hdr_subcommands(image):
    calls = hdr_invocations(ENTRYPOINTS[image].read_text())
    assert set(calls) == EXPECTED[image]
    for words, options in sorted(calls.items()):
        done = run_help(words)
        command = "hdr " + " ".join(words)
        assert done.returncode == 0, f"`{command} --help` failed:\n{done.stdout}{done.stderr}"
        for option in sorted(options):
            assert re.search(rf"(?<![\w-]){option}(?![\w-])", done.stdout), (
                f"`{command}` has no option {option}"
            )


def test_trainer_overrides_name_real_config_keys(tmp_path):
    """The dotted overrides the trainer entrypoint gives `hdr sft` and `hdr train` are keys
    of TrainConfig in both shipped configs."""
    from core.config import load_config
    from trainer.config import TrainConfig

    script = ENTRYPOINTS["trainer"].read_text()
    keys = set(re.findall(r'"([a-z_]+(?:\.[a-z_]+)*)=', script))
    assert keys == {"retrieval.urls", "out_dir", "model.path", "sft.init_model"}
    overrides = [
        'retrieval.urls=["http://retrieval:8000","http://retrieval-2:8000"]',
        f"out_dir={tmp_path / 'run'}",
        f"model.path={tmp_path / 'model'}",
        f"sft.init_model={tmp_path / 'init'}",
    ]
    for config in ("tiny-cpu.yaml", "search-r1-qwen2.5-3b.yaml"):
        loaded = load_config(TrainConfig, ROOT / "configs" / config, overrides)
        assert loaded.retrieval.urls == ["http://retrieval:8000", "http://retrieval-2:8000"]
        assert loaded.out_dir == str(tmp_path / "run")
        assert loaded.model.path == str(tmp_path / "model")
        assert loaded.sft.init_model == str(tmp_path / "init")
