"""Training above a frozen bottom (`model.train_layers`) on a real tiny Llama: the kept
states give the scores the whole backbone gives, only the top layers train, a group's states
are the same numbers however often they are computed, and the vLLM sync sends what trains."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_llama

from headroom_drift import GroupTensors, make_group
from trainer.frozen_bottom import attach, attached, cast_frozen_once, freeze_below
from trainer.scoring import left_pad, score_groups, token_logprobs


def groups(seed: int, count: int = 3) -> list:
    """`count` groups of 3 left-padded rows of different lengths, a loss mask on the tail."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(count):
        rows = [torch.randint(1, 64, (n,), generator=g).tolist() for n in (6 + k, 9, 5 + 2 * k)]
        ids, attn = left_pad(rows), left_pad([[1] * len(r) for r in rows])
        mask = attn.float() * (torch.arange(ids.shape[1]) >= ids.shape[1] - 3).float()
        zeros = torch.zeros(3)
        tensors = GroupTensors(ids, attn, mask, torch.zeros_like(mask), zeros, zeros)
        out.append(make_group(f"g{seed}/{k}", tensors, 1))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kept_states_score_as_the_whole_backbone(dtype):
    plain, split = tiny_llama(seed=3), tiny_llama(seed=3)
    attach(split, 1, dtype, 1 << 20)
    stored = groups(0)
    with torch.no_grad():
        want = score_groups(plain, stored)
        got = score_groups(split, stored)
    tolerance = 1e-6 if dtype == torch.float32 else 2e-2  # bf16 keeps ~3 significant digits
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, atol=tolerance, rtol=0)
    bottom = attached(split)
    assert bottom.computed_tokens == sum(int(g.attention_mask.sum()) for g in stored)
    with torch.no_grad():
        score_groups(split, stored)  # a second scan: no bottom forward at all
    assert bottom.computed_tokens == sum(int(g.attention_mask.sum()) for g in stored)


def test_only_the_top_layers_train_and_get_gradients():
    model = tiny_llama(seed=1)
    trainable = freeze_below(model, 1)
    assert trainable and all(n.startswith(("model.layers.1.", "model.norm.")) for n in trainable)
    attach(model, 1, torch.float32, 1 << 20)
    stored = groups(1)
    lp = score_groups(model, stored, with_grad=True)
    torch.stack([x.sum() for x in lp]).sum().backward()
    got_grad = {n for n, p in model.named_parameters() if p.grad is not None}
    assert got_grad == set(trainable)
    with pytest.raises(ValueError, match="the model has 2 layers"):
        freeze_below(tiny_llama(), 3)


def test_frozen_layers_cast_once_give_the_same_bits_and_follow_their_weights():
    # under bf16 autocast the frozen layers' kept casts change no bit of the scores or of the
    # trained layers' gradients; the cast is kept between forwards and made again when the
    # weight changes in place
    kept, plain = tiny_llama(seed=5), tiny_llama(seed=5)
    attach(kept, 1, torch.float32, 1 << 20)
    freeze_below(plain, 1)
    head = kept.get_output_embeddings()
    assert "forward" in head.__dict__ and "forward" not in plain.get_output_embeddings().__dict__
    stored = groups(5)

    def scores_and_grads(model):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            lp = score_groups(model, stored, with_grad=True)
        torch.stack([x.sum() for x in lp]).sum().backward()
        return lp, [p.grad for p in model.parameters() if p.requires_grad]

    for _ in range(2):  # the second forward runs on the kept casts
        (got, got_grads), (want, want_grads) = scores_and_grads(kept), scores_and_grads(plain)
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads, strict=True))
    cast = head.__dict__["_cast_once"][2]
    scores_and_grads(kept)
    assert head.__dict__["_cast_once"][2] is cast  # kept, not cast again
    x = torch.randn(4, head.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        before = head(x)
        head.weight.mul_(1.5)
        after, want = head(x), torch.nn.Linear.forward(head, x)
    assert torch.equal(after, want) and not torch.equal(after, before)
    assert cast_frozen_once(tiny_llama()) == 0  # nothing frozen: nothing changed


def test_a_groups_states_are_the_same_whenever_computed():
    model = tiny_llama(seed=2)
    bottom = attach(model, 1, torch.float32, max_bytes=1)  # keeps nothing: every call recomputes
    stored = groups(2)
    with torch.no_grad():
        first = score_groups(model, stored)
        again = score_groups(model, list(reversed(stored)))[::-1]  # other groups beside it
    for a, b in zip(first, again, strict=True):
        assert torch.equal(a, b)
    assert bottom.computed_tokens > 2 * sum(int(g.attention_mask.sum()) for g in stored) - 1


def test_rows_never_filled_are_computed_together_and_kept():
    model = tiny_llama(seed=4)
    plain = tiny_llama(seed=4)
    bottom = attach(model, 1, torch.float32, 1 << 20)
    ids = left_pad([[5, 6, 7, 8], [9, 10, 11]])
    attn = left_pad([[1] * 4, [1] * 3])
    with torch.no_grad():
        got, _ = token_logprobs(model, ids, attn)
        want, _ = token_logprobs(plain, ids, attn)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
    assert bottom.computed_tokens == 7


def test_in_a_run_the_replay_scan_forwards_no_bottom_layer(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    # every scanned group had its states kept by its behaviour pass: the selection phase
    # forwards the top layer only (0 bottom tokens), the behaviour pass all of its rows; a run
    # resumed at a smaller replay.capacity keeps the newest groups, logs the others as leaving
    # at its first step, and computes the kept groups' states before it (its scans: 0 too)
    import json

    from conftest import TINY_CPU, tiny_overrides

    from core.config import load_config
    from trainer.config import TrainConfig
    from trainer.loop import train
    from trainer.run import load_train_config

    overrides = tiny_overrides(
        retrieval_url, sft_policy, small_qa, tmp_path / "run", "steps=4", "eval.every=0",
        "checkpoint.save_every=4", "model.train_layers=1", "replay.tau=1.0",
    )  # fmt: skip
    run_dir = train(load_config(TrainConfig, TINY_CPU, overrides))
    ckpt = run_dir / "checkpoints" / "step-000004"
    stored = [g["group_id"] for g in torch.load(ckpt / "replay.pt", weights_only=True)["groups"]]
    assert len(stored) >= 2, "too few stored groups to cut the buffer"
    train(load_train_config(None, ["steps=6", "replay.capacity=1"], ckpt), resume=ckpt)
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    scanned = [r for r in rows if r["scanned_groups"]]
    assert scanned, "no step scanned a stored group"
    for r in rows:
        assert r["bottom_tokens_scoring"] > 0
        assert r["bottom_tokens_selection"] == 0
    assert rows[4]["scanned_groups"] == 1  # the one group kept
    left = [json.loads(x) for x in (run_dir / "groups.jsonl").read_text().splitlines()]
    assert [g["group_id"] for g in left if g["left_step"] == 5][: len(stored) - 1] == stored[:-1]
