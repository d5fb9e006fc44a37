"""`hdr index build`: encode a corpus and write its index directory, resumably.

Passages are encoded in chunks of `chunk_size`, each saved as `DIR.partial/vectors/NNNNNN.npy`
as soon as it is done, so a rerun with the same corpus and encoder spec resumes after the last
finished chunk; a rerun with other settings refuses to discard them (one line naming what
differs). Then the FAISS index is made from the chunks (`writers.write_dense`) and BM25
beside it, and the folder is moved into place (`staging.commit`). `dense=False` builds
BM25 alone. Converting an index is `convert`, adopting an existing FAISS file
`importing`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import UserError
from core.fingerprint import differences, resume_or_refuse
from retrieval_server.index.corpus import read_contents, scan_corpus
from retrieval_server.index.defaults import (
    BM25_AUTO_MAX_DOCUMENTS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_TRAIN_SAMPLE,
)
from retrieval_server.index.encoder import (
    DEFAULT_ENCODER,
    Encoder,
    EncoderSpec,
    encoder_spec,
    resolve_encoder,
)
from retrieval_server.index.files import (
    BM25_DIR,
    DENSE_FILE,
    FLAT_FACTORY,
    OFFSETS_FILE,
    IndexManifest,
    corpus_fingerprint,
)
from retrieval_server.index.staging import (
    BUILD_STATE,
    VECTORS_DIR,
    check_index_output,
    commit,
    encoded_chunks,
    folder_bytes,
    fresh_partial,
    human_bytes,
    is_unfinished_build,
    new_manifest,
    partial_dir,
)
from retrieval_server.index.writers import (
    FAST_SCAN_ALIAS,
    ChunkFiles,
    check_trainable,
    factory_string,
    new_faiss_index,
    write_bm25,
    write_dense,
)

if TYPE_CHECKING:
    import numpy as np

    from retrieval_server.index.config import EncoderConfig


@dataclass
class BuildResult:
    manifest: IndexManifest
    chunks_encoded: int  # chunks encoded by this run
    chunks_reused: int  # chunks found done by an interrupted earlier run


def start_partial(out_dir: Path, state: dict[str, object]) -> Path:
    """`DIR.partial` for a build with `state`: kept if an earlier run had the same state. An
    earlier run's encoded chunks under another state are never discarded silently: the
    build refuses, naming each setting that differs and how to resume or start over."""
    partial = partial_dir(out_dir)
    if is_unfinished_build(partial):
        chunks = len(encoded_chunks(partial))
        held = f"{chunks} encoded chunks" if chunks else None
        if resume_or_refuse(partial / BUILD_STATE, state, held, "build", state_differences):
            return partial
    partial = fresh_partial(out_dir)
    (partial / VECTORS_DIR).mkdir()
    (partial / BUILD_STATE).write_text(json.dumps(state, indent=2) + "\n")
    return partial


CORPUS_STATE = ("corpus_fingerprint", "corpus_bytes")
BUILD_OPTION_OF = {
    "chunk_size": "--chunk-size",
    "encoder.name": "--encoder",
    "encoder.query_prefix": "--query-prefix",
    "encoder.passage_prefix": "--passage-prefix",
    "encoder.pooling": "--pooling",
}


def state_differences(earlier: dict, now: dict) -> list[str]:
    """Each setting of a build state that differs, as `--chunk-size 1000 then, 500 now`."""

    def settings(state: dict) -> dict:
        return {key: value for key, value in state.items() if key not in CORPUS_STATE}

    corpus = any(earlier.get(key) != now.get(key) for key in CORPUS_STATE)
    changed = differences(
        settings(earlier),
        settings(now),
        label=lambda key: BUILD_OPTION_OF.get(key, key.replace(".", " ", 1)),
    )
    return ["the corpus file changed since"] * corpus + changed


@contextmanager
def disk_full_explained(partial: Path, needed_bytes: int, command: str) -> Iterator[None]:
    """Turn "no space left on device" while writing into `partial` into one line naming the
    folder, what it holds, the space the build needs and free, and how to resume or remove
    it. The folder is kept: its finished chunks are resumable work."""
    try:
        yield
    except OSError as err:
        held = folder_bytes(partial) if partial.is_dir() else 0
        free = shutil.disk_usage(partial if partial.is_dir() else partial.parent).free
        # numpy's writes say only "N requested and M written" (no errno): a short write on a
        # disk without room for the rest of the build is the same full disk
        short_write = err.errno is None and free < needed_bytes - held
        if err.errno not in (errno.ENOSPC, errno.EDQUOT) and not short_write:
            raise
        raise UserError(
            f"no space left on the device of {partial}: it holds {human_bytes(held)} of"
            f" resumable work ({len(encoded_chunks(partial))} encoded chunks); the build needs"
            f" about {human_bytes(needed_bytes)} in all there and {human_bytes(free)} is free."
            f" Free space and rerun `{command}` with the same options to resume, or remove the"
            f" folder with `rm -r {partial}`"
        ) from None


def build_space_needed(documents: int, dimension: int, corpus_bytes: int, bm25: bool) -> int:
    """Bytes a dense build writes at its peak: the chunks and the FAISS file beside them
    (a Flat index is the vectors again; compressed ones are smaller), offsets, and BM25 (its
    arrays measured at about half the corpus's bytes on wiki-vital)."""
    vectors = documents * dimension * 4
    return 2 * vectors + 8 * (documents + 1) + (corpus_bytes // 2 if bm25 else 0)


def build_index(
    corpus: Path,
    out_dir: Path,
    spec: EncoderSpec | None = None,
    index_type: str = FLAT_FACTORY,
    bm25: bool | None = None,
    encoder_config: EncoderConfig | None = None,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    train_sample: int = DEFAULT_TRAIN_SAMPLE,
    show_progress: bool = True,
    dense: bool = True,
    force: bool = False,
) -> BuildResult:
    """Encode every passage of `corpus` and write the index directory `out_dir` (see module).

    `bm25` None builds BM25 for corpora of at most `BM25_AUTO_MAX_DOCUMENTS` passages.
    `dense` False builds BM25 alone: nothing is encoded (seconds where encoding takes minutes
    or hours on a CPU); the manifest records the encoder a dense index would use.
    """
    import numpy as np

    from core.progress import progress as progress_bar

    corpus, out_dir = Path(corpus), Path(out_dir)
    if not corpus.is_file():  # the input first: a missing corpus is the mistake to name
        raise UserError(f"corpus file not found: {corpus}")
    check_index_output(out_dir, force, [corpus])
    started = time.perf_counter()
    factory = index_type if index_type == FAST_SCAN_ALIAS else factory_string(index_type)
    offsets = scan_corpus(corpus)  # the whole corpus is checked before anything is encoded
    documents = len(offsets) - 1
    spec = spec or encoder_spec(DEFAULT_ENCODER)
    with_bm25 = documents <= BM25_AUTO_MAX_DOCUMENTS if bm25 is None else bm25
    if not dense:
        if not with_bm25:
            raise UserError("--no-dense with --no-bm25 leaves nothing to build")
        return build_bm25_only(corpus, out_dir, spec, offsets, chunk_size, show_progress, started)
    encoder = Encoder(spec, encoder_config)
    if index_type == FAST_SCAN_ALIAS:
        factory = factory_string(index_type, documents, encoder.dimension)
    check_trainable(factory, documents, train_sample)
    new_faiss_index(factory, encoder.dimension)  # a bad factory string fails before encoding

    state = {
        "corpus_fingerprint": corpus_fingerprint(corpus),
        "corpus_bytes": int(offsets[-1]),
        "encoder": spec.model_dump(),
        "chunk_size": chunk_size,
    }
    partial = start_partial(out_dir, state)
    command = f"hdr index build --corpus {corpus} --out {out_dir}" + (
        f" --chunk-size {chunk_size}" if chunk_size != DEFAULT_CHUNK_SIZE else ""
    )
    needed = build_space_needed(documents, encoder.dimension, int(offsets[-1]), with_bm25)
    with disk_full_explained(partial, needed, command):
        chunk_paths = [
            partial / VECTORS_DIR / f"{i:06d}.npy" for i in range(-(-documents // chunk_size))
        ]
        done = [path for path in chunk_paths if path.is_file()]
        with progress_bar(
            total=documents, desc="encode passages", unit="doc", enabled=show_progress
        ) as progress:
            progress.update(sum(np.load(path, mmap_mode="r").shape[0] for path in done))
            for number, path in enumerate(chunk_paths):
                if path.is_file():
                    continue
                start = number * chunk_size
                stop = min(start + chunk_size, documents)
                vectors = encoder.encode_passages(read_contents(corpus, offsets, start, stop))
                tmp = path.with_suffix(".tmp.npy")
                np.save(tmp, vectors, allow_pickle=False)  # (stop - start, dimension)
                os.replace(tmp, path)  # a chunk file exists only when complete
                progress.update(stop - start)

        np.save(partial / OFFSETS_FILE, offsets, allow_pickle=False)
        with progress_bar(
            total=documents, desc=f"index {factory}", unit="doc", enabled=show_progress
        ) as bar:
            write_dense(
                ChunkFiles(chunk_paths), factory, partial / DENSE_FILE, train_sample, bar.update
            )
        if with_bm25:
            write_bm25(corpus, offsets, partial / BM25_DIR, chunk_size, show_progress)
    shutil.rmtree(partial / VECTORS_DIR)
    (partial / BUILD_STATE).unlink()
    manifest = new_manifest(
        spec, encoder.dimension, factory, corpus, out_dir,
        build_seconds=round(time.perf_counter() - started, 1),
    )  # fmt: skip
    return BuildResult(
        manifest=commit(partial, out_dir, manifest),
        chunks_encoded=len(chunk_paths) - len(done),
        chunks_reused=len(done),
    )


def build_bm25_only(
    corpus: Path,
    out_dir: Path,
    spec: EncoderSpec,
    offsets: np.ndarray,
    chunk_size: int,
    show_progress: bool,
    started: float,
) -> BuildResult:
    """The index directory without a dense index: offsets and BM25."""
    import numpy as np
    from transformers import AutoConfig

    dimension = AutoConfig.from_pretrained(resolve_encoder(spec.name)).hidden_size
    partial = fresh_partial(out_dir)
    np.save(partial / OFFSETS_FILE, offsets, allow_pickle=False)
    write_bm25(corpus, offsets, partial / BM25_DIR, chunk_size, show_progress)
    manifest = new_manifest(
        spec, dimension, None, corpus, out_dir,
        build_seconds=round(time.perf_counter() - started, 1),
    )  # fmt: skip
    return BuildResult(
        manifest=commit(partial, out_dir, manifest), chunks_encoded=0, chunks_reused=0
    )
