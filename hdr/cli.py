"""The `hdr` command. Each package registers its own subcommands here.

Subcommand bodies import their heavy dependencies (torch, faiss, transformers) lazily so
that `hdr --help` and argument errors answer at once.

`main` is the one place where a user's mistake becomes one line on stderr and exit code 2,
whatever the subcommand: a `UserError` raised anywhere (config, files, the server's startup,
an evaluation), and the command-line parser's own complaints (unknown option or subcommand,
bad value), with a "did you mean" where a near name exists. Ctrl-C is one "hdr: stopped; ..."
line and exit 130, never a traceback: it says the command line that resumes (`index build`,
`eval`, `sft`, `experiment`, `demo` continue where they stopped when run again; `hdr train`
first saves a checkpoint and prints its own line), or that the command has nothing to resume.

Subcommands without a config (`index build`, `index prepare-wiki`, `plot`, ...) take KEY=VALUE
too: `batch_size=8` is their option `--batch-size 8` (`settings_as_options`), so the root help's
promise holds for every subcommand.
"""

from __future__ import annotations

import difflib
import inspect
import os
import re
import shlex
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version

import typer

from core.errors import RunInterrupted, UserError

app = typer.Typer(
    name="hdr",
    help="Train search agents with GRPO and Headroom-Drift Replay.\n\n"
    "Every subcommand takes KEY=VALUE arguments after its options: dotted overrides of its "
    "config (`hdr train --config configs/tiny-cpu.yaml grpo.lr=3e-5`), or, where it has no "
    "config, its options written as settings (`hdr index build ... batch_size=8` is "
    "`--batch-size 8`). `hdr SUBCOMMAND --help` shows an example.",
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
    from experiment.cli import register as register_experiment
    from models.cli import register as register_models
    from retrieval_server.cli import register as register_retrieval
    from trainer.cli import register as register_trainer

    register_retrieval(app)
    register_models(app)
    register_agent_env(app)
    register_trainer(app)
    register_evaluation(app)
    register_experiment(app)


def reflow(text: str | None) -> str | None:
    """`text` with each paragraph of prose on one line, so that help reads at any terminal
    width: typer keeps the line breaks of a help text's later paragraphs and of epilogs, and
    the source's 100-column lines showed as hard wraps mid-sentence. Indented lines (the
    examples) are kept as they are."""
    if text is None:
        return None
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(
        paragraph if any(line[:1].isspace() for line in paragraph.splitlines())
        else " ".join(paragraph.split())
        for paragraph in paragraphs
    )  # fmt: skip


def reflow_help(typer_app: typer.Typer) -> None:
    """`reflow` every registered command's help and epilog, in groups too."""
    for info in typer_app.registered_commands:
        info.help = reflow(info.help or inspect.getdoc(info.callback))
        info.epilog = reflow(info.epilog)
    for group in typer_app.registered_groups:
        reflow_help(group.typer_instance)


_register_all()
reflow_help(app)


def quiet_third_party() -> None:
    """Silence the loading bars of huggingface_hub and transformers (set before they are
    imported): hdr shows its own progress, and their bars fill every log."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # The one-time ONNX export of the query encoder (retrieval_server.index.encoder, then cached)
    # traces the model, and torch's tracer and exporter warn about constructs that are
    # constant for BERT-style encoders; they are no news to a user starting `hdr serve`.
    for message in ONNX_EXPORT_WARNINGS:
        warnings.filterwarnings("ignore", message=message)


ONNX_EXPORT_WARNINGS = (
    r"Converting a tensor to a Python (boolean|index|integer|float)",
    r"Exporting aten::index operator of advanced indexing",
    r"torch\.onnx\.",
)


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
    Hidden synonyms (`--set`) are never suggested; an option that was renamed names the new one."""
    from core.options import RENAMED_OPTIONS, keys_like_option

    now = RENAMED_OPTIONS.get(ctx.info_name or "", {}).get(option)
    if now is not None:
        return f"No such option: {option}. It was renamed: use {now}."

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


SETTING = re.compile(r"([A-Za-z_][A-Za-z0-9_-]*)=(.*)", re.DOTALL)
RESUMED_BY_RERUN = ("index build", "eval", "sft", "experiment", "demo")
"""Subcommands that continue where they stopped when the same command line is run again."""


def resolve_command(argv: list[str]):
    """The click command `argv` names and how many words name it (`index build`: 2)."""
    import typer.main

    command = typer.main.get_command(app)
    ctx = typer.Context(command)
    used = 0
    while used < len(argv) and hasattr(command, "get_command"):
        sub = command.get_command(ctx, argv[used])
        if sub is None:
            break
        command, used = sub, used + 1
    return command, used


def settings_as_options(argv: list[str]) -> list[str]:
    """`argv` with each KEY=VALUE given to a subcommand without a config rewritten as its
    option (`batch_size=8`: `--batch-size 8`; `dense=false`: `--no-dense`); a KEY that is no
    option of it is one line naming the options it has."""
    command, used = resolve_command(argv)
    params = getattr(command, "params", None)
    if params is None or used == 0 or any(p.name == "overrides" for p in params):
        return argv
    options = {
        name: param
        for param in params
        if param.param_type_name == "option"
        for name in [*param.opts, *param.secondary_opts]
    }
    out, rest = argv[:used], argv[used:]
    position = 0
    while position < len(rest):
        token = rest[position]
        position += 1
        if token == "--":
            out += rest[position - 1 :]
            break
        setting = SETTING.fullmatch(token)
        if token.startswith("-"):
            out.append(token)
            param = options.get(token.split("=", 1)[0])
            if param is not None and not param.is_flag and "=" not in token:
                out += rest[position : position + 1]  # the option's value, whatever it looks like
                position += 1
        elif setting:
            out += setting_as_option(" ".join(argv[:used]), options, *setting.groups())
        else:
            out.append(token)
    return out


def setting_as_option(command: str, options: dict, key: str, value: str) -> list[str]:
    import yaml

    name = "--" + key.replace("_", "-")
    param = options.get(name)
    if param is None or getattr(param, "hidden", False) or name in param.secondary_opts:
        visible = sorted(
            {p.opts[0] for p in options.values() if not p.hidden and p.opts[0] != "--help"}
        )
        close = difflib.get_close_matches(name, visible, n=1, cutoff=0.6)
        hint = f" Did you mean {close[0]}?" if close else ""
        raise UserError(
            f"`hdr {command}` has no setting {key}: it has no config, and its KEY=VALUE"
            f" arguments are its options ({', '.join(visible)}).{hint}"
        )
    if not param.is_flag:
        return [name, value]
    try:
        on = yaml.safe_load(value) if value.strip() else None
    except yaml.YAMLError:
        on = None
    if not isinstance(on, bool):
        raise UserError(f"{key}={value}: {name} is a flag; write {key}=true or {key}=false")
    if on:
        return [name]
    return [param.secondary_opts[0]] if param.secondary_opts else []


def interrupted_line(argv: list[str]) -> str:
    """What Ctrl-C leaves: the command line that resumes, or that there is nothing to."""
    _, used = resolve_command(argv)
    typed = shlex.join(["hdr", *argv])
    if " ".join(argv[:used]) in RESUMED_BY_RERUN:
        return f"to resume run: {typed}"
    return f"this command keeps nothing to resume from; to start it again run: {typed}"


def main(argv: list[str] | None = None) -> None:
    quiet_third_party()
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        result = app(args=settings_as_options(argv), prog_name="hdr", standalone_mode=False)
    except UserError as err:
        label = "stopped" if isinstance(err, RunInterrupted) else "error"
        fail(" ".join(str(err).split()) or type(err).__name__, err.exit_code, label)
    except typer.TyperException as err:  # the parser: unknown option or command, bad value
        if type(err).__name__ == "NoArgsIsHelpError":
            sys.exit(0)  # `hdr` or `hdr index` alone: the help was the answer
        fail(usage_message(err), 2)
    except (KeyboardInterrupt, typer.Abort):
        result = 130
    if result == 130:  # typer's answer to Ctrl-C under standalone_mode=False: Exit(130)
        sys.stderr.write(f"hdr: stopped; {interrupted_line(argv)}\n")
        sys.exit(130)
    sys.exit(result if isinstance(result, int) else 0)


if __name__ == "__main__":
    main()
