"""`hdr` subcommands of the models package: `hdr init-model`.

Heavy imports (torch, transformers, tokenizers) happen inside the command body.
"""

from __future__ import annotations

from pathlib import Path

import typer

from core.options import (
    all_overrides,
    force_option,
    overrides_argument,
    register_config,
    set_option,
)

INIT_MODEL_EXAMPLE = """Example:

  hdr init-model --out data/tiny-policy hidden_size=256 num_layers=6
"""


def init_model_command(
    out: Path = typer.Option(..., "--out", help="Directory to write the model and tokenizer to."),
    arch: str = typer.Option(
        "llama", "--arch", help="llama (hdr's BPE, fast bed) or qwen2 (Qwen2.5's tokenizer)."
    ),
    overrides: list[str] = overrides_argument("TinyPolicyConfig", "hidden_size=256"),
    set_: list[str] = set_option(),
    force: bool = force_option(),
) -> None:
    """Build a tiny policy and its tokenizer: a Llama on a BPE trained on the embedded corpus,
    or (--arch qwen2) a Qwen2 model on Qwen2.5's tokenizer."""
    import time

    from core.config import load_config
    from core.paths import MODEL, check_output
    from models.tiny import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts

    config = load_config(TinyPolicyConfig, None, [f"arch={arch}", *all_overrides(overrides, set_)])
    check_output(out, MODEL, force=force)  # before the tokenizer's seconds of training
    start = time.perf_counter()
    texts = vital_corpus_texts() if config.arch == "llama" else []
    init_tiny_policy(out, texts, config, force=force)
    typer.echo(f"wrote tiny {config.arch} policy to {out} in {time.perf_counter() - start:.1f}s")


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.command("init-model", epilog=INIT_MODEL_EXAMPLE)(init_model_command)
    register_config("init-model", "models.tiny:TinyPolicyConfig")
