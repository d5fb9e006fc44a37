"""Teacher-forced scoring on a real tiny Llama: agreement with a plain forward pass, left
padding, target masks, and the drift of a stored group before and after an update."""

import torch

from headroom_drift import (
    GroupTensors,
    ReplayBuffer,
    ScanParams,
    make_group,
    policy_drift,
    policy_loss,
    replay_rule,
)
from headroom_drift.objective import token_entropy
from trainer.scoring import align, left_pad, score_groups, token_logprobs


def plain_logits(model, row: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([row])).logits[0, :-1].float()


def plain_logprobs(model, row: list[int]) -> torch.Tensor:
    targets = torch.tensor(row[1:])
    return torch.log_softmax(plain_logits(model, row), -1).gather(-1, targets[:, None]).squeeze(-1)


def test_left_padded_chunked_scores_match_unpadded_forward(llama):
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (4, 11, 7, 15, 9)]
    ids = left_pad(rows)
    attn = left_pad([[1] * len(r) for r in rows])
    with torch.no_grad():
        lp, ent = token_logprobs(llama, ids, attn, chunk_size=2, with_entropy=True)
    assert lp.shape == (5, 14)
    for i, row in enumerate(rows):
        n = len(row) - 1
        torch.testing.assert_close(lp[i, -n:], plain_logprobs(llama, row), atol=1e-5, rtol=0)
        assert torch.all(lp[i, :-n] == 0)  # padding and the first token are never scored
        plain_entropy = token_entropy(plain_logits(llama, row))
        torch.testing.assert_close(ent[i, -n:], plain_entropy, atol=1e-5, rtol=0)


def test_only_targets_under_the_mask_are_scored(llama):
    row = list(range(1, 13))
    ids = left_pad([row])
    target = torch.zeros(1, 12, dtype=torch.long)
    target[0, 5:8] = 1  # tokens 5, 6, 7 are policy tokens
    with torch.no_grad():
        lp, _ = token_logprobs(llama, ids, torch.ones(1, 12, dtype=torch.long), target)
    full = plain_logprobs(llama, row)
    aligned = align(lp)[0]
    torch.testing.assert_close(aligned[5:8], full[4:7], atol=1e-5, rtol=0)
    assert torch.count_nonzero(aligned) == 3


def make_stored_groups(model, step=0, seed=2):
    """Two groups of 3 responses each, prompt + response, behaviour log-probs scored together
    in one batch (as the training loop does for a step's fresh groups)."""
    g = torch.Generator().manual_seed(seed)
    rows, masks = [], []
    for _ in range(6):
        prompt = torch.randint(1, 64, (int(torch.randint(3, 6, (1,), generator=g)),), generator=g)
        resp = torch.randint(1, 64, (int(torch.randint(4, 9, (1,), generator=g)),), generator=g)
        rows.append(prompt.tolist() + resp.tolist())
        masks.append([0] * len(prompt) + [1] * len(resp))
    ids, loss_mask = left_pad(rows), left_pad(masks)
    attn = left_pad([[1] * len(r) for r in rows])
    with torch.no_grad():
        gen, _ = token_logprobs(model, ids, attn, loss_mask, chunk_size=4)
    gen = align(gen)
    rewards = torch.tensor([1.0, 0.0, 0.0])
    adv = torch.tensor([1.0, -0.5, -0.5])
    return [
        make_group(f"g{k}", GroupTensors(ids[s], attn[s], loss_mask[s], gen[s], rewards, adv), step)
        for k, s in enumerate((slice(0, 3), slice(3, 6)))
    ]


def test_drift_zero_after_ingress_and_grows_after_update(llama):
    groups = make_stored_groups(llama)
    buffer = ReplayBuffer(8)
    buffer.ingest(groups)
    # scored again, in another batch composition (different padding), unchanged weights
    for group, lp in zip(buffer, score_groups(llama, buffer.groups(), chunk_size=2), strict=True):
        assert policy_drift(lp, group.gen_logprobs, group.loss_mask).item() < 1e-10

    target = groups[0]
    opt = torch.optim.AdamW(llama.parameters(), lr=1e-2)
    llama.train()
    for _ in range(3):
        lp, _ = token_logprobs(llama, target.input_ids, target.attention_mask, target.loss_mask)
        loss = policy_loss(
            align(lp), target.gen_logprobs, target.advantages, target.loss_mask, 0.2, 0.2
        )
        opt.zero_grad()
        loss.backward()
        opt.step()
    llama.eval()
    drifts = [
        policy_drift(lp, g.gen_logprobs, g.loss_mask).item()
        for g, lp in zip(buffer, score_groups(llama, buffer.groups()), strict=True)
    ]
    assert all(d > 1e-4 for d in drifts), drifts

    # and the gate now sees it: a tau below the drift admits nothing, above it admits both
    params = ScanParams(budget=2, tau=min(drifts) / 2)
    score = lambda gs: score_groups(llama, gs)  # noqa: E731
    assert replay_rule("headroom_drift")(buffer, 1, params, score).groups == []
    params = ScanParams(budget=2, tau=max(drifts) * 2)
    assert len(replay_rule("headroom_drift")(buffer, 1, params, score).groups) == 2


def test_duplicate_rows_are_scored_once_with_the_same_result(llama):
    from trainer.scoring import unique_rows

    rows = [[5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 8], [9, 10, 11], [5, 6, 7, 9]]
    ids, attn = left_pad(rows), left_pad([[1] * len(r) for r in rows])
    first, inverse = unique_rows(ids, attn, None)
    assert first.tolist() == [0, 1, 4] and inverse.tolist() == [0, 1, 0, 1, 2]
    with torch.no_grad():
        deduped, _ = token_logprobs(llama, ids, attn)
        plain, _ = token_logprobs(llama, ids, attn, dedupe=False)
    torch.testing.assert_close(deduped, plain, atol=1e-6, rtol=0)
    assert torch.equal(deduped[0], deduped[2]) and not torch.equal(deduped[0], deduped[4])
