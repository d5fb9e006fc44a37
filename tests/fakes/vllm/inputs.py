"""vllm.inputs.TokensPrompt, as vLLM 0.31 defines it: a dict with `prompt_token_ids`."""

from typing import TypedDict


class TokensPrompt(TypedDict):
    prompt_token_ids: list[int]
