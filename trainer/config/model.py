"""The policy being trained: its path, dtypes, device and which layers train (`model`)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from core.config import StrictModel


class ModelConfig(StrictModel):
    """The policy being trained."""

    path: str = Field(description="Model directory (save_pretrained / Hub layout) with tokenizer.")
    dtype: Literal["float32"] = Field(
        "float32",
        description="Parameters' dtype: the master weights AdamW steps (float32 only; bfloat16"
        " compute is `compute_dtype`).",
    )
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="Forward/backward matmuls under torch.autocast; parameters, gradients"
        " and optimizer state stay in `dtype` (float32 master weights).",
    )
    device: str = Field("cpu", description="torch device of the trained model (cpu, cuda:0).")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in backward (large models on a GPU)."
    )
    train_layers: int | None = Field(
        None,
        ge=1,
        description="Train only the top N decoder layers and the final norm (the embeddings and"
        " the layers below frozen), and keep the frozen bottom's output per stored group, so"
        " scans and updates run the top N layers only (trainer/frozen_bottom.py); None: train"
        " every parameter.",
    )
    bottom_cache_dtype: Literal["float32", "bfloat16"] = Field(
        "bfloat16", description="train_layers: the dtype the frozen bottom's states are kept in."
    )
    bottom_cache_mib: int = Field(
        1024, ge=1, description="train_layers: most MiB of frozen-bottom states kept (LRU)."
    )

    @field_validator("dtype", mode="before")
    @classmethod
    def _master_weights_in_fp32(cls, v: object) -> object:
        if v != "float32":
            raise ValueError(
                f"{v} parameters under plain AdamW lose every update smaller than their"
                " spacing (at lr 1e-6 nearly all); keep model.dtype=float32 and set"
                " model.compute_dtype=bfloat16 for bf16 compute on fp32 master weights"
            )
        return v
