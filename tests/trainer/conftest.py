"""Fixtures for the trainer tests: a real tiny Llama model built from a config."""

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama(seed: int = 0, vocab: int = 64) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture
def llama():
    return tiny_llama()
