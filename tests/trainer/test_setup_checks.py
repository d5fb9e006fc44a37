"""`hdr train` checks what a user can get wrong before it loads any model: the training data
(a missing parquet), the retrieval server, and whether that server serves the index the config
expects (`retrieval.expect_encoder` / `expect_documents` against its /health). A spy on
transformers' `from_pretrained` shows that no model was loaded when each check fails."""

from __future__ import annotations

import re
import subprocess
import sys

import httpx
import pytest
from conftest import TINY_CPU, tiny_overrides

from core.config import load_config
from core.errors import UserError
from trainer.config import TrainConfig
from trainer.run import setup_run


@pytest.fixture
def loaded(monkeypatch) -> list[str]:
    """Every model directory transformers is asked to load, in order (it still loads)."""
    from transformers import AutoModelForCausalLM

    calls: list[str] = []
    real = AutoModelForCausalLM.from_pretrained

    def spy(path, *args, **kwargs):
        calls.append(str(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", spy)
    return calls


def config(url, model, qa, out, *extra) -> TrainConfig:
    return load_config(TrainConfig, TINY_CPU, tiny_overrides(url, model, qa, out, *extra))


def test_a_missing_data_file_fails_before_the_server_and_any_model(loaded, tiny_policy, tmp_path):
    missing = tmp_path / "searchr1" / "train.parquet"
    nowhere = "http://127.0.0.1:9"  # no server: the data must fail first
    cfg = config(nowhere, tiny_policy, missing, tmp_path / "run")
    with pytest.raises(UserError, match=f"^dataset file not found: {re.escape(str(missing))}$"):
        setup_run(cfg)
    assert loaded == []
    assert not (tmp_path / "run").exists()  # nothing written either


def test_no_server_and_a_server_with_another_index_fail_before_any_model(
    loaded, tiny_policy, small_qa, retrieval_url, tmp_path
):
    with pytest.raises(UserError, match=r"no retrieval server answers at http://127\.0\.0\.1:9"):
        setup_run(config("http://127.0.0.1:9", tiny_policy, small_qa, tmp_path / "a"))
    health = httpx.get(retrieval_url + "/health", timeout=10).json()
    served = f"encoder {health['encoder']}, documents {health['documents']}"
    wrong = config(
        retrieval_url, tiny_policy, small_qa, tmp_path / "b",
        "retrieval.expect_encoder=e5-base-v2", "retrieval.expect_documents=21015324",
    )  # fmt: skip
    with pytest.raises(UserError) as refused:
        setup_run(wrong)
    assert str(refused.value) == (
        f"retrieval server {retrieval_url} serves {served}, but the config expects encoder"
        " e5-base-v2, documents 21015324 (retrieval.expect_encoder / expect_documents): serve"
        " the index the config is for, or change those settings"
    )
    assert loaded == []
    right = config(
        retrieval_url, tiny_policy, small_qa, tmp_path / "c",
        f"retrieval.expect_encoder=/models/{health['encoder']}",  # a path: its last part counts
        f"retrieval.expect_documents={health['documents']}", "steps=1",
    )  # fmt: skip
    run, _ = setup_run(right)
    run.client.close()
    run.logs.close()
    assert loaded == [str(tiny_policy)]  # the spy sees a load when there is one


def test_the_cli_says_a_missing_data_file_in_one_line(tiny_policy, tmp_path):
    missing = tmp_path / "train.parquet"
    args = tiny_overrides("http://127.0.0.1:9", tiny_policy, missing, tmp_path / "run")
    done = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "train", "--config", str(TINY_CPU), *args],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [f"hdr: error: dataset file not found: {missing}"]
