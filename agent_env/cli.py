"""`hdr` subcommands of the agent_env package: `hdr rollout`.

Heavy imports (torch, transformers, the generation backends) happen inside the command bodies.
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

ROLLOUT_EXAMPLES = """Examples (a retrieval server must be running, see `hdr serve`):

  hdr rollout --model data/tiny-sft --max-questions 64 --group-size 8

  hdr rollout --model data/tiny-policy --prompt compact max_turns=1 doc_words=8

A model saved by hdr carries the prompt and rollout settings it was trained with
(hdr_rollout.yaml); they are used unless --config, --prompt or KEY=VALUE say otherwise.
"""


def _rollout_config(
    model: Path, config_path: Path | None, prompt: str | None, overrides: list[str]
):
    """RolloutConfig from, in order of precedence: dotted overrides, the YAML file, a prompt
    preset, the settings saved with the model (hdr_rollout.yaml), the defaults."""
    from agent_env.policy_settings import SETTINGS_FILE, load_settings
    from agent_env.prompts import PromptConfig
    from agent_env.rollout import RolloutConfig
    from core.config import build_config, read_config_file
    from core.errors import UserError

    data = read_config_file(config_path) if config_path is not None else {}
    if prompt is not None:
        if prompt not in ("instruct", "compact"):
            raise UserError(f"--prompt must be instruct or compact, not {prompt!r}")
        data.setdefault("prompt", PromptConfig.preset(prompt).model_dump())
    saved = load_settings(model)
    if saved is not None and isinstance(saved.get("rollout"), dict):
        for key, value in saved["rollout"].items():
            data.setdefault(key, value)
        typer.echo(f"using the rollout settings saved with the model ({SETTINGS_FILE})", err=True)
    return build_config(RolloutConfig, data, overrides), (saved or {}).get("retrieval") or {}


def rollout_command(
    model: Path = typer.Option(..., "--model", help="Model dir (from_pretrained); tokenizer too."),
    task: str = typer.Option(
        "wiki-vital", "--data", help="wiki-vital, a FlashRAG .jsonl or a Search-R1 .parquet."
    ),
    split: str = typer.Option("test", "--split", help="wiki-vital split: train, test or all."),
    n: int | None = typer.Option(
        None, "--max-questions", min=1, help="Only the first N questions (default: all)."
    ),
    group_size: int = typer.Option(1, "--group-size", min=1, help="Responses per question (G)."),
    server: list[str] = typer.Option(
        ["http://127.0.0.1:8000"], "--server", help="Retrieval server URL (repeatable)."
    ),
    retriever: str | None = typer.Option(
        None, "--retriever", help="dense or bm25 (default: the model's, else the server's)."
    ),
    topk: int | None = typer.Option(
        None, "--topk", min=1, help="Documents per search (default: the model's, else 3)."
    ),
    backend: str = typer.Option("hf", "--backend", help="scripted, hf or vllm."),
    oracle: bool = typer.Option(False, "--oracle", help="scripted: answer the gold title if seen."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt preset: instruct|compact."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="YAML with RolloutConfig fields."
    ),
    overrides: list[str] = overrides_argument("RolloutConfig", "max_turns=1 doc_words=8"),
    set_: list[str] = set_option(),
    batch: int = typer.Option(64, "--batch", min=1, help="Questions per rollout batch."),
    device: str = typer.Option("cpu", "--device", help="torch device for hf."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="torch CPU threads (default: torch's choice)."
    ),
    out: Path = typer.Option(
        Path("runs/rollout/trajectories.jsonl"), "--out", help="Trajectories JSONL to write."
    ),
    force: bool = force_option(),
) -> None:
    """Roll out a policy against a retrieval server; write trajectories, print a summary."""
    from agent_env.runner import RolloutJob, run_rollout_job

    rollout_config, saved_retrieval = _rollout_config(
        model, config, prompt, all_overrides(overrides, set_)
    )
    job = RolloutJob(
        model=model,
        task=task,
        split=split,
        n=n,
        group_size=group_size,
        servers=server,
        retriever=retriever or saved_retrieval.get("retriever"),
        topk=topk or saved_retrieval.get("topk") or 3,
        backend=backend,
        oracle=oracle,
        batch=batch,
        device=device,
        seed=seed,
        threads=threads,
        out=out,
        force=force,
    )
    run_rollout_job(job, rollout_config)


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.command("rollout", epilog=ROLLOUT_EXAMPLES)(rollout_command)
    register_config("rollout", "agent_env.rollout:RolloutConfig")
