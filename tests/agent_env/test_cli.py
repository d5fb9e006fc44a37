"""`hdr rollout` end to end against the live server; trajectories JSONL and summary."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from hdr.cli import app


def test_hdr_rollout_writes_trajectories(tiny_policy_dir, retrieval_url, tmp_path) -> None:
    out = tmp_path / "traj.jsonl"
    common = ["rollout", "--model", str(tiny_policy_dir), "--data", "wiki-vital", "--split"]
    common += ["all", "--max-questions", "6", "--server", retrieval_url, "--prompt", "compact"]
    result = CliRunner().invoke(
        app,
        [
            *common,
            "--group-size",
            "2",
            "--backend",
            "scripted",
            "--out",
            str(out),
            "--set",
            "doc_words=6",
            "--set",
            "max_turns=1",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "exact match" in result.output and "env calls" in result.output
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 12 and len({line["group_id"] for line in lines}) == 6
    first = lines[0]
    assert len(first["response_ids"]) == len(first["loss_mask"]) == len(first["sampler_logprobs"])
    assert first["response_text"].startswith(f" {first['question']} </search>")

    hf = CliRunner().invoke(
        app,
        [
            *common,
            "--backend",
            "hf",
            "--out",
            str(tmp_path / "hf.jsonl"),
            "--set",
            "max_tokens_per_turn=8",
        ],
    )
    assert hf.exit_code == 0, hf.output
    assert len((tmp_path / "hf.jsonl").read_text().splitlines()) == 6


def test_the_old_option_names_are_refused_naming_the_new_ones(tiny_policy_dir, tmp_path) -> None:
    """`--task` and `--n` were renamed `--data` and `--max-questions` (the names `hdr eval`
    uses), `hdr demo --runs R` is `--out R/demo`: each old name is one line naming the new."""
    import subprocess
    import sys
    from pathlib import Path

    hdr = str(Path(sys.executable).with_name("hdr"))
    for command, old, new in [
        (["rollout", "--model", str(tiny_policy_dir), "--task", "wiki-vital"], "--task", "--data"),
        (["rollout", "--model", str(tiny_policy_dir), "--n", "3"], "--n", "--max-questions"),
        (["demo", "--runs", str(tmp_path)], "--runs", "--out (--runs R was --out R/demo)"),
    ]:
        done = subprocess.run([hdr, *command], capture_output=True, text=True, timeout=300)
        assert done.returncode == 2
        assert done.stderr.startswith(
            f"hdr: error: No such option: {old}. It was renamed: use {new}. (see `hdr"
        ), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    assert not any(tmp_path.iterdir())


def test_bad_override_is_one_line(tiny_policy_dir, retrieval_url) -> None:
    from core.errors import UserError

    result = CliRunner().invoke(
        app, ["rollout", "--model", str(tiny_policy_dir), "--set", "max_turn=3"]
    )
    assert result.exit_code != 0
    assert isinstance(result.exception, UserError) and "max_turn" in str(result.exception)
