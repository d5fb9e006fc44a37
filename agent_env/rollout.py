"""The Search-R1 multi-turn rollout loop: b prompts x G responses, batched turn by turn.

Each turn every live trajectory generates until `</search>`, `</answer>`, EOS or the turn's
token limit; the first action of the turn's text is parsed; all searches of the turn go to
the retrieval server as ONE batched call; each observation
`\\n\\n<information>Doc 1(Title: ...) ...\\nDoc 2(...) ...</information>\\n\\n` is tokenized,
cut to `max_obs_tokens` and appended with loss mask 0. After `max_turns` search turns comes
one last turn in which a search is not executed, as in Search-R1.

What a trajectory keeps: the exact ids the model conditioned on (sampled ids as sampled,
environment text tokenized once; decoded text is never re-tokenized), mask 1 only on sampled
ids, the sampler's log-prob per sampled id, and the environment's own texts
(`observations`, one per maximal mask-0 run, so a test can decode the runs and compare).

Departures from Search-R1:
- A turn that hits the token limit inside an open `<search>` is closed by the environment;
  the closing `</search>` is environment text (mask 0), and the query is what was written.
- EOS without an action ends the trajectory (invalid, no answer); Search-R1 re-tokenizes
  decoded text, drops the EOS and carries on, which we cannot do without breaking exact ids.
- The answer is the policy's own parsed `<answer>` action, never text the environment
  appended (the correction message mentions the tags).
- `max_query_words` (off by default) sends only a search's first words to the retriever; the
  policy's tokens stay as written (mask 1), so the loss is on what it wrote.
- A retrieval failure marks the trajectory `failed` and ends it, instead of continuing with
  empty information; `on_failure` decides what the caller gets. Only the trajectories whose own
  query failed are marked; the rest of the turn's searches go on. A retrieval outage pauses the
  turn inside the client (see agent_env/retrieval_client.py) and loses nothing.
"""

from __future__ import annotations

import hashlib
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from pydantic import Field

from agent_env.data import QAExample
from agent_env.generation.base import Completion, Generator, SamplingParams
from agent_env.prompts import (
    SEARCH_CLOSE,
    SEARCH_OPEN,
    PromptConfig,
    format_documents,
    observation_parts,
    prompt_text,
)
from agent_env.retrieval_client import RetrievalClient, RetrievalFailed
from agent_env.rewards import exact_match, f1_score, format_reward
from core.config import StrictModel


class RolloutConfig(StrictModel):
    """Shape of one rollout: turns, token budgets, sampling, reward, failure handling."""

    prompt: PromptConfig = Field(default_factory=PromptConfig, description="Prompt text.")
    max_turns: int = Field(2, ge=0, description="Search turns; then one final turn, no search.")
    max_tokens_per_turn: int = Field(128, ge=1, description="Generation limit of one turn.")
    max_obs_tokens: int = Field(
        256, ge=8, description="Longest observation (information block incl. tags), in tokens."
    )
    max_response_tokens: int = Field(
        1024, ge=1, description="A trajectory stops once its response is this long."
    )
    doc_words: int | None = Field(
        None, ge=1, description="Keep only the first words of each document (tiny models: 6-8)."
    )
    max_query_words: int | None = Field(
        None,
        ge=1,
        description="Query budget: only the first N whitespace-separated words of each search"
        " reach the retriever (a keyword box, an API billed by query); the trajectory keeps"
        " every token the policy wrote. None: the whole query.",
    )
    temperature: float = Field(1.0, ge=0, description="Sampling temperature; 0 is greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    reward: Literal["exact_match", "f1"] = Field(
        "exact_match", description="Answer score against the golden answers."
    )
    format_weight: float = Field(
        0.0, ge=0, le=1, description="reward = (1-w) * answer score + w * format reward."
    )
    on_failure: Literal["keep", "drop_group", "raise"] = Field(
        "drop_group",
        description="Retrieval gave up: keep the marked trajectories, drop their groups"
        " (into RolloutResult.dropped), or raise RetrievalFailed.",
    )

    @property
    def longest_response(self) -> int:
        """The most tokens a response can reach: it is checked against `max_response_tokens`
        only after a turn, which may add a full turn and an observation."""
        return self.max_response_tokens + self.max_tokens_per_turn + self.max_obs_tokens


@dataclass
class Trajectory:
    """One sampled response; see docs/design.md, "Interfaces between the packages"."""

    group_id: str
    example: QAExample
    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    sampler_logprobs: list[float] = field(default_factory=list)
    answer: str | None = None
    reward: float = 0.0
    turns: int = 0
    searches: int = 0
    valid_actions: list[bool] = field(default_factory=list)
    failed: bool = False
    gen_time: float = 0.0
    retrieval_time: float = 0.0
    observations: list[str] = field(default_factory=list)
    truncated: bool = False

    def add_policy(self, ids: list[int], logprobs: list[float]) -> None:
        self.response_ids += ids
        self.loss_mask += [1] * len(ids)
        self.sampler_logprobs += logprobs

    def add_env(self, ids: list[int], text: str) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.sampler_logprobs += [0.0] * len(ids)
        self.observations.append(text)


@dataclass
class RolloutResult:
    groups: list[list[Trajectory]]
    env_calls: int  # batched HTTP requests to the retrieval server
    retrieval_calls: int  # turns that searched (one batched call each, maybe several requests)
    gen_time: float
    retrieval_time: float
    wall_time: float
    dropped: list[list[Trajectory]] = field(default_factory=list)


@dataclass(frozen=True)
class Action:
    kind: Literal["search", "answer", "invalid"]
    content: str = ""
    env_close: bool = False  # the environment must append `</search>`


_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def parse_action(turn_text: str, finished: bool) -> Action:
    """The first complete action of a turn's text (opening prefix included).

    An unfinished turn (token limit) that left a `<search>` open is a search the environment
    closes; anything else without a complete action is invalid.
    """
    match = _ACTION.search(turn_text)
    if match:
        kind, content = match.group(1), match.group(2).strip()
        if kind == "search" and not content:
            return Action("invalid")
        return Action(kind, content)
    open_at = turn_text.rfind(SEARCH_OPEN)
    if not finished and open_at >= 0:
        query = turn_text[open_at + len(SEARCH_OPEN) :].strip()
        if query and "<" not in query:
            return Action("search", query, env_close=True)
    return Action("invalid")


@dataclass
class _Live:
    traj: Trajectory
    prefix: str  # text in the context that opens the coming turn
    done: bool = False
    seed: int | None = None  # the trajectory's sampling seed (per-request seeding backends)

    @property
    def context(self) -> list[int]:
        return self.traj.prompt_ids + self.traj.response_ids


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def _decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def _encode_many(tokenizer, texts: list[str]) -> list[list[int]]:
    """One batched tokenizer call (the Rust tokenizer encodes the batch in parallel)."""
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def observations(tokenizer, results: list[list[str]], leads: list[str], config: RolloutConfig):
    """(ids, text) of each information block; documents are cut to fit max_obs_tokens.

    `results[i]` holds the documents' contents for query i; `leads[i]` is environment text
    that comes first (an environment-closed `</search>`, or ""). All texts of the turn are
    tokenized in one batched call; the constant head and tail once.
    """
    bodies = [format_documents(contents, config.doc_words) for contents in results]
    head, _, tail = observation_parts("", config.prompt)
    fixed_texts = sorted({lead + head for lead in leads} | {tail})
    fixed = dict(zip(fixed_texts, _encode_many(tokenizer, fixed_texts), strict=True))
    out = []
    for lead, body, body_ids in zip(leads, bodies, _encode_many(tokenizer, bodies), strict=True):
        head_ids, tail_ids = fixed[lead + head], fixed[tail]
        room = max(config.max_obs_tokens - len(head_ids) - len(tail_ids), 0)
        if len(body_ids) > room:
            body_ids = body_ids[:room]
            while body_ids and _decode(tokenizer, body_ids).endswith("\ufffd"):
                body_ids = body_ids[:-1]  # never end inside a multi-byte character
            body = _decode(tokenizer, body_ids)
        out.append((head_ids + body_ids + tail_ids, lead + head + body + tail))
    return out


def observation(tokenizer, contents: list[str], config: RolloutConfig, lead: str = ""):
    """(ids, text) of one information block (see `observations`)."""
    return observations(tokenizer, [contents], [lead], config)[0]


def _step_policy(live: _Live, completion: Completion, tokenizer, final: bool):
    """Append the sampled ids, parse the action; returns the Action.

    The completion says why it ended. On "eos" its last id is the sampled EOS: a policy token
    (kept, mask 1) that is left out of the parsed text. On "stop" the text may run past the
    stop string (`</search>\n\n` from one `>\n\n` token): the action is parsed from it as
    written. On "length" an open `<search>` is closed by the environment; a "length" with no
    token (the context already fills the engine's `max_model_len`) ends the trajectory as
    truncated.
    """
    traj = live.traj
    if completion.finish_reason == "length" and not completion.token_ids:
        live.done = traj.truncated = True  # the context fills the engine: nothing more fits
        return Action("invalid")
    traj.add_policy(completion.token_ids, completion.logprobs)
    traj.turns += 1
    ended_by_eos = completion.finish_reason == "eos"
    text = _decode(tokenizer, completion.token_ids[:-1] if ended_by_eos else completion.token_ids)
    action = parse_action(live.prefix + text, completion.finished)
    traj.valid_actions.append(action.kind != "invalid")
    live.prefix = ""
    if action.kind == "answer":
        traj.answer = action.content
        live.done = True
    elif action.kind == "search":
        live.done = final  # the last turn does not search
    else:
        live.done = final or ended_by_eos
    return action


def response_reward(
    answer: str | None, golden_answers: list[str], response_text: str, config: RolloutConfig
) -> float:
    """The rollout's reward: `config.reward` (exact match or F1) of the parsed answer, mixed
    with the format reward of the response (prefix included) by `config.format_weight`."""
    scorer = exact_match if config.reward == "exact_match" else f1_score
    score = scorer(answer, golden_answers)
    if config.format_weight == 0:
        return score
    return (1 - config.format_weight) * score + config.format_weight * format_reward(response_text)


def response_text(traj: Trajectory, tokenizer, config: RolloutConfig) -> str:
    """The response as the format reward reads it: the opening prefix and every token."""
    return config.prompt.response_prefix + _decode(tokenizer, traj.response_ids)


def _score(traj: Trajectory, tokenizer, config: RolloutConfig) -> float:
    text = response_text(traj, tokenizer, config) if config.format_weight else ""
    return response_reward(traj.answer, traj.example.golden_answers, text, config)


def turn_seed(seed: int, turn: int) -> int:
    """The sampling seed of one trajectory's turn, from the trajectory's seed."""
    return int(np.random.SeedSequence([seed, turn]).generate_state(1, np.uint32)[0])


def question_seeds(seed: int, examples, k: int) -> list[int]:
    """One sampling seed per question and sample (example-major, as `rollout_groups` takes
    them): a hash of (run seed, question id, sample index), the same at every step."""
    out = []
    for example in examples:
        for j in range(k):
            text = f"heldout|{seed}|{example.id}|{j}".encode()
            out.append(int.from_bytes(hashlib.sha256(text).digest()[:4], "little"))
    return out


def rollout_groups(
    generator: Generator,
    client: RetrievalClient,
    tokenizer,
    examples: list[QAExample],
    group_size: int,
    config: RolloutConfig,
    seeds: list[int] | None = None,
) -> RolloutResult:
    """Roll out `group_size` responses per example; returns groups in example order.

    `seeds` (one per trajectory, example-major) go to a backend that samples each request
    from its own seed (`Generator.per_request_seeds`), one per turn (`turn_seed`): a
    trajectory's tokens then do not depend on the other trajectories of the call."""
    if seeds is not None and len(seeds) != len(examples) * group_size:
        raise ValueError(f"{len(seeds)} seeds for {len(examples) * group_size} trajectories")
    wall_start = time.perf_counter()
    stats_before = (client.stats.requests, client.stats.calls)
    states: list[_Live] = []
    for example in examples:
        prompt_ids = _encode(tokenizer, prompt_text(config.prompt, example.question, tokenizer))
        group_id = f"{example.id}#{uuid.uuid4().hex[:12]}"
        for _ in range(group_size):
            traj = Trajectory(group_id=group_id, example=example, prompt_ids=list(prompt_ids))
            seed = None if seeds is None else seeds[len(states)]
            states.append(_Live(traj, prefix=config.prompt.response_prefix, seed=seed))
    gen_time = retrieval_time = 0.0
    params = SamplingParams(config.temperature, config.top_p, config.max_tokens_per_turn)
    for turn in range(config.max_turns + 1):
        live = [s for s in states if not s.done]
        if not live:
            break
        final = turn == config.max_turns
        start = time.perf_counter()
        contexts = [s.context for s in live]
        if seeds is None:
            completions = generator.generate(contexts, params)
        else:
            turn_seeds = [turn_seed(s.seed, turn) for s in live]
            completions = generator.generate(contexts, params, seeds=turn_seeds)
        elapsed = time.perf_counter() - start
        gen_time += elapsed
        searches: list[tuple[_Live, Action]] = []
        for s, completion in zip(live, completions, strict=True):
            s.traj.gen_time += elapsed
            action = _step_policy(s, completion, tokenizer, final)
            if action.kind == "search" and not s.done:
                searches.append((s, action))
            elif action.kind == "invalid" and not s.done:
                msg = config.prompt.invalid_action_message
                s.traj.add_env(_encode(tokenizer, msg), msg)
        if searches:
            retrieval_time += _search(searches, client, tokenizer, config)
        for s in live:
            if not s.done and len(s.traj.response_ids) >= config.max_response_tokens:
                s.done = s.traj.truncated = True
    for s in states:
        s.traj.reward = _score(s.traj, tokenizer, config)
    groups = [
        [s.traj for s in states[i : i + group_size]] for i in range(0, len(states), group_size)
    ]
    kept, dropped = groups, []
    if config.on_failure == "drop_group":
        kept, dropped = split_failed(groups)
    return RolloutResult(
        groups=kept,
        env_calls=client.stats.requests - stats_before[0],
        retrieval_calls=client.stats.calls - stats_before[1],
        gen_time=gen_time,
        retrieval_time=retrieval_time,
        wall_time=time.perf_counter() - wall_start,
        dropped=dropped,
    )


def split_failed(groups: list[list[Trajectory]]) -> tuple[list, list]:
    """(groups none of whose trajectories failed, the others), each in order."""
    failed = [any(t.failed for t in g) for g in groups]
    return (
        [g for g, bad in zip(groups, failed, strict=True) if not bad],
        [g for g, bad in zip(groups, failed, strict=True) if bad],
    )


def budget_query(query: str, max_words: int | None) -> str:
    """What reaches the retriever of a search the policy wrote: its first `max_words` words
    (`RolloutConfig.max_query_words`), or the query untouched when there is no budget."""
    if max_words is None:
        return query
    return " ".join(query.split()[:max_words])


def _search(searches, client: RetrievalClient, tokenizer, config: RolloutConfig) -> float:
    """One batched call for the turn's searches; appends observations. Returns its time."""
    start = time.perf_counter()
    queries = [budget_query(action.content, config.max_query_words) for _, action in searches]
    results = client.search_each(queries)
    failed = sum(docs is None for docs in results)
    if failed and config.on_failure == "raise":
        raise RetrievalFailed(f"{failed} of {len(results)} searches failed")
    elapsed = time.perf_counter() - start
    for (s, _), docs in zip(searches, results, strict=True):
        s.traj.retrieval_time += elapsed
        if docs is None:  # only the trajectories whose own query failed
            s.traj.failed = s.done = True
    searched = [pair for pair in zip(searches, results, strict=True) if pair[1] is not None]
    if not searched:
        return elapsed
    leads = [SEARCH_CLOSE if action.env_close else "" for (_, action), _ in searched]
    contents = [[d.contents for d in docs] for _, docs in searched]
    blocks = observations(tokenizer, contents, leads, config)
    for ((s, _), _), (ids, text) in zip(searched, blocks, strict=True):
        s.traj.add_env(ids, text)
        s.traj.searches += 1
        s.prefix = config.prompt.observation_suffix
    return elapsed


def trajectory_record(traj: Trajectory, tokenizer) -> dict:
    """One JSON-ready line per trajectory: ids, mask, log-probs, outcome, text for reading."""
    return {
        "group_id": traj.group_id,
        "example_id": traj.example.id,
        "question": traj.example.question,
        "golden_answers": traj.example.golden_answers,
        "answer": traj.answer,
        "reward": traj.reward,
        "turns": traj.turns,
        "searches": traj.searches,
        "valid_actions": traj.valid_actions,
        "failed": traj.failed,
        "truncated": traj.truncated,
        "gen_time": traj.gen_time,
        "retrieval_time": traj.retrieval_time,
        "response_text": _decode(tokenizer, traj.response_ids),
        "prompt_ids": traj.prompt_ids,
        "response_ids": traj.response_ids,
        "loss_mask": traj.loss_mask,
        "sampler_logprobs": traj.sampler_logprobs,
    }


def summarize(trajectories: list[Trajectory]) -> dict[str, float]:
    """Means over trajectories: exact match, reward, turns, searches, valid actions, failures."""
    n = max(len(trajectories), 1)
    actions = [v for t in trajectories for v in t.valid_actions]
    return {
        "trajectories": len(trajectories),
        "exact_match": sum(exact_match(t.answer, t.example.golden_answers) for t in trajectories)
        / n,
        "reward": sum(t.reward for t in trajectories) / n,
        "turns": sum(t.turns for t in trajectories) / n,
        "searches": sum(t.searches for t in trajectories) / n,
        "valid_action_rate": sum(actions) / max(len(actions), 1),
        "answered": sum(t.answer is not None for t in trajectories) / n,
        "failed": sum(t.failed for t in trajectories),
        "response_tokens": sum(len(t.response_ids) for t in trajectories) / n,
    }
