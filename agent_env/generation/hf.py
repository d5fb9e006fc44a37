"""`hf` backend: transformers `generate` with left padding, the sampler's own log-probs and an
explicit finish reason per row.

Choices that keep the sampler's log-probs equal to teacher forcing (the pitfalls of
docs/notebook/cpu-bed.md):
- during `generate` the model's own generation config is swapped for a neutral one, so a
  checkpoint's generation_config.json (Qwen2.5-Instruct ships repetition_penalty 1.05, top_k
  20, top_p 0.8) cannot fill the fields we leave unset and change the distribution unseen;
- `top_k=0`: transformers otherwise samples from the top 50 only;
- left padding with an attention mask; `generate` derives position ids as
  `cumsum(attention_mask) - 1`, which teacher forcing must use too;
- temperature and top-p are applied by our own processor list, whose last member
  (`LogprobRecorder`) reads the processed scores: the distribution actually sampled from.
  It keeps one step's scores at a time, so memory does not grow with the number of steps
  times the vocabulary (151,936 entries for Qwen2.5).

Finishing: `FinishTracker`, a stopping criterion, is the only thing that ends a row. At each
step it looks at the newest token of every live row: an EOS id (every id the model's
generation config or the tokenizer names) ends it with "eos"; a stop tag that is a single
token id (hdr's tiny tokenizer) or a stop string completed by the token's text ends it with
"stop". Each token is decoded once, on its own, and checked against the few characters
before it, so detection is linear in length (stop strings are ASCII, which a byte-level
piece decodes intact). The completion is cut right after its own finishing token: nothing a
row samples after it (transformers keeps sampling finished rows until the batch ends) is
returned, and no padding ever is. Characters after the stop string inside the last token
(`>\\n\\n`) stay: they are what the policy wrote.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence

from agent_env.generation.base import GENERATORS, Completion, SamplingParams
from agent_env.prompts import STOP_STRINGS

# contexts of one batch -> extra transformers LogitsProcessors for it (applied before
# temperature/top-p; the reported log-probs are of the distribution they produce)
ProcessorFactory = Callable[[list[list[int]]], Sequence]


def eos_ids(model, tokenizer) -> set[int]:
    """Every end-of-sequence id named by the model's generation config or the tokenizer."""
    ids = set()
    for source in (getattr(model.generation_config, "eos_token_id", None), tokenizer.eos_token_id):
        if isinstance(source, int):
            ids.add(source)
        elif source:
            ids.update(source)
    return ids


def single_token_ids(tokenizer, strings) -> dict[int, str] | None:
    """{id: string} when every string is exactly one token id, else None."""
    ids = {}
    for s in strings:
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids[encoded[0]] = s
    return ids


class FinishTracker:
    """Stopping criterion that records, per row, the step and the reason it finished.

    `finish_step[row]` is the index (within the generated tokens) of the token that ended the
    row, or -1 while it runs; `reason[row]` and `stop_string[row]` say why.
    """

    def __init__(
        self,
        batch: int,
        prompt_width: int,
        eos: set[int],
        stop_ids: dict[int, str],
        stop_strings: Sequence[str],
        decode_one: Callable[[list[int]], list[str]],
    ) -> None:
        import torch

        self.width = prompt_width
        self.eos = eos
        self.stop_ids = stop_ids
        self.stop_strings = tuple(stop_strings)
        self.keep = max((len(s) for s in self.stop_strings), default=1) - 1
        self.decode_one = decode_one
        self.end_ids = torch.tensor(sorted(eos | set(stop_ids)), dtype=torch.long)
        self.done = torch.zeros(batch, dtype=torch.bool)
        self.finish_step = [-1] * batch
        self.reason: list[str | None] = [None] * batch
        self.stop_string: list[str | None] = [None] * batch
        self.tails = [""] * batch  # the last characters of each live row, for split stops

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        step = input_ids.shape[1] - self.width - 1
        last = input_ids[:, -1].cpu()  # (B,)
        live = ~self.done
        ended = live & torch.isin(last, self.end_ids)
        for row in ended.nonzero().flatten().tolist():
            tok = int(last[row])
            if tok in self.eos:
                self._finish(row, step, "eos", None)
            else:
                self._finish(row, step, "stop", self.stop_ids[tok])
        rows = (live & ~ended).nonzero().flatten().tolist()
        if self.stop_strings and rows:
            pieces = self.decode_one([int(last[r]) for r in rows])
            for row, piece in zip(rows, pieces, strict=True):
                text = self.tails[row] + piece
                hit = next((s for s in self.stop_strings if s in text), None)
                if hit is not None:
                    self._finish(row, step, "stop", hit)
                else:
                    self.tails[row] = text[-self.keep :] if self.keep else ""
        return self.done.clone().to(input_ids.device)

    def _finish(self, row: int, step: int, reason: str, stop: str | None) -> None:
        self.done[row] = True
        self.finish_step[row] = step
        self.reason[row] = reason
        self.stop_string[row] = stop


class LogprobRecorder:
    """Last logits processor: log-prob of each sampled token under the processed scores.

    At step k it sees the scores token k is drawn from and, in `input_ids`, token k-1; it
    keeps only the previous step's log-softmax. `finish(new_ids)` adds the last token's.
    """

    def __init__(self) -> None:
        self.prev = None  # (B, V) log-softmax of the previous step
        self.steps: list = []  # (B,) per step

    def __call__(self, input_ids, scores):
        import torch

        if self.prev is not None:
            self.steps.append(self.prev.gather(1, input_ids[:, -1:]).squeeze(1).cpu())
        self.prev = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def finish(self, new_ids):
        """`[B, N]` log-probs of the generated ids `new_ids` `[B, N]`."""
        import torch

        if self.prev is not None and new_ids.shape[1] > len(self.steps):
            last = new_ids[:, -1:].to(self.prev.device)
            self.steps.append(self.prev.gather(1, last).squeeze(1).cpu())
        self.prev = None
        if not self.steps:
            return torch.zeros(new_ids.shape[0], 0)
        return torch.stack(self.steps, dim=1)  # (B, N)


@contextlib.contextmanager
def neutral_generation_defaults(model):
    """Swap in a default GenerationConfig while `generate` runs (see the module docstring)."""
    from transformers import GenerationConfig

    saved = model.generation_config
    model.generation_config = GenerationConfig()
    try:
        yield
    finally:
        model.generation_config = saved


class HFGenerator:
    """Batched sampling with a transformers causal LM (shared with the trainer when given).

    `autocast_dtype` (a torch dtype or None) runs generation under `torch.autocast`, as the
    trainer does when it computes in bf16 on float32 weights. `processor_factory` is the
    extension point for logits processors (a bias, a ban list); with one, the sampler's
    log-probs are of the processed distribution and no longer equal teacher forcing.
    """

    def __init__(
        self,
        model,
        tokenizer,
        max_batch: int | None = None,
        autocast_dtype=None,
        processor_factory: ProcessorFactory | None = None,
        synced_gpus: bool | None = None,
    ) -> None:
        self.model = model
        # transformers' own choice when None: lockstep across processes under ZeRO-3/FSDP,
        # which a multi-turn rollout cannot keep (processes take different numbers of turns)
        self.synced_gpus = synced_gpus
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.autocast_dtype = autocast_dtype
        self.processor_factory = processor_factory
        self.eos_ids = eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else min(self.eos_ids)
        self.stop_ids = single_token_ids(tokenizer, STOP_STRINGS)
        self.stop_strings = () if self.stop_ids is not None else tuple(STOP_STRINGS)

    per_request_seeds = False  # samples from torch's RNG (the trainer forks it per shard)

    def sync_weights(self, model) -> None:
        """No-op when the trainer's module is this one; otherwise copy its weights in."""
        if model is not self.model:
            self.model.load_state_dict(model.state_dict())

    def sleep(self) -> None:
        """Nothing to free: the module is the trainer's (or a plain copy)."""

    def close(self) -> None:
        """Nothing of its own to let go."""

    def generate(
        self, contexts: list[list[int]], params: SamplingParams, seeds: list[int] | None = None
    ) -> list[Completion]:
        size = self.max_batch or max(len(contexts), 1)
        out: list[Completion] = []
        for start in range(0, len(contexts), size):
            out += self._generate_batch(contexts[start : start + size], params)
        return out

    def _decode_one(self, ids: list[int]) -> list[str]:
        return self.tokenizer.batch_decode(
            [[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    def _processors(self, contexts, params: SamplingParams):
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

        processors = list(self.processor_factory(contexts)) if self.processor_factory else []
        if params.temperature > 0 and params.temperature != 1.0:
            processors.append(TemperatureLogitsWarper(params.temperature))
        if params.temperature > 0 and params.top_p < 1.0:
            processors.append(TopPLogitsWarper(params.top_p))
        recorder = LogprobRecorder()
        return LogitsProcessorList([*processors, recorder]), recorder

    def _autocast(self):
        import torch

        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.model.device.type, dtype=self.autocast_dtype)

    def _generate_batch(self, contexts: list[list[int]], params: SamplingParams):
        import torch
        from transformers import GenerationConfig, StoppingCriteriaList

        device = self.model.device
        width = max(len(c) for c in contexts)
        input_ids = torch.full((len(contexts), width), self.pad_id, dtype=torch.long)
        attention_mask = torch.zeros((len(contexts), width), dtype=torch.long)
        for row, ctx in enumerate(contexts):  # left padding
            input_ids[row, width - len(ctx) :] = torch.tensor(ctx, dtype=torch.long)
            attention_mask[row, width - len(ctx) :] = 1
        tracker = FinishTracker(
            len(contexts),
            width,
            self.eos_ids,
            self.stop_ids or {},
            self.stop_strings,
            self._decode_one,
        )
        processors, recorder = self._processors(contexts, params)
        # temperature/top-p live in `processors`; only the tracker ends rows (no eos_token_id)
        config = GenerationConfig(
            do_sample=params.temperature > 0,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            repetition_penalty=1.0,
            max_new_tokens=params.max_tokens,
            pad_token_id=self.pad_id,
            use_cache=True,
        )
        with torch.no_grad(), self._autocast(), neutral_generation_defaults(self.model):
            sequences = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention_mask.to(device),
                generation_config=config,
                logits_processor=processors,
                stopping_criteria=StoppingCriteriaList([tracker]),
                synced_gpus=self.synced_gpus,
            )
        new = sequences[:, width:].cpu()  # (B, N)
        logprobs = recorder.finish(new)  # (B, N)
        out = []
        for row in range(len(contexts)):
            end = tracker.finish_step[row]
            if end < 0:
                ids, lps = new[row].tolist(), logprobs[row].tolist()
                out.append(Completion(ids, lps, "length"))
                continue
            ids, lps = new[row, : end + 1].tolist(), logprobs[row, : end + 1].tolist()
            out.append(Completion(ids, lps, tracker.reason[row], tracker.stop_string[row]))
        return out


@GENERATORS.register("hf")
def build_hf(*, config, model_dir, tokenizer, prompt, model=None) -> HFGenerator:
    """Load `model_dir` with AutoModelForCausalLM unless the trainer passes its module; a
    shared float32 module with a lower `config.dtype` generates under autocast."""
    import torch

    dtype = getattr(torch, config.dtype)
    autocast = None
    if model is None:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        model = model.to(config.device).eval()
    elif dtype != torch.float32 and next(model.parameters()).dtype == torch.float32:
        autocast = dtype
    return HFGenerator(model, tokenizer, max_batch=config.max_batch, autocast_dtype=autocast)
