"""Headroom-Drift Replay's rows in veRL 0.9.1's batch, on the CPU (trainer/integrations/
verl_replay.py): what of the replay step veRL can run without a GPU.

A real tiny Qwen2 policy samples GRPO groups; the rows are veRL's `DataProto` layout, their
log-probs veRL's `logprobs_from_logits`, their advantages veRL's own GRPO step
(`compute_advantage`), the loss veRL's `vanilla` policy loss with the recipe's actor settings.
hdr's `GroupReplay` stores the groups, scans them with those log-probs after a real update,
and its selection goes back into a veRL batch beside fresh rows. veRL's trainer around it
(Ray workers, TransferQueue, FSDP, vLLM) needs GPUs and is outlined in docs/integrations.md.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from real_verl import NEEDS_VERL, compose_recipe

pytestmark = NEEDS_VERL

G, PROMPT, RESPONSE = 4, 16, 12  # rows per group, veRL's prompt and response widths
QUESTIONS = ["Who built Pavia Cathedral?", "What is a haiku?"]


def left_pad(ids: list[int], width: int, pad: int) -> list[int]:
    return [pad] * (width - len(ids)) + ids[-width:]


def sample_batch(model, tokenizer, seed: int, uid_prefix: str):
    """G sampled responses to each question as veRL's rows (before rewards and advantages)."""
    from verl.protocol import DataProto
    from verl.utils.model import compute_position_id_with_mask

    pad = tokenizer.pad_token_id
    prompts = torch.tensor(
        [left_pad(tokenizer.encode(q), PROMPT, pad) for q in QUESTIONS for _ in range(G)]
    )
    prompt_mask = (prompts != pad).long()
    torch.manual_seed(seed)
    with torch.no_grad():
        out = model.generate(
            input_ids=prompts,
            attention_mask=prompt_mask,
            do_sample=True,
            max_new_tokens=RESPONSE,
            min_new_tokens=RESPONSE,
            pad_token_id=pad,
        )
    responses = out[:, PROMPT:]
    response_mask = torch.ones_like(responses)
    response_mask[::3, RESPONSE - 4 :] = 0  # some rows end early (right padding), as in veRL
    responses = torch.where(response_mask.bool(), responses, torch.full_like(responses, pad))
    attention_mask = torch.cat([prompt_mask, response_mask], dim=1)
    uids = [f"{uid_prefix}{i // G}" for i in range(len(prompts))]
    return DataProto.from_dict(
        tensors={
            "prompts": prompts,
            "responses": responses,
            "input_ids": torch.cat([prompts, responses], dim=1),
            "attention_mask": attention_mask,
            "position_ids": compute_position_id_with_mask(attention_mask),
            "response_mask": response_mask.float(),
        },
        non_tensors={"uid": np.array(uids, dtype=object)},
    )


def response_log_probs(model):
    """The policy's log-probs of each row's response tokens, as veRL's actor computes them."""
    from verl.utils.torch_functional import logprobs_from_logits

    def log_probs(batch):
        rows = batch.batch
        logits = model(
            input_ids=rows["input_ids"],
            attention_mask=rows["attention_mask"],
            position_ids=rows["position_ids"],
        ).logits[:, PROMPT - 1 : -1]
        return logprobs_from_logits(logits, rows["responses"], inplace_backward=False)

    return log_probs


def scored_fresh_batch(model, tokenizer, seed, uid_prefix, rewards):
    """Sampled rows with veRL's old_log_probs, outcome rewards and GRPO advantages."""
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage

    batch = sample_batch(model, tokenizer, seed, uid_prefix)
    with torch.no_grad():
        batch.batch["old_log_probs"] = response_log_probs(model)(batch)
    mask = batch.batch["response_mask"]
    last = torch.arange(RESPONSE) == (mask.sum(-1, keepdim=True) - 1)
    batch.batch["token_level_rewards"] = last.float() * torch.tensor(rewards).unsqueeze(-1)
    return compute_advantage(batch, AdvantageEstimator.GRPO, num_repeat=G)


def verl_policy_loss(batch, log_probs, actor):
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    loss, _ = get_policy_loss_fn("vanilla")(
        old_log_prob=batch.batch["old_log_probs"],
        log_prob=log_probs,
        advantages=batch.batch["advantages"],
        response_mask=batch.batch["response_mask"],
        loss_agg_mode="token-mean",
        config=actor,
    )
    return loss


@pytest.fixture
def policy(qwen_policy_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(qwen_policy_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def actor():
    from verl.utils.config import omega_conf_to_dataclass

    return omega_conf_to_dataclass(compose_recipe().actor_rollout_ref.actor)


REWARDS_1 = [1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
REWARDS_2 = [0.0, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0]


def test_veRLs_rows_become_hdrs_groups_and_come_back_the_same(policy, qwen_tokenizer) -> None:
    from headroom_drift import GroupReplay
    from trainer.integrations.verl_replay import batch_from_groups, groups_from_batch

    fresh = scored_fresh_batch(policy, qwen_tokenizer, 1, "step1-", REWARDS_1)
    replay = GroupReplay(capacity=8, rule="headroom_drift", budget=2, tau=1.0)
    for group in groups_from_batch(fresh):
        replay.store(1, **group)
    stored = replay.buffer.groups()
    assert [g.group_id for g in stored] == ["step1-0", "step1-1"]
    # hdr's own group advantages of the rewards are veRL's GRPO advantages
    for group, rewards in zip(stored, (REWARDS_1[:G], REWARDS_1[G:]), strict=True):
        assert torch.allclose(group.rewards, torch.tensor(rewards))
    back = batch_from_groups(stored, PROMPT)
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids"):
        assert torch.equal(back.batch[key], fresh.batch[key]), key
    mask = fresh.batch["response_mask"]
    assert torch.equal(back.batch["response_mask"], mask)
    assert torch.equal(back.batch["token_level_rewards"], fresh.batch["token_level_rewards"])
    assert torch.equal(back.batch["old_log_probs"], fresh.batch["old_log_probs"] * mask)
    assert list(back.non_tensor_batch["uid"]) == list(fresh.non_tensor_batch["uid"])


def test_replay_scans_with_veRLs_log_probs_and_its_rows_train_in_veRLs_loss(
    policy, qwen_tokenizer, actor
) -> None:
    """Step 1 trains on fresh rows and stores the groups; step 2 scans them with the moved
    policy's log-probs (drift above 0, refused by a tight tau, admitted by a loose one), adds
    the admitted groups' rows to step 2's fresh rows, and veRL's own advantage step and
    policy loss treat them as hdr's loss does."""
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import AdvantageEstimator
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from headroom_drift import GroupReplay
    from headroom_drift.objective import policy_loss
    from trainer.integrations.verl_replay import batch_from_groups, groups_from_batch, score_with

    log_probs = response_log_probs(policy)
    optimizer = torch.optim.SGD(policy.parameters(), lr=0.5)
    fresh = scored_fresh_batch(policy, qwen_tokenizer, 1, "step1-", REWARDS_1)
    verl_policy_loss(fresh, log_probs(fresh), actor).backward()  # step 1's update
    optimizer.step()
    optimizer.zero_grad()
    tight = GroupReplay(capacity=8, rule="headroom_drift", budget=2, tau=1e-9)
    loose = GroupReplay(capacity=8, rule="headroom_drift", budget=2, tau=1e3)
    for group in groups_from_batch(fresh):  # ingress after the update
        tight.store(1, **group)
        loose.store(1, **group)

    score = score_with(log_probs, PROMPT)
    refused = tight.select(2, score)
    picked = loose.select(2, score)
    assert refused.groups == [] and refused.scanned == 2
    assert sorted(g.group_id for g in picked.groups) == ["step1-0", "step1-1"]
    # the drift the scan saw is the masked mean squared change of veRL's log-probs
    with torch.no_grad():
        moved = log_probs(fresh)
    mask = fresh.batch["response_mask"]
    for group, drift in zip(picked.groups, picked.drift_admitted, strict=True):
        first = G * int(group.group_id.removeprefix("step1-"))
        rows = slice(first, first + G)
        change = (moved[rows] - fresh.batch["old_log_probs"][rows]) ** 2 * mask[rows]
        assert drift == pytest.approx(float(change.sum() / mask[rows].sum()), rel=1e-4)
        assert drift > 0

    new = scored_fresh_batch(policy, qwen_tokenizer, 2, "step2-", REWARDS_2)
    replayed = batch_from_groups(picked.groups, PROMPT)
    for key in ("advantages", "returns"):
        new.batch.pop(key)
    batch = compute_advantage(
        DataProto.concat([new, replayed]), AdvantageEstimator.GRPO, num_repeat=G
    )
    rows = len(new)
    stored = torch.cat([g.advantages for g in picked.groups])
    row_advantage = batch.batch["advantages"].sum(-1) / batch.batch["response_mask"].sum(-1)
    assert torch.allclose(row_advantage[rows:], stored, atol=1e-5)  # veRL gives them back
    assert torch.equal(batch.batch["old_log_probs"][rows:], replayed.batch["old_log_probs"])
    now = log_probs(batch)
    verl_loss = verl_policy_loss(batch, now, actor)
    hdr_loss = policy_loss(
        now, batch.batch["old_log_probs"], row_advantage, batch.batch["response_mask"],
        eps_low=actor.clip_ratio_low, eps_high=actor.clip_ratio_high,
    )  # fmt: skip
    assert verl_loss.item() == pytest.approx(hdr_loss.item(), rel=1e-5)
    verl_loss.backward()  # step 2's update runs on fresh and replayed rows together
    assert all(p.grad is not None for p in policy.parameters() if p.requires_grad)
