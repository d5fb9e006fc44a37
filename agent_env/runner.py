"""`hdr rollout` as a function: load a task, a policy and a client; roll out in batches;
write trajectories as JSONL; print a summary. The benchmark and the scripted reference call it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from core.errors import UserError, warn
from core.paths import TRAJECTORIES, check_output, local_model, looks_like_hub_id


@dataclass
class RolloutJob:
    model: Path
    task: str = "wiki-vital"
    split: str = "test"
    n: int | None = None
    group_size: int = 1
    servers: list[str] = field(default_factory=lambda: ["http://127.0.0.1:8000"])
    retriever: str | None = None
    topk: int = 3
    backend: str = "hf"
    oracle: bool = False
    batch: int = 64
    device: str = "cpu"
    seed: int = 0
    threads: int | None = None
    out: Path | None = None
    force: bool = False  # replace an existing trajectories file at `out`


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")
MODEL_HINT = "`hdr init-model --out DIR` builds a tiny policy, `hdr sft` trains one"


def load_tokenizer(model_dir: str | Path):
    """The tokenizer saved in `model_dir`; a missing or unreadable one is one UserError line
    (transformers would otherwise guess a tokenizer class and fail deep inside it)."""
    from transformers import AutoTokenizer

    hub_id = not Path(model_dir).exists() and looks_like_hub_id(str(model_dir))
    model_dir = Path(local_model(model_dir, MODEL_HINT))  # a missing path: one line, no hub
    if not hub_id and not any((model_dir / name).is_file() for name in TOKENIZER_FILES):
        raise UserError(
            f"no tokenizer in {model_dir} (expected tokenizer.json or tokenizer_config.json,"
            " as save_pretrained writes them)"
        )
    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, ImportError, TypeError, KeyError) as err:
        if hub_id:
            raise UserError(
                f"model not found: {model_dir} (no such directory, nor a Hub model available"
                " offline)"
            ) from None
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise UserError(f"cannot load the tokenizer in {model_dir}: {first}") from None


def make_generator(job: RolloutJob, tokenizer, config, examples):
    from agent_env.generation import GenerationConfig, build_generator
    from agent_env.generation.scripted import ScriptedGenerator

    if job.oracle:
        if job.backend != "scripted":
            raise UserError("--oracle only applies to --backend scripted")
        answers = {ex.question: ex.golden_answers for ex in examples}
        return ScriptedGenerator(tokenizer, config.prompt, oracle=answers)
    gen_config = GenerationConfig(backend=job.backend, device=job.device, seed=job.seed)
    return build_generator(
        gen_config, model_dir=job.model, tokenizer=tokenizer, prompt=config.prompt
    )


def run_rollout_job(job: RolloutJob, config, console: Console | None = None) -> dict:
    """Run the job; returns the summary (also printed). Trajectories go to `job.out`."""
    import torch

    from agent_env.data import load_task
    from agent_env.retrieval_client import RetrievalConfig, connect
    from agent_env.rollout import rollout_groups, summarize, trajectory_record
    from core.config import build_config
    from core.progress import progress

    console = console or Console()
    torch.manual_seed(job.seed)
    if job.threads is not None:
        torch.set_num_threads(job.threads)
    tokenizer = load_tokenizer(job.model)
    if job.out is not None:  # before any work: never over another file, never over the model
        check_output(job.out, TRAJECTORIES, force=job.force, inputs=[job.model])
    examples = load_task(job.task, job.split)[: job.n]
    if not examples:
        raise UserError(f"task {job.task!r} ({job.split}) has no questions")
    generator = make_generator(job, tokenizer, config, examples)
    client_config = build_config(
        RetrievalConfig, {"urls": job.servers, "topk": job.topk, "retriever": job.retriever}
    )
    totals = dict(gen_time=0.0, retrieval_time=0.0, wall_time=0.0, env_calls=0, retrieval_calls=0)
    trajectories, dropped = [], 0
    staged = None
    if job.out is not None:  # written beside `out`, renamed into place when complete
        job.out.parent.mkdir(parents=True, exist_ok=True)
        staged = job.out.with_name(f".{job.out.name}.{os.getpid()}.tmp")
    sink = staged.open("w") if staged is not None else None
    start = time.perf_counter()
    try:
        with (
            connect(client_config, seed=job.seed) as client,
            progress(desc="rollout", total=len(examples), unit="q", leave=False) as bar,
        ):
            for lo in range(0, len(examples), job.batch):
                chunk = examples[lo : lo + job.batch]
                result = rollout_groups(generator, client, tokenizer, chunk, job.group_size, config)
                for key in totals:
                    totals[key] += getattr(result, key)
                dropped += len(result.dropped)
                for group in result.groups + result.dropped:
                    trajectories += group
                    if sink is not None:
                        for traj in group:
                            sink.write(json.dumps(trajectory_record(traj, tokenizer)) + "\n")
                bar.update(len(chunk))
            in_flight = client.stats.max_in_flight
        if sink is not None:
            sink.close()
            os.replace(staged, job.out)
    finally:
        if sink is not None:
            sink.close()
            staged.unlink(missing_ok=True)
    total_time = time.perf_counter() - start
    summary = {
        **summarize(trajectories),
        **totals,
        "dropped_groups": dropped,
        "total_time": total_time,
        "trajectories_per_s": len(trajectories) / max(totals["wall_time"], 1e-9),
        "max_concurrent_requests": in_flight,
    }
    print_summary(summary, job, console)
    if trajectories and summary["env_calls"] == 0:
        warn(
            "the rollout made no retrieval calls: the policy never searched. Is this the prompt"
            " it was trained with? (--prompt, --config or rollout KEY=VALUE overrides)"
        )
    return summary


def print_summary(summary: dict, job: RolloutJob, console: Console) -> None:
    table = Table(title=f"hdr rollout: {job.task} ({job.split}), backend {job.backend}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    wall = max(summary["wall_time"], 1e-9)
    other = wall - summary["gen_time"] - summary["retrieval_time"]
    rows = [
        ("trajectories", f"{summary['trajectories']}"),
        ("exact match", f"{summary['exact_match']:.3f}"),
        ("reward", f"{summary['reward']:.3f}"),
        ("turns / trajectory", f"{summary['turns']:.2f}"),
        ("searches / trajectory", f"{summary['searches']:.2f}"),
        ("valid actions", f"{summary['valid_action_rate']:.3f}"),
        ("answered", f"{summary['answered']:.3f}"),
        ("failed (retrieval)", f"{summary['failed']}"),
        ("dropped groups", f"{summary['dropped_groups']}"),
        ("env calls (HTTP requests)", f"{summary['env_calls']}"),
        ("rollout wall time", f"{wall:.2f} s"),
        ("  generation", f"{summary['gen_time']:.2f} s ({summary['gen_time'] / wall:.0%})"),
        (
            "  retrieval",
            f"{summary['retrieval_time']:.2f} s ({summary['retrieval_time'] / wall:.0%})",
        ),
        ("  other", f"{other:.2f} s ({other / wall:.0%})"),
        ("trajectories / s", f"{summary['trajectories_per_s']:.1f}"),
    ]
    for name, value in rows:
        table.add_row(name, value)
    console.print(table)
    if job.out is not None:
        console.print(f"trajectories written to {job.out}")
