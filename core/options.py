"""Command-line options that mean the same in every `hdr` subcommand.

Overrides: every subcommand with a config takes dotted `KEY=VALUE` arguments after its
options (`hdr train -c configs/tiny-cpu.yaml grpo.lr=3e-5`, `hdr serve --index data/index
max_topk=20`), each applied to that subcommand's config and validated (unknown keys are errors
with a "did you mean"). `--set KEY=VALUE` is accepted as a synonym so older scripts still run;
the documentation shows the positional form only.
"""

from __future__ import annotations

import json
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


RENAMED_OPTIONS = {
    "rollout": {"--task": "--data", "--n": "--max-questions"},
    "demo": {"--runs": "--out (--runs R was --out R/demo)"},
}
"""Options an earlier hdr took under another name, by subcommand: given now, they are refused
in one line naming today's option (`hdr.cli.no_such_option`)."""


def all_overrides(positional: list[str] | None, via_set: list[str] | None) -> list[str]:
    """`--set` ones first, then the positional ones (later wins on the same key)."""
    return [*(via_set or []), *(positional or [])]


def force_option() -> Any:
    """`--force`: replace an existing output of the same kind (core.paths' rule)."""
    from core.paths import FORCE_HELP

    return typer.Option(False, "--force", help=FORCE_HELP)


def server_option() -> Any:
    """`--server URL` (repeatable): the retrieval server(s), in every command that talks to one."""
    return typer.Option(
        None,
        "--server",
        help="Retrieval server URL, e.g. http://127.0.0.1:8000 (repeatable; default: the"
        " config's retrieval.urls).",
    )


def server_overrides(servers: list[str] | None) -> list[str]:
    """`--server` values as the override of the config's `retrieval.urls` (none if unset)."""
    return [f"retrieval.urls={json.dumps(servers)}"] if servers else []


CONFIG_MODELS: dict[str, str] = {}
"""Subcommand -> "module:ConfigClass" whose keys its KEY=VALUE arguments set; each package
registers its own, and a mistyped option (`hdr train --steps 4`) is answered with the key."""


def register_config(command: str, model: str) -> None:
    CONFIG_MODELS[command] = model


def config_keys(model: type) -> list[str]:
    """Every dotted key of a pydantic config model, sections expanded; a mapping field that
    names the model of its keys (`json_schema_extra={"keys_of": "module:Model"}`, less those
    listed under "except") too."""
    import importlib

    from pydantic import BaseModel

    keys = []
    for name, field in model.model_fields.items():
        nested = [
            t
            for t in (field.annotation, *getattr(field.annotation, "__args__", ()))
            if isinstance(t, type) and issubclass(t, BaseModel)
        ]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if "keys_of" in extra:
            module, _, attr = str(extra["keys_of"]).partition(":")
            nested = [getattr(importlib.import_module(module), attr)]
        left_out = set(extra.get("except", ()))
        below = [k for k in config_keys(nested[0]) if k not in left_out] if nested else []
        keys += [f"{name}.{k}" for k in below] if nested else [name]
    return keys


def keys_like_option(command: str, option: str) -> list[str]:
    """The config keys of `command` that `--option` most likely meant: same last part
    (`--lr` -> grpo.lr, sft.lr), else a close name (`--out` -> out_dir)."""
    import difflib
    import importlib

    if command not in CONFIG_MODELS:
        return []
    module, _, name = CONFIG_MODELS[command].partition(":")
    keys = config_keys(getattr(importlib.import_module(module), name))
    wanted = option.lstrip("-").replace("-", "_")
    same = [k for k in keys if k.split(".")[-1] == wanted or k == wanted]
    if same:
        return same[:3]
    close = difflib.get_close_matches(wanted, [k.split(".")[-1] for k in keys], n=2, cutoff=0.6)
    return [k for k in keys if k.split(".")[-1] in close][:3]
