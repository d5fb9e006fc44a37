"""The `hdr` command. Each package registers its own subcommands here.

Subcommand bodies import their heavy dependencies (torch, faiss, transformers) lazily so
that `hdr --help` and argument errors answer at once.

`main` is the one place where a user's mistake becomes one line on stderr and exit code 2,
whatever the subcommand: a `UserError` raised anywhere (config, files, the server's startup,
an evaluation), and the command-line parser's own complaints (unknown option or subcommand,
bad value), with a "did you mean" where a near name exists. Ctrl-C is "hdr: stopped: ..." and
exit 130, never a traceback (`hdr train` first saves a checkpoint and says how to continue).
"""

from __future__ import annotations

import difflib
import os
import sys
from importlib.metadata import PackageNotFoundError, version

import typer

from core.errors import RunInterrupted, UserError

app = typer.Typer(
    name="hdr",
    help="Train search agents with GRPO and Headroom-Drift Replay.\n\n"
    "Every subcommand takes dotted KEY=VALUE overrides of its config after the options, "
    "e.g. `hdr train --config configs/tiny-cpu.yaml grpo.lr=3e-5`; `hdr SUBCOMMAND --help` "
    "shows an example.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def hdr_version() -> str:
    try:
        return version("hdr")
    except PackageNotFoundError:  # running from a source tree that was never installed
        return "unknown"


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"hdr {hdr_version()}")
        raise typer.Exit()


@app.callback()
def _root(
    _version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """Train search agents with GRPO and Headroom-Drift Replay."""


def _register_all() -> None:
    from agent_env.cli import register as register_agent_env
    from evaluation.cli import register as register_evaluation
    from models.cli import register as register_models
    from retrieval_server.cli import register as register_retrieval
    from trainer.cli import register as register_trainer

    register_retrieval(app)
    register_models(app)
    register_agent_env(app)
    register_trainer(app)
    register_evaluation(app)


_register_all()


def quiet_third_party() -> None:
    """Silence the loading bars of huggingface_hub and transformers (set before they are
    imported): hdr shows its own progress, and their bars fill every log."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def usage_message(err: Exception) -> str:
    """The parser's complaint as one line, with a "did you mean" for an unknown subcommand."""
    ctx = getattr(err, "ctx", None)
    message = err.format_message() if hasattr(err, "format_message") else str(err)
    message = " ".join(message.split())
    command = ctx.command_path if ctx is not None and ctx.command_path else "hdr"
    if command.split()[0] != "hdr":  # the program name as invoked, e.g. a path
        command = " ".join(["hdr", *command.split()[1:]])
    if type(err).__name__ == "NoSuchOption" and ctx is not None:
        message = no_such_option(err.option_name, ctx)
    if message.startswith("No such command") and "Did you mean" not in message and ctx:
        wanted = message.split("'")[1] if "'" in message else ""
        names = ctx.command.list_commands(ctx) if hasattr(ctx.command, "list_commands") else []
        close = difflib.get_close_matches(wanted, names, n=1)
        message += f" Did you mean '{close[0]}'?" if close else f" Commands: {', '.join(names)}."
    return f"{message} (see `{command} --help`)"


def no_such_option(option: str, ctx) -> str:
    """An unknown option, with the option it probably meant (`--confg`: `--config`) or else
    the KEY=VALUE setting (settings are not options: `hdr train steps=4`, not `--steps 4`).
    Hidden synonyms (`--set`) are never suggested."""
    from core.options import keys_like_option

    visible = [
        name
        for param in ctx.command.params
        if not getattr(param, "hidden", False)
        for name in getattr(param, "opts", [])
        if name.startswith("-")
    ]
    close = difflib.get_close_matches(option, visible, n=1, cutoff=0.75)
    if close:
        return f"No such option: {option}. Did you mean {close[0]}?"
    keys = keys_like_option(ctx.info_name or "", option)
    if not keys:
        return f"No such option: {option}."
    meant = " or ".join(f"{key}=VALUE" for key in keys)
    return f"No such option: {option}. Settings are KEY=VALUE arguments: did you mean {meant}?"


def fail(message: str, code: int = 2, label: str = "error") -> None:
    """One line on stderr, then exit."""
    sys.stderr.write(f"hdr: {label}: {message}\n")
    sys.stderr.flush()
    sys.exit(code)


def main(argv: list[str] | None = None) -> None:
    quiet_third_party()
    try:
        result = app(args=argv, prog_name="hdr", standalone_mode=False)
    except UserError as err:
        label = "stopped" if isinstance(err, RunInterrupted) else "error"
        fail(" ".join(str(err).split()) or type(err).__name__, err.exit_code, label)
    except typer.TyperException as err:  # the parser: unknown option or command, bad value
        if type(err).__name__ == "NoArgsIsHelpError":
            sys.exit(0)  # `hdr` or `hdr index` alone: the help was the answer
        fail(usage_message(err), 2)
    except (KeyboardInterrupt, typer.Abort):
        fail("interrupted", 130, "stopped")
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
