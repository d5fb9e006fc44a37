"""The supervised warm start's settings (`sft`, `hdr sft`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from core.config import StrictModel


class SFTConfig(StrictModel):
    """The supervised warm start (`hdr sft`); reads the rest of the training config."""

    init_model: str = Field(
        "data/tiny-policy",
        description="Starting model dir; built with init-model defaults if absent.",
    )
    epochs: int = Field(8, ge=1, description="Passes over the scripted trajectories.")
    train_layers: int | None = Field(
        None,
        ge=1,
        description="Train only the top N decoder layers and the final norm, the frozen"
        " bottom's output computed once per trajectory (as `model.train_layers` in RL);"
        " None: every parameter.",
    )
    lr: float = Field(2e-3, gt=0, description="AdamW peak learning rate.")
    warmup_frac: float = Field(0.03, ge=0, lt=1, description="Share of updates in linear warmup.")
    batch_size: int = Field(32, ge=1, description="Trajectories per update.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW decoupled weight decay.")
    grad_clip: float = Field(1.0, gt=0, description="Gradient L2-norm clip.")
    max_examples: int | None = Field(
        None, ge=1, description="Use only the first N training questions (None: all)."
    )
    split: str | None = Field(
        None,
        description="Split of the training task the trajectories come from (None:"
        " data.train_split); `sft` keeps them apart from the `rl` questions RL then trains on.",
    )
    rollout_chunk: int = Field(512, ge=1, description="Questions per scripted rollout call.")
    query: Literal["verbatim", "shuffled", "subset", "mixed", "suffix"] = Field(
        "verbatim",
        description="The scripted search: the question verbatim, its words in a random order"
        " (shuffled), a random subset of its words in order, each kept with probability 1/2"
        " (subset), the question or such a subset, each half the time (mixed), or its words"
        " from a random one to the end (suffix); one draw per trajectory and epoch. The last four"
        " teach the format without settling which words come first; under"
        " `rollout.max_query_words` that is left to RL.",
    )
    answer: Literal["gold_if_seen", "doc1"] = Field(
        "gold_if_seen",
        description="The scripted answer: the gold title when the search retrieved it, else"
        " Doc 1's (gold_if_seen), or always Doc 1's title (doc1: a rule the policy can read"
        " off what it sees, where the gold at rank 2 or 3 can only be memorised).",
    )
    queries_per_question: int = Field(
        1,
        ge=1,
        description="Scripted trajectories per question, each with its own draw (`shuffled`"
        " or `subset` only): several random subsets of the question's words reach the"
        " retriever.",
    )
    length_batches: bool = Field(
        False,
        description="Batch trajectories of similar lengths (less padding, faster epochs; the"
        " demo's choice) instead of uniformly random batches.",
    )
    eval_questions: int = Field(
        200, ge=0, description="Held-out questions decoded greedily after each epoch (0: none)."
    )
    stop: Literal["epochs", "plateau"] = Field(
        "epochs",
        description="epochs: a cosine schedule over exactly `epochs`. plateau: a constant lr"
        " after warmup until the held-out loss (the scripted trajectories of the held-out"
        " questions) has not improved for `patience` epochs, at most `epochs`, then the best"
        " epoch's weights: a start that converges whenever copying begins.",
    )
    patience: int = Field(2, ge=1, description="plateau: epochs without improvement to stop.")
    min_improvement: float = Field(
        0.01, ge=0, description="plateau: the relative drop in held-out loss that counts."
    )

    @model_validator(mode="after")
    def _copies_need_shuffling(self) -> SFTConfig:
        if self.queries_per_question > 1 and self.query == "verbatim":
            raise ValueError(
                "sft.queries_per_question > 1 repeats the same verbatim trajectory: add"
                " sft.query=shuffled or sft.query=subset"
            )
        return self

    @model_validator(mode="after")
    def _plateau_needs_heldout(self) -> SFTConfig:
        if self.stop == "plateau" and self.eval_questions == 0:
            raise ValueError(
                "sft.stop=plateau watches the held-out loss: add sft.eval_questions=100 (or more)"
            )
        return self
