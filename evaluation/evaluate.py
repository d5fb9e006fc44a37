"""Held-out evaluation: Mean@k, Best@k and greedy EM through the full rollout loop.

For every question, `k` responses are sampled (at the rollout config's temperature unless the
eval config sets one) and, optionally, one is decoded greedily, each through agent_env's
multi-turn loop (`rollout_groups`: generate, search the retrieval server, observe, answer).
A response is correct when its answer is an exact match of a golden answer (SQuAD
normalisation, `agent_env.rewards.exact_match`), whatever reward the rollout config trains
with. Numbers per dataset, their plain average and the average weighted by dataset size, as
the paper reports them (`evaluation.metrics`).

Datasets: FlashRAG JSONL, Search-R1 parquet (agent_env.data loaders) or the name `wiki-vital`
(the embedded task's test split). Search-R1's seven test sets are named from `data_source`
or the file name; one parquet holding several of them is split by `data_source`.

Reproducible and safe to interrupt: questions are processed in chunks and each chunk's
sampling is seeded from `(seed, dataset, chunk start)` inside a forked RNG (the caller's
torch RNG state is left as it was, which matters when the trainer evaluates in-process); a
backend that seeds each request (vLLM) gets one seed per question and sample, a hash of
(seed, question id, sample index), so a question's draws depend on neither its chunk nor the
other questions.
With an output directory every finished chunk is appended to `partial.jsonl`; a rerun with
the same model, data and settings skips the chunks already there (a broken last line is
ignored) and gives the numbers an uninterrupted run would. `eval.json` and `eval.md` are
written atomically at the end, so no half-written result file ever exists.

Departures from the paper's evaluation: a retrieval failure aborts the evaluation (rerun to
resume) instead of scoring the affected responses as wrong.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, Field, PrivateAttr

from agent_env.generation import GenerationConfig
from agent_env.retrieval_client import RetrievalConfig
from agent_env.rewards import best_at_k, mean_at_k, per_question_best, per_question_mean
from agent_env.rollout import RolloutConfig
from core.config import StrictModel
from core.errors import UserError, warn
from core.fingerprint import differences, digest, summary
from core.paths import EVAL, check_output, local_model, write_json_atomic, write_text_atomic
from evaluation.metrics import (
    WIKI_VITAL,
    average_scores,
    dataset_order,
    markdown_table,
    recognize_dataset,
    score_dataset,
)

__all__ = [
    "DatasetResult",
    "EvalConfig",
    "EvalDataset",
    "EvalReport",
    "best_at_k",
    "evaluate",
    "evaluate_policy",
    "load_eval_datasets",
    "mean_at_k",
]

PARTIAL = "partial.jsonl"


class EvalConfig(StrictModel):
    """How to evaluate: samples per question, decoding, chunking, and the rollout settings
    (the prompt must be the one the model was trained with)."""

    k: int = Field(8, ge=1, description="Sampled responses per question (Mean@k, Best@k).")
    greedy: bool = Field(True, description="Also decode one response greedily (greedy EM).")
    temperature: float | None = Field(
        None, gt=0, description="Sampling temperature; None: the rollout config's."
    )
    seed: int = Field(0, description="Seed of the sampling; chunks derive theirs from it.")
    max_questions: int | None = Field(
        None, ge=1, description="Evaluate only the first N questions of each dataset."
    )
    chunk_questions: int = Field(
        16, ge=1, description="Questions per rollout call (k x this many sequences at once)."
    )
    progress: bool = Field(True, description="Show a progress bar on stderr.")
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    retrieval: RetrievalConfig = Field(default_factory=RetrievalConfig)

    @property
    def sample_temperature(self) -> float:
        return self.temperature if self.temperature is not None else self.rollout.temperature


@dataclass(frozen=True)
class EvalDataset:
    """One dataset's questions (agent_env QAExamples) and the files they came from."""

    name: str
    examples: list[Any]
    sources: tuple[str, ...]


class DatasetResult(BaseModel):
    """One dataset: the scores and, per question, which responses were correct."""

    dataset: str
    sources: list[str]
    num_questions: int
    k: int
    mean_at_k: float
    best_at_k: float
    greedy_em: float | None
    question_ids: list[str]
    correct: list[list[int]]  # [Q, k] 0/1
    greedy: list[int] | None  # [Q] 0/1
    greedy_answers: list[str | None] | None
    env_calls: int
    responses_sha: str = Field(description="Hash of every response's token ids (reproducibility).")
    behaviour: list[list[list[int]]] | None = Field(
        None,
        description="[Q][k] `evaluation.behaviour.Behaviour` rows of the sampled responses"
        " (None in evaluations written before hdr recorded them).",
    )

    def behaviour_summary(self) -> dict | None:
        """Format, reading and searching numbers of the sampled responses
        (`evaluation.behaviour.summarize_behaviour`); None where none were recorded."""
        if self.behaviour is None:
            return None
        from evaluation.behaviour import summarize_behaviour

        rows = [row for question in self.behaviour for row in question]
        right = [c for question in self.correct for c in question]
        return summarize_behaviour(rows, right)


class EvalReport(BaseModel):
    """What `evaluate` returns and writes as `eval.json`."""

    model: str
    k: int
    temperature: float
    greedy: bool
    seed: int
    datasets: list[DatasetResult]
    average: dict[str, float | int | None]  # plain ("Avg") and weighted averages
    env_calls: int
    wall_time: float = Field(description="Seconds of rollout (resumed chunks: as first run).")
    gen_time: float
    retrieval_time: float
    fingerprint: str | None = Field(
        None, description="Model, weights, questions and settings hashed: a rerun that has the"
        " same one finds this evaluation complete.",
    )  # fmt: skip
    settings: dict[str, Any] | None = Field(
        None, description="What the fingerprint covers (the question ids counted), so that a"
        " rerun with other settings is told which differ.",
    )  # fmt: skip
    _reused: bool = PrivateAttr(False)

    @property
    def reused(self) -> bool:
        """True when `evaluate` found this evaluation already complete and did no work."""
        return self._reused

    def dataset(self, name: str) -> DatasetResult:
        for result in self.datasets:
            if result.dataset == name:
                return result
        raise KeyError(name)

    def per_question(self, metric: str) -> np.ndarray:
        """`[Q]` over all datasets in report order: `mean` (fraction of k correct), `best`
        (any correct) or `greedy`; for paired comparisons of two reports."""
        parts = []
        for r in self.datasets:
            if metric == "mean":
                parts.append(per_question_mean(r.correct))
            elif metric == "best":
                parts.append(per_question_best(r.correct))
            elif metric == "greedy":
                if r.greedy is None:
                    raise ValueError("this report has no greedy decoding")
                parts.append(np.asarray(r.greedy, dtype=np.float64))
            else:
                raise ValueError(f"unknown metric {metric!r}; valid: mean, best, greedy")
        return np.concatenate(parts) if parts else np.zeros(0)

    def question_ids(self) -> list[str]:
        return [q for r in self.datasets for q in r.question_ids]

    def markdown(self) -> str:
        k = self.k
        headers = ["dataset", "questions", f"Mean@{k}", f"Best@{k}", "greedy EM"]
        rows: list[list[Any]] = [
            [r.dataset, r.num_questions, r.mean_at_k, r.best_at_k, r.greedy_em]
            for r in self.datasets
        ]
        a = self.average
        if len(self.datasets) > 1:
            rows.append(
                ["**Avg**", a["num_questions"], a["mean_at_k"], a["best_at_k"], a["greedy_em"]]
            )
            rows.append(
                [
                    "**Weighted**",
                    a["num_questions"],
                    a["weighted_mean_at_k"],
                    a["weighted_best_at_k"],
                    a["weighted_greedy_em"],
                ]
            )
        head = (
            f"Model `{self.model}`: k={k} samples per question at temperature "
            f"{self.temperature:g}{', plus greedy' if self.greedy else ''}; seed {self.seed}; "
            f"{self.env_calls} retrieval calls, {self.wall_time:.1f}s of rollout.\n\n"
        )
        return head + markdown_table(headers, rows) + self.behaviour_markdown()

    def behaviour_markdown(self) -> str:
        """What the sampled responses did (evaluation/behaviour.py), a row per dataset."""
        from evaluation.behaviour import SUMMARY_COLUMNS

        summaries = [(r.dataset, r.behaviour_summary()) for r in self.datasets]
        summaries = [(name, b) for name, b in summaries if b is not None]
        if not summaries:
            return ""
        headers = ["dataset", *SUMMARY_COLUMNS.values()]
        rows = [[name, *(b[key] for key in SUMMARY_COLUMNS)] for name, b in summaries]
        return "\n\nWhat the sampled responses did:\n\n" + markdown_table(headers, rows, digits=3)


TRAIN_SECTIONS = ("rollout", "generation", "retrieval")


def find_train_config(model_dir: Path) -> Path | None:
    """The training config next to a model: `<run>/config.yaml` for `<run>/final` or
    `<run>/checkpoints/step-N`, or a checkpoint's own `config.yaml`."""
    for d in (model_dir, model_dir.parent, model_dir.parent.parent):
        if (d / "config.yaml").is_file():
            return d / "config.yaml"
    return None


def eval_config_for(
    model_dir: str | Path,
    config_path: str | Path | None = None,
    train_config: str | Path | None = None,
    overrides: Sequence[str] = (),
) -> EvalConfig:
    """EvalConfig from a YAML file, the rollout settings the model was trained with, then
    `key=value` overrides.

    The model must be evaluated with the prompt it was trained on. Where that is written
    down, first found: `train_config` (a training config's rollout/generation/retrieval
    sections), the model's own `hdr_rollout.yaml` (saved with every model hdr writes), a
    run's `config.yaml` next to the model. The eval YAML's own settings win over it.
    """
    from agent_env.policy_settings import apply_saved, load_settings
    from core.config import build_config, read_config_file

    data = read_config_file(config_path) if config_path is not None else {}
    saved = load_settings(model_dir) if train_config is None else None
    if saved is not None:
        apply_saved(data, saved)
    else:
        source = train_config if train_config is not None else find_train_config(Path(model_dir))
        if source is not None:
            trained = read_config_file(source)
            apply_saved(data, {s: trained[s] for s in TRAIN_SECTIONS if s in trained})
    return build_config(EvalConfig, data, overrides)


# ------------------------------------------------------------------------------- data


def load_eval_datasets(specs: Sequence[str | Path], max_questions: int | None = None):
    """`wiki-vital` (its test split), FlashRAG `.jsonl` or Search-R1 `.parquet` files, grouped
    into datasets by name (`data_source` first, else the file name); the first
    `max_questions` of each dataset, in file order."""
    from agent_env.data import load_task

    if not specs:
        raise UserError("no evaluation data given")
    by_name: dict[str, list[Any]] = {}
    sources: dict[str, list[str]] = {}
    for spec in specs:
        spec = str(spec)
        path = None if spec == WIKI_VITAL else Path(spec)
        examples = load_task(spec, split="test")
        if not examples:
            raise UserError(f"{spec}: no questions")
        for ex in examples:
            name = WIKI_VITAL if path is None else recognize_dataset(ex.data_source, path)
            by_name.setdefault(name, []).append(ex)
            if spec not in sources.setdefault(name, []):
                sources[name].append(spec)
    datasets = []
    for name in dataset_order(list(by_name)):
        examples = by_name[name]
        seen: set[str] = set()
        for ex in examples:
            if ex.id in seen:
                raise UserError(f"dataset {name}: question id {ex.id!r} appears twice")
            seen.add(ex.id)
        if max_questions is not None:
            examples = examples[:max_questions]
        datasets.append(EvalDataset(name, examples, tuple(sources[name])))
    return datasets


# -------------------------------------------------------------------------- evaluation


def _chunk_seed(seed: int, dataset: str, start: int) -> int:
    digest = hashlib.sha256(f"{seed}|{dataset}|{start}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


@contextmanager
def _seeded(seed: int, device):
    """Seed torch inside a forked RNG, so the caller's RNG state is untouched."""
    import torch

    devices = [device.index or 0] if getattr(device, "type", "cpu") == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def weights_signature(model_dir: Path) -> str:
    """Names, sizes and mtimes of the weight files: a changed model never resumes old chunks."""
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    return ";".join(f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files)


def _fingerprint_payload(
    model_id: str, datasets: list[EvalDataset], config: EvalConfig
) -> dict[str, Any]:
    settings = config.model_dump(mode="json", exclude={"progress", "retrieval"})
    settings["retriever"] = config.retrieval.retriever
    settings["topk"] = config.retrieval.topk
    return {
        "model": model_id,
        "settings": settings,
        "questions": {d.name: [e.id for e in d.examples] for d in datasets},
    }


def _fingerprint(model_id: str, datasets: list[EvalDataset], config: EvalConfig) -> str:
    return digest(_fingerprint_payload(model_id, datasets, config), length=16, compact=False)


def _settings_record(model_id: str, datasets: list[EvalDataset], config: EvalConfig) -> dict:
    """The fingerprint's payload with each dataset's question ids as a count and a digest."""
    payload = _fingerprint_payload(model_id, datasets, config)
    model, _, weights = payload["model"].partition("|")
    payload["model"], payload["weights"] = model, weights
    payload["questions"] = {
        name: f"{len(ids)} questions, ids {digest(ids, length=8, compact=False)}"
        for name, ids in payload["questions"].items()
    }
    return payload


def settings_differences(earlier: dict[str, Any], now: dict[str, Any]) -> str:
    """`k 8 then, 5 now; max_questions None then, 200 now`: what differs, the evaluation's own
    settings first, briefly."""
    changes = differences(
        earlier, now,
        label=lambda key: key.removeprefix("settings."),
        order=lambda key: (not key.startswith("settings."), key),
    )  # fmt: skip
    return summary(changes) or "an older format"


def _read_partial(path: Path, fingerprint: str) -> dict[tuple[str, int], dict[str, Any]]:
    """Finished chunks of an earlier run with the same fingerprint; {} otherwise."""
    if not path.is_file():
        return {}
    lines = path.read_text(encoding="utf-8").splitlines()
    done: dict[tuple[str, int], dict[str, Any]] = {}
    for i, line in enumerate(lines):
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break  # interrupted while writing the last chunk
            return {}
        if i == 0:
            if row.get("fingerprint") != fingerprint:
                return {}
            continue
        done[(row["dataset"], row["start"])] = row
    return done


def _responses_sha(items) -> str:
    """sha256 over the response ids of trajectory groups (or earlier digests, as strings)."""
    h = hashlib.sha256()
    for group in items:
        for t in group:
            h.update(t.encode() if isinstance(t, str) else json.dumps(t.response_ids).encode())
    return h.hexdigest()[:16]


def _is_correct(traj) -> int:
    from agent_env.rewards import exact_match

    return int(exact_match(traj.answer, traj.example.golden_answers) == 1.0)


def _run_chunk(
    generator, client, tokenizer, dataset: str, start: int, examples, config, device
) -> dict[str, Any]:
    from agent_env.retrieval_client import RetrievalFailed
    from agent_env.rollout import question_seeds, rollout_groups
    from evaluation.behaviour import observe

    sample_cfg = config.rollout.model_copy(
        update={"temperature": config.sample_temperature, "on_failure": "raise"}
    )
    greedy_cfg = sample_cfg.model_copy(update={"temperature": 0.0})
    # a backend that seeds each request (vLLM) samples from the evaluation's seed only through
    # them: its own generator is the engine's, which the torch seed below does not reach
    seeds = None
    if getattr(generator, "per_request_seeds", False):
        seeds = question_seeds(config.seed, examples, config.k)
    try:
        with _seeded(_chunk_seed(config.seed, dataset, start), device):
            sampled = rollout_groups(
                generator, client, tokenizer, examples, config.k, sample_cfg, seeds=seeds
            )
            greedy = (
                rollout_groups(generator, client, tokenizer, examples, 1, greedy_cfg)
                if config.greedy
                else None
            )
    except RetrievalFailed as err:
        raise UserError(f"evaluation stopped, retrieval failed: {err} (rerun to resume)") from None
    ids = [ex.id for ex in examples]
    assert [g[0].example.id for g in sampled.groups] == ids, "rollout reordered the questions"
    row: dict[str, Any] = {
        "dataset": dataset,
        "start": start,
        "ids": ids,
        "correct": [[_is_correct(t) for t in group] for group in sampled.groups],
        "behaviour": [
            [observe(t, tokenizer, sample_cfg).as_row() for t in group] for group in sampled.groups
        ],
        "greedy": None,
        "greedy_answers": None,
        "sha": _responses_sha(sampled.groups),
        "env_calls": sampled.env_calls,
        "gen_time": sampled.gen_time,
        "retrieval_time": sampled.retrieval_time,
        "wall_time": sampled.wall_time,
    }
    if greedy is not None:
        row["greedy"] = [_is_correct(g[0]) for g in greedy.groups]
        row["greedy_answers"] = [g[0].answer for g in greedy.groups]
        row["sha"] = _responses_sha([[row["sha"]], *greedy.groups])
        for key in ("env_calls", "gen_time", "retrieval_time", "wall_time"):
            row[key] += getattr(greedy, key)
    return row


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return nullcontext(None)
    from core.progress import progress

    return progress(total=total, desc=desc, unit="q", leave=False)


def _report(model_id: str, datasets: list[EvalDataset], rows, config: EvalConfig) -> EvalReport:
    results, scores = [], []
    for d in datasets:
        chunks = sorted((r for r in rows if r["dataset"] == d.name), key=lambda r: r["start"])
        ids = [q for r in chunks for q in r["ids"]]
        assert ids == [e.id for e in d.examples], f"{d.name}: chunks do not cover the questions"
        correct = [c for r in chunks for c in r["correct"]]
        greedy = [g for r in chunks for g in r["greedy"]] if config.greedy else None
        score = score_dataset(d.name, np.array(correct).reshape(len(ids), config.k), greedy)
        scores.append(score)
        results.append(
            DatasetResult(
                dataset=d.name,
                sources=list(d.sources),
                num_questions=score.num_questions,
                k=config.k,
                mean_at_k=score.mean_at_k,
                best_at_k=score.best_at_k,
                greedy_em=score.greedy_em,
                question_ids=ids,
                correct=correct,
                greedy=greedy,
                greedy_answers=(
                    [a for r in chunks for a in r["greedy_answers"]] if config.greedy else None
                ),
                env_calls=sum(r["env_calls"] for r in chunks),
                responses_sha=_responses_sha([[r["sha"] for r in chunks]]),
                behaviour=(
                    [b for r in chunks for b in r["behaviour"]]
                    if all("behaviour" in r for r in chunks)
                    else None
                ),
            )
        )
    return EvalReport(
        model=model_id,
        k=config.k,
        temperature=config.sample_temperature,
        greedy=config.greedy,
        seed=config.seed,
        datasets=results,
        average=vars(average_scores(scores)),
        env_calls=sum(r["env_calls"] for r in rows),
        wall_time=sum(r["wall_time"] for r in rows),
        gen_time=sum(r["gen_time"] for r in rows),
        retrieval_time=sum(r["retrieval_time"] for r in rows),
    )


def evaluate_policy(
    model,
    tokenizer,
    datasets: Sequence[EvalDataset],
    client,
    config: EvalConfig,
    out_dir: str | Path | None = None,
    model_id: str = "in-process",
    generator=None,
    resume_key: str = "",
) -> EvalReport:
    """Evaluate a loaded policy (the trainer's periodic eval passes its own module).

    `client`: an `agent_env.retrieval_client.RetrievalClient`. `generator`: defaults to the
    configured backend around `model`. With `out_dir`, resumable chunks and the result files
    are written there; `resume_key` (e.g. the weights' signature) must match for earlier
    chunks to be reused. The model is put in eval mode and restored afterwards.
    """
    from agent_env.generation import build_generator

    datasets = list(datasets)
    if generator is None:
        generator = build_generator(
            config.generation,
            model_dir=None,
            tokenizer=tokenizer,
            prompt=config.rollout.prompt,
            model=model,
        )
    device = getattr(model, "device", None)
    was_training = bool(getattr(model, "training", False))
    fingerprint = _fingerprint(f"{model_id}|{resume_key}", datasets, config)
    partial = Path(out_dir) / PARTIAL if out_dir is not None else None
    done = _read_partial(partial, fingerprint) if partial is not None else {}
    if partial is not None:
        partial.parent.mkdir(parents=True, exist_ok=True)
        # rewrite what is kept (drops a broken last line or another run's chunks)
        kept = [json.dumps({"fingerprint": fingerprint})] + [json.dumps(r) for r in done.values()]
        write_text_atomic(partial, "\n".join(kept) + "\n")
    rows = list(done.values())
    total = sum(len(d.examples) for d in datasets)
    if model is not None and hasattr(model, "eval"):
        model.eval()
    try:
        with _progress(total, config.progress, f"eval k={config.k}") as bar:
            if bar is not None:
                bar.update(sum(len(r["ids"]) for r in rows))
            for d in datasets:
                for start in range(0, len(d.examples), config.chunk_questions):
                    if (d.name, start) in done:
                        continue
                    examples = d.examples[start : start + config.chunk_questions]
                    row = _run_chunk(
                        generator, client, tokenizer, d.name, start, examples, config, device
                    )
                    rows.append(row)
                    if partial is not None:
                        with partial.open("a", encoding="utf-8") as fh:
                            fh.write(json.dumps(row) + "\n")
                    if bar is not None:
                        bar.update(len(examples))
    finally:
        if was_training:
            model.train()
    report = _report(model_id, datasets, rows, config)
    report.fingerprint = fingerprint
    report.settings = _settings_record(f"{model_id}|{resume_key}", datasets, config)
    if out_dir is not None:
        write_report(report, out_dir)
        partial.unlink(missing_ok=True)
    return report


def check_eval_output(
    out_dir: Path, fingerprint: str, force: bool, model_dir: Path, settings: dict[str, Any]
) -> EvalReport | None:
    """`out_dir` may take this evaluation: new or empty, this evaluation's unfinished chunks
    (resumed), or another evaluation with `force`; one UserError line otherwise, naming what
    differs. Returns the finished report when `out_dir` already holds this same evaluation
    (same model, weights, questions and settings): there is nothing left to do."""
    check_output(out_dir, EVAL, force=force, reuse=True, inputs=[model_dir])
    partial = out_dir / PARTIAL
    first = partial.read_text(encoding="utf-8").split("\n", 1)[0] if partial.is_file() else ""
    resumes = first == json.dumps({"fingerprint": fingerprint})
    if not EVAL.recognise(out_dir) or force or resumes:
        return None
    try:
        earlier = load_report(out_dir)
    except (UserError, ValueError):
        earlier = None
    if earlier is not None and earlier.fingerprint == fingerprint:
        earlier._reused = True
        return earlier
    differs = (
        f" with other settings ({settings_differences(earlier.settings, settings)})"
        if earlier is not None and earlier.settings
        else " (written by an older hdr, which did not record its settings)"
    )
    raise UserError(
        f"--out {out_dir} already holds an evaluation{differs}; pass --force to replace it, or"
        " choose another --out"
    )


def write_report(report: EvalReport, out_dir: str | Path) -> tuple[Path, Path]:
    """`eval.json` and `eval.md` in `out_dir`, each written atomically."""
    out_dir = Path(out_dir)
    return (
        write_json_atomic(out_dir / "eval.json", report),
        write_text_atomic(out_dir / "eval.md", report.markdown()),
    )


GZIPPED = ".gz"  # an exported evaluation (`hdr report --export`) is kept compressed


def report_file(path: str | Path) -> Path | None:
    """The evaluation at `path` (an eval.json, or a folder holding one), or the gzipped copy
    beside it that an export leaves (`eval.json.gz`), whichever exists; None if neither."""
    path = Path(path)
    if path.is_dir():
        path = path / "eval.json"
    for candidate in (path, path.with_name(path.name + GZIPPED)):
        if candidate.is_file():
            return candidate
    return None


def load_report(path: str | Path) -> EvalReport:
    """The EvalReport at `path` (see `report_file`: plain or gzipped)."""
    found = report_file(path)
    if found is None:
        raise UserError(f"evaluation result not found: {path}")
    data = found.read_bytes()
    if found.name.endswith(GZIPPED):
        data = gzip.decompress(data)
    return EvalReport.model_validate_json(data)


def evaluate(
    model_dir: str | Path,
    datasets: Sequence[str | Path] | Sequence[EvalDataset],
    k: int | None = None,
    server_urls: Sequence[str] | None = None,
    config: EvalConfig | None = None,
    out_dir: str | Path | None = None,
    force: bool = False,
) -> EvalReport:
    """Evaluate the model saved in `model_dir` (from_pretrained layout, with tokenizer).

    `datasets`: specs (`wiki-vital`, `.jsonl`, `.parquet`) or loaded `EvalDataset`s. `k` and
    `server_urls` override the config's. Writes `eval.json`, `eval.md` to `out_dir` if given:
    a new or empty folder, the same evaluation's unfinished one (resumed), or with `force` an
    earlier evaluation (replaced); checked before any work. When `out_dir` already holds this
    same evaluation, finished, that report is returned (`report.reused`) and nothing is run.
    """
    from agent_env.generation import build_generator
    from agent_env.retrieval_client import connect
    from agent_env.runner import load_tokenizer

    config = (config or EvalConfig()).model_copy(deep=True)
    if k is not None:
        config.k = k  # validate_assignment checks it
    if server_urls:
        config.retrieval.urls = list(server_urls)
    model_dir = Path(model_dir)
    if config.generation.backend != "scripted":
        local_model(model_dir, "`hdr sft` or `hdr train` writes one; `hdr init-model` a tiny one")
    if datasets and all(isinstance(d, EvalDataset) for d in datasets):
        n = config.max_questions
        loaded = [EvalDataset(d.name, d.examples[:n], d.sources) for d in datasets]
    else:
        loaded = load_eval_datasets(datasets, config.max_questions)
    tokenizer = load_tokenizer(model_dir)
    resume_key = weights_signature(model_dir) if model_dir.is_dir() else ""
    if out_dir is not None:  # the inputs are checked; now where the results go
        model_id = f"{model_dir}|{resume_key}"
        fingerprint = _fingerprint(model_id, loaded, config)
        settings = _settings_record(model_id, loaded, config)
        finished = check_eval_output(Path(out_dir), fingerprint, force, model_dir, settings)
        if finished is not None:
            return finished
    generator = build_generator(
        config.generation, model_dir=model_dir, tokenizer=tokenizer, prompt=config.rollout.prompt
    )
    try:
        with connect(config.retrieval, seed=config.seed) as client:
            report = evaluate_policy(
                getattr(generator, "model", None),
                tokenizer,
                loaded,
                client,
                config,
                out_dir,
                model_id=str(model_dir),
                generator=generator,
                resume_key=resume_key,
            )
    finally:
        generator.close()
    if report.env_calls == 0 and any(d.num_questions for d in report.datasets):
        warn(
            f"the evaluation of {model_dir} made no retrieval calls: the policy never searched."
            " Is this the prompt it was trained with? Pass its training config with"
            " --train-config, or rollout.* overrides."
        )
    return report
