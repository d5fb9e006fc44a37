"""The rollout loop against a real server: exact ids, masks, observations, log-probs, failures."""

from __future__ import annotations

import httpx
import pytest
import torch
from trajectories import masked_runs

from agent_env.generation import Completion, SamplingParams
from agent_env.generation.hf import HFGenerator
from agent_env.generation.scripted import ScriptedGenerator
from agent_env.prompts import PromptConfig
from agent_env.retrieval_client import (
    RetrievalClient,
    RetrievalConfig,
    RetrievalFailed,
    RetrievalUnavailable,
)
from agent_env.rewards import exact_match
from agent_env.rollout import RolloutConfig, observation, parse_action, rollout_groups

COMPACT = PromptConfig.preset("compact")


def expected_block(raw_docs: list[dict], doc_words: int | None, suffix: str) -> str:
    """The information block built from the server's raw JSON, following docs/design.md."""
    lines = []
    for k, doc in enumerate(raw_docs, start=1):
        title, text = doc["contents"].split("\n", 1)
        words = text.split()[:doc_words] if doc_words else text.split()
        lines.append(f"Doc {k}(Title: {title}) {' '.join(words)}")
    return "\n\n<information>" + "\n".join(lines) + "</information>\n\n" + suffix


def test_scripted_rollout_observations_are_exactly_the_masked_spans(
    tokenizer, client, retrieval_url, indexed_questions
) -> None:
    examples = indexed_questions[:8]
    config = RolloutConfig(prompt=COMPACT, max_turns=1, doc_words=8, max_obs_tokens=200)
    result = rollout_groups(
        ScriptedGenerator(tokenizer, COMPACT), client, tokenizer, examples, 2, config
    )
    trajectories = [t for g in result.groups for t in g]
    assert len(trajectories) == 16 and len(result.groups) == 8
    assert result.env_calls == 1  # all 16 searches of the turn in one batched request
    assert len({g[0].group_id for g in result.groups}) == 8
    raw = httpx.post(
        f"{retrieval_url}/retrieve",
        json={"queries": [ex.question for ex in examples], "topk": 3},
    ).json()["result"]
    for traj in trajectories:
        assert len(traj.response_ids) == len(traj.loss_mask) == len(traj.sampler_logprobs)
        runs = masked_runs(traj)
        decoded = [tokenizer.decode(r, skip_special_tokens=False) for r in runs]
        assert decoded == traj.observations
        i = examples.index(traj.example)
        assert traj.observations == [expected_block(raw[i], 8, "<answer>")]
        policy_text = tokenizer.decode(
            [t for t, m in zip(traj.response_ids, traj.loss_mask, strict=True) if m],
            skip_special_tokens=False,
        )
        assert policy_text == f" {traj.example.question} </search> {traj.answer} </answer>"
        assert (traj.turns, traj.searches, traj.valid_actions) == (2, 1, [True, True])
        assert traj.reward == exact_match(traj.answer, traj.example.golden_answers)
        assert (
            tokenizer.decode(traj.prompt_ids) == f"<s>Question: {traj.example.question}\n<search>"
        )
    assert sum(t.reward for t in trajectories) >= 8  # Doc 1 is usually the article itself


def test_oracle_answers_the_gold_title_when_retrieved(tokenizer, client, indexed_questions):
    examples = indexed_questions[:20]
    oracle = {ex.question: ex.golden_answers for ex in examples}
    config = RolloutConfig(prompt=COMPACT, max_turns=1, doc_words=6)
    plain = rollout_groups(
        ScriptedGenerator(tokenizer, COMPACT), client, tokenizer, examples, 1, config
    )
    best = rollout_groups(
        ScriptedGenerator(tokenizer, COMPACT, oracle), client, tokenizer, examples, 1, config
    )
    plain_em = [g[0].reward for g in plain.groups]
    best_em = [g[0].reward for g in best.groups]
    assert all(b >= p for b, p in zip(best_em, plain_em, strict=True))
    for group in best.groups:
        traj = group[0]
        seen = traj.observations[0]
        assert (traj.reward == 1.0) == (f'(Title: "{traj.example.golden_answers[0]}")' in seen)


def test_sampler_logprobs_equal_teacher_forcing(tokenizer, tiny_model, client, indexed_questions):
    """T=1, fp32, left-padded batch of unequal prompts, several turns with observations."""
    torch.manual_seed(0)
    config = RolloutConfig(prompt=COMPACT, max_turns=2, max_tokens_per_turn=12, doc_words=6)
    examples = [indexed_questions[0], indexed_questions[5]]  # prompts of different lengths
    result = rollout_groups(
        HFGenerator(tiny_model, tokenizer), client, tokenizer, examples, 2, config
    )
    trajectories = [t for g in result.groups for t in g]
    assert any(t.observations for t in trajectories)
    seqs = [t.prompt_ids + t.response_ids for t in trajectories]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for row, seq in enumerate(seqs):  # left padding, as in generation
        ids[row, width - len(seq) :] = torch.tensor(seq)
        attn[row, width - len(seq) :] = 1
    assert len({len(s) for s in seqs}) > 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)  # (B, T)
    with torch.no_grad():
        logits = tiny_model(input_ids=ids, attention_mask=attn, position_ids=positions).logits
    forced = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
    max_err, max_wrong = 0.0, 0.0
    for row, traj in enumerate(trajectories):
        n = len(traj.response_ids)
        mask = torch.tensor(traj.loss_mask, dtype=torch.bool)  # (n,)
        sampled = torch.tensor(traj.sampler_logprobs)[mask]
        max_err = max(max_err, (forced[row, -n:][mask] - sampled).abs().max().item())
        shifted = forced[row, -n - 1 : -1][mask]  # off by one token: must disagree
        max_wrong = max(max_wrong, (shifted - sampled).abs().max().item())
        assert (torch.tensor(traj.sampler_logprobs)[~mask] == 0).all()
    assert max_err < 1e-4
    assert max_wrong > 0.1  # the comparison is sharp: a misalignment is visible
    pairs = [zip(t.sampler_logprobs, t.loss_mask, strict=True) for t in trajectories]
    spread = torch.tensor([lp for pair in pairs for lp, m in pair if m])
    assert spread.std() > 0.1  # not a flat distribution where every check would pass


class FixedPolicy:
    """A test policy that writes the same text every turn (e.g. never a valid action)."""

    def __init__(self, tokenizer, text: str, eos: bool = False) -> None:
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        if eos:
            self.ids.append(tokenizer.eos_token_id)
        # stopped on a stop tag or EOS; otherwise it ran into the token limit
        tag = next((t for t in ("</search>", "</answer>") if text.endswith(t)), None)
        self.finish = ("eos", None) if eos else ("stop", tag) if tag else ("length", None)
        self.calls = 0

    def generate(self, contexts, params: SamplingParams) -> list[Completion]:
        self.calls += 1
        ids = self.ids[: params.max_tokens]
        return [Completion(list(ids), [-0.5] * len(ids), *self.finish) for _ in contexts]

    def sync_weights(self, model) -> None:
        pass


def test_invalid_actions_get_the_correction_message(tokenizer, client, indexed_questions):
    config = RolloutConfig(max_turns=2)
    policy = FixedPolicy(tokenizer, "I think it is Paris.")
    result = rollout_groups(policy, client, tokenizer, indexed_questions[:2], 2, config)
    for traj in (t for g in result.groups for t in g):
        assert traj.valid_actions == [False, False, False]  # two turns + the final one
        assert traj.observations == [config.prompt.invalid_action_message] * 2
        assert traj.answer is None and traj.reward == 0.0 and traj.searches == 0
        assert tokenizer.decode(masked_runs(traj)[0], skip_special_tokens=False) == (
            config.prompt.invalid_action_message
        )
    assert result.env_calls == 0


def test_eos_without_an_action_ends_the_trajectory(tokenizer, client, indexed_questions):
    policy = FixedPolicy(tokenizer, " no idea", eos=True)
    result = rollout_groups(policy, client, tokenizer, indexed_questions[:1], 1, RolloutConfig())
    traj = result.groups[0][0]
    assert (traj.turns, traj.valid_actions, traj.observations) == (1, [False], [])
    assert traj.response_ids[-1] == tokenizer.eos_token_id and traj.loss_mask[-1] == 1


def test_max_turns_then_one_final_turn_without_search(tokenizer, client, indexed_questions):
    config = RolloutConfig(max_turns=2, doc_words=4)
    policy = FixedPolicy(tokenizer, "<search> Africa literature </search>")
    result = rollout_groups(policy, client, tokenizer, indexed_questions[:2], 2, config)
    assert policy.calls == 3
    assert result.env_calls == 2  # one batched request per search turn
    for traj in (t for g in result.groups for t in g):
        assert (traj.turns, traj.searches) == (3, 2)
        assert traj.valid_actions == [True, True, True]
        assert len(traj.observations) == 2 and traj.answer is None
        assert traj.response_ids[-1] == tokenizer.encode("</search>", add_special_tokens=False)[0]


def test_unclosed_search_is_closed_by_the_environment(tokenizer, client, indexed_questions):
    config = RolloutConfig(prompt=COMPACT, max_turns=1, max_tokens_per_turn=3, doc_words=4)
    examples = [ex for ex in indexed_questions if len(ex.question.split()) >= 4][:1]
    result = rollout_groups(
        ScriptedGenerator(tokenizer, COMPACT), client, tokenizer, examples, 1, config
    )
    traj = result.groups[0][0]
    assert traj.searches == 1 and traj.valid_actions[0]
    assert traj.observations[0].startswith("</search>\n\n<information>Doc 1(Title: ")
    close_id = tokenizer.encode("</search>", add_special_tokens=False)[0]
    where = traj.response_ids.index(close_id)
    assert where == 3 and traj.loss_mask[where] == 0  # the environment's token, not the policy's
    assert sum(traj.loss_mask[:3]) == 3


def test_server_stopped_mid_rollout_past_the_grace_stops_the_rollout(
    tokenizer, small_index, indexed_questions
):
    from servers import running_server

    class StopServerAfterFirstTurn(ScriptedGenerator):
        def generate(self, contexts, params):
            out = super().generate(contexts, params)
            server.stop()  # the server goes away between generation and retrieval
            return out

    keep = RolloutConfig(prompt=COMPACT, max_turns=1, on_failure="keep")
    retry = RetrievalConfig(max_retries=2, backoff_s=0.01, backoff_max_s=0.05, outage_grace_s=0)
    with running_server(small_index) as server:
        config = retry.model_copy(update={"urls": [server.url]})
        with RetrievalClient(config, seed=0) as client:
            policy = StopServerAfterFirstTurn(tokenizer, COMPACT)
            with pytest.raises(RetrievalUnavailable, match="no retrieval server answered"):
                rollout_groups(policy, client, tokenizer, indexed_questions[:3], 2, keep)
            assert client.stats.attempts == 3 and client.stats.outages == 1


def test_only_trajectories_whose_query_is_refused_fail(tokenizer, small_index, indexed_questions):
    """A strict server refuses queries over 40 characters; the client sends them whole. The
    scripted policy searches the question verbatim, so long questions fail and short ones go on
    (one request per turn, bisected until the refused queries are alone)."""
    from servers import running_server

    examples = [ex for ex in indexed_questions if len(ex.question) <= 40][:2]
    examples += [ex for ex in indexed_questions if len(ex.question) > 40][:2]
    keep = RolloutConfig(prompt=COMPACT, max_turns=1, on_failure="keep")
    with running_server(small_index, profile="strict", max_query_chars=40) as server:
        config = RetrievalConfig(urls=[server.url], max_query_chars=None)
        with RetrievalClient(config, seed=0) as client:
            policy = ScriptedGenerator(tokenizer, COMPACT)
            result = rollout_groups(policy, client, tokenizer, examples, 2, keep)
            assert client.stats.refused_queries == 4 and client.stats.failed_queries == 4
            drop = keep.model_copy(update={"on_failure": "drop_group"})
            dropped = rollout_groups(policy, client, tokenizer, examples, 2, drop)
            with pytest.raises(RetrievalFailed, match="2 of 4 searches failed"):
                raising = keep.model_copy(update={"on_failure": "raise"})
                rollout_groups(policy, client, tokenizer, examples[1:3], 2, raising)
    failed = [[t.failed for t in group] for group in result.groups]
    assert failed == [[False, False], [False, False], [True, True], [True, True]]
    for traj in (t for g in result.groups[:2] for t in g):
        assert traj.searches == 1 and traj.observations[0].startswith("\n\n<information>")
    for traj in (t for g in result.groups[2:] for t in g):
        assert traj.searches == 0 and traj.observations == [] and traj.reward == 0.0
    assert len(dropped.groups) == 2 and len(dropped.dropped) == 2


def test_a_10000_character_model_query_is_truncated_and_counted(
    tokenizer, small_index, indexed_questions
):
    """A turn that writes a 10,000-character query (a model cut off inside <search>) against a
    strict server that refuses queries over 2,048 characters: the client cuts it to 2,048, counts
    it, and the step completes with real observations."""
    from servers import running_server

    words = "Great Wall of China fortifications built across northern China "
    query = (words * (10_000 // len(words) + 1))[:10_000].strip()
    assert len(query) >= 9_990
    policy = FixedPolicy(tokenizer, f"<search> {query} </search>")
    config = RolloutConfig(
        max_turns=1, max_tokens_per_turn=len(policy.ids), max_response_tokens=100_000
    )
    with running_server(small_index, profile="strict") as server:
        retrieval = RetrievalConfig(urls=[server.url])
        with RetrievalClient(retrieval, seed=0) as client:
            result = rollout_groups(policy, client, tokenizer, indexed_questions[:2], 2, config)
            assert client.stats.truncated_queries == 4  # 2 questions x 2 samples, one turn
            assert client.stats.failed_queries == 0 and client.stats.requests == 1
    for traj in (t for g in result.groups for t in g):
        assert not traj.failed and traj.searches == 1
        assert "Great Wall of China" in traj.observations[0]


@pytest.mark.parametrize(
    ("text", "finished", "expected"),
    [
        ("<search> q1 </search>", True, ("search", "q1", False)),
        ("<think> a </think><answer> Lima </answer>", True, ("answer", "Lima", False)),
        ("<search> half a que", False, ("search", "half a que", True)),
        ("<search> half a que", True, ("invalid", "", False)),  # EOS: not closed for it
        ("<search></search>", True, ("invalid", "", False)),
        ("nothing here", False, ("invalid", "", False)),
        ("<answer> x <search> y </search>", True, ("search", "y", False)),
    ],
)
def test_parse_action(text, finished, expected) -> None:
    action = parse_action(text, finished)
    assert (action.kind, action.content, action.env_close) == expected


def test_observation_is_cut_to_its_token_budget(tokenizer) -> None:
    contents = ['"Émile Zola"\n' + "Émile Zola was a French novelist, journalist. " * 20] * 3
    config = RolloutConfig(prompt=COMPACT, max_obs_tokens=40)
    ids, text = observation(tokenizer, contents, config)
    assert len(ids) <= 40
    assert text.startswith('\n\n<information>Doc 1(Title: "Émile Zola") Émile')
    assert text.endswith("</information>\n\n<answer>")
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
    roomy = RolloutConfig(prompt=COMPACT, max_obs_tokens=2000)
    full_ids, full_text = observation(tokenizer, contents, roomy)
    assert len(full_ids) > 40 and "Doc 3(Title: " in full_text


def test_the_query_budget_sends_the_first_words_and_keeps_the_policys_tokens(
    tokenizer, small_index, retrieval_url, indexed_questions
):
    """`max_query_words=2`: a strict server that refuses queries over 20 characters answers the
    search, so what reached it was the first two words ("Great Wall", 10 characters), and the
    observation is the server's own answer to them, not to the whole query. The trajectory keeps
    every token the policy wrote (mask 1). Without the budget the same search is refused."""
    from servers import running_server

    query = "Great Wall of China fortifications built across northern China"
    policy = FixedPolicy(tokenizer, f"<search> {query} </search>")
    raw = {
        q: httpx.post(f"{retrieval_url}/retrieve", json={"queries": [q], "topk": 3}).json()
        for q in (query, "Great Wall")
    }
    assert raw[query] != raw["Great Wall"]  # the budget changes what is retrieved
    budget = RolloutConfig(max_turns=1, max_query_words=2, doc_words=8, on_failure="keep")
    questions = indexed_questions[:2]
    with (
        running_server(small_index, profile="strict", max_query_chars=20) as server,
        RetrievalClient(RetrievalConfig(urls=[server.url], topk=3), seed=0) as client,
    ):
        result = rollout_groups(policy, client, tokenizer, questions, 2, budget)
        assert client.stats.refused_queries == 0
        whole = budget.model_copy(update={"max_query_words": None})
        refused = rollout_groups(policy, client, tokenizer, questions, 2, whole)
        assert client.stats.refused_queries == 4  # the whole query never passes there
    assert all(t.failed for g in refused.groups for t in g)
    suffix = budget.prompt.observation_suffix
    for traj in (t for g in result.groups for t in g):
        assert not traj.failed and traj.searches == 1
        assert traj.observations[0] == expected_block(raw["Great Wall"]["result"][0], 8, suffix)
        assert traj.response_ids[: len(policy.ids)] == policy.ids
        assert traj.loss_mask[: len(policy.ids)] == [1] * len(policy.ids)
        written = tokenizer.decode(masked_runs(traj, 1)[0], skip_special_tokens=False)
        assert written == f"<search> {query} </search>"


@pytest.mark.parametrize(
    ("query", "budget", "sent"),
    [
        ("a  b\tc d", 2, "a b"),
        ("one two", 5, "one two"),
        ("  keep  this  spacing ", None, "  keep  this  spacing "),  # no budget: untouched
    ],
)
def test_budget_query(query, budget, sent) -> None:
    from agent_env.rollout import budget_query

    assert budget_query(query, budget) == sent
