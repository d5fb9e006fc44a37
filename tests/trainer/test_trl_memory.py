"""Defect 5 of the TRL review, memory: no log-prob computation of the TRL path holds the logits
of a whole micro-batch (`[rows, positions, vocabulary]`).

Two computations run there: TRL 1.16's own (`GRPOTrainer._get_per_token_logps_and_entropies`,
for its loss, its old log-probs and the reference's), which calls the model with TRL's fused
output layer (`trl.trainer.utils.add_fused_lm_head`: tiles of at most 4,096 positions x 32,768
vocabulary entries, recomputed in backward), and hdr's replay scoring (`trainer.scoring`: the
output layer in slices of `HEAD_SLICE` positions). On the Qwen2 bed (Qwen2.5's 151,936-entry
vocabulary) each is held to the unchunked computation (log-probs and entropies from the full
logits) and the largest activation it builds is measured with a dispatch mode that sees every
tensor an operator returns; the same measure on the model's plain forward sees the whole
micro-batch's logits, the shape the review described.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from test_trl import grpo_args, length_reward, questions_stub
from transformers import AutoModelForCausalLM, AutoTokenizer

from headroom_drift.objective import token_entropy
from trainer import scoring
from trainer.integrations.trl_rollout import search_r1_dataset


class LargestActivation(TorchDispatchMode):
    """The bytes of the largest new memory any operator returns inside the block (views of
    its inputs left out), leaving out tensors shaped like one of `model`'s parameters (their
    gradients, the weights' casts)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.parameter_shapes = {tuple(p.shape) for p in model.parameters()}
        self.bytes, self.shape = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or tuple(t.shape) in self.parameter_shapes:
                continue
            storage = t.untyped_storage()
            if storage.data_ptr() not in inputs and storage.nbytes() > self.bytes:
                self.bytes, self.shape = storage.nbytes(), tuple(t.shape)
        return out


def rows(vocab_used: int, n: int, T: int, seed: int = 0):
    """`n` left-padded rows of `T` tokens (row i has 7 * i padding columns)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab_used, (n, T), generator=g)
    mask = torch.ones(n, T, dtype=torch.long)
    for i in range(n):
        mask[i, : 7 * i] = 0
    return ids, mask


def full_logits_scores(model, ids, mask, temperature: float = 1.0):
    """Log-probs and entropies of `ids[:, 1:]` from the whole `[n, T, V]` logits (the
    unchunked computation), `[n, T-1]` each."""
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    logits = logits[:, :-1].float() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
    return lp, token_entropy(logits)


def test_trl_logprobs_are_tiled_and_equal_the_full_logits(qwen_policy_dir, tmp_path):
    from trl import GRPOTrainer
    from trl.trainer.utils import _CHUNKED_LOGPROB_CHUNK_SIZE as VOCAB_TILE

    tokenizer = AutoTokenizer.from_pretrained(str(qwen_policy_dir))
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(str(qwen_policy_dir), dtype=torch.float32),
        reward_funcs=[length_reward], args=grpo_args(tmp_path, temperature=0.7),
        train_dataset=search_r1_dataset(questions_stub()), processing_class=tokenizer,
    )  # fmt: skip
    model = trainer.model
    V = model.config.vocab_size
    n, T, C = 2, 100, 80  # C completion positions scored per row
    ids, mask = rows(5000, n, T)
    seen = LargestActivation(model)
    with seen:
        lp, ent, _ = trainer._get_per_token_logps_and_entropies(
            model, ids, mask, C, compute_entropy=True
        )
        (lp * mask[:, -C:]).sum().backward()  # the loss's backward recomputes TRL's tiles
    assert model.get_output_embeddings().weight.grad.abs().sum() > 0
    whole = n * T * V * 4  # fp32 logits of the micro-batch
    # on the CPU TRL scores every position (n x (T-1)) in tiles of VOCAB_TILE columns
    assert seen.bytes <= n * (T - 1) * VOCAB_TILE * 4 < whole / 4
    plain = LargestActivation(model)
    with torch.no_grad(), plain:  # the measure does see a micro-batch's logits where built
        ref_lp, ref_ent = full_logits_scores(model, ids, mask, temperature=0.7)
    assert plain.bytes >= n * T * V * 4
    policy = mask[:, -C:].bool()
    torch.testing.assert_close(lp.detach()[policy], ref_lp[:, -C:][policy], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent.detach()[policy], ref_ent[:, -C:][policy], atol=1e-4, rtol=1e-5)


def test_hdr_replay_scoring_holds_one_head_slice(qwen_policy_dir, monkeypatch):
    """hdr's scoring (behaviour log-probs, the candidate scan, the reference) holds at most one
    slice of `HEAD_SLICE` positions' logits whatever the rows' length, and equals the full
    logits' log-probs and entropies."""
    model = AutoModelForCausalLM.from_pretrained(str(qwen_policy_dir), dtype=torch.float32)
    V = model.config.vocab_size
    monkeypatch.setattr(scoring, "HEAD_SLICE", 32)  # rows far longer than a slice, cheaply
    n, T = 3, 100
    ids, mask = rows(5000, n, T, seed=1)
    target = mask.clone()
    target[:, : T // 3] = 0  # a prompt: its tokens are not scored
    seen = LargestActivation(model)
    with torch.no_grad(), seen:
        lp, ent = scoring.token_logprobs(model, ids, mask, target, chunk_size=2,
                                         temperature=0.7, with_entropy=True)  # fmt: skip
    wanted = scoring.wanted_targets(mask, target)
    assert wanted > 4 * 32  # several slices per chunk
    assert seen.bytes <= 32 * V * 4 < n * T * V * 4 / 8
    with torch.no_grad():
        ref_lp, ref_ent = full_logits_scores(model, ids, mask, temperature=0.7)
    scored = (target[:, 1:] & mask[:, :-1]).bool()
    assert int(scored.sum()) == wanted
    torch.testing.assert_close(lp[scored], ref_lp[scored], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(ent[scored], ref_ent[scored], atol=1e-4, rtol=1e-5)
