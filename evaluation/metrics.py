"""Evaluation arithmetic: Mean@k, Best@k, greedy EM, averages over datasets, paired differences.

Pure functions over numpy arrays; no model, no HTTP. `evaluation.evaluate` fills the arrays
from rollouts and the experiment compares arms with them.

- `correct` is a `[Q, k]` array of 0/1 (one row per question, one column per sample).
  Mean@k = mean over questions of the fraction of the k samples that are correct;
  Best@k = fraction of questions with at least one correct sample (the paper's names).
- Across datasets the paper reports the plain average of the per-dataset numbers ("Avg") and
  the average weighted by dataset size ("Weighted"); both are here.
- Arms are compared *paired*: on the same questions, difference of per-question scores, with
  the standard error of that mean over questions. With several seeds per arm the per-question
  scores are first averaged over seeds, and the per-seed differences are reported too, so the
  spread between seeds can be set against the difference (docs/cpu-bed.md: gains here are small).
  These are descriptive; intervals, p-values, verdicts and equivalence over seeds x questions
  are `evaluation.statistics`, the one place they are computed.

Also here, because every result writer needs them: recognising Search-R1's seven test sets
and the embedded wiki-vital split by name, a Markdown table writer, and atomic file writes
(temp file in the same directory, then `os.replace`), so no half-written result ever exists.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agent_env.rewards import as_correct, best_at_k, greedy_em, mean_at_k

# Search-R1's test sets in the paper's column order: general QA, then multi-hop QA.
SEARCH_R1_DATASETS: tuple[str, ...] = (
    "nq",
    "triviaqa",
    "popqa",
    "hotpotqa",
    "2wikimultihopqa",
    "musique",
    "bamboogle",
)
WIKI_VITAL = "wiki-vital"

# Spellings met in FlashRAG directory names, HF dataset ids and Search-R1's `data_source`,
# after `_normalise` (lower case, letters and digits only).
_ALIASES: dict[str, str] = {
    "nq": "nq",
    "naturalquestions": "nq",
    "nqopen": "nq",
    "triviaqa": "triviaqa",
    "tqa": "triviaqa",
    "popqa": "popqa",
    "hotpotqa": "hotpotqa",
    "hotpot": "hotpotqa",
    "2wikimultihopqa": "2wikimultihopqa",
    "2wiki": "2wikimultihopqa",
    "2wikimqa": "2wikimultihopqa",
    "twowikimultihopqa": "2wikimultihopqa",
    "musique": "musique",
    "bamboogle": "bamboogle",
    "wikivital": WIKI_VITAL,
}


def _normalise(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def canonical_dataset(name: str) -> str | None:
    """The canonical name of a known dataset spelled `name`, or None.

    `"NQ"`, `"natural_questions"` -> `"nq"`; `"2wiki"` -> `"2wikimultihopqa"`;
    `"wiki_vital"` -> `"wiki-vital"`.
    """
    return _ALIASES.get(_normalise(name))


def recognize_dataset(data_source: str | None = None, path: str | Path | None = None) -> str:
    """Name a dataset from a row's `data_source` or else from its file path.

    The `data_source` wins when it is a known name. Otherwise the path's parts are tried from
    the file stem upwards (FlashRAG keeps `nq/test.jsonl`, Search-R1 ships `nq_test.parquet`
    style names), first whole, then split on `_`, `-` and `.`. An unknown dataset keeps its
    `data_source`, else its file stem, so results are still grouped, only under that name.
    """
    if data_source:
        known = canonical_dataset(data_source)
        if known:
            return known
    if path is not None:
        path = Path(path)
        for part in [path.name.split(".")[0], *reversed(path.parent.parts)]:
            known = canonical_dataset(part)
            if known:
                return known
            for piece in re.split(r"[_\-.]", part):
                known = canonical_dataset(piece) if piece else None
                if known:
                    return known
    if data_source:
        return data_source
    if path is not None:
        return Path(path).name.split(".")[0]
    raise ValueError("recognize_dataset needs a data_source or a path")


def dataset_order(names: Sequence[str]) -> list[str]:
    """Search-R1's seven in the paper's order first, then wiki-vital, then the rest sorted."""
    fixed = [*SEARCH_R1_DATASETS, WIKI_VITAL]
    known = [n for n in fixed if n in names]
    return known + sorted(n for n in set(names) if n not in fixed)


# ---------------------------------------------------------------------------- per dataset


@dataclass(frozen=True)
class DatasetScore:
    """One dataset's numbers for one model."""

    dataset: str
    num_questions: int
    k: int
    mean_at_k: float
    best_at_k: float
    greedy_em: float | None  # None when greedy decoding was not run


def score_dataset(dataset: str, correct: Any, greedy: Any | None = None) -> DatasetScore:
    arr = as_correct(correct)
    if greedy is not None and len(np.asarray(greedy).reshape(-1)) != arr.shape[0]:
        raise ValueError("greedy must have one entry per question")
    return DatasetScore(
        dataset=dataset,
        num_questions=int(arr.shape[0]),
        k=int(arr.shape[1]),
        mean_at_k=mean_at_k(arr),
        best_at_k=best_at_k(arr),
        greedy_em=None if greedy is None else greedy_em(greedy),
    )


@dataclass(frozen=True)
class Averages:
    """Across datasets: the plain average of per-dataset numbers and the size-weighted one."""

    mean_at_k: float
    best_at_k: float
    greedy_em: float | None
    weighted_mean_at_k: float
    weighted_best_at_k: float
    weighted_greedy_em: float | None
    num_questions: int


def average_scores(scores: Sequence[DatasetScore]) -> Averages:
    """Plain ("Avg") and size-weighted ("Weighted") averages over datasets.

    The weighted average equals the score over all questions pooled together.
    """
    if not scores:
        raise ValueError("average_scores needs at least one dataset")
    sizes = np.array([s.num_questions for s in scores], dtype=np.float64)
    if sizes.sum() == 0:
        raise ValueError("average_scores needs at least one question")

    def both(values: list[float | None]) -> tuple[float | None, float | None]:
        if any(v is None for v in values):
            return None, None
        arr = np.array(values, dtype=np.float64)
        keep = sizes > 0
        return float(arr[keep].mean()), float((arr[keep] * sizes[keep]).sum() / sizes.sum())

    mean_plain, mean_weighted = both([s.mean_at_k for s in scores])
    best_plain, best_weighted = both([s.best_at_k for s in scores])
    greedy_plain, greedy_weighted = both([s.greedy_em for s in scores])
    return Averages(
        mean_at_k=mean_plain,
        best_at_k=best_plain,
        greedy_em=greedy_plain,
        weighted_mean_at_k=mean_weighted,
        weighted_best_at_k=best_weighted,
        weighted_greedy_em=greedy_weighted,
        num_questions=int(sizes.sum()),
    )


# ----------------------------------------------------------------------- seeds and arms


@dataclass(frozen=True)
class Spread:
    """A number over seeds: mean, sample standard deviation (0 with one seed), min, max."""

    mean: float
    std: float
    min: float
    max: float
    n: int


def mean_spread(values: Sequence[float]) -> Spread:
    arr = np.asarray(values, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        raise ValueError("mean_spread needs at least one value")
    std = float(arr.std(ddof=1)) if arr.size > 1 else 0.0
    return Spread(float(arr.mean()), std, float(arr.min()), float(arr.max()), int(arr.size))


@dataclass(frozen=True)
class PairedDifference:
    """`a - b` on the same questions.

    `diff`: mean over questions of the seed-averaged per-question difference; `se`: its
    standard error over questions (sample std / sqrt(Q)). `per_seed`: the difference of the
    two arms' means for each seed index both arms have; `seed_std`: their sample std (0 with
    one seed). When `seed_std` is larger than `diff`, the seeds disagree more than the arms do.
    """

    diff: float
    se: float
    num_questions: int
    per_seed: list[float]
    seed_std: float


def paired_difference(a: Any, b: Any) -> PairedDifference:
    """Paired difference of two arms' per-question scores.

    `a`, `b`: `[Q]` (one seed) or `[S, Q]` (seeds by questions, same question order in both;
    the seed counts may differ, then `per_seed` covers the common prefix). Per-question scores
    are a question's Mean@k fraction, its Best@k 0/1, or its greedy 0/1.
    """
    a2 = np.atleast_2d(np.asarray(a, dtype=np.float64))
    b2 = np.atleast_2d(np.asarray(b, dtype=np.float64))
    if a2.ndim != 2 or b2.ndim != 2 or a2.shape[1] != b2.shape[1]:
        raise ValueError(f"paired arms need the same questions: {a2.shape} vs {b2.shape}")
    q = a2.shape[1]
    if q == 0:
        raise ValueError("paired_difference needs at least one question")
    d = a2.mean(axis=0) - b2.mean(axis=0)  # (Q,)
    se = float(d.std(ddof=1) / math.sqrt(q)) if q > 1 else math.nan
    common = min(a2.shape[0], b2.shape[0])
    per_seed = [float(a2[s].mean() - b2[s].mean()) for s in range(common)]
    seed_std = float(np.std(per_seed, ddof=1)) if len(per_seed) > 1 else 0.0
    return PairedDifference(float(d.mean()), se, q, per_seed, seed_std)


# ----------------------------------------------------------------------------- writing


def _fmt(value: Any, digits: int) -> str:
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int | np.integer):
        return str(int(value))
    if isinstance(value, float | np.floating):
        return "nan" if math.isnan(value) else f"{value:.{digits}f}"
    return str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], digits: int = 4) -> str:
    """A GitHub Markdown table; floats with `digits` decimals, None as an en dash.

    Columns whose first row holds a number are right-aligned.
    """
    for row in rows:
        if len(row) != len(headers):
            raise ValueError(f"row {list(row)!r} has {len(row)} cells for {len(headers)} headers")
    numeric = [
        bool(rows) and isinstance(rows[0][i], int | float | np.number) for i in range(len(headers))
    ]
    lines = [
        "| " + " | ".join(_fmt(h, digits) for h in headers) + " |",
        "| " + " | ".join("---:" if n else "---" for n in numeric) + " |",
    ]
    lines += ["| " + " | ".join(_fmt(c, digits) for c in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
