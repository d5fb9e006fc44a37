"""`hdr index import`: adopt an existing FAISS file (Search-R1's or FlashRAG's `e5_Flat.index`)
and its corpus as an index directory: the file is linked (or copied), never re-encoded; offsets
and the manifest are written after re-encoding a sample of passages and comparing them with
the stored vectors (`verify_imported_vectors`: wrong encoder, prefix, pooling or corpus order
is one line).
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import UserError
from retrieval_server.index.corpus import read_contents, scan_corpus
from retrieval_server.index.defaults import BM25_AUTO_MAX_DOCUMENTS, DEFAULT_CHUNK_SIZE
from retrieval_server.index.encoder import Encoder, EncoderSpec
from retrieval_server.index.files import (
    BM25_DIR,
    DENSE_FILE,
    OFFSETS_FILE,
    IndexManifest,
    read_dense,
)
from retrieval_server.index.staging import check_index_output, commit, fresh_partial, new_manifest
from retrieval_server.index.writers import write_bm25

if TYPE_CHECKING:
    import faiss
    import numpy as np

    from retrieval_server.index.config import EncoderConfig

IMPORT_MIN_COSINE = 0.98  # re-encoded vs stored; fp16 GPU builds agree to ~0.999

IMPORT_MIN_SELF_RECALL = 0.9  # lossy indexes: share of sampled passages found in their top 10


def verify_imported_vectors(
    dense: faiss.Index, encoder: Encoder, corpus: Path, offsets: np.ndarray, sample: int
) -> str:
    """Re-encode `sample` passages spread over the corpus and compare them with the index.

    Indexes that store vectors (Flat, HNSW..Flat) are compared by cosine; lossy ones (PQ, SQ)
    by whether each passage's own row is among its 10 nearest. Returns a one-line summary;
    raises UserError on a mismatch (wrong encoder, prefix, pooling, or corpus order).
    """
    import faiss
    import numpy as np

    rows = np.unique(np.linspace(0, dense.ntotal - 1, min(sample, dense.ntotal)).astype(np.int64))
    passages = [read_contents(corpus, offsets, int(row), int(row) + 1)[0] for row in rows]
    encoded = encoder.encode_passages(passages)  # (sample, dimension)
    hint = "check --encoder, --passage-prefix and --pooling, and that the corpus is the indexed one"
    stores_vectors = isinstance(faiss.downcast_index(dense), faiss.IndexFlat | faiss.IndexHNSWFlat)
    if stores_vectors:
        stored = dense.reconstruct_batch(rows)
        cosine = (encoded * stored).sum(1) / (
            np.linalg.norm(encoded, axis=1) * np.linalg.norm(stored, axis=1) + 1e-12
        )  # (sample,)
        worst = int(np.argmin(cosine))
        if cosine[worst] < IMPORT_MIN_COSINE:
            raise UserError(
                f"the vectors in the index do not match {encoder.spec.name} on this corpus: "
                f"re-encoded passage {int(rows[worst])} has cosine {cosine[worst]:.3f} to its "
                f"stored vector (median {np.median(cosine):.3f} over {len(rows)}, needed >= "
                f"{IMPORT_MIN_COSINE}); {hint}"
            )
        return f"{len(rows)} re-encoded passages match, cosine >= {cosine.min():.4f}"
    _, found = dense.search(encoded, 10)  # (sample, 10)
    recall = float(np.mean([row in hits for row, hits in zip(rows, found, strict=True)]))
    if recall < IMPORT_MIN_SELF_RECALL:
        raise UserError(
            f"the index does not match {encoder.spec.name} on this corpus: only {recall:.0%} of "
            f"{len(rows)} re-encoded passages find their own row in their top 10 (needed >= "
            f"{IMPORT_MIN_SELF_RECALL:.0%}); {hint}"
        )
    return f"{len(rows)} re-encoded passages: {recall:.0%} find their own row in their top 10"


def import_index(
    faiss_file: Path,
    corpus: Path,
    out_dir: Path,
    spec: EncoderSpec,
    encoder_config: EncoderConfig | None = None,
    bm25: bool | None = None,
    verify_sample: int = 64,
    copy: bool = False,
    show_progress: bool = True,
    force: bool = False,
) -> tuple[IndexManifest, str]:
    """Adopt an existing FAISS inner-product index of `corpus` (row i = line i) as `out_dir`.

    The FAISS file is hard-linked (or symlinked across file systems; copied with `copy`), never
    re-encoded; a sample is re-encoded to check encoder, prefixes and row order. Returns the
    manifest and the verification summary.
    """
    import faiss
    import numpy as np

    started = time.perf_counter()
    faiss_file, corpus, out_dir = Path(faiss_file), Path(corpus), Path(out_dir)
    if not faiss_file.is_file():
        raise UserError(f"FAISS file not found: {faiss_file}")
    check_index_output(out_dir, force, [faiss_file, corpus])
    offsets = scan_corpus(corpus)
    documents = len(offsets) - 1
    dense = read_dense(faiss_file, mmap=True)
    if dense.ntotal != documents:
        raise UserError(
            f"{faiss_file} holds {dense.ntotal} vectors but {corpus} has {documents} passages; "
            "row i of the index must be line i of the corpus"
        )
    if dense.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise UserError(f"{faiss_file} is not an inner-product index (metric {dense.metric_type})")
    encoder = Encoder(spec, encoder_config)
    if encoder.dimension != dense.d:
        raise UserError(
            f"{faiss_file} holds {dense.d}-d vectors, encoder {spec.name} gives "
            f"{encoder.dimension}-d ones"
        )
    summary = verify_imported_vectors(dense, encoder, corpus, offsets, verify_sample)

    partial = fresh_partial(out_dir)
    if copy:
        shutil.copyfile(faiss_file, partial / DENSE_FILE)
    else:
        try:
            os.link(faiss_file, partial / DENSE_FILE)
        except OSError:  # another file system: a symlink serves (and maps) the same bytes
            (partial / DENSE_FILE).symlink_to(faiss_file.resolve())
    np.save(partial / OFFSETS_FILE, offsets, allow_pickle=False)
    if documents <= BM25_AUTO_MAX_DOCUMENTS if bm25 is None else bm25:
        write_bm25(corpus, offsets, partial / BM25_DIR, DEFAULT_CHUNK_SIZE, show_progress)
    manifest = new_manifest(
        spec, dense.d, describe_factory(dense), corpus, out_dir,
        build_seconds=round(time.perf_counter() - started, 1),
        imported_from=str(faiss_file.resolve()),
    )  # fmt: skip
    return commit(partial, out_dir, manifest), summary


def describe_factory(index: faiss.Index) -> str:
    """The factory string of an index read from a file, where faiss can tell (else its class)."""
    import faiss
    from faiss.contrib.factory_tools import reverse_index_factory

    try:
        return reverse_index_factory(index)
    except (NotImplementedError, RuntimeError, AttributeError):
        return type(faiss.downcast_index(index)).__name__
