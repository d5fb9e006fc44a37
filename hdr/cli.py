"""The `hdr` command. Each package registers its own subcommands here.

Subcommand bodies import their heavy dependencies (torch, faiss, transformers) lazily so
that `hdr --help` and argument errors answer at once.
"""

from __future__ import annotations

import sys

import typer
from rich.console import Console

from hdr.errors import UserError

app = typer.Typer(
    name="hdr",
    help="Train search agents with GRPO and Headroom-Drift Replay.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _register_all() -> None:
    from agent_env.cli import register as register_agent_env
    from evaluation.cli import register as register_evaluation
    from retrieval_server.cli import register as register_retrieval
    from trainer.cli import register as register_trainer

    register_retrieval(app)
    register_agent_env(app)
    register_trainer(app)
    register_evaluation(app)


_register_all()


def main() -> None:
    try:
        app(standalone_mode=True)
    except UserError as err:
        Console(stderr=True, highlight=False).print(f"hdr: error: {err}", soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
