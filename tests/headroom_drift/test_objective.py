"""The GRPO formulas against hand-computed values."""

import math

import pytest
import torch

from headroom_drift.objective import group_advantages, kl_k3, policy_loss, token_entropy


def test_equal_rewards_give_zero_advantages():
    adv = group_advantages(torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]]))
    assert torch.equal(adv, torch.zeros(2, 4))


def test_advantages_use_bessel_std_plus_eps():
    # mean 0.25; Bessel std sqrt((0.75^2 + 3 * 0.25^2) / 3) = 0.5
    adv = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]))
    expected = torch.tensor([[0.75, -0.25, -0.25, -0.25]]) / (0.5 + 1e-6)
    torch.testing.assert_close(adv, expected)
    # a population std (divisor 4: 0.4330) would give 1.732 for the first response
    assert adv[0, 0].item() == pytest.approx(1.5, abs=1e-5)


def test_group_of_one_gives_zero_advantage():
    assert torch.equal(group_advantages(torch.tensor([[1.0], [0.0]])), torch.zeros(2, 1))


def _one_token(ratio: float, adv: float, eps_low=0.2, eps_high=0.2) -> float:
    lp = torch.tensor([[math.log(ratio)]])
    return policy_loss(
        lp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), eps_low, eps_high
    ).item()


@pytest.mark.parametrize(
    ("ratio", "adv", "expected"),
    [
        (1.5, 1.0, -1.2),  # A>0, ratio above 1+eps_high: clipped
        (0.5, 1.0, -0.5),  # A>0, ratio below 1-eps_low: min keeps the unclipped value
        (0.5, -1.0, 0.8),  # A<0, ratio below 1-eps_low: clipped
        (1.5, -1.0, 1.5),  # A<0, ratio above 1+eps_high: min keeps the unclipped value
        (1.1, 2.0, -2.2),  # inside the trust region: plain ratio * A
    ],
)
def test_policy_loss_clips_on_both_sides(ratio, adv, expected):
    assert _one_token(ratio, adv) == pytest.approx(expected, abs=1e-6)


def test_policy_loss_asymmetric_eps():
    assert _one_token(1.5, 1.0, eps_low=0.1, eps_high=0.3) == pytest.approx(-1.3, abs=1e-6)
    assert _one_token(0.5, -1.0, eps_low=0.1, eps_high=0.3) == pytest.approx(0.9, abs=1e-6)


def test_policy_loss_is_token_mean_over_all_rows_and_ignores_masked_tokens():
    # row 0: 3 policy tokens with ratio 1, A=1; row 1: 1 policy token, ratio 1, A=-1.
    # token mean: -(3 * 1 + 1 * -1) / 4 = -0.5 (a per-row mean would give 0).
    lp = torch.tensor([[0.0, 0.0, 0.0, 9.0], [5.0, 0.0, -7.0, 3.0]])
    old = torch.tensor([[0.0, 0.0, 0.0, -9.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]])
    loss = policy_loss(lp, old, torch.tensor([1.0, -1.0]), mask)
    assert loss.item() == pytest.approx(-0.5, abs=1e-6)


def test_policy_loss_gradient_is_zero_when_clipped():
    lp = torch.tensor([[math.log(1.5)]], requires_grad=True)
    policy_loss(lp, torch.zeros(1, 1), torch.tensor([1.0]), torch.ones(1, 1)).backward()
    assert lp.grad.item() == 0.0


def test_kl_k3_hand_values():
    lp = torch.tensor([[math.log(0.5), math.log(0.25), 0.0]])
    ref = torch.tensor([[math.log(0.25), math.log(0.25), 3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    # token 0: delta = log(0.5) -> 0.5 - log(0.5) - 1 = 0.193147; token 1: 0
    assert kl_k3(lp, ref, mask).item() == pytest.approx((0.5 + math.log(2) - 1) / 2, abs=1e-6)


def test_token_entropy_uniform_and_peaked():
    logits = torch.tensor([[0.0, 0.0, 0.0, 0.0], [100.0, 0.0, 0.0, 0.0]])
    ent = token_entropy(logits)
    assert ent[0].item() == pytest.approx(math.log(4), abs=1e-6)
    assert ent[1].item() == pytest.approx(0.0, abs=1e-6)


def test_truncated_is_weights_and_weighted_loss():
    from headroom_drift.objective import logprob_gap, truncated_is_weights

    trainer = torch.log(torch.tensor([[0.5, 0.2, 0.9, 0.3]]))
    sampler = torch.log(torch.tensor([[0.25, 0.4, 0.1, 0.3]]))
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    w = truncated_is_weights(trainer, sampler, mask, cap=3.0)
    # p_trainer / p_sampler = 2, 0.5, 9 (capped at 3); off the mask 1
    torch.testing.assert_close(w, torch.tensor([[2.0, 0.5, 3.0, 1.0]]))
    mean, worst = logprob_gap(trainer, sampler, mask)
    gaps = [math.log(2), math.log(2), math.log(9)]
    assert mean.item() == pytest.approx(sum(gaps) / 3)
    assert worst.item() == pytest.approx(math.log(9))
    # weighted surrogate: -sum(m * w * ratio * A) / sum(m) with ratio 1 (lp == old)
    lp = torch.zeros(1, 4, requires_grad=True)
    adv = torch.tensor([1.0])
    loss = policy_loss(lp, torch.zeros(1, 4), adv, mask, token_weights=w)
    assert loss.item() == pytest.approx(-(2.0 + 0.5 + 3.0) / 3)
    loss.backward()
    torch.testing.assert_close(lp.grad, -torch.tensor([[2.0, 0.5, 3.0, 0.0]]) / 3)
    plain = policy_loss(torch.zeros(1, 4), torch.zeros(1, 4), adv, mask)
    assert plain.item() == pytest.approx(-1.0)
