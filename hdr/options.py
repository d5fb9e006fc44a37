"""Command-line options that mean the same in every `hdr` subcommand.

Overrides: every subcommand with a config takes dotted `KEY=VALUE` arguments after its
options (`hdr train -c configs/tiny-cpu.yaml grpo.lr=3e-5`, `hdr serve --index data/index
max_topk=20`), each applied to that subcommand's config and validated (unknown keys are errors
with a "did you mean"). `--set KEY=VALUE` is accepted as a synonym so older scripts still run;
the documentation shows the positional form only.
"""

from __future__ import annotations

from typing import Any

import typer


def overrides_argument(config: str, example: str) -> Any:
    """The positional `KEY=VALUE ...` overrides of `config` (e.g. "TrainConfig")."""
    return typer.Argument(
        None,
        metavar="[KEY=VALUE]...",
        show_default=False,
        help=f"Dotted overrides of the {config}, e.g. {example}.",
    )


def set_option() -> Any:
    """`--set KEY=VALUE`, the hidden synonym of a positional override."""
    return typer.Option([], "--set", hidden=True, help="Same as a KEY=VALUE argument.")


def all_overrides(positional: list[str] | None, via_set: list[str] | None) -> list[str]:
    """`--set` ones first, then the positional ones (later wins on the same key)."""
    return [*(via_set or []), *(positional or [])]


def force_option() -> Any:
    """`--force`: replace an existing output of the same kind (hdr.paths' rule)."""
    from hdr.paths import FORCE_HELP

    return typer.Option(False, "--force", help=FORCE_HELP)
