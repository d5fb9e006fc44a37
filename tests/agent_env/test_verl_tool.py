"""hdr's search tool inside veRL 0.9.1 (`agent_env/integrations/verl_tool.py`), on the CPU.

The tool is built from `configs/verl/search_tool.yaml` by veRL's own tool registry and called
through veRL's own tool-calling code (its `AgentLoopWorker` running the `tool_agent` loop, or
`ToolAgentLoop._call_tool` as veRL's `test_call_tool_on_cpu` calls it) against a real `hdr
serve` process on 127.0.0.1 that wants a bearer token. Only the LLM is scripted
(tests/real_verl.py says why).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from real_verl import NEEDS_VERL, ScriptedLLM, call_through_verl, compose_recipe, write_tool_yaml
from servers import free_port, serve_process

pytestmark = NEEDS_VERL

TOKEN = "verl-tool-test-token"
QUERIES = ["Pavia Cathedral", "Haiku"]  # a wiki-18 passage and a vital article of the index


def old_tool_text(result: list[list[dict]]) -> str:
    """What veRL's removed SearchTool answered for a /retrieve `result` (its
    search_r1_like_utils, 0.4-0.7): per hit `Doc n (Title: <first line>)` and the other lines,
    then a blank line; queries apart by `\\n---\\n`; the whole as JSON `{"result": ...}`."""
    blocks = []
    for hits in result:
        block = ""
        for rank, hit in enumerate(hits, start=1):
            lines = hit["document"]["contents"].split("\n")
            block += f"Doc {rank} (Title: {lines[0]})\n" + "\n".join(lines[1:]) + "\n\n"
        blocks.append(block.strip())
    return json.dumps({"result": "\n---\n".join(blocks)}, ensure_ascii=False)


@pytest.fixture(scope="module")
def served(small_index: Path):
    with serve_process(small_index, env={"HDR_API_TOKEN": TOKEN}) as server:
        yield server
    assert "Traceback" not in server.output, server.output[-3000:]


@pytest.fixture
def with_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HDR_API_TOKEN", TOKEN)


def load_tools(yaml_path: Path) -> list:
    from verl.tools.tool_registry import load_all_tools

    return load_all_tools(tool_config_path=str(yaml_path), function_tool_path=None)


def test_verls_registry_builds_hdrs_tool_from_the_yaml_with_the_old_tools_face(
    served, with_token, tmp_path: Path
) -> None:
    from agent_env.integrations.verl_tool import HdrSearchTool

    (tool,) = load_tools(write_tool_yaml(tmp_path / "tool.yaml", served.url))
    assert isinstance(tool, HdrSearchTool) and tool.name == "search"
    schema = tool.get_openai_tool_schema().model_dump(exclude_none=True)
    assert schema["function"]["parameters"]["required"] == ["query_list"]
    assert schema["function"]["parameters"]["properties"]["query_list"]["type"] == "array"
    assert tool.settings.urls == [served.url] and tool.settings.topk == 3
    tool.close()


def test_a_rollout_of_verls_agent_loop_reads_the_passages_as_the_old_tool_wrote_them(
    served, with_token, tmp_path: Path, qwen_policy_dir: Path, qwen_tokenizer
) -> None:
    """veRL's AgentLoopWorker, built from the recipe, runs one trajectory: the scripted model
    calls `search`, veRL parses the Hermes tool call, hdr's tool searches, veRL puts the answer
    into the trajectory as a tool message (response_mask 0) and the model answers."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto

    call = {"name": "search", "arguments": {"query_list": QUERIES}}
    turns = [f"<tool_call>{json.dumps(call)}</tool_call><|im_end|>", "<answer>Amadeo</answer>"]
    llm = ScriptedLLM(qwen_tokenizer, turns)
    tool_yaml = write_tool_yaml(tmp_path / "tool.yaml", served.url)
    config = compose_recipe(
        f"actor_rollout_ref.model.path={qwen_policy_dir}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={tool_yaml}",
        "actor_rollout_ref.rollout.multi_turn.max_tool_response_length=100000",
        "data.max_prompt_length=256",
        "data.max_response_length=4096",
    )
    worker = AgentLoopWorker(config, llm_client=llm)
    batch = DataProto.from_dict(
        non_tensors={
            "raw_prompt": np.array([[{"role": "user", "content": "Who built Pavia Cathedral?"}]]),
            "tools_kwargs": np.array([{}]),
            "data_source": np.array(["searchR1_nq"]),
            "extra_info": np.array([{}]),
        }
    )
    out = asyncio.run(worker.generate_sequences(batch))

    response = out.batch["responses"][0]
    mask = out.batch["response_mask"][0].bool()
    valid = out.batch["attention_mask"][0, out.batch["prompts"].shape[1] :].bool()
    model_text = qwen_tokenizer.decode(response[valid & mask])
    tool_text = qwen_tokenizer.decode(response[valid & ~mask])
    assert model_text == turns[0] + turns[1], model_text  # the model's tokens, trained on
    assert len(llm.prompts) == 2 and not llm.turns
    # veRL rendered the tool's answer as a tool message between the two assistant turns
    body = re.fullmatch(
        r"\n<\|im_start\|>tool\n(.*)<\|im_end\|>\n<\|im_start\|>assistant\n", tool_text, re.S
    )
    assert body, tool_text
    expected = httpx.post(
        f"{served.url}/retrieve",
        json={"queries": QUERIES, "topk": 3, "return_scores": True},
        headers={"Authorization": f"Bearer {TOKEN}"},
    ).json()["result"]
    assert body[1] == old_tool_text(expected)
    per_query = json.loads(body[1])["result"].split("\n---\n")
    assert [block.split("\n", 1)[0] for block in per_query] == [
        'Doc 1 (Title: "Pavia Cathedral")',
        'Doc 1 (Title: "Haiku")',
    ]
    ranks = [re.findall(r"^Doc (\d) \(Title: ", block, re.M) for block in per_query]
    assert ranks == [["1", "2", "3"]] * 2, per_query
    assert "Amadeo" in per_query[0]  # the wiki-18 passage's text, not only its title
    # veRL counts the prompt, the two assistant turns and the tool turn
    assert out.non_tensor_batch["__num_turns__"][0] == 4


def test_without_the_token_the_model_reads_the_servers_refusal(
    served, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("HDR_API_TOKEN", raising=False)
    (tool,) = load_tools(write_tool_yaml(tmp_path / "tool.yaml", served.url))
    response, reward, metrics = asyncio.run(
        call_through_verl(tool, json.dumps({"query_list": QUERIES}))
    )
    answer = json.loads(response.text)["result"]
    assert answer.startswith("Search error: retrieval server refused the request: HTTP 401"), answer
    assert reward == 0.0 and metrics["status"] == "api_error"
    tool.close()


def test_a_call_without_queries_answers_the_old_tools_error(
    served, with_token, tmp_path: Path
) -> None:
    (tool,) = load_tools(write_tool_yaml(tmp_path / "tool.yaml", served.url))
    for arguments in ({"query_list": []}, {"query": "Haiku"}, {"query_list": "Haiku"}):
        response, _, _ = asyncio.run(call_through_verl(tool, json.dumps(arguments)))
        assert json.loads(response.text) == {
            "result": "Error: 'query_list' is missing, empty, or not a list in parameters."
        }
    tool.close()


def test_a_stopped_server_gives_the_model_a_search_error(
    small_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A call before the stop finds its passages; after it, the retries and the outage grace
    (1 s here) run out and the model reads one `Search error` line naming the URL."""
    monkeypatch.delenv("HDR_API_TOKEN", raising=False)
    with serve_process(small_index) as server:
        settings = {"outage_grace_s": 1, "max_retries": 2, "backoff_s": 0.05}
        (tool,) = load_tools(write_tool_yaml(tmp_path / "tool.yaml", server.url, **settings))
        before, _, _ = asyncio.run(call_through_verl(tool, json.dumps({"query_list": ["Haiku"]})))
        server.stop()
        response, reward, metrics = asyncio.run(
            call_through_verl(tool, json.dumps({"query_list": ["Haiku"]}))
        )
    assert json.loads(before.text)["result"].startswith('Doc 1 (Title: "Haiku")')
    answer = json.loads(response.text)["result"]
    assert answer.startswith("Search error: no retrieval server answered for 1 s"), answer
    assert server.url in answer
    assert (reward, metrics["status"], metrics["total_results"]) == (0.0, "api_error", 0)
    tool.close()


def test_calls_refused_with_503_wait_out_retry_after_and_all_get_their_passages(
    small_index: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request at a time (300 ms each), four calls at once through veRL's `_call_tool`:
    three are refused 503 with Retry-After: 2 at first. The tool's own backoff is 50 ms, so
    only the server's Retry-After can make the calls last 2 s; every call gets its passages."""
    monkeypatch.delenv("HDR_API_TOKEN", raising=False)
    busy = ["max_concurrent_requests=1", "emulated_cost.request_latency_ms=300", "retry_after_s=2"]
    with serve_process(small_index, *busy) as server:
        settings = {"backoff_s": 0.05, "backoff_max_s": 5.0}
        (tool,) = load_tools(write_tool_yaml(tmp_path / "tool.yaml", server.url, **settings))
        queries = [[f"{title} {i}" for title in QUERIES] for i in range(4)]

        async def all_at_once():
            calls = [call_through_verl(tool, json.dumps({"query_list": q})) for q in queries]
            return await asyncio.gather(*calls)

        started = time.monotonic()
        answers = asyncio.run(all_at_once())
        elapsed = time.monotonic() - started
        metrics_text = httpx.get(f"{server.url}/metrics").text
        tool.close()
    refused = re.search(
        r'^hdr_retrieval_rejected_total\{reason="concurrency"\} (\S+)$', metrics_text, re.M
    )
    assert refused and float(refused[1]) >= 1, metrics_text
    assert elapsed >= 2.0, elapsed  # a refused call waited out Retry-After before retrying
    for (response, _, metrics), asked in zip(answers, queries, strict=True):
        assert metrics["status"] == "success" and metrics["total_results"] == 6, metrics
        per_query = json.loads(response.text)["result"].split("\n---\n")
        assert len(per_query) == len(asked) and per_query[1].startswith('Doc 1 (Title: "Haiku")')


def test_a_wrong_url_or_an_old_setting_fails_at_start_in_one_line(tmp_path: Path) -> None:
    from core.errors import UserError

    closed = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(UserError, match=rf"no retrieval server answers at {re.escape(closed)}"):
        load_tools(write_tool_yaml(tmp_path / "a.yaml", closed))
    with pytest.raises(UserError, match=r"rate_limit: .* max_connections"):
        load_tools(write_tool_yaml(tmp_path / "b.yaml", closed, rate_limit=120))
    with pytest.raises(UserError, match="topk"):
        load_tools(write_tool_yaml(tmp_path / "c.yaml", closed, topk=0))
