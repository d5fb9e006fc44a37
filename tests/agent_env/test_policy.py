"""The tiny policy loads with the Auto classes like a real model, tags are single tokens."""

from __future__ import annotations

from agent_env.prompts import TAGS


def test_tiny_policy_loads_like_a_real_model(tiny_policy_dir, tokenizer, tiny_model) -> None:
    assert (tiny_policy_dir / "config.json").is_file()
    assert (tiny_policy_dir / "tokenizer.json").is_file()
    assert len(tokenizer) == 4096
    for tag in TAGS:
        ids = tokenizer.encode(tag, add_special_tokens=False)
        assert len(ids) == 1, tag
        assert tokenizer.decode(ids, skip_special_tokens=False) == tag
    config = tiny_model.config
    assert config.model_type == "llama"
    assert (config.hidden_size, config.num_hidden_layers, config.intermediate_size) == (128, 4, 512)
    assert tiny_model.get_input_embeddings().weight is tiny_model.get_output_embeddings().weight
    params = sum(p.numel() for p in tiny_model.parameters())
    assert 1.4e6 < params < 1.8e6
    encoded = tokenizer("Question: 1968 film\n").input_ids
    assert encoded[0] == tokenizer.bos_token_id
    assert {tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.bos_token_id} == {0, 1, 2}


def test_byte_level_roundtrip(tokenizer) -> None:
    text = '\n\n<information>Doc 1(Title: "Émile Zola") naïve 東京 — ok</information>\n\n'
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=False) == text
