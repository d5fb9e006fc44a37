"""TRL's GRPOTrainer with hdr's Search-R1 rollout and replay (trainer/integrations/trl.py), on
the tiny Llama bed and the Qwen2 bed, against the session's real retrieval server.

What is shown: the rollout's env_mask keeps every `<information>` token out of TRL's loss
(decoded); replay runs inside TRL and selects exactly what hdr's own selector does on the same
buffer and weights; TRL's loss and gradient on an hdr batch equal hdr's (dapo, bnpo) or differ
by the conventions docs/integrations.md lists (grpo's sequence mean, the advantages' epsilon).
"""

from __future__ import annotations

import copy
import math
import os

import pytest
import torch
from trajectories import masked_runs

pytest.importorskip("trl")  # the hdr[trl] extra (make setup installs it)
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig

from agent_env.data import QAExample, load_flashrag_jsonl
from agent_env.prompts import PromptConfig
from agent_env.retrieval_client import RetrievalClient, RetrievalConfig
from agent_env.rollout import RolloutConfig, rollout_groups
from headroom_drift import assemble_batch
from headroom_drift.objective import group_advantages, kl_k3, policy_loss
from trainer.config import ReplayConfig
from trainer.integrations.trl import ReplayGRPOTrainer, TRLReplayConfig
from trainer.integrations.trl_layout import rows_from_trl, trl_inputs
from trainer.integrations.trl_rollout import (
    SearchR1Rollout,
    ended,
    exact_match_reward,
    search_r1_dataset,
    search_r1_reward,
)
from trainer.scoring import align, behaviour_groups, forward_logprobs, score_groups

G = 4


def rollout_config(**changes) -> RolloutConfig:
    return RolloutConfig(
        prompt=PromptConfig.preset("compact"), max_turns=1, max_tokens_per_turn=12,
        max_obs_tokens=48, doc_words=6, on_failure="keep", **changes,
    )  # fmt: skip


def length_reward(completions, **kwargs) -> list[float]:
    """A test reward that varies on an untrained policy (whose answers all score 0), so that
    groups have advantages and enter the buffer."""
    return [(len(c) % 7) / 7 for c in completions]


def grpo_args(tmp_path, **changes) -> GRPOConfig:
    settings = dict(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=2 * G, num_generations=G,
        max_steps=3, learning_rate=2e-3, use_cpu=True, bf16=False, gradient_checkpointing=False,
        report_to=[], logging_steps=1, save_strategy="no", seed=0, loss_type="dapo", beta=0.0,
    )  # fmt: skip
    return GRPOConfig(**{**settings, **changes})


def questions(small_qa, n: int = 8) -> list[QAExample]:
    return load_flashrag_jsonl(small_qa)[:n]


ON_POLICY = TRLReplayConfig(replay=ReplayConfig(rule="on_policy"))


def make_trainer(policy_dir, url, small_qa, tmp_path, replay: TRLReplayConfig, **args):
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    client = RetrievalClient(RetrievalConfig(urls=[url], topk=2, retriever="bm25"))
    config = rollout_config(reward="f1", format_weight=0.5)  # rewards that vary untrained
    return ReplayGRPOTrainer(
        model=model,
        reward_funcs=[exact_match_reward, search_r1_reward(config), length_reward],
        args=grpo_args(tmp_path, **args),
        train_dataset=search_r1_dataset(questions(small_qa)),
        processing_class=tokenizer,
        rollout_func=SearchR1Rollout(client, config),
        replay=replay,
    )


class Snapshots(TrainerCallback):
    """After each step's ingress: the buffer and the weights the next step starts from."""

    def __init__(self, trainer) -> None:
        self.trainer = trainer
        self.taken: dict[int, tuple] = {}

    def on_step_end(self, args, state, control, **kwargs):
        model = self.trainer.accelerator.unwrap_model(self.trainer.model)
        weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.taken[state.global_step] = (
            copy.deepcopy(self.trainer.replay.lifecycle.groups()),
            weights,
        )


def hdr_selection(trainer, snapshot, step: int, policy_dir):
    """What hdr's loop selects at `step` from the snapshot: the replay lifecycle its config
    makes (`ReplayConfig.make_replay`, the rule and its params) over the snapshot's buffer,
    and its ScoreFn (`score_groups` under the snapshot's weights)."""
    buffer, weights = snapshot
    model = AutoModelForCausalLM.from_pretrained(str(policy_dir), dtype=torch.float32)
    model.load_state_dict(weights)
    cfg = trainer.replay.config
    replay = cfg.replay.make_replay(0, trainer.state.max_steps)
    replay.ingest(buffer)  # the snapshot's groups, in its order
    score = lambda groups: score_groups(model.eval(), groups, cfg.score_chunk, 1.0)  # noqa: E731
    return replay.select(step, score)


def check_replay_run(trainer, snapshots, policy_dir, fresh_rows: int) -> None:
    """Every step after the first replayed and its selection is hdr's own."""
    history = trainer.replay.history
    assert [h["step"] for h in history] == [1, 2, 3]
    assert history[0]["replayed"] == []  # nothing stored before step 1's ingress
    for h in history[1:]:
        assert h["scanned"] >= 1
        hdr = hdr_selection(trainer, snapshots.taken[h["step"] - 1], h["step"], policy_dir)
        assert h["replayed"] == [g.group_id for g in hdr.groups]
        assert h["drift_scanned"] == pytest.approx(hdr.drift_scanned, rel=1e-4, abs=1e-7)
    admitted = sum(len(h["replayed"]) for h in history)
    refused = sum(h["scanned"] - len(h["replayed"]) for h in history)
    assert admitted >= 1 and refused >= 1  # the gate decided something both ways
    # replayed rows were trained on: more rows than the fresh ones alone
    assert any(h["trained_rows"] > fresh_rows for h in history)


def tau_between(trainer) -> float:
    """A gate inside the drifts seen on a first run of the same settings."""
    drifts = sorted(d for h in trainer.replay.history for d in h["drift_scanned"])
    return math.sqrt(drifts[0] * drifts[-1])


@pytest.mark.parametrize("bed", ["tiny_llama", "qwen2"])
def test_trl_trains_with_replay_and_selects_as_hdr_loop(
    bed, tiny_policy, qwen_policy_dir, retrieval_url, small_qa, tmp_path
):
    policy_dir = tiny_policy if bed == "tiny_llama" else qwen_policy_dir
    batch = 2 * G if bed == "tiny_llama" else G  # groups per step (Qwen's 151,936-row head)
    probe = make_trainer(
        policy_dir, retrieval_url, small_qa, tmp_path,
        TRLReplayConfig(replay=ReplayConfig(budget=2, capacity=8, tau=math.inf)),
        per_device_train_batch_size=batch,
    )  # fmt: skip
    probe.train()
    tau = tau_between(probe)
    trainer = make_trainer(
        policy_dir, retrieval_url, small_qa, tmp_path,
        TRLReplayConfig(replay=ReplayConfig(budget=2, capacity=8, tau=tau)),
        per_device_train_batch_size=batch,
    )  # fmt: skip
    snapshots = Snapshots(trainer)
    trainer.add_callback(snapshots)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    trainer.train()
    check_replay_run(trainer, snapshots, policy_dir, batch)
    after = trainer.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)
    # ingress after the update: the buffer holds the steps' groups with variance, none of step 4
    stored = {g.entered_step for g in trainer.replay.lifecycle.groups()}
    assert stored <= {1, 2, 3} and len(stored) >= 2
    assert any(g.replay_count >= 1 for g in trainer.replay.lifecycle.groups())
    trainer.rollout_func.client.close()
    probe.rollout_func.client.close()


@pytest.mark.parametrize("bed", ["tiny_llama", "qwen2"])
def test_env_mask_keeps_information_out_of_trl_loss(
    bed, tiny_policy, qwen_policy_dir, retrieval_url, small_qa, tmp_path
):
    """The rollout's env_mask is 0 exactly on the environment's text (decoded: every masked
    span is an observation the environment appended), and TRL's loss mask is that mask."""
    policy_dir = tiny_policy if bed == "tiny_llama" else qwen_policy_dir
    trainer = make_trainer(
        policy_dir, retrieval_url, small_qa, tmp_path, ON_POLICY, max_steps=1,
    )  # fmt: skip
    trainer.train()
    rollout = trainer.rollout_func
    trajectories = [t for group in rollout.last.groups for t in group]
    tokenizer = trainer.processing_class
    searched = [t for t in trajectories if t.searches]
    assert searched, "no trajectory searched: the masked path was not exercised"
    for t in trajectories:
        spans = masked_runs(t)
        decoded = [tokenizer.decode(s, skip_special_tokens=False) for s in spans]
        assert decoded == t.observations
        policy_text = tokenizer.decode(
            [i for i, m in zip(t.response_ids, t.loss_mask, strict=True) if m],
            skip_special_tokens=False,
        )
        assert "<information>" not in policy_text
    assert any("<information>" in text for t in searched for text in t.observations)
    # TRL's loss mask (the fresh groups hdr built from TRL's batch) is the env_mask
    fresh = trainer.replay.last.fresh
    rows = [
        row for g in fresh for row in zip(g.input_ids, g.attention_mask, g.loss_mask, strict=True)
    ]
    # (a completion that was not cut ends on an EOS TRL reads as "finished", env_mask 0)
    for t, (ids, attn, mask) in zip(trajectories, rows, strict=True):
        end = ended(t, tokenizer.eos_token_id)
        n = len(t.prompt_ids) + len(t.response_ids) + len(end)
        assert ids[attn.bool()].tolist() == t.prompt_ids + t.response_ids + end
        assert mask[-n:].tolist() == [0] * len(t.prompt_ids) + t.loss_mask + [0] * len(end)
    rollout.client.close()


# --- agreement of the losses -----------------------------------------------------------------


@pytest.fixture(scope="module")
def update_batch(tiny_policy, retrieval_url, small_qa):
    """An update's batch as hdr's loop builds it: two fresh groups (behaviour log-probs under
    the policy) and two replayed groups whose stored log-probs come from other weights (so the
    ratio moves and clipping acts), from real rollouts of the tiny policy."""
    from agent_env.generation.hf import HFGenerator

    torch.manual_seed(int(os.environ.get("SEED", "0")))  # the rollouts and the older weights
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy))
    policy = AutoModelForCausalLM.from_pretrained(str(tiny_policy), dtype=torch.float32).eval()

    with RetrievalClient(RetrievalConfig(urls=[retrieval_url], topk=2)) as client:
        result = rollout_groups(
            HFGenerator(policy, tokenizer), client, tokenizer, questions(small_qa, 4), G,
            rollout_config(),
        )  # fmt: skip
    for k, group in enumerate(result.groups):  # rewards with variance in every group
        for i, t in enumerate(group):
            t.reward = float((i + k) % 3)
    fresh, _, _ = behaviour_groups(policy, result.groups[:2], 2, [0, 1], 16, 1.0)
    older = copy.deepcopy(policy)
    with torch.no_grad():
        for p in older.parameters():
            p.add_(0.05 * torch.randn_like(p))
    stale, _, _ = behaviour_groups(older, result.groups[2:], 1, [2, 3], 16, 1.0)
    return tokenizer, policy, assemble_batch(fresh, stale)


def hdr_loss_and_grads(policy, batch, eps: float, ref=None, beta: float = 0.0):
    """hdr's update on one micro-batch: `forward_logprobs` and `policy_loss` (+ beta * k3)."""
    model = copy.deepcopy(policy).train()
    r = batch.rows()
    lp = align(forward_logprobs(model, r.input_ids, r.attention_mask, r.loss_mask)[0])
    loss = policy_loss(lp, r.gen_logprobs, r.advantages, r.loss_mask, eps, eps)
    if ref is not None:
        with torch.no_grad():
            ref_lp = align(forward_logprobs(ref, r.input_ids, r.attention_mask, r.loss_mask)[0])
        loss = loss + beta * kl_k3(lp, ref_lp, r.loss_mask)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}, lp.detach()


def trl_loss_and_grads(policy, tokenizer, batch, tmp_path, ref_lp=None, **args):
    """TRL's `compute_loss` on the same batch, in TRL's layout (trl_inputs)."""
    from trl import GRPOTrainer

    model = copy.deepcopy(policy).train()
    trainer = GRPOTrainer(
        model=model, reward_funcs=[length_reward], args=grpo_args(tmp_path, **args),
        train_dataset=search_r1_dataset(questions_stub()), processing_class=tokenizer,
    )  # fmt: skip
    r = batch.rows()
    extra = {} if ref_lp is None else {"ref_per_token_logps": ref_lp}
    inputs = trl_inputs(
        r.input_ids, r.attention_mask, r.loss_mask, r.advantages, r.gen_logprobs,
        r.loss_mask.sum(), extra,
    )  # fmt: skip
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1  # as Trainer's loop sets it: one micro-batch
    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def questions_stub() -> list[QAExample]:
    return [QAExample(id="0", question="q", golden_answers=["a"], data_source="t")] * G


def assert_grads_close(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=atol, rtol=1e-4, msg=name)


@pytest.mark.parametrize("loss_type", ["dapo", "bnpo"])
def test_trl_loss_and_gradient_equal_hdr_loop_token_mean(update_batch, loss_type, tmp_path):
    tokenizer, policy, batch = update_batch
    hdr_loss, hdr_grads, _ = hdr_loss_and_grads(policy, batch, 0.2)
    trl_loss, trl_grads = trl_loss_and_grads(
        policy, tokenizer, batch, tmp_path, loss_type=loss_type
    )
    assert abs(float(hdr_loss)) > 1e-4  # a loss that moves
    assert float(trl_loss) == pytest.approx(float(hdr_loss), abs=1e-5)
    assert_grads_close(hdr_grads, trl_grads)


def test_trl_kl_term_is_hdr_k3_or_its_ratio_weighted_form(update_batch, tmp_path):
    """With `use_bias_correction_kl=False`, TRL's beta * k3 term equals hdr's (loss and
    gradient). TRL's default (True) weights each token's k3 by the ratio: the loss equals that
    formula and not hdr's."""
    tokenizer, policy, batch = update_batch
    ref = copy.deepcopy(policy)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(0.02 * torch.randn_like(p))
    r = batch.rows()
    with torch.no_grad():
        ref_lp = align(forward_logprobs(ref, r.input_ids, r.attention_mask, r.loss_mask)[0])
    hdr_loss, hdr_grads, lp = hdr_loss_and_grads(policy, batch, 0.2, ref, beta=0.5)
    trl_loss, trl_grads = trl_loss_and_grads(
        policy, tokenizer, batch, tmp_path, ref_lp, beta=0.5, use_bias_correction_kl=False
    )
    assert float(trl_loss) == pytest.approx(float(hdr_loss), abs=1e-5)
    assert_grads_close(hdr_grads, trl_grads)
    k3 = torch.exp(ref_lp - lp) - (ref_lp - lp) - 1.0
    ratio = torch.exp(lp - r.gen_logprobs)
    plain = kl_k3(lp, ref_lp, r.loss_mask)
    weighted = (ratio * k3 * r.loss_mask).sum() / r.loss_mask.sum()
    corrected, _ = trl_loss_and_grads(policy, tokenizer, batch, tmp_path, ref_lp, beta=0.5)
    expected = float(hdr_loss) - 0.5 * float(plain) + 0.5 * float(weighted)
    assert float(corrected) == pytest.approx(expected, abs=1e-5)
    assert abs(float(corrected) - float(hdr_loss)) > 1e-5


def test_trl_forward_equals_hdr_teacher_forcing(update_batch, tmp_path):
    """TRL's forward passes no position ids (0..T-1 over the left padding), hdr's passes
    `cumsum(attention_mask) - 1`; rotary embeddings see the same differences, so the policy
    tokens' log-probs agree up to float error."""
    from trl import GRPOTrainer

    tokenizer, policy, batch = update_batch
    trainer = GRPOTrainer(
        model=copy.deepcopy(policy), reward_funcs=[length_reward], args=grpo_args(tmp_path),
        train_dataset=search_r1_dataset(questions_stub()), processing_class=tokenizer,
    )  # fmt: skip
    r = batch.rows()
    inputs = trl_inputs(
        r.input_ids, r.attention_mask, r.loss_mask, r.advantages, r.gen_logprobs, r.loss_mask.sum()
    )
    C = inputs["completion_ids"].shape[1]
    with torch.no_grad():
        trl_lp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, r.input_ids, r.attention_mask, C
        )
        hdr_lp = align(forward_logprobs(policy, r.input_ids, r.attention_mask, r.loss_mask)[0])
    policy_tokens = inputs["tool_mask"].bool()
    assert int(policy_tokens.sum()) > 100
    assert (trl_lp - hdr_lp[:, -C:])[policy_tokens].abs().max() < 1e-5


def test_trl_grpo_loss_is_a_mean_of_sequence_means(update_batch, tmp_path):
    """TRL's `loss_type="grpo"` averages each sequence's token mean (hdr: one token mean over
    the batch): equal to that formula on hdr's per-token surrogate, and not to hdr's loss."""
    tokenizer, policy, batch = update_batch
    hdr_loss, _, lp = hdr_loss_and_grads(policy, batch, 0.2)
    r = batch.rows()
    ratio = torch.exp(lp - r.gen_logprobs)
    adv = r.advantages.unsqueeze(1)
    surrogate = -torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv) * r.loss_mask
    sequence_mean = (surrogate.sum(1) / r.loss_mask.sum(1).clamp(min=1)).mean()
    trl_loss, _ = trl_loss_and_grads(policy, tokenizer, batch, tmp_path, loss_type="grpo")
    assert float(trl_loss) == pytest.approx(float(sequence_mean), abs=1e-5)
    assert abs(float(trl_loss) - float(hdr_loss)) > 1e-4


def test_trl_advantages_use_its_own_epsilon(tiny_policy, retrieval_url, small_qa, tmp_path):
    """The fresh groups' stored advantages are TRL's, `(r - mean) / (std + 1e-4)`; hdr's loop
    divides by `std + 1e-6`."""
    trainer = make_trainer(
        tiny_policy, retrieval_url, small_qa, tmp_path, ON_POLICY, max_steps=1,
    )  # fmt: skip
    trainer.train()
    for group in trainer.replay.last.fresh:
        r = group.rewards
        trl = (r - r.mean()) / (r.std() + 1e-4)
        torch.testing.assert_close(group.advantages, trl, atol=1e-6, rtol=1e-5)
        if r.std() > 0:
            hdr = group_advantages(r.unsqueeze(0))[0]
            assert not torch.allclose(group.advantages, hdr, atol=1e-7, rtol=1e-7)
    trainer.rollout_func.client.close()


# --- layout ------------------------------------------------------------------------------------


def test_trl_layout_round_trip_keeps_tokens_and_mask():
    """TRL's two blocks -> hdr's rows -> TRL's dict: each row's real tokens, in order, with
    the policy mask on the same tokens and the per-token values beside them."""
    prompt_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1]])
    completion_ids = torch.tensor([[11, 12, 13, 14], [21, 22, 0, 0]])
    completion_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    tool_mask = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1]])
    logps = torch.tensor([[-1.0, -2.0, -3.0, -4.0], [-5.0, -6.0, 0.0, 0.0]])
    rows = rows_from_trl({
        "prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
        "completion_mask": completion_mask, "tool_mask": tool_mask,
        "sampling_per_token_logps": logps,
    })  # fmt: skip
    assert rows.input_ids.tolist() == [[0, 5, 6, 11, 12, 13, 14], [0, 0, 7, 8, 9, 21, 22]]
    assert rows.attention_mask.tolist() == [[0, 1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1, 1]]
    assert rows.loss_mask.tolist() == [[0, 0, 0, 1, 0, 0, 1], [0, 0, 0, 0, 0, 1, 1]]
    assert rows.per_token["sampling_per_token_logps"][0, -4:].tolist() == [-1, -2, -3, -4]
    out = trl_inputs(
        rows.input_ids, rows.attention_mask, rows.loss_mask, torch.ones(2),
        rows.per_token["sampling_per_token_logps"], rows.loss_mask.sum(),
    )  # fmt: skip
    # the completion block starts at the first policy token of any row (column 3)
    assert out["completion_ids"].tolist() == [[11, 12, 13, 14], [8, 9, 21, 22]]
    assert out["tool_mask"].tolist() == [[1, 0, 0, 1], [0, 0, 1, 1]]
    assert out["old_per_token_logps"][1, -2:].tolist() == [-5.0, -6.0]
    assert int(out["num_items_in_batch"]) == 4


def test_replay_settings_trl_cannot_honour_are_refused(tiny_policy, small_qa, tmp_path):
    with pytest.raises(ValueError, match="steps_per_generation == gradient_accumulation_steps"):
        make_trainer(
            tiny_policy, "http://127.0.0.1:9", small_qa, tmp_path, TRLReplayConfig(),
            steps_per_generation=2,
        )  # fmt: skip
    with pytest.raises(ValueError, match="drop_group"):
        SearchR1Rollout(RetrievalClient(RetrievalConfig()), RolloutConfig(on_failure="drop_group"))


# --- vLLM server mode (no vLLM here: a recording stand-in for its HTTP endpoint) -------------


class RecordingSession:
    """Stands in for `requests.Session` in TRL's VLLMClient: records each POST and answers
    with vLLM's `/v1/completions` shape (choices with token ids, log-probs, finish reasons)."""

    def __init__(self, choices: list[dict]) -> None:
        self.choices = choices
        self.posts: list[tuple[str, dict]] = []

    def post(self, url: str, json: dict):
        from types import SimpleNamespace

        self.posts.append((url, json))
        return SimpleNamespace(status_code=200, json=lambda: {"choices": self.choices})


def test_vllm_server_generator_asks_for_stops_and_reads_finish_reasons():
    from types import SimpleNamespace

    from agent_env.generation.base import SamplingParams
    from trainer.integrations.trl_vllm import VLLMServerGenerator

    def choice(index, ids, reason, stop):
        logprobs = {"token_logprobs": [-0.5] * len(ids)}
        return {"index": index, "token_ids": ids, "logprobs": logprobs,
                "finish_reason": reason, "stop_reason": stop}  # fmt: skip

    session = RecordingSession([
        choice(1, [7, 2], "stop", None),  # EOS (id 2) sampled
        choice(0, [5, 6], "stop", "</search>"),
        choice(2, [8, 9, 10], "length", None),
    ])  # fmt: skip
    client = SimpleNamespace(model="qwen", base_url="http://vllm:8001", session=session)
    out = VLLMServerGenerator(client, eos={2}).generate(
        [[1, 2, 3], [4], [5, 6]], SamplingParams(temperature=1.0, top_p=1.0, max_tokens=3)
    )
    [(url, body)] = session.posts
    assert url == "http://vllm:8001/v1/completions"
    assert body["prompt"] == [[1, 2, 3], [4], [5, 6]] and body["n"] == 1
    assert body["stop"] == ["</search>", "</answer>"] and body["stop_token_ids"] == [2]
    assert body["include_stop_str_in_output"] and body["logprobs"] == 0
    assert body["max_tokens"] == 3 and body["return_token_ids"]
    # every field the server would fill from the checkpoint's generation_config.json is named,
    # at what the loss assumes (Qwen2.5-Instruct ships repetition_penalty 1.05, top_k 20)
    sampling = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty")  # fmt: skip
    assert {k: body[k] for k in sampling} == {
        "temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
        "presence_penalty": 0.0, "frequency_penalty": 0.0,
    }  # fmt: skip
    assert [(c.token_ids, c.finish_reason, c.stop_string) for c in out] == [
        ([5, 6], "stop", "</search>"), ([7, 2], "eos", None), ([8, 9, 10], "length", None),
    ]  # fmt: skip
    assert out[0].logprobs == [-0.5, -0.5]


def test_the_8gpu_recipe_is_a_config_trl_accepts():
    """configs/trl/qwen2.5-3b-8gpu.yaml (written for GPUs, not run here) loads as hdr's config,
    every `trl:` key builds TRL's GRPOConfig (bf16 off only because this machine has no GPU),
    its schedule is one replay can use, and the accelerate config is ZeRO-3 on 7 processes."""
    import yaml

    from core.config import load_config
    from trainer.integrations.trl import check_schedule
    from trainer.integrations.trl_run import TRLRunConfig, grpo_args

    root = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "trl")
    config = load_config(
        TRLRunConfig, os.path.join(root, "qwen2.5-3b-8gpu.yaml"), ["trl.bf16=false"]
    )
    args = grpo_args(config)
    assert args.use_vllm and args.vllm_mode == "server" and args.loss_type == "dapo"
    check_schedule(args, args.num_generations)
    assert config.model == "Qwen/Qwen2.5-3B-Instruct"
    assert config.replay.replay.rule == "headroom_drift"
    with open(os.path.join(root, "accelerate-zero3.yaml")) as f:
        launch = yaml.safe_load(f)
    assert launch["distributed_type"] == "DEEPSPEED"
    assert launch["deepspeed_config"]["zero_stage"] == 3 and launch["num_processes"] == 7
