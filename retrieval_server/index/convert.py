"""`hdr index convert`: an index's dense part remade as another FAISS index, from the vectors
it stores (Flat or HNSW..Flat), without re-encoding: e.g. an imported wiki-18 Flat index into
IVF-PQ. BM25 and offsets are carried over (hard-linked where possible).

In resumable steps (`add_in_steps`): the trained empty index is saved (`trained.faiss`), then
each `chunk_size` rows are added to a copy of it saved as `added/NNNNNN.faiss`, then the
copies are merged in row order; a rerun with the same settings resumes after the last saved
step, one with other settings refuses to discard them.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import UserError, error_reason
from core.fingerprint import resume_or_refuse
from retrieval_server.index.defaults import DEFAULT_CONVERT_CHUNK, DEFAULT_TRAIN_SAMPLE
from retrieval_server.index.files import (
    BM25_DIR,
    COMPACT_FILE,
    DENSE_FILE,
    FLAT_FACTORY,
    OFFSETS_FILE,
    REFINE_FILE,
    IndexManifest,
    read_dense,
    validate_index,
)
from retrieval_server.index.staging import (
    check_index_output,
    commit,
    fresh_partial,
    is_unfinished_build,
    link_or_copy,
    new_manifest,
    partial_dir,
    write_atomically,
    write_index_atomically,
)
from retrieval_server.index.writers import (
    StoredVectors,
    check_trainable,
    factory_string,
    new_faiss_index,
    training_rows,
    write_dense,
)

if TYPE_CHECKING:
    pass

CONVERT_STATE = "convert.json"  # an unfinished convert's settings, compared on resume

TRAINED_FILE = "trained.faiss"  # the trained, empty index of an unfinished convert

ADDED_DIR = "added"  # an unfinished convert's steps: the trained index + one chunk's rows


def convert_index(
    source_dir: Path,
    out_dir: Path,
    index_type: str,
    train_sample: int = DEFAULT_TRAIN_SAMPLE,
    show_progress: bool = True,
    refine: bool = False,
    force: bool = False,
    chunk_size: int = DEFAULT_CONVERT_CHUNK,
    after_step: Callable[[int], None] = lambda steps: None,
    compact: str | None = None,
) -> IndexManifest:
    """A copy of the index at `source_dir` with its dense index remade as `index_type`, from the
    stored vectors (no re-encoding); BM25 and offsets are carried over (hard-linked if possible).
    `refine` also links the source's Flat vectors as REFINE_FILE, which the server memory-maps
    to re-rank the compressed index's candidates exactly. `compact` (a factory string of codes
    without lists, e.g. PQ192) adds COMPACT_FILE: finer codes the server holds in RAM to rank
    those candidates before only the best few are read from REFINE_FILE.

    Resumable (`add_in_steps`): rerunning the same command after an interruption reuses the
    trained index and every chunk of `chunk_size` rows already added. `after_step` is called
    with the number of chunks saved so far, after each one this run adds."""
    from core.progress import progress as progress_bar

    started = time.perf_counter()
    source_dir, out_dir = Path(source_dir), Path(out_dir)
    files = validate_index(source_dir)
    check_index_output(out_dir, force, [source_dir, files.corpus])
    if files.manifest.index_factory is None:
        raise UserError(f"{source_dir} has no dense index to convert (built with --no-dense)")
    if refine and files.manifest.index_factory != FLAT_FACTORY:
        raise UserError(
            f"--refine needs a Flat source index (the exact vectors); {source_dir} holds "
            f"{files.manifest.index_factory}"
        )
    if chunk_size < 1:
        raise UserError(f"--chunk-size must be at least 1 (got {chunk_size})")
    factory = factory_string(index_type, files.manifest.documents, files.manifest.dimension)
    new_faiss_index(factory, files.manifest.dimension)
    check_trainable(factory, files.manifest.documents, train_sample)
    if compact is not None:
        check_compact(compact, files.manifest.dimension, refine)
    vectors = StoredVectors(read_dense(source_dir / DENSE_FILE, mmap=True))
    try:
        vectors.rows(training_rows(vectors.count, 1))
    except RuntimeError:
        raise UserError(
            f"{source_dir} has a {files.manifest.index_factory} index, whose vectors cannot be "
            "read back; convert from a Flat (or HNSW..Flat) index"
        ) from None
    source_stat = (source_dir / DENSE_FILE).stat()
    state = {
        "source": str(source_dir.resolve()),
        "source_dense": [source_stat.st_size, source_stat.st_mtime_ns],
        "corpus_fingerprint": files.manifest.corpus_fingerprint,
        "index_type": factory,
        "train_sample": train_sample,
        "refine": refine,
        "chunk_size": chunk_size,
        **({"compact": compact} if compact is not None else {}),
    }
    partial = start_convert(out_dir, state)
    for name in (OFFSETS_FILE, REFINE_FILE, BM25_DIR):  # links this run makes again
        target = partial / name
        if target.is_dir():
            shutil.rmtree(target)
        target.unlink(missing_ok=True)
    link_or_copy(source_dir / OFFSETS_FILE, partial / OFFSETS_FILE)
    if files.manifest.bm25:
        shutil.copytree(source_dir / BM25_DIR, partial / BM25_DIR, copy_function=link_or_copy)
    if refine:
        link_or_copy(source_dir / DENSE_FILE, partial / REFINE_FILE)
    if factory == FLAT_FACTORY:  # a plain copy of the vectors, streamed (nothing to resume)
        with progress_bar(
            total=vectors.count, desc=f"index {factory}", unit="doc", enabled=show_progress
        ) as bar:
            write_dense(vectors, factory, partial / DENSE_FILE, train_sample, bar.update)
    elif not (partial / DENSE_FILE).is_file():  # else the last run stopped after writing it
        add_in_steps(vectors, factory, partial, train_sample, chunk_size, show_progress, after_step)
    if compact is not None and not (partial / COMPACT_FILE).is_file():
        add_in_steps(
            vectors, compact, partial, train_sample, chunk_size, show_progress, after_step,
            target=COMPACT_FILE,
        )  # fmt: skip
    for target in (DENSE_FILE, COMPACT_FILE):
        trained, added = step_files(partial, target)
        trained.unlink(missing_ok=True)
        shutil.rmtree(added, ignore_errors=True)
    (partial / CONVERT_STATE).unlink(missing_ok=True)
    manifest = new_manifest(
        files.manifest.encoder, files.manifest.dimension, factory, files.corpus, out_dir,
        build_seconds=round(time.perf_counter() - started, 1),
        imported_from=files.manifest.imported_from, refine=refine, compact_factory=compact,
    )  # fmt: skip
    return commit(partial, out_dir, manifest)


def start_convert(out_dir: Path, state: dict[str, object]) -> Path:
    """`DIR.partial` for a convert with `state`: an unfinished convert's with the same state is
    kept (resumed); one with other settings that holds work (a trained index, added chunks) is
    never discarded silently: the convert refuses, naming the settings that differ."""
    partial = partial_dir(out_dir)
    if is_unfinished_build(partial):
        steps = len(added_steps(partial))
        trained = (partial / TRAINED_FILE).is_file()
        held = f"{steps} added chunks" if steps else "a trained index" if trained else None
        if resume_or_refuse(partial / CONVERT_STATE, state, held, "`hdr index convert`"):
            return partial
    partial = fresh_partial(out_dir)
    write_atomically(partial / CONVERT_STATE, (json.dumps(state, indent=2) + "\n").encode())
    return partial


def check_compact(compact: str, dimension: int, refine: bool) -> None:
    """`--compact` names codes without lists (PQ.., SQ..) and comes with `--refine`."""
    import faiss

    if not refine:
        raise UserError(
            "--compact ranks the candidates before their exact vectors are read: it needs --refine"
        )
    codes = faiss.downcast_index(new_faiss_index(compact, dimension))
    if not isinstance(codes, faiss.IndexFlatCodes) or isinstance(codes, faiss.IndexFlat):
        raise UserError(
            f"--compact {compact!r} must be codes without lists or graphs, smaller than the flat"
            f" vectors (e.g. PQ{dimension // 4}, SQ8, SQ4)"
        )


def step_files(partial: Path, target: str) -> tuple[Path, Path]:
    """The trained index and the folder of added chunks an unfinished convert keeps while it
    makes `target` (DENSE_FILE or COMPACT_FILE)."""
    if target == DENSE_FILE:
        return partial / TRAINED_FILE, partial / ADDED_DIR
    stem = target.removesuffix(".faiss")
    return partial / f"{stem}.{TRAINED_FILE}", partial / f"{ADDED_DIR}-{stem}"


def added_steps(partial: Path, target: str = DENSE_FILE) -> list[Path]:
    """The chunk files an unfinished convert in `partial` has saved for `target`."""
    folder = step_files(partial, target)[1]
    return sorted(folder.glob("[0-9]*.faiss")) if folder.is_dir() else []


def add_in_steps(
    source: StoredVectors,
    factory: str,
    partial: Path,
    train_sample: int,
    chunk_size: int,
    show_progress: bool,
    after_step: Callable[[int], None],
    target: str = DENSE_FILE,
) -> None:
    """Train `factory` (or reuse `partial`'s trained index), add the rows chunk by chunk, each
    into its own copy of the trained index saved under `added/` (skipping chunks already
    there), then merge the copies in row order into `target` (DENSE_FILE or COMPACT_FILE).
    Every file is written under a temporary name and renamed, so a kill at any point leaves
    only whole steps behind.

    Merging in row order gives the index an uninterrupted `add` of all rows would: the same
    ids (IVF chunks are added with their global row numbers) and the same list order. An
    index FAISS cannot merge (HNSW) is filled in one step, not resumable."""
    import faiss
    import numpy as np

    from core.progress import progress as progress_bar

    def say(line: str) -> None:
        if show_progress:
            print(line, file=sys.stderr, flush=True)

    trained_path, folder = step_files(partial, target)
    if trained_path.is_file():
        trained = faiss.read_index(str(trained_path))
        say(f"convert: resuming in {partial} (trained {factory} found)")
    else:
        trained = new_faiss_index(factory, source.dimension)
        if not trained.is_trained:
            rows = training_rows(source.count, train_sample)
            say(f"convert: training {factory} on {len(rows):,} vectors")
            try:
                trained.train(source.rows(rows))
            except RuntimeError as err:
                raise UserError(f"cannot train {factory!r}: {error_reason(err)}") from None
        write_index_atomically(trained, trained_path)
    try:
        ivf = faiss.extract_index_ivf(trained)
    except RuntimeError:
        ivf = None
    mergeable = ivf is not None or isinstance(faiss.downcast_index(trained), faiss.IndexFlatCodes)
    total = source.count
    bar_settings = {"total": total, "desc": f"add {factory}", "unit": "doc"}
    if not mergeable:
        say(f"convert: {factory} cannot be merged from parts; adding all rows in one step")
        with progress_bar(**bar_settings, enabled=show_progress) as bar:
            for vectors in source.chunks():
                trained.add(vectors)
                bar.update(len(vectors))
        write_index_atomically(trained, partial / target)
        return
    folder.mkdir(exist_ok=True)
    steps = -(-total // chunk_size)
    done = {path.name for path in added_steps(partial, target)}
    if done:
        say(f"convert: {len(done)} of {steps} chunks already added")
    with progress_bar(**bar_settings, enabled=show_progress) as bar:
        for step in range(steps):
            start = step * chunk_size
            count = min(chunk_size, total - start)
            path = folder / f"{step:06d}.faiss"
            if path.name not in done:
                part = faiss.clone_index(trained)
                vectors = source.block(start, count)
                if ivf is not None:
                    part.add_with_ids(vectors, np.arange(start, start + count, dtype=np.int64))
                else:
                    part.add(vectors)
                write_index_atomically(part, path)
                after_step(step + 1)
            bar.update(count)
    say(f"convert: merging {steps} chunks into {target}")
    for step in range(steps):
        trained.merge_from(faiss.read_index(str(folder / f"{step:06d}.faiss")), 0)
    write_index_atomically(trained, partial / target)
