"""Index layouts on real MiniLM vectors: the embedded corpus's passage vectors (its flat index)
and real queries (the articles' short descriptions, encoded by the index's encoder).

The synthetic generator of bench/scale.py decides nothing alone: this bench checks, on the
vectors the project actually serves, how each compressed layout ranks alone and after exact
re-ranking (FAISS `IndexRefine` over the flat vectors, k x factor candidates), for a few nprobe
values, one thread. Recall@10 is against the flat index's own top 10.

    .venv/bin/python bench/scale_real.py --index data/index
    # writes bench/results/scale_real_minilm_10k.json
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import typer

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as hdr serve sets it


def main(
    index: Path = typer.Option(Path("data/index"), help="Index directory with a Flat index."),
    layouts: str = typer.Option(
        "IVF100,PQ48x4fs;IVF100,PQ48", help="Factory strings, ;-separated."
    ),
    queries: int = typer.Option(400, help="Real queries (short descriptions)."),
    out: Path = typer.Option(Path("bench/results/scale_real_minilm_10k.json")),
) -> None:
    import faiss
    from retrieval import benchmark_queries

    from retrieval_server.index.encoder import Encoder
    from retrieval_server.index.files import validate_index

    faiss.omp_set_num_threads(1)
    flat = faiss.read_index(str(index / "dense.faiss"))
    vectors = flat.reconstruct_n(0, flat.ntotal)
    encoder = Encoder(validate_index(index).manifest.encoder)
    texts = benchmark_queries(queries)[:queries]
    query_vectors = encoder.encode_queries(texts)
    _, truth = flat.search(query_vectors, 10)

    def recall(rows: np.ndarray) -> float:
        return float(np.mean([len(set(a) & set(b)) / 10 for a, b in zip(rows, truth, strict=True)]))

    results = []
    for factory in layouts.split(";"):
        compressed = faiss.index_factory(vectors.shape[1], factory, faiss.METRIC_INNER_PRODUCT)
        compressed.train(vectors)
        compressed.add(vectors)
        for nprobe in (8, 16, 32):
            faiss.extract_index_ivf(compressed).nprobe = nprobe
            for k_factor in (0, 8, 32):
                searched = compressed
                if k_factor:
                    searched = faiss.IndexRefine(compressed, flat)
                    searched.k_factor = k_factor
                started = time.perf_counter()
                for vector in query_vectors[:200]:
                    searched.search(vector[None], 10)
                qps_1 = 200 / (time.perf_counter() - started)
                _, rows = searched.search(query_vectors, 10)
                results.append(
                    {"index": factory, "nprobe": nprobe, "refine_k_factor": k_factor,
                     "recall_at_10": round(recall(rows), 3), "qps_1": round(qps_1)}
                )  # fmt: skip
                print(results[-1], flush=True)
    report = {
        "command": " ".join(["bench/scale_real.py", *sys.argv[1:]]),
        "corpus": "embedded wiki vital articles",
        "vectors": int(flat.ntotal),
        "dimension": int(flat.d),
        "queries": len(texts),
        "query_source": "article short descriptions (bench/retrieval.py benchmark_queries)",
        "threads": 1,
        "load_average": list(os.getloadavg()),
        "rows": results,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    typer.run(main)
