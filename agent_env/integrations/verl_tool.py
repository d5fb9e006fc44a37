"""hdr's search tool for veRL 0.8 and later (written and tested against veRL 0.9.1).

veRL 0.8 dropped its built-in `SearchTool`; this `BaseTool` subclass takes its place, with the
same face to the model, so Search-R1 recipes and prompts made for the old tool keep working:

- the tool is named `search` and takes `query_list`, a list of queries (the default schema
  below; a `tool_schema` in the YAML replaces it);
- its answer is the old tool's text: JSON `{"result": ...}` whose value holds, per query, the
  hits as `Doc n (Title: <first line of contents>)` and the rest of the passage, hits apart by a
  blank line, queries apart by `\\n---\\n`; a failed call answers `{"result": "Search error:
  ..."}`, a call without queries the old tool's `Error: 'query_list' ...` line;
- its metrics are the old tool's: `query_count`, `status`, `total_results`,
  `api_request_error`.

The HTTP side is hdr's own retrieval client (`agent_env.retrieval_client`): one batched
`POST /retrieve` per call (`{"queries", "topk", "return_scores": true}`, Search-R1's API, so
any Search-R1 retrieval server works too), a deadline per attempt, retries with backoff on
connection errors, timeouts, 429 and 5xx that wait at least the server's `Retry-After`, the
bearer token from `token_env`, failover across several URLs, and a grace period in which an
unreachable server (a restart) pauses the call instead of failing it. The tool checks at
construction that a server answers, so a wrong URL fails the job at start in one line.

In the tool YAML (`actor_rollout_ref.rollout.multi_turn.tool_config_path`):

    tools:
      - class_name: agent_env.integrations.verl_tool.HdrSearchTool
        config: {type: native, retrieval_service_url: http://127.0.0.1:8000/retrieve}

`configs/verl/search_tool.yaml` is the full file; docs/integrations.md the whole recipe.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Literal

from pydantic import Field, model_validator
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from agent_env.retrieval_client import RetrievalConfig, connect
from core.config import build_config
from core.errors import UserError
from retrieval_server.api import Document

log = logging.getLogger(__name__)

# The old tool's schema (veRL's Search-R1 example): what existing prompts and chat templates name.
DEFAULT_SCHEMA = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Searches the web for relevant information based on the given query.",
        "parameters": {
            "type": "object",
            "properties": {
                "query_list": {
                    "type": "array",
                    "description": "A list of fully-formed semantic queries. The tool will "
                    "return search results for each query.",
                }
            },
            "required": ["query_list"],
        },
    },
}
NO_QUERIES = "Error: 'query_list' is missing, empty, or not a list in parameters."
# veRL's old tool keys and the key of this tool that does their job
OLD_KEYS = {
    "retrieval_service_url": "urls",
    "timeout": "timeout_s",
    "num_workers": "max_connections",
}
REFUSED_KEYS = {
    "rate_limit": "veRL's old job-wide Ray token bucket is gone; bound the calls in flight per "
    "worker with max_connections",
    "enable_global_rate_limit": "veRL's old job-wide Ray token bucket is gone; bound the calls"
    " in flight per worker with max_connections",
}


class HdrSearchToolConfig(RetrievalConfig):
    """The `config:` block of the tool YAML: hdr's retrieval client settings (each documented
    in `RetrievalConfig`), veRL's `type`, and veRL's old key names read as theirs."""

    type: Literal["native"] = Field(
        "native", description="veRL's tool type; 0.9.1 builds only `native` tools from YAML."
    )
    max_connections: int = Field(
        64, ge=1, description="Searches in flight at once from one veRL agent-loop worker."
    )

    @model_validator(mode="before")
    @classmethod
    def _old_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for key, why in REFUSED_KEYS.items():
            if key in data:
                raise ValueError(f"{key}: {why}")
        for old, new in OLD_KEYS.items():
            if old in data:
                if new in data:
                    raise ValueError(f"{old} and {new} say the same thing: keep one")
                data[new] = data.pop(old)
        return data

    def client_config(self) -> RetrievalConfig:
        return RetrievalConfig(**self.model_dump(exclude={"type"}))


class HdrSearchTool(BaseTool):
    """veRL's `BaseTool` for Search-R1 retrieval through `hdr serve` (module docstring)."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None) -> None:
        self.settings = build_config(HdrSearchToolConfig, dict(config))
        super().__init__(config, tool_schema)
        self.client = connect(self.settings.client_config())

    def get_openai_tool_schema(self) -> OpenAIFunctionToolSchema:
        """The YAML's `tool_schema`, else the old tool's (BaseTool asks before it has one)."""
        return getattr(self, "tool_schema", None) or OpenAIFunctionToolSchema.model_validate(
            DEFAULT_SCHEMA
        )

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        queries = parameters.get("query_list")
        if not queries or not isinstance(queries, list):
            return ToolResponse(text=answer(NO_QUERIES)), 0.0, {}
        queries = [str(query) for query in queries]
        metrics: dict[str, Any] = {
            "query_count": len(queries),
            "status": "success",
            "total_results": 0,
            "api_request_error": None,
        }
        try:
            results = await self.client.search_each_from_loop(queries)
        except UserError as err:  # the server refused our request, or stayed away too long
            log.warning("hdr search tool: %s", err)
            metrics.update(status="api_error", api_request_error=str(err))
            return ToolResponse(text=answer(f"Search error: {err}")), 0.0, metrics
        failed = sum(hits is None for hits in results)
        if failed:
            error = f"{failed} of {len(queries)} queries could not be searched"
            metrics.update(status="api_error", api_request_error=error)
        metrics["total_results"] = sum(len(hits) for hits in results if hits is not None)
        if not metrics["total_results"] and not failed:
            metrics["status"] = "no_results"
            return ToolResponse(text=answer("No search results found.")), 0.0, metrics
        return ToolResponse(text=answer(results_text(results))), 0.0, metrics

    def close(self) -> None:
        """Close the connection pool (veRL never does; the worker's exit ends it otherwise)."""
        self.client.close()


def answer(text: str) -> str:
    """The tool's answer as the old tool wrote it: `{"result": text}`, non-ASCII kept."""
    return json.dumps({"result": text}, ensure_ascii=False)


def results_text(results: list[list[Document] | None]) -> str:
    """Each query's hits as the old tool showed them; queries apart by `\\n---\\n`."""
    return "\n---\n".join(
        "Search error: this query could not be searched" if hits is None else passages(hits)
        for hits in results
    )


def passages(hits: list[Document]) -> str:
    """`Doc n (Title: <first line>)` then the passage's other lines, hits apart by a blank line."""
    shown = []
    for rank, hit in enumerate(hits, start=1):
        title, _, text = hit.contents.partition("\n")
        shown.append(f"Doc {rank} (Title: {title})\n{text}")
    return "\n\n".join(shown).strip()
