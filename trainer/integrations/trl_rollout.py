"""Search-R1 rollouts inside TRL (`hdr[trl]`): TRL's `rollout_func` hook and reward functions.

- `SearchR1Rollout`: TRL's `rollout_func` hook. It runs hdr's multi-turn Search-R1 loop
  (`agent_env.rollout.rollout_groups`) against `hdr serve` or any Search-R1 retrieval server,
  generating with TRL's own engine: the trainer's transformers model through hdr's `hf`
  backend, or TRL's vLLM in colocate or server mode (trainer/integrations/trl_vllm.py;
  colocate run on vLLM's CPU build). It returns the token ids, the sampler's log-probs, and
  `env_mask` (1 on the policy's tokens, 0 on `<information>` blocks and other environment
  text), which TRL multiplies into its loss mask; and each completion's parsed `answer` and
  text for the reward.
- `exact_match_reward`: hdr's exact match as a TRL reward function (`answer` against the
  dataset's `golden_answers` column); `search_r1_reward(config)` the rollout config's reward
  (exact match or F1, with a format term), as hdr's loop computes it.
- `search_r1_dataset`: QA examples as the prompt dataset TRL samples from; the checks of the
  generation settings the rollout can honour (`check_vllm_settings`,
  `check_sampling_settings`, `check_generation_settings`).

The trainer that replays is `trainer/integrations/trl.py`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from trl import GRPOTrainer

from agent_env.data import QAExample
from agent_env.generation.hf import HFGenerator, eos_ids
from agent_env.retrieval_client import RetrievalClient
from agent_env.rewards import exact_match
from agent_env.rollout import (
    RolloutConfig,
    RolloutResult,
    response_reward,
    response_text,
    rollout_groups,
)
from trainer.integrations.trl_vllm import VLLMServerGenerator, colocate_generator

# GRPOConfig's sampling fields at the values under which the sampler draws from
# softmax(logits / temperature), the distribution TRL's loss (its fused output layer) and hdr's
# scoring compute log-probs under; min_p None is TRL's "off"
NEUTRAL_SAMPLING_ARGS: dict[str, tuple] = {
    "top_p": (1.0,),
    "top_k": (0, None),
    "min_p": (None, 0.0),
    "repetition_penalty": (1.0,),
    "generation_kwargs": (None, {}),
}


def search_r1_dataset(examples: Sequence[QAExample]):
    """A `datasets.Dataset` for TRL: `prompt` (the question; the rollout builds the Search-R1
    prompt around it) and `golden_answers` (read by `exact_match_reward`)."""
    from datasets import Dataset

    return Dataset.from_list(
        [{"prompt": e.question, "golden_answers": list(e.golden_answers)} for e in examples]
    )


def exact_match_reward(completions, answer, golden_answers, **kwargs) -> list[float]:
    """hdr's exact match as a TRL reward function: 1.0 when the completion's parsed `answer`
    (from `SearchR1Rollout`) matches a golden answer after normalisation, else 0.0."""
    return [exact_match(a, gold) for a, gold in zip(answer, golden_answers, strict=True)]


def search_r1_reward(config: RolloutConfig):
    """hdr's rollout reward as a TRL reward function: `config.reward` (exact match or F1) of
    the parsed `answer` against `golden_answers`, mixed with the format reward of the
    `response_text` (both from `SearchR1Rollout`) by `config.format_weight`: what hdr's own
    loop rewards with the same rollout config."""

    def reward(completions, answer, golden_answers, response_text, **kwargs) -> list[float]:
        return [
            response_reward(a, gold, text, config)
            for a, gold, text in zip(answer, golden_answers, response_text, strict=True)
        ]

    reward.__name__ = f"search_r1_{config.reward}"  # TRL logs each reward by its name
    return reward


def ended(trajectory, eos_id: int | None) -> list[int]:
    """The token that tells TRL a trajectory ended: `[eos_id]` for one that was not cut
    (answered on `</answer>`, or out of turns) and does not already end on EOS, else `[]`.
    TRL counts a completion whose last id is neither EOS nor padding as truncated (its
    `completions/clipped_ratio`, and `mask_truncated_completions` drops it from the loss); a
    Search-R1 answer ends on the stop string, so without this nearly every one read as cut.
    The EOS joins the environment's tokens (env_mask 0): it is never trained on."""
    ids = trajectory.response_ids
    if trajectory.truncated or eos_id is None or (ids and ids[-1] == eos_id):
        return []
    return [eos_id]


def check_vllm_settings(args) -> None:
    """Refuse, in one line, the colocated-vLLM settings the Search-R1 rollout cannot honour:
    it calls each process's engine with that process's prompts, where TRL's own generation
    first gathers prompts across a tensor-parallel group and wakes a sleeping engine."""
    if not getattr(args, "use_vllm", False) or args.vllm_mode != "colocate":
        return
    if args.vllm_tensor_parallel_size > 1 or args.vllm_enable_sleep_mode:
        raise ValueError(
            "hdr's rollout in TRL's colocate mode supports vllm_tensor_parallel_size=1 without"
            " vllm_enable_sleep_mode; for tensor parallelism or freeing the engine's memory use"
            " vllm_mode=server (trl vllm-serve --tensor_parallel_size N)"
        )


def check_sampling_settings(args) -> None:
    """Refuse, in one line, sampling settings the loss does not see: TRL's log-probs apply the
    temperature only, so a truncated or penalised sampler (top_p < 1, top_k, min_p, a
    repetition penalty, extra generation kwargs) would train on a distribution other than the
    one it sampled from. hdr's own loop refuses `rollout.top_p < 1` for the same reason."""
    changed = [
        f"{name}={getattr(args, name)!r}"
        for name, neutral in NEUTRAL_SAMPLING_ARGS.items()
        if getattr(args, name, None) not in neutral
    ]
    if changed:
        raise ValueError(
            f"hdr's rollout in TRL samples with the temperature only, which is all TRL's loss"
            f" applies; unset {', '.join(changed)} (top_p=1.0, top_k=0, min_p=None,"
            " repetition_penalty=1.0, no generation_kwargs)"
        )


def check_generation_settings(args) -> None:
    """Refuse, in one line, ZeRO-3 generation from sharded weights: transformers then keeps
    every process in lockstep per generated token, and a multi-turn rollout calls `generate`
    as many times as its own trajectories take turns, which differs between processes (the
    processes would wait on each other forever)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    if getattr(args, "use_vllm", False) or args.ds3_gather_for_generation:
        return
    if is_deepspeed_zero3_enabled():
        raise ValueError(
            "hdr's multi-turn rollout under ZeRO-3 needs ds3_gather_for_generation=True (each"
            " process generates whole weights for as many turns as it needs) or use_vllm=True"
        )


class SearchR1Rollout:
    """TRL's `rollout_func`: hdr's multi-turn Search-R1 loop with TRL's generation engine.

    `rollout_func(prompts, trainer) -> dict`: TRL 1.16 passes each process's prompts with
    every prompt repeated `num_generations` times in a row (its `RepeatSampler`), so the
    prompts are read as groups of that size, one completion returned per prompt received.
    Sampling temperature and top-p are TRL's (`GRPOConfig.temperature`, `top_p`), so the
    sampler and TRL's loss see one distribution (`check_sampling_settings` refuses top-p and
    the other settings TRL's loss does not apply); the rest of the turn loop is `config`.
    """

    def __init__(
        self, client: RetrievalClient, config: RolloutConfig, max_batch: int | None = None
    ):
        if config.on_failure == "drop_group":
            raise ValueError(
                "rollout.on_failure=drop_group cannot be used with TRL, which needs one"
                " completion per prompt: use keep (failed searches end with no answer) or raise"
            )
        self.client = client
        self.config = config
        self.max_batch = max_batch  # hf generation: most contexts per generate call
        self.last: RolloutResult | None = None  # the latest rollout (tests, telemetry)

    def __call__(self, prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
        if trainer.use_vllm and trainer.vllm_mode == "server":
            return self.on_main_process(prompts, trainer)
        with self.generator(trainer) as generator:
            return self.run(prompts, trainer, generator)

    def run(self, prompts: list[str], trainer: GRPOTrainer, generator) -> dict[str, list]:
        G = trainer.num_generations if trainer.model.training else trainer.num_generations_eval
        questions = prompts[::G]
        if len(prompts) % G or [q for q in questions for _ in range(G)] != list(prompts):
            raise ValueError(
                f"rollout_func expects each prompt {G} times in a row (TRL's RepeatSampler);"
                " got a different order"
            )
        examples = [
            QAExample(id=f"trl/{i}", question=q, golden_answers=[], data_source="trl")
            for i, q in enumerate(questions)
        ]
        config = self.config.model_copy(
            update={"temperature": trainer.temperature, "top_p": trainer.args.top_p}
        )
        tokenizer = trainer.processing_class
        result = rollout_groups(generator, self.client, tokenizer, examples, G, config)
        self.last = result
        trajectories = [t for group in result.groups for t in group]
        ends = [ended(t, tokenizer.eos_token_id) for t in trajectories]
        return {
            "prompt_ids": [t.prompt_ids for t in trajectories],
            "completion_ids": [
                t.response_ids + end for t, end in zip(trajectories, ends, strict=True)
            ],
            "logprobs": [
                list(t.sampler_logprobs) + [0.0] * len(end)
                for t, end in zip(trajectories, ends, strict=True)
            ],
            "env_mask": [
                t.loss_mask + [0] * len(end) for t, end in zip(trajectories, ends, strict=True)
            ],
            "answer": [t.answer for t in trajectories],
            "response_text": [response_text(t, tokenizer, config) for t in trajectories],
            "searches": [t.searches for t in trajectories],
        }

    @contextlib.contextmanager
    def generator(self, trainer: GRPOTrainer):
        """hdr's generator over TRL's engine for this process: the trainer's own model (gathered
        under ZeRO-3 as TRL's own generation does) or TRL's colocated vLLM."""
        tokenizer = trainer.processing_class
        if trainer.use_vllm:
            model = trainer.accelerator.unwrap_model(trainer.model)
            yield colocate_generator(trainer, eos_ids(model, tokenizer))
            return
        from trl.models import unwrap_model_for_generation

        args = trainer.args
        with unwrap_model_for_generation(
            trainer.model_wrapped,
            trainer.accelerator,
            gather_deepspeed3_params=args.ds3_gather_for_generation,
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs,
        ) as model:
            autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
            # the weights are whole on every process here (check_generation_settings), so no
            # per-token lockstep: each process runs as many turns (generate calls) as it needs
            yield HFGenerator(
                model, tokenizer, self.max_batch, autocast_dtype=autocast, synced_gpus=False
            )

    def on_main_process(self, prompts: list[str], trainer: GRPOTrainer) -> dict[str, list]:
        """vLLM server mode: the server's client lives on the main process only, so every
        process's prompts are rolled out there and each process gets its own slice back."""
        from accelerate.utils import broadcast_object_list, gather_object

        accelerator = trainer.accelerator
        everyone = gather_object(list(prompts))
        out = [None]
        if accelerator.is_main_process:
            model = accelerator.unwrap_model(trainer.model)
            client = trainer.vllm_generation.vllm_client
            generator = VLLMServerGenerator(client, eos_ids(model, trainer.processing_class))
            out = [self.run(everyone, trainer, generator)]
        broadcast_object_list(out, from_process=0)
        start = accelerator.process_index * len(prompts)
        mine = slice(start, start + len(prompts))
        return {key: values[mine] for key, values in out[0].items()}
