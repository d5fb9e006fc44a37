"""Scale benchmark: a synthetic wiki-18-shaped dense index served flat-mmap and as IVF-PQ.

wiki-18 with e5-base-v2 is 21M passages x 768 dimensions (a 64.5 GB flat index). This bench
makes `--vectors` synthetic 768-d unit vectors chunk by chunk, deterministically (chunk i is
drawn from seed i, so nothing is stored to be re-read and the flat matrix is never in memory),
and in one pass over the chunks:

- streams them into a Flat FAISS file (`FlatFileWriter`, what `hdr index build` uses);
- adds them to an IVF-PQ index trained on a sample (`--ivf`, default IVF1024,PQ96);
- keeps the exact top 10 of `--queries` held-out query vectors (ground truth for recall).

A third point serves the IVF-PQ index re-ranked from the memory-mapped flat file
(`--refine` k_factor, what `hdr index convert --refine` + `hdr serve` do): PQ codes propose
k x k_factor candidates, their exact vectors (3 KiB each, read from the file) rank them.
With `--compact FACTORY` (e.g. PQ192, what `hdr index convert --refine --compact` adds), a
fourth point re-ranks those candidates first by finer codes held in RAM and reads only the
best k x `--exact-k-factor` from the flat file for their exact scores.

Then, for each index, a fresh process opens it exactly as `hdr serve` does
(`retrieval_server.index.files.read_dense` + `set_search_parameters`: mmap for flat) and reports its
start time (process start to ready), resident memory while searching (VmRSS, split into
anonymous and file-backed pages), queries/s (one query per call, and batches of 32) and
recall@10 against exact search. The server's encoder and HTTP layer are not part of it (the
synthetic corpus has no text; bench/retrieval.py measures those).

The data: `--clusters` cluster centres (1,024 by default) in a 128-d subspace of R^768, points
scattered around them in that subspace, plus isotropic noise in all 768 dimensions (10% of the
norm), L2-normalised: clustered and of low intrinsic dimension, as sentence embeddings are, not
uniform noise. With 1,024 clusters and IVF1024 every list holds one cluster, which flatters IVF:
vary `--clusters` (e.g. 8,192) so lists and clusters do not line up.

`--memory-limit-gib` runs each serving probe in a memory cgroup of that size (cgroup v2 when
its memory controller is available, else v1 `memory.limit_in_bytes`; both charge the page cache
too, so re-ranking reads from a flat file larger than the limit are real disk reads); the
report says which was used, or that none could be made. `--refine-in-ram` re-ranks from the
flat vectors read into memory instead of memory-mapped.

Disk: the flat file needs vectors x 3 KiB. If free disk (minus a 10 GB margin) is short, the
flat point is measured at the largest size that fits and the report says so. Everything the
bench writes is deleted at the end (`--keep` keeps it).

    .venv/bin/python bench/scale.py --vectors 10000000      # writes bench/results/scale.json

Targets (issue 11): IVF-PQ resident memory < 4 GB with recall@10 >= 0.9; flat-mmap starts in
seconds.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import typer
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

DIMENSION = 768
RANK = 128
CLUSTERS = 1024
NOISE = 0.1
TOPK = 10
WIKI18_PASSAGES = 21_015_324
DISK_MARGIN = 10 * 2**30
RSS_TARGET_BYTES = 4 * 10**9
RECALL_TARGET = 0.9


def generator_basis(seed: int = 1234, clusters: int = CLUSTERS) -> tuple[np.ndarray, np.ndarray]:
    """The shared subspace basis (RANK, DIMENSION) and cluster centres (clusters, RANK)."""
    rng = np.random.default_rng(seed)
    basis = rng.standard_normal((RANK, DIMENSION), dtype=np.float32) / np.sqrt(RANK)
    centres = rng.standard_normal((clusters, RANK), dtype=np.float32)
    return basis, centres


def synthetic_vectors(seed: int, count: int, basis: np.ndarray, centres: np.ndarray) -> np.ndarray:
    """(count, DIMENSION) float32 unit vectors, the same for the same seed."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, len(centres), count)
    latent = centres[labels] + 0.6 * rng.standard_normal((count, RANK), dtype=np.float32)
    vectors = latent @ basis  # (count, DIMENSION)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors += (
        NOISE
        * norms
        / np.sqrt(DIMENSION)
        * rng.standard_normal((count, DIMENSION), dtype=np.float32)
    )
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def chunk_seeds(total: int, chunk: int) -> list[tuple[int, int]]:
    """(seed, size) per chunk; seeds 0.. for the base, queries and training use others."""
    return [(i, min(chunk, total - start)) for i, start in enumerate(range(0, total, chunk))]


def merge_topk(
    best_scores: np.ndarray, best_rows: np.ndarray, scores: np.ndarray, rows: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Keep the TOPK highest of two (Q, k) candidate sets."""
    all_scores = np.concatenate([best_scores, scores], axis=1)
    all_rows = np.concatenate([best_rows, rows], axis=1)
    order = np.argsort(-all_scores, axis=1)[:, :TOPK]
    return np.take_along_axis(all_scores, order, 1), np.take_along_axis(all_rows, order, 1)


def build(
    workdir: Path,
    vectors: int,
    flat_vectors: int,
    chunk: int,
    ivf: str,
    train: int,
    queries: int,
    clusters: int = CLUSTERS,
    compact: str = "",
) -> dict:
    """One pass over the chunks: flat file, IVF-PQ index (and the `compact` re-rank codes),
    exact top 10 of the queries."""
    import faiss

    from retrieval_server.index.writers import FlatFileWriter, new_faiss_index

    basis, centres = generator_basis(clusters=clusters)
    query_vectors = synthetic_vectors(10**9, queries, basis, centres)  # held out
    timings: dict[str, float] = {}

    started = time.perf_counter()
    ivf_index = new_faiss_index(ivf, DIMENSION)
    training = synthetic_vectors(10**9 + 1, train, basis, centres)
    ivf_index.train(training)
    timings["ivf_train_s"] = time.perf_counter() - started
    compact_index, compact_s = None, 0.0
    if compact:
        started = time.perf_counter()
        compact_index = new_faiss_index(compact, DIMENSION)
        compact_index.train(training)
        timings["compact_train_s"] = time.perf_counter() - started
    del training

    flat = FlatFileWriter(workdir / "flat.faiss", DIMENSION, flat_vectors)
    best_scores = np.full((queries, TOPK), -np.inf, dtype=np.float32)
    best_rows = np.full((queries, TOPK), -1, dtype=np.int64)
    flat_best = (best_scores.copy(), best_rows.copy())
    generate_s = flat_s = ivf_s = exact_s = 0.0
    start_row = 0
    for seed, size in chunk_seeds(vectors, chunk):
        t0 = time.perf_counter()
        block = synthetic_vectors(seed, size, basis, centres)
        t1 = time.perf_counter()
        if start_row < flat_vectors:
            flat.add(block[: flat_vectors - start_row])
        t2 = time.perf_counter()
        ivf_index.add(block)
        t3 = time.perf_counter()
        if compact_index is not None:
            compact_index.add(block)
            compact_s += time.perf_counter() - t3
            t3 = time.perf_counter()
        scores, rows = faiss.knn(query_vectors, block, TOPK, faiss.METRIC_INNER_PRODUCT)
        best_scores, best_rows = merge_topk(best_scores, best_rows, scores, rows + start_row)
        if start_row < flat_vectors:  # exact top 10 within the (smaller) flat point
            keep = rows + start_row < flat_vectors
            flat_best = merge_topk(
                *flat_best, np.where(keep, scores, -np.inf), np.where(keep, rows + start_row, -1)
            )
        t4 = time.perf_counter()
        generate_s, flat_s, ivf_s, exact_s = (
            generate_s + t1 - t0, flat_s + t2 - t1, ivf_s + t3 - t2, exact_s + t4 - t3
        )  # fmt: skip
        start_row += size
        print(f"  {start_row:>11,} / {vectors:,} vectors", flush=True)
    flat.close()
    t0 = time.perf_counter()
    faiss.write_index(ivf_index, str(workdir / "ivf.faiss"))
    timings["ivf_write_s"] = time.perf_counter() - t0
    if compact_index is not None:
        faiss.write_index(compact_index, str(workdir / "compact.faiss"))
        timings["compact_add_s"] = compact_s
    np.save(workdir / "queries.npy", query_vectors)
    np.save(workdir / "truth_ivf.npy", best_rows)
    np.save(workdir / "truth_flat.npy", flat_best[1])
    timings.update(
        generate_s=generate_s, flat_write_s=flat_s, ivf_add_s=ivf_s, exact_topk_s=exact_s
    )
    return {key: round(value, 1) for key, value in timings.items()}


SERVE_PROBE = r"""
import json, sys, time
started = float(sys.argv[1])
sys.path.insert(0, sys.argv[6])
import numpy as np
from retrieval_server.index.files import read_dense, set_search_parameters
from retrieval_server.index.rerank import with_compact_refine, with_exact_rerank, with_refine
from pathlib import Path
index = read_dense(Path(sys.argv[2]), mmap=sys.argv[3] == "1")
set_search_parameters(index, int(sys.argv[4]), 128)
flat = Path(sys.argv[8])
if sys.argv[8] and sys.argv[11]:  # first by the compact codes (in RAM), then read ahead
    compact = read_dense(Path(sys.argv[11]), mmap=False)
    index = with_compact_refine(index, compact, flat, int(sys.argv[9]), int(sys.argv[12]))
elif sys.argv[8] and sys.argv[10] == "ram":  # the flat vectors read into memory
    index = with_refine(index, read_dense(flat, mmap=False), int(sys.argv[9]))
elif sys.argv[8]:  # as `hdr serve` does: the candidates' rows read ahead, then scored
    index = with_exact_rerank(index, flat, int(sys.argv[9]))
ready = time.time() - started
queries = np.load(sys.argv[5])
budget = float(sys.argv[7])

def timed(batch):
    rows, done, t0 = [], 0, time.perf_counter()
    while done < len(queries) and (time.perf_counter() - t0 < budget or done == 0):
        rows.append(index.search(queries[done : done + batch], 10)[1])
        done += len(rows[-1])
    return np.concatenate(rows), done / (time.perf_counter() - t0)

rows_single, qps_single = timed(1)
rows_batch, qps_batch = timed(32)
status = dict(
    line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line
)
kib = lambda key: int(status[key].split()[0]) * 1024
print(json.dumps({
    "start_s": round(ready, 2), "qps_1": round(qps_single, 1), "qps_32": round(qps_batch, 1),
    "rss_bytes": kib("VmRSS"), "rss_anon_bytes": kib("RssAnon"), "rss_file_bytes": kib("RssFile"),
    "rows": rows_batch.tolist() if len(rows_batch) >= len(rows_single) else rows_single.tolist(),
}))
"""


def serve_probe(
    path: Path, mmap: bool, nprobe: int, queries: Path, budget_s: float,
    refine: Path | None = None, k_factor: int = 0, refine_in_ram: bool = False,
    cgroup: Path | None = None, compact: Path | None = None, exact_k_factor: int = 0,
) -> dict:  # fmt: skip
    """Open the index in a fresh process as the server does; time it, search, measure RSS.
    With `cgroup`, the process runs inside that memory cgroup (and its peak is reported)."""
    command = [sys.executable, "-c", SERVE_PROBE, str(time.time()), str(path), "1" if mmap else "0",
               str(nprobe), str(queries), str(ROOT), str(budget_s), str(refine or ""),
               str(k_factor), "ram" if refine_in_ram else "mmap", str(compact or ""),
               str(exact_k_factor)]  # fmt: skip
    if cgroup is not None:  # join the cgroup, then become the probe
        command = ["sh", "-c", f'echo $$ > {cgroup}/cgroup.procs && exec "$@"', "probe", *command]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        killed = done.returncode in (-9, 137)
        return {"failed": "killed at the memory limit" if killed else done.stderr[-400:]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def memory_cgroup(limit_bytes: int) -> tuple[Path | None, str]:
    """A fresh memory cgroup capped at `limit_bytes` (page cache included), and how it was
    made; (None, why not) where this machine allows none."""
    name = f"hdr-scale-{os.getpid()}"
    unified = Path("/sys/fs/cgroup")
    for root, limit_file, how in (
        (unified, "memory.max", "cgroup v2 memory.max"),
        (unified / "unified", "memory.max", "cgroup v2 memory.max"),
        (unified / "memory", "memory.limit_in_bytes", "cgroup v1 memory.limit_in_bytes"),
    ):
        controllers = root / "cgroup.controllers"
        if limit_file == "memory.max" and not (
            controllers.is_file() and "memory" in controllers.read_text().split()
        ):
            continue
        if limit_file == "memory.limit_in_bytes" and not (root / limit_file).is_file():
            continue
        try:
            group = root / name
            group.mkdir(exist_ok=True)
            (group / limit_file).write_text(str(limit_bytes))
            return group, how
        except OSError as err:
            return None, f"no memory cgroup: {err}"
    return None, "no memory cgroup controller on this machine (RLIMIT_AS is not the same)"


def recall_at_10(found: list[list[int]], truth: np.ndarray) -> float:
    hits = [len(set(row) & set(true_row)) for row, true_row in zip(found, truth, strict=False)]
    return round(sum(hits) / (TOPK * len(hits)), 4)


def drop_page_cache_hint(path: Path) -> None:
    """Ask the kernel to forget the file's cached pages, so a start is measured cold."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main(
    vectors: int = typer.Option(10_000_000, help="Vectors in the IVF-PQ point (and flat)."),
    chunk: int = typer.Option(100_000, help="Vectors generated per chunk."),
    ivf: str = typer.Option("IVF1024,PQ96", help="FAISS factory string of the compressed point."),
    nprobe: int = typer.Option(128, help="IVF lists searched per query."),
    train: int = typer.Option(65_536, help="Training vectors for the IVF-PQ index."),
    queries: int = typer.Option(200, help="Held-out queries for recall and speed."),
    seconds: float = typer.Option(20.0, help="Search time budget per measurement."),
    refine: int = typer.Option(
        32,
        help="k_factor of a third point: the IVF-PQ index re-ranked from the mmap'd flat"
        " file (`hdr index convert --refine`); 0 leaves it out (so does a reduced flat point).",
    ),
    clusters: int = typer.Option(CLUSTERS, help="Cluster centres the generator draws from."),
    compact: str = typer.Option(
        "",
        help="Factory string of compact re-rank codes held in RAM (e.g. PQ192): a fourth"
        " point re-ranks the candidates by them, then k x --exact-k-factor exactly.",
    ),
    exact_k_factors: str = typer.Option(
        "2",
        "--exact-k-factor",
        help="With --compact: exact re-ranks per result; a comma list"
        " (e.g. 2,4,8) measures one point each.",
    ),
    probe_kept: bool = typer.Option(
        False,
        help="Skip the build: probe the files an earlier run kept in --workdir (--keep)"
        " with this run's serving settings (nprobe, refine, exact k factors).",
    ),
    flat_probe: bool = typer.Option(
        True,
        help="Probe exact search on the memory-mapped flat file (at 10M under a memory"
        " limit: one cold 30 GB scan a query, about an hour on this machine's disk).",
    ),
    memory_limit_gib: float = typer.Option(
        0.0, help="Run each serving probe in a memory cgroup of this size (0: none)."
    ),
    refine_in_ram: bool = typer.Option(
        False, help="Re-rank from flat vectors read into memory instead of memory-mapped."
    ),
    workdir: Path = typer.Option(Path(tempfile.gettempdir()) / "hdr-scale", help="Scratch dir."),
    out: Path = typer.Option(Path("bench/results/scale.json"), help="JSON results file."),
    keep: bool = typer.Option(False, help="Keep the index files instead of deleting them."),
) -> None:
    console = Console()
    workdir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(workdir).free
    flat_vectors = min(vectors, max(0, (free - DISK_MARGIN) // (DIMENSION * 4)))
    flat_vectors -= flat_vectors % chunk if flat_vectors > chunk else 0
    note = "" if flat_vectors == vectors else (
        f"flat point reduced to {flat_vectors:,} vectors: {free / 2**30:.0f} GiB free disk"
    )  # fmt: skip
    console.print(f"free disk {free / 2**30:.0f} GiB; flat {flat_vectors:,}, {ivf} {vectors:,}")
    load_before = os.getloadavg()
    cgroup, limit_how = None, "none"
    if memory_limit_gib > 0:
        cgroup, limit_how = memory_cgroup(int(memory_limit_gib * 2**30))
        console.print(f"memory limit {memory_limit_gib:g} GiB: {limit_how}")
    exact_factors = [int(factor) for factor in exact_k_factors.split(",")]
    points: list[dict] = []
    timings: dict[str, float] = {}
    build_s = 0.0
    try:
        started = time.perf_counter()
        if probe_kept:
            flat_vectors = vectors
            if not (workdir / "ivf.faiss").is_file():
                raise SystemExit(f"--probe-kept: no kept files in {workdir} (run with --keep)")
        else:
            timings = build(
                workdir, vectors, flat_vectors, chunk, ivf, train, queries, clusters, compact
            )
        build_s = time.perf_counter() - started
        query_file = workdir / "queries.npy"
        flat, compressed = workdir / "flat.faiss", workdir / "ivf.faiss"
        cases = [("flat-mmap", flat, True, flat_vectors, "truth_flat.npy", None, None, 0)]
        cases = cases if flat_probe else []
        cases.append((ivf, compressed, False, vectors, "truth_ivf.npy", None, None, 0))
        if refine and flat_vectors == vectors:
            source = "flat in RAM" if refine_in_ram else "flat mmap"
            cases.append((f"{ivf} + refine x{refine} ({source})", compressed, False, vectors,
                          "truth_ivf.npy", flat, None, 0))  # fmt: skip
            for factor in exact_factors if compact else []:
                cases.append((
                    f"{ivf} + {compact} x{refine} (RAM) + exact x{factor} ({source})",
                    compressed, False, vectors, "truth_ivf.npy", flat, workdir / "compact.faiss",
                    factor,
                ))  # fmt: skip
        for name, path, mmap, count, truth, refine_file, compact_file, exact_k_factor in cases:
            drop_page_cache_hint(path)
            if refine_file is not None:
                drop_page_cache_hint(refine_file)
            probe = serve_probe(path, mmap, nprobe, query_file, seconds, refine_file, refine,
                                refine_in_ram, cgroup, compact_file, exact_k_factor)  # fmt: skip
            if "failed" in probe:
                points.append({"index": name, "vectors": count, **probe})
                console.print(points[-1])
                continue
            recall = recall_at_10(probe.pop("rows"), np.load(workdir / truth))
            points.append(
                {"index": name, "vectors": count, "size_bytes": path.stat().st_size,
                 **({"compact_bytes": compact_file.stat().st_size} if compact_file else {}),
                 "recall_at_10": recall, **probe}
            )  # fmt: skip
            console.print(points[-1])
    finally:
        if not keep:
            shutil.rmtree(workdir, ignore_errors=True)
        if cgroup is not None:
            cgroup.rmdir()

    measured = [point for point in points if "failed" not in point]
    ivf_point = next(point for point in measured if point["index"] == ivf)
    served = measured[-1]  # the last refined point when there is one
    per_vector_rss = ivf_point["rss_anon_bytes"] / vectors
    extrapolated = {
        "passages": WIKI18_PASSAGES,
        "flat_size_bytes": WIKI18_PASSAGES * DIMENSION * 4,
        "ivf_size_bytes": round(ivf_point["size_bytes"] / vectors * WIKI18_PASSAGES),
        "ivf_rss_anon_bytes": round(per_vector_rss * WIKI18_PASSAGES),
    }
    if "ivf_add_s" in timings:
        extrapolated["ivf_add_s"] = round(timings["ivf_add_s"] / vectors * WIKI18_PASSAGES)
    passed = served["rss_bytes"] < RSS_TARGET_BYTES and served["recall_at_10"] >= RECALL_TARGET
    report = {
        "build_seconds_total": round(build_s, 1),
        "build_timings": timings,
        "points": points,
        "extrapolated_to_wiki18": extrapolated,
        "note": note,
        "settings": {
            "chunk": chunk,
            "nprobe": nprobe,
            "train": train,
            "queries": queries,
            "clusters": clusters,
            "ivf": ivf,
            "refine": refine,
            "refine_in_ram": refine_in_ram,
            "compact": compact,
            "exact_k_factors": exact_factors,
            "probe_kept": probe_kept,
        },
        "memory_limit": {"gib": memory_limit_gib, "how": limit_how},
        "command": " ".join(["bench/scale.py", *sys.argv[1:]]),
        "machine": {
            "cpus": os.cpu_count(),
            "load_average_before": list(load_before),
            "load_average_after": list(os.getloadavg()),
        },
        "target": {"index": served["index"], "rss_below_4gb_and_recall_0.9": passed},
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    table = Table(title=f"scale benchmark ({DIMENSION}-d synthetic, topk {TOPK})")
    for column in ("index", "vectors", "size GiB", "start s", "RSS GiB (anon+file)", "q/s x1",
                   "q/s x32", "recall@10"):  # fmt: skip
        table.add_column(column, justify="right")
    for p in measured:
        table.add_row(
            p["index"], f"{p['vectors']:,}", f"{p['size_bytes'] / 2**30:.2f}", f"{p['start_s']}",
            f"{p['rss_bytes'] / 2**30:.2f} ({p['rss_anon_bytes'] / 2**30:.2f}+"
            f"{p['rss_file_bytes'] / 2**30:.2f})",
            f"{p['qps_1']}", f"{p['qps_32']}", f"{p['recall_at_10']:.3f}",
        )  # fmt: skip
    console.print(table)
    console.print(f"build: {timings}; {note}")
    console.print(f"extrapolated to wiki-18: {extrapolated}; written to {out}")
    failed = [point for point in points if "failed" in point]
    if failed:
        raise SystemExit(f"a probe failed: {failed}; the rest is written to {out}")


if __name__ == "__main__":
    typer.run(main)
