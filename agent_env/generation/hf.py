"""`hf` backend: transformers `generate` with left padding and the sampler's own log-probs.

Choices that keep the sampler's log-probs equal to teacher forcing (cpu-bed.md's pitfalls):
- a fresh transformers GenerationConfig with only our fields, so a checkpoint's
  generation_config.json (repetition penalty, top_k) cannot change the distribution unseen;
- `top_k=0` explicitly: `generate` otherwise samples from the top 50 only;
- left padding with an attention mask; `generate` derives position ids as
  `cumsum(attention_mask) - 1`, which teacher forcing must use too;
- log-probs are `log_softmax` of the *processed* scores (after temperature and top-p), i.e.
  of the distribution actually sampled from.
Stopping: when every stop string is a single token id (hdr's tiny tokenizer makes the tags
special tokens) they join EOS in `eos_token_id`, a one-id check per step; otherwise
`stop_strings` is used and the completion is trimmed after the token that completes it.
"""

from __future__ import annotations

from agent_env.generation.base import GENERATORS, Completion, SamplingParams
from agent_env.prompts import STOP_STRINGS


def _eos_ids(model, tokenizer) -> set[int]:
    ids = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def _single_token_ids(tokenizer, strings) -> list[int] | None:
    ids = []
    for s in strings:
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids.append(encoded[0])
    return ids


class HFGenerator:
    """Batched sampling with a transformers causal LM (shared with the trainer when given)."""

    def __init__(self, model, tokenizer, max_batch: int | None = None) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        self.stop_ids = _single_token_ids(tokenizer, STOP_STRINGS)
        self.stop_strings = None if self.stop_ids is not None else list(STOP_STRINGS)
        self.end_ids = self.eos_ids | set(self.stop_ids or ())

    def sync_weights(self, model) -> None:
        """No-op when the trainer's module is this one; otherwise copy its weights in."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())

    def generate(self, contexts: list[list[int]], params: SamplingParams) -> list[Completion]:
        size = self.max_batch or max(len(contexts), 1)
        out: list[Completion] = []
        for start in range(0, len(contexts), size):
            out += self._generate_batch(contexts[start : start + size], params)
        return out

    def _generation_config(self, params: SamplingParams):
        from transformers import GenerationConfig

        common = dict(
            max_new_tokens=params.max_tokens,
            eos_token_id=sorted(self.end_ids),
            pad_token_id=self.pad_id,
            output_scores=True,
            return_dict_in_generate=True,
            use_cache=True,
        )
        if params.temperature > 0:
            return GenerationConfig(
                do_sample=True,
                temperature=params.temperature,
                top_p=params.top_p,
                top_k=0,
                **common,
            )
        return GenerationConfig(do_sample=False, **common)

    def _generate_batch(self, contexts: list[list[int]], params: SamplingParams):
        import torch

        device = self.model.device
        width = max(len(c) for c in contexts)
        input_ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, ctx in enumerate(contexts):  # left padding
            input_ids[row, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
            attention_mask[row, width - len(ctx) :] = 1
        extra = {}
        if self.stop_strings is not None:
            extra = dict(stop_strings=self.stop_strings, tokenizer=self.tokenizer)
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=self._generation_config(params),
                **extra,
            )
        new = out.sequences[:, width:].cpu()  # (B, N)
        logprobs = torch.stack(  # (B, N): log-prob of each sampled token under the sampler
            [
                torch.log_softmax(step.float(), dim=-1)
                .gather(1, new[:, i : i + 1].to(step.device))
                .squeeze(1)
                .cpu()
                for i, step in enumerate(out.scores)
            ],
            dim=1,
        )
        return [self._trim(new[row].tolist(), logprobs[row].tolist()) for row in range(len(new))]

    def _trim(self, ids: list[int], logprobs: list[float]) -> Completion:
        """Cut after the first stop (stop id, EOS, or the token completing a stop string)."""
        for i, tok in enumerate(ids):
            if tok in self.end_ids:
                return Completion(ids[: i + 1], logprobs[: i + 1], finished=True)
        if self.stop_strings is not None:
            for i in range(len(ids)):
                text = self.tokenizer.decode(ids[: i + 1], skip_special_tokens=False)
                if any(s in text for s in self.stop_strings):
                    return Completion(ids[: i + 1], logprobs[: i + 1], finished=True)
        return Completion(ids, logprobs, finished=False)


@GENERATORS.register("hf")
def build_hf(*, config, model_dir, tokenizer, prompt, model=None) -> HFGenerator:
    """Load `model_dir` with AutoModelForCausalLM unless the trainer passes its module."""
    if model is None:
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            str(model_dir), dtype=getattr(torch, config.dtype)
        )
        model = model.to(config.device).eval()
    return HFGenerator(model, tokenizer, max_batch=config.max_batch)
