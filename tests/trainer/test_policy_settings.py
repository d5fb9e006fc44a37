"""The prompt and rollout settings travel with a saved model (`hdr_rollout.yaml`), and
`hdr eval` / `hdr rollout` use them by default; an evaluation that never searches warns."""

import json
import os
import subprocess
import sys

import yaml
from conftest import TINY_CPU
from transformers import AutoTokenizer

from agent_env.policy_settings import SETTINGS_FILE

HDR = [sys.executable, "-m", "hdr.cli"]


def env(**extra: str) -> dict:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **extra}


def test_sft_output_carries_its_prompt(sft_policy):
    saved = yaml.safe_load((sft_policy / SETTINGS_FILE).read_text())
    trained = yaml.safe_load(TINY_CPU.read_text())
    for key, value in trained["rollout"]["prompt"].items():
        assert saved["rollout"]["prompt"][key] == value
    assert saved["rollout"]["max_turns"] == trained["rollout"]["max_turns"]
    assert saved["retrieval"] == {"retriever": "bm25", "topk": 3}


def test_eval_uses_the_saved_prompt_and_warns_when_nothing_is_searched(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    common = ["eval", "--model", str(sft_policy), "--data", str(small_qa), "--k", "2"]
    common += ["--server", retrieval_url, "max_questions=4", "progress=false"]
    good = subprocess.run(
        [*HDR, *common, "--out", str(tmp_path / "a")], env=env(), capture_output=True, text=True
    )
    assert good.returncode == 0, good.stderr
    assert "warning" not in good.stderr
    report = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert report["env_calls"] > 0  # the saved prompt opens with <search>: the policy searches

    # no search turn at all: the numbers are still written, and one line says why to worry
    none = subprocess.run(
        [*HDR, *common, "rollout.max_turns=0", "--out", str(tmp_path / "b")],
        env=env(),
        capture_output=True,
        text=True,
    )
    assert none.returncode == 0, none.stderr
    warnings = [x for x in none.stderr.splitlines() if x.startswith("hdr: warning:")]
    assert len(warnings) == 1 and "made no retrieval calls" in warnings[0]


def test_rollout_uses_the_saved_settings_and_prints_progress_lines(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    out = tmp_path / "traj.jsonl"
    args = [
        "--model",
        str(sft_policy),
        "--data",
        str(small_qa),
        "--max-questions",
        "4",
        "--batch",
        "2",
    ]
    result = subprocess.run(
        [*HDR, "rollout", *args, "--server", retrieval_url, "--out", str(out)],
        env=env(HDR_PROGRESS_INTERVAL="0"),
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert f"using the rollout settings saved with the model ({SETTINGS_FILE})" in result.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    # the saved prompt (tiny-cpu's), not the default instruction: the context ends in <search>
    tokenizer = AutoTokenizer.from_pretrained(str(sft_policy))
    assert len(rows) == 4
    for row in rows:
        prompt = tokenizer.decode(row["prompt_ids"])
        assert f"Question: {row['question']}" in prompt and prompt.endswith("<search>")
    # not a terminal: plain progress lines, no carriage-return frames
    assert "\r" not in result.stderr
    assert "rollout: 0/4" in result.stderr and "rollout: 4/4 (100%)" in result.stderr
