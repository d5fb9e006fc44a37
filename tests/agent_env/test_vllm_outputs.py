"""The vllm backend's parsing and settings, without a GPU: pure functions over the shapes of
vLLM's outputs (`CompletionOutput`: token_ids, logprobs as one {id: Logprob} per token,
finish_reason, stop_reason), recorded here as plain objects."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from agent_env.generation import GenerationConfig, SamplingParams
from agent_env.generation.vllm import check_vllm_version, completion_from_output, sampling_kwargs
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
    """vLLM 0.11's V1 `check_stop` tested the token limit before the stop ids, so an EOS that
    was the turn's last allowed token came back as "length" (0.33 tests the ids first; hdr
    accepts both shapes)."""
    at_limit = completion_from_output(output([12095, 9217, eos_id], "length", None), EOS)
    assert (at_limit.finish_reason, at_limit.token_ids[-1]) == ("eos", eos_id)
    assert at_limit.finished and at_limit.logprobs == pytest.approx([-0.1, -0.2, -0.3])
    # the same tokens as 0.33 reports them
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
    check_vllm_version("0.33.0")
    check_vllm_version("0.33.1")
    for old_or_new in ("0.11.2", "0.32.0", "0.34.0"):
        with pytest.raises(UserError, match=r"written for vllm"):
            check_vllm_version(old_or_new)
    with pytest.raises(UserError, match="tensor_parallel_size > 1 is not supported"):
        build_config(GenerationConfig, {"backend": "vllm", "tensor_parallel_size": 2})
    assert GenerationConfig().seed is None
