"""veRL in tests (the tests marked `verl`): where it runs, and veRL's own code driven on the CPU.

`make test` runs these tests in a third environment, `.venv-verl` (`make setup-verl`: veRL
0.9.1 with its core extra, hdr installed beside it, the same torch); the main environment
deselects them (pyproject's addopts). Where veRL is missing they skip with one line.

What runs is veRL's, as its own `_on_cpu` tests drive it: its tool registry builds the tools
from the YAML, its config loader (Hydra) composes the recipe, its `AgentLoopWorker` runs the
`tool_agent` loop (prompt building, the Hermes tool-call parser, `_call_tool`, the tool message
tokenized back into the trajectory, padding into a `DataProto`). Only the LLM server is a
stand-in: `ScriptedLLM` answers veRL's `generate` with fixed turns, since veRL's engines (vLLM,
SGLang) serve from a GPU.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
RECIPE = REPO / "configs" / "verl" / "search-r1-qwen2.5-3b.yaml"
TOOL_YAML = REPO / "configs" / "verl" / "search_tool.yaml"


def verl_missing() -> str | None:
    """Why veRL cannot run here (one line), or None."""
    if importlib.util.find_spec("verl") is None:
        return (
            "veRL is not installed in this environment: `make test` runs the tests marked"
            " verl in .venv-verl (make setup-verl)"
        )
    return None


NEEDS_VERL = [
    pytest.mark.verl,
    pytest.mark.skipif(verl_missing() is not None, reason=verl_missing() or ""),
]


def compose_recipe(*overrides: str, name: str = RECIPE.stem):
    """The recipe as `python -m verl.trainer.main_ppo --config-path configs/verl --config-name
    NAME overrides...` composes it (Hydra, veRL's config loader)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(RECIPE.parent), version_base=None):
        return compose(config_name=name, overrides=list(overrides))


class ScriptedLLM:
    """veRL's LLM server client (`generate(request_id, prompt_ids=..., sampling_params=...)`)
    answering each call with the next of `turns`, tokenized; it keeps every prompt it saw."""

    def __init__(self, tokenizer: Any, turns: list[str]) -> None:
        self.tokenizer = tokenizer
        self.turns = list(turns)
        self.prompts: list[list[int]] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], **kwargs: Any):
        from verl.workers.rollout.replica import TokenOutput

        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer.encode(self.turns.pop(0), add_special_tokens=False)
        return TokenOutput(token_ids=ids, stop_reason="completed")


async def call_through_verl(tool: Any, arguments: str, max_response_chars: int = 100_000):
    """One tool call through veRL's `ToolAgentLoop._call_tool` (create, execute, release, the
    response cut), bound to a stand-in loop object as veRL's own `test_call_tool_on_cpu` does."""
    from unittest.mock import MagicMock

    from verl.experimental.agent_loop.tool_agent_loop import AgentData, ToolAgentLoop
    from verl.experimental.agent_loop.tool_parser import FunctionCall

    loop = MagicMock(spec=ToolAgentLoop)
    loop.tools = {tool.name: tool}
    loop.max_tool_response_length = max_response_chars
    loop.tool_response_truncate_side = "right"
    call = ToolAgentLoop._call_tool.__get__(loop, ToolAgentLoop)
    data = AgentData([], None, None, None, None, {}, "request", {})
    return await call(FunctionCall(name=tool.name, arguments=arguments), {}, data)


def write_tool_yaml(path: Path, url: str, **config: Any) -> Path:
    """configs/verl/search_tool.yaml with `url` as the retrieval URL and `config` on top."""
    import yaml

    data = yaml.safe_load(TOOL_YAML.read_text())
    data["tools"][0]["config"].update(retrieval_service_url=f"{url}/retrieve", **config)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path
