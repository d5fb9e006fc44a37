"""`hdr experiment`, `hdr demo`, `hdr report` and `hdr power`: the replay experiment, its
one-run demo, its tables recomputed from committed files, and the power of a design.

`hdr/cli.py` calls `register(app)`. Heavy imports (torch, transformers, matplotlib) happen
inside the command bodies so `hdr --help` answers at once.
"""

from __future__ import annotations

from pathlib import Path

import typer

from core.options import (
    all_overrides,
    overrides_argument,
    register_config,
    set_option,
)

EXPERIMENT_EXAMPLES = """Examples:

  hdr experiment --quick

  hdr experiment --ablations seeds=[1,2,3] train.steps=80

  hdr experiment --preset bridge seeds=[1]

  hdr experiment --preset my-design.yaml --out runs/my-design

  hdr experiment --preset powered --preset powered-ablations

Presets: the YAML files of configs/experiments/, each read on main.yaml.
--bridge is --preset bridge; --ablations is --preset ablations.
"""

DEMO_EXAMPLE = """Examples:

  hdr demo --data-dir data --out runs/demo train.steps=20

  .venv-vllm/bin/hdr demo --model smollm2    # a real model (vLLM's CPU engine: make demo-smollm2)
"""

# `hdr demo --model NAME`: the policy bed and the preset (configs/experiments/) that runs it
DEMO_PRESETS = {"tiny": "demo", "smollm2": "demo-smollm2"}

POWER_EXAMPLE = """Example (a pilot: on_policy and headroom_drift, 2 seeds, the design's settings):

  hdr power --pilot runs/pilot --seeds 3,5,8 --questions 910 --k 8
"""


def power_command(
    pilot: list[Path] = typer.Option(..., "--pilot", help="Pilot experiment out dir (repeatable)."),
    seeds: str = typer.Option("3,5,8", "--seeds", help="Seed counts to size (comma-separated)."),
    questions: str = typer.Option("910", "--questions", help="Held-out question counts."),
    k: str = typer.Option("8", "--k", help="Samples per question (comma-separated)."),
    pair: list[str] = typer.Option(
        None,
        "--pair",
        help="ARM,REFERENCE[,METRIC] to size (repeatable; default: the pilot's contrasts).",
    ),
    alpha: float = typer.Option(0.05, "--alpha", min=1e-6, max=0.5, help="Two-sided level."),
    power: float = typer.Option(0.8, "--power", min=0.05, max=0.999, help="Power to detect."),
) -> None:
    """The minimum detectable effect of each contrast for each design (seeds x questions x
    k), from the variances measured on pilot runs; and each pilot run's gain over the SFT
    start against three times the primary contrast's MDE (the go/no-go)."""
    from core.errors import UserError
    from experiment.power import Design, power_table, print_power

    def counts(text: str, what: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise UserError(f"--{what} takes comma-separated whole numbers, not {text!r}") from None
        if not values or min(values) < 1:
            raise UserError(f"--{what} needs positive whole numbers, not {text!r}")
        return values

    designs = [
        Design(s, q, kk)
        for s in counts(seeds, "seeds")
        for q in counts(questions, "questions")
        for kk in counts(k, "k")
    ]
    if min(d.seeds for d in designs) < 2:
        raise UserError("--seeds: an interval over seeds needs at least 2")
    pairs = None
    if pair:
        pairs = []
        for text in pair:
            parts = [p.strip() for p in text.split(",")]
            if len(parts) not in (2, 3):
                raise UserError(f"--pair takes ARM,REFERENCE[,METRIC], not {text!r}")
            metric = parts[2] if len(parts) == 3 else "mean_at_k"
            if metric not in ("mean_at_k", "best_at_k", "greedy_em"):
                raise UserError("--pair metric must be mean_at_k, best_at_k or greedy_em")
            pairs.append((parts[0], parts[1], metric, not pairs))
    rows, notes = power_table(pilot, designs, pairs, alpha, power)
    typer.echo(print_power(rows, notes, designs))


def experiment_command(
    data_dir: Path = typer.Option(
        Path("data"), "--data-dir", help="Directory of the corpus, index and cached SFT start."
    ),
    out: Path = typer.Option(None, "--out", help="Results dir (default runs/experiment)."),
    ablations: bool = typer.Option(
        False,
        "--ablations",
        help="headroom_only, drift_only, headroom_drift_l1 vs headroom_drift (preset ablations).",
    ),
    quick: bool = typer.Option(
        False,
        "--quick",
        help="A few-minute version (pipeline check; preset quick or quick-bridge).",
    ),
    bridge: bool = typer.Option(
        False,
        "--bridge",
        help="The multi-turn wiki-bridge task with an emulated search-API cost (preset bridge).",
    ),
    presets: list[str] = typer.Option(
        None,
        "--preset",
        help="A preset by name (a file of configs/experiments/, e.g. bridge) or a YAML path;"
        " read after main.yaml and before --bridge/--ablations/--quick. Repeat it to lay one"
        " preset over another (--preset powered --preset powered-ablations).",
    ),
    base_config: Path | None = typer.Option(
        None,
        "--config",
        "-c",
        help="Base TrainConfig YAML (default: the presets' base_config, else"
        " configs/tiny-cpu.yaml).",
    ),
    overrides: list[str] = overrides_argument("ExperimentConfig", "seeds=[1,2,3]"),
    set_: list[str] = set_option(),
) -> None:
    """Train every arm with the same SFT start, seeds and held-out questions against a real
    `hdr serve`; write results.json, results.md and charts."""
    from experiment.pipeline import run_experiment

    flags = [name for name, on in (("bridge", bridge), ("ablations", ablations)) if on]
    overrides = all_overrides(overrides, set_)
    cfg = command_config(presets or [], flags, quick, overrides, data_dir, out, base_config)
    out_dir = run_experiment(cfg)
    typer.echo((out_dir / "results.md").read_text())
    typer.echo(f"results: {out_dir / 'results.md'}, {out_dir / 'results.json'}")
    typer.echo(f"charts: {out_dir / 'charts'}")


def command_config(
    presets: list[str],
    flags: list[str],
    quick: bool,
    overrides: list[str],
    data_dir: Path,
    out: Path | None,
    base_config: Path | None,
):
    """The ExperimentConfig `hdr experiment` runs: main.yaml, the presets, the flags' presets,
    the options, the overrides. The presets' base config stands unless `--config` names one."""
    from experiment.config import experiment_config

    if not presets:
        default_out = ("bridge-" if "bridge" in flags else "") + (
            "ablations" if "ablations" in flags else "experiment"
        )
    else:  # runs/<last preset's name>, joined by the flags' presets: runs/my-design-ablations
        default_out = "-".join([Path(presets[-1]).stem, *flags])
    return experiment_config(
        *presets,
        *flags,
        quick=quick,
        overrides=overrides,
        data_dir=data_dir,
        out_dir=out or Path("runs") / default_out,
        **({"base_config": base_config} if base_config else {}),
    )


REPORT_EXAMPLE = """Example (the committed sample; a full experiment's out dir reads the same):

  hdr report --from tests/experiment/fixtures/report-sample --out runs/report-sample
"""


def report_command(
    source: Path = typer.Option(
        ..., "--from", help="An experiment's files: experiment_config.json and runs/."
    ),
    out: Path = typer.Option(
        None,
        "--out",
        help="Also write results.md, results.json and the charts here: a new folder, or the"
        " --export folder (beside the evidence).",
    ),
    export: Path = typer.Option(
        None,
        "--export",
        help="Also copy the files this recompute reads (per-question evaluations gzipped, run"
        " metrics, configs: a few MB) into this new folder, to commit beside the results.",
    ),
    force: bool = typer.Option(
        False, "--force", help="Replace an earlier --export folder (and the results in it)."
    ),
) -> None:
    """Recompute every table (contrasts, precondition, quality at matched and modelled cost,
    the ledger) from an experiment's per-question, per-seed evaluation files and run metrics.
    `--out` may name the `--export` folder: the results then sit beside their evidence."""
    from core.paths import EXPERIMENT, check_output, write_json_atomic, write_text_atomic
    from experiment.recompute import export_evidence, finished_runs, ignored_by_git, recompute

    beside = None not in (out, export) and out.resolve() == export.resolve()
    if out is not None and not beside:  # refused before any work, never over another's file
        out = check_output(out, EXPERIMENT, inputs=[source])
    if export is not None:
        export = check_output(export, EXPERIMENT, inputs=[source], option="--export", force=force)
        out = export if beside else out
    if export is not None and out is None and not finished_runs(Path(source)):
        # the SFT start's evaluation alone, so that another session need not evaluate it again
        typer.echo(f"{source}: no run has finished yet; exporting the evaluated start alone")
    else:
        charts = out / "charts" if out is not None else None
        # beside the evidence, earlier charts go as the export's check (--force) allowed
        summary, cfg, markdown = recompute(source, charts, replace_charts=beside)
        typer.echo(markdown)
        if out is not None:
            write_json_atomic(out / "results.json", {**vars(summary), "config": cfg})
            write_text_atomic(out / "results.md", markdown)
            typer.echo(f"wrote {out / 'results.md'} and {out / 'results.json'}")
    if export is not None:
        written = export_evidence(source, export)
        size = sum((export / name).stat().st_size for name in written)
        typer.echo(f"exported {len(written)} files ({size / 2**20:.1f} MiB) to {export}")
        ignored = ignored_by_git(export, written)
        if ignored:  # an export is made to be committed: say loudly what git would leave out
            typer.echo(
                f"warning: git ignores {len(ignored)} of the exported files, so `git add` skips"
                f" them (first: {ignored[0]}); change the ignore rule or use `git add -f`",
                err=True,
            )


def demo_command(
    data_dir: Path = typer.Option(
        Path("data"), "--data-dir", help="Directory of the corpus, index and cached SFT start."
    ),
    out: Path | None = typer.Option(
        None,
        "--out",
        help="Directory of the demo's run, results and charts (default: runs/demo, or"
        " runs/demo-MODEL).",
    ),
    model: str = typer.Option(
        "tiny",
        "--model",
        help="The policy: tiny (hdr's own, fast) or smollm2 (SmolLM2-135M-Instruct, a real"
        " model; generates on vLLM's CPU engine, in .venv-vllm).",
    ),
    overrides: list[str] = overrides_argument("ExperimentConfig", "train.steps=20"),
    set_: list[str] = set_option(),
) -> None:
    """The whole pipeline on the embedded defaults: corpus, index, server, SFT, a short
    headroom_drift run and its held-out evaluation beside the SFT start."""
    from core.errors import UserError
    from experiment.config import experiment_config
    from experiment.pipeline import run_experiment

    if model not in DEMO_PRESETS:
        raise UserError(f"--model {model!r}: valid: {', '.join(DEMO_PRESETS)}")
    if out is None:
        out = Path("runs/demo" if model == "tiny" else f"runs/demo-{model}")
    cfg = experiment_config(
        DEMO_PRESETS[model],
        overrides=all_overrides(overrides, set_),
        data_dir=data_dir,
        out_dir=out,
    )
    out_dir = run_experiment(cfg)
    typer.echo((out_dir / "results.md").read_text())
    typer.echo(f"results: {out_dir / 'results.md'}, {out_dir / 'results.json'}")
    typer.echo(f"charts: {out_dir / 'charts'}")
    typer.echo(f"run (metrics.jsonl, eval.jsonl, TensorBoard tb/, final model): {out_dir / 'runs'}")


def register(app: typer.Typer) -> None:
    """Add `experiment`, `power`, `demo` and `report` to the root `hdr` app."""
    app.command("experiment", epilog=EXPERIMENT_EXAMPLES)(experiment_command)
    app.command("power", epilog=POWER_EXAMPLE)(power_command)
    app.command("demo", epilog=DEMO_EXAMPLE)(demo_command)
    app.command("report", epilog=REPORT_EXAMPLE)(report_command)
    for command in ("experiment", "demo"):
        register_config(command, "experiment.config:ExperimentConfig")
