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


def test_the_old_option_names_still_work_and_say_the_new_ones(
    tiny_policy_dir, retrieval_url, tmp_path
) -> None:
    """`--task` and `--n` were renamed `--data` and `--max-questions` (the names `hdr eval`
    uses); scripts that use the old ones still run, told the new names in one line each."""
    import subprocess
    import sys
    from pathlib import Path

    out = tmp_path / "old.jsonl"
    result = subprocess.run(
        [str(Path(sys.executable).with_name("hdr")), "rollout", "--model", str(tiny_policy_dir),
         "--task", "wiki-vital", "--n", "3", "--backend", "scripted", "--server", retrieval_url,
         "--prompt", "compact", "--out", str(out), "max_turns=1"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("hdr: note:")]
    assert notes == [
        "hdr: note: --task is now --data (the same in every subcommand); the old name still works",
        "hdr: note: --n is now --max-questions (the same in every subcommand); the old name still"
        " works",
    ]
    assert len(out.read_text().splitlines()) == 3
    both = subprocess.run(
        [str(Path(sys.executable).with_name("hdr")), "rollout", "--model", str(tiny_policy_dir),
         "--task", "a.jsonl", "--data", "b.jsonl"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    assert both.returncode == 2
    assert both.stderr.strip() == "hdr: error: --task is the old name of --data; give --data alone"


def test_bad_override_is_one_line(tiny_policy_dir, retrieval_url) -> None:
    from core.errors import UserError

    result = CliRunner().invoke(
        app, ["rollout", "--model", str(tiny_policy_dir), "--set", "max_turn=3"]
    )
    assert result.exit_code != 0
    assert isinstance(result.exception, UserError) and "max_turn" in str(result.exception)
