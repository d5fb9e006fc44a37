"""`hdr` subcommands of the agent_env package: `hdr init-model`, `hdr rollout`.

Heavy imports (torch, transformers, the generation backends) happen inside the command bodies.
"""

from __future__ import annotations

from pathlib import Path

import typer


def init_model_command(
    out: Path = typer.Option(..., "--out", help="Directory to write the model and tokenizer to."),
    arch: str = typer.Option(
        "llama", "--arch", help="llama (hdr's BPE, fast bed) or qwen2 (Qwen2.5's tokenizer)."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="TinyPolicyConfig override key=value, e.g. --set hidden_size=256."
    ),
) -> None:
    """Build a tiny policy and its tokenizer: a Llama on a BPE trained on the embedded corpus,
    or (--arch qwen2) a Qwen2 model on Qwen2.5's tokenizer."""
    import time

    from agent_env.policy import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts
    from hdr.config import load_config

    config = load_config(TinyPolicyConfig, None, [f"arch={arch}", *overrides])
    start = time.perf_counter()
    texts = vital_corpus_texts() if config.arch == "llama" else []
    init_tiny_policy(out, texts, config)
    typer.echo(f"wrote tiny {config.arch} policy to {out} in {time.perf_counter() - start:.1f}s")


def _rollout_config(config_path: Path | None, prompt: str | None, overrides: list[str]):
    """RolloutConfig from YAML + a prompt preset (if the YAML sets none) + dotted overrides."""
    from agent_env.prompts import PromptConfig
    from agent_env.rollout import RolloutConfig
    from hdr.config import build_config, read_config_file
    from hdr.errors import UserError

    data = read_config_file(config_path) if config_path is not None else {}
    if prompt is not None:
        if prompt not in ("instruct", "compact"):
            raise UserError(f"--prompt must be instruct or compact, not {prompt!r}")
        data.setdefault("prompt", PromptConfig.preset(prompt).model_dump())
    return build_config(RolloutConfig, data, overrides)


def rollout_command(
    model: Path = typer.Option(..., "--model", help="Model dir (from_pretrained); tokenizer too."),
    task: str = typer.Option("wiki-vital", "--task", help="wiki-vital, a .jsonl or a .parquet."),
    split: str = typer.Option("test", "--split", help="wiki-vital split: train, test or all."),
    n: int | None = typer.Option(None, "--n", min=1, help="First N questions (default: all)."),
    group_size: int = typer.Option(1, "--group-size", min=1, help="Responses per question (G)."),
    server: list[str] = typer.Option(
        ["http://127.0.0.1:8000"], "--server", help="Retrieval server URL (repeatable)."
    ),
    retriever: str | None = typer.Option(None, "--retriever", help="dense or bm25."),
    topk: int = typer.Option(3, "--topk", min=1, help="Documents per search."),
    backend: str = typer.Option("hf", "--backend", help="scripted, hf or vllm."),
    oracle: bool = typer.Option(False, "--oracle", help="scripted: answer the gold title if seen."),
    prompt: str | None = typer.Option(None, "--prompt", help="Prompt preset: instruct|compact."),
    config: Path | None = typer.Option(None, "--config", help="YAML with RolloutConfig fields."),
    overrides: list[str] = typer.Option([], "--set", help="RolloutConfig override key=value."),
    batch: int = typer.Option(64, "--batch", min=1, help="Questions per rollout batch."),
    device: str = typer.Option("cpu", "--device", help="torch device for hf."),
    seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    threads: int | None = typer.Option(
        None, "--threads", min=1, help="torch CPU threads (default: torch's choice)."
    ),
    out: Path = typer.Option(
        Path("runs/rollout/trajectories.jsonl"), "--out", help="Trajectories JSONL to write."
    ),
) -> None:
    """Roll out a policy against a retrieval server; write trajectories, print a summary."""
    from agent_env.runner import RolloutJob, run_rollout_job

    job = RolloutJob(
        model=model,
        task=task,
        split=split,
        n=n,
        group_size=group_size,
        servers=server,
        retriever=retriever,
        topk=topk,
        backend=backend,
        oracle=oracle,
        batch=batch,
        device=device,
        seed=seed,
        threads=threads,
        out=out,
    )
    run_rollout_job(job, _rollout_config(config, prompt, overrides))


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.command("init-model")(init_model_command)
    app.command("rollout")(rollout_command)
