"""Biased-logits policies for tests: a real model, real sampling, steered by a logits bias.

`ScriptBias` adds `bias` to the logit of the k-th token of each row's script at the k-th
generated step, so a random model writes chosen text through the real `generate`, the real
stopping and trimming, token by token over the real vocabulary. `scripted_bias(...)` makes
the script from hdr's scripted policy (search the question, answer Doc 1 or the gold title),
optionally followed by text such as "\\n\\n" that a byte-level BPE merges into the closing
tag's last token. A small `bias` on random tokens instead gives a deliberately perturbed
sampler (its log-probs differ from the trainer's).

Import as `from policies import ScriptBias, scripted_bias` (pytest puts tests/ on sys.path).
"""

from __future__ import annotations


class ScriptBias:
    """A transformers logits processor: +`bias` on `scripts[row][k]` at generated step k."""

    def __init__(self, scripts: list[list[int]], bias: float) -> None:
        self.scripts = scripts
        self.bias = bias
        self.start: int | None = None

    def __call__(self, input_ids, scores):
        if self.start is None:
            self.start = input_ids.shape[1]
        k = input_ids.shape[1] - self.start
        for row, script in enumerate(self.scripts):
            if k < len(script):
                scores[row, script[k]] += self.bias
        return scores


def scripted_bias(tokenizer, prompt, oracle=None, after_close: str = "", bias: float = 50.0):
    """A processor factory for HFGenerator: per batch, bias each row toward what the scripted
    policy would write in that context (plus `after_close`)."""
    from agent_env.generation import SamplingParams
    from agent_env.generation.scripted import ScriptedGenerator

    scripted = ScriptedGenerator(tokenizer, prompt, oracle=oracle, after_close=after_close)
    unlimited = SamplingParams(max_tokens=10_000)

    def factory(contexts):
        scripts = [c.token_ids for c in scripted.generate(contexts, unlimited)]
        return [ScriptBias(scripts, bias)]

    return factory
