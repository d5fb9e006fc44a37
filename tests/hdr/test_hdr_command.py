"""The `hdr` entry point as a user meets it: version, examples in every help, and every
mistake of the command line answered in one line with exit code 2."""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

HDR = str(Path(sys.executable).with_name("hdr"))
REPO = Path(__file__).resolve().parents[2]
TINY_CPU = REPO / "configs" / "tiny-cpu.yaml"
SUBCOMMANDS = [
    ["index", "prepare-wiki"],
    ["index", "build"],
    ["serve"],
    ["init-model"],
    ["rollout"],
    ["sft"],
    ["train"],
    ["calibrate"],
    ["eval"],
    ["plot"],
    ["experiment"],
    ["demo"],
]


def hdr(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [HDR, *args], capture_output=True, text=True, timeout=300, check=False, cwd=cwd
    )


def assert_one_line(result: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Exit code 2, exactly one `hdr: error:` line on stderr holding every fragment."""
    assert result.returncode == 2, (result.returncode, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hdr: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    assert "Traceback" not in result.stdout + result.stderr
    return lines[0]


def test_version() -> None:
    from importlib.metadata import version

    result = hdr("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"hdr {version('hdr')}"


def test_every_help_shows_an_example() -> None:
    from typer.testing import CliRunner

    from hdr.cli import app

    for command in SUBCOMMANDS:
        result = CliRunner().invoke(app, [*command, "--help"])
        assert result.exit_code == 0, result.output
        assert "Example" in result.output, command
        assert f"hdr {' '.join(command)} " in result.output, command  # runs this subcommand


def test_parser_mistakes_are_one_line_with_a_suggestion(tmp_path: Path) -> None:
    assert_one_line(hdr("trian"), "No such command 'trian'", "Did you mean 'train'?")
    assert_one_line(hdr("index", "biuld"), "Did you mean 'build'?", "hdr index --help")
    assert_one_line(hdr("train", "--confg", str(TINY_CPU)), "--confg", "--config")
    assert_one_line(hdr("serve", "--index", str(tmp_path), "--port", "http"), "'--port'")
    assert_one_line(hdr("calibrate", "-c", str(TINY_CPU), "--taus", "a,b"), "--taus")


def test_unknown_config_keys_name_the_nearest_valid_key(tmp_path: Path) -> None:
    """The same KEY=VALUE syntax on every subcommand, the same answer to a typo."""
    assert_one_line(hdr("train", "-c", str(TINY_CPU), "stpes=3"), "stpes", "did you mean steps?")
    assert_one_line(
        hdr("sft", "-c", str(TINY_CPU), "grpo.lrr=1e-4"), "grpo.lrr", "did you mean grpo.lr?"
    )
    assert_one_line(
        hdr("rollout", "--model", str(tmp_path), "max_turn=3"), "did you mean max_turns?"
    )
    assert_one_line(
        hdr("eval", "--model", str(tmp_path), "--data", "wiki-vital", "max_question=3"),
        "did you mean max_questions?",
    )
    assert_one_line(hdr("serve", "--index", str(tmp_path), "max_topkk=3"), "max_topk?")
    assert_one_line(hdr("init-model", "--out", str(tmp_path / "m"), "hiden_size=8"), "hidden_size")
    assert_one_line(hdr("demo", "--data-dir", str(tmp_path), "step=3"), "mean train.steps?")
    # no close name: the section's valid keys are listed instead
    line = assert_one_line(hdr("train", "-c", str(TINY_CPU), "grpo.learning_rate=1"))
    assert "valid keys in grpo:" in line and " lr," in line
    # --set is the same override, kept for older scripts
    assert_one_line(hdr("train", "-c", str(TINY_CPU), "--set", "stpes=3"), "did you mean steps?")
    assert not (tmp_path / "m").exists()


def test_missing_and_malformed_configs(tmp_path: Path) -> None:
    assert_one_line(hdr("train", "-c", str(tmp_path / "no.yaml")), "config file not found")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: [1,\n")
    assert_one_line(hdr("train", "-c", str(bad)), "not valid YAML")
    assert_one_line(hdr("train"), "needs --config")


def test_a_model_directory_without_tokenizer_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    assert_one_line(
        hdr("rollout", "--model", str(tmp_path), "--max-questions", "1"), "no tokenizer in"
    )
    assert_one_line(
        hdr("eval", "--model", str(tmp_path), "--data", "wiki-vital", "--out", str(tmp_path / "e")),
        "no tokenizer in",
    )
    assert not (tmp_path / "e").exists()


ALL_COMMANDS = [[], ["index"], *SUBCOMMANDS, ["index", "convert"], ["index", "import"],
                ["plan-memory"], ["trl-train"], ["power"]]  # fmt: skip


def test_help_reads_at_any_width_without_hard_wraps_mid_sentence() -> None:
    """At 1,000 columns nothing needs wrapping: a prose line followed by one that goes on
    in lower case is a line break kept from the source (typer keeps them in epilogs and in a
    help's later paragraphs); `hdr.cli.reflow` joins them."""
    import os
    import re

    env = {**os.environ, "COLUMNS": "1000"}
    for command in ALL_COMMANDS:
        shown = subprocess.run([HDR, *command, "--help"], capture_output=True, text=True,
                               env=env, timeout=120, check=True).stdout  # fmt: skip
        lines = [line.strip() for line in shown.splitlines()]
        for line, following in itertools.pairwise(lines):
            if line and not line.startswith(("│", "╭", "╰")) and re.match(r"[a-z(]", following):
                assert following.startswith("hdr "), (command, line, following)


def test_ctrl_c_in_a_command_without_a_resume_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """typer answers Ctrl-C with Exit(130), which `standalone_mode=False` returns silently;
    `hdr.cli.main` says it stopped, and that this command has nothing to resume. Ctrl-C comes
    while `hdr rollout` waits for a retrieval server that accepts and never answers."""
    import shlex
    import signal
    import socket

    model = tmp_path / "policy"
    built = hdr("init-model", "--out", str(model), "hidden_size=16", "num_layers=1",
                "num_heads=2", "intermediate_size=32")  # fmt: skip
    assert built.returncode == 0, built.stderr
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        silent.settimeout(240)
        argv = ["rollout", "--model", str(model), "--backend", "scripted", "--max-questions", "2",
                "--server", f"http://127.0.0.1:{silent.getsockname()[1]}",
                "--out", str(tmp_path / "t.jsonl")]  # fmt: skip
        # SIGINT at its default, as in a terminal: a shell that starts the suite in the
        # background (`make test &`) hands its children SIGINT ignored, and Python then
        # installs no KeyboardInterrupt handler at all
        process = subprocess.Popen(
            [HDR, *argv], stderr=subprocess.PIPE, text=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )  # fmt: skip
        try:
            connection, _ = silent.accept()  # the command is running: it asks the server
            process.send_signal(signal.SIGINT)
            _, stderr = process.communicate(timeout=120)
            connection.close()
        finally:
            process.kill()
            process.wait()
    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr
    # the whole of stderr: no asyncio "Task was destroyed but it is pending" after it
    stopped = [line for line in stderr.splitlines() if line.strip()]
    assert stopped == [
        "hdr: stopped; this command keeps nothing to resume from; to start it again run:"
        f" {shlex.join(['hdr', *argv])}"
    ], stderr
