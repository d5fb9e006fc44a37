"""Where an index command writes: the half-finished folder `DIR.partial` and the move into `DIR`.

Every writer (build, convert, import) checks where it writes first (`check_index_output`: `DIR`
new, empty, or an index it may replace with `force`; never one of its inputs), then works in
`DIR.partial/` (`fresh_partial`, marked as hdr's), then records the files in the manifest and
moves the new index into `DIR` (`commit`), replacing only an older index's own files. An
interrupted or failed run never leaves a directory that looks like an index; `DIR.partial` is
only ever read by the next run for the same `DIR`, which resumes it when it was started with
the same settings (`core.fingerprint.resume_or_refuse`) and never discards encoded chunks
silently.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import UserError
from core.paths import INDEX, check_output, swap_in
from retrieval_server.index.files import (
    BM25_DIR,
    BM25_STOPWORDS,
    COMPACT_FILE,
    DENSE_FILE,
    FORMAT_VERSION,
    MANIFEST,
    OFFSETS_FILE,
    REFINE_FILE,
    IndexManifest,
    corpus_fingerprint,
    relative_corpus_path,
)

if TYPE_CHECKING:
    import faiss

    from retrieval_server.index.encoder import EncoderSpec

VECTORS_DIR = "vectors"

BUILD_STATE = "build.json"

STAGING_MARK = ".hdr-partial"  # marks DIR.partial as hdr's own unfinished build


def partial_dir(out_dir: Path) -> Path:
    return out_dir.with_name(out_dir.name + ".partial")


def check_index_output(out_dir: Path, force: bool, inputs: list[Path]) -> None:
    """`out_dir` may receive an index (new, empty, or an index with `force`; never an input),
    and `DIR.partial` beside it is absent or an earlier build's: one UserError line otherwise,
    before any work."""
    check_output(out_dir, INDEX, force=force, inputs=inputs)
    partial = partial_dir(out_dir)
    if partial.exists() and not is_unfinished_build(partial):
        raise UserError(
            f"{partial} exists and is not an unfinished hdr build; move it away (hdr builds the"
            f" index there before it becomes {out_dir})"
        )


def is_unfinished_build(partial: Path) -> bool:
    """Whether `partial` is hdr's own unfinished build (marked, or an older build's state)."""
    return (partial / STAGING_MARK).is_file() or (partial / BUILD_STATE).is_file()


def encoded_chunks(partial: Path) -> list[Path]:
    """The finished chunk files of an unfinished dense build in `partial` (its resumable work)."""
    vectors = partial / VECTORS_DIR
    if not vectors.is_dir():
        return []
    return sorted(p for p in vectors.glob("[0-9]*.npy") if not p.name.endswith(".tmp.npy"))


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def human_bytes(size: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def fresh_partial(out_dir: Path) -> Path:
    """An empty `DIR.partial`, marked as hdr's. An unfinished earlier build there is removed
    only if it holds no encoded chunks: those are hours of work at 21M passages, so a build
    that cannot resume them refuses and says how to resume or remove them."""
    partial = partial_dir(out_dir)
    if partial.exists():
        if not is_unfinished_build(partial):
            raise UserError(f"{partial} exists and is not an unfinished hdr build; move it away")
        chunks = encoded_chunks(partial)
        if chunks:
            raise UserError(
                f"{partial} holds {len(chunks)} encoded chunks"
                f" ({human_bytes(folder_bytes(partial))}) of an interrupted `hdr index build`,"
                f" which this command would discard: rerun that build to resume it, or remove"
                f" them with `rm -r {partial}` to start over"
            )
        shutil.rmtree(partial)
    partial.mkdir(parents=True)
    (partial / STAGING_MARK).write_text("an unfinished hdr index build; safe to delete\n")
    return partial


def commit(partial: Path, out_dir: Path, manifest: IndexManifest) -> IndexManifest:
    """Record the files' sizes in the manifest, write it, and move the new index into
    `out_dir`: a new or empty folder is renamed into place; over an older index only the old
    index's own files are replaced or removed (`core.paths.swap_in`), the manifest last, and
    nothing else in the folder is touched."""
    (partial / STAGING_MARK).unlink(missing_ok=True)
    files = [partial / OFFSETS_FILE]
    if manifest.index_factory is not None:
        files.append(partial / DENSE_FILE)
    if manifest.refine:
        files.append(partial / REFINE_FILE)
    if manifest.compact_factory is not None:
        files.append(partial / COMPACT_FILE)
    if manifest.bm25:
        files += sorted(p for p in (partial / BM25_DIR).iterdir() if p.is_file())
    manifest.files = {p.relative_to(partial).as_posix(): p.stat().st_size for p in files}
    (partial / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    previous = (
        [*json.loads((out_dir / MANIFEST).read_text())["files"], MANIFEST]
        if (INDEX.recognise(out_dir))
        else []
    )
    swap_in(partial, out_dir, previous, last=MANIFEST)
    return manifest


def new_manifest(
    spec: EncoderSpec,
    dimension: int,
    factory: str | None,
    corpus: Path,
    out_dir: Path,
    **fields: object,
) -> IndexManifest:
    import numpy as np

    offsets = np.load(partial_dir(out_dir) / OFFSETS_FILE, mmap_mode="r")
    bm25 = (partial_dir(out_dir) / BM25_DIR).is_dir()
    return IndexManifest(
        format_version=FORMAT_VERSION,
        encoder=spec,
        dimension=dimension,
        index_factory=factory,
        documents=len(offsets) - 1,
        corpus_path=relative_corpus_path(corpus, out_dir),
        corpus_bytes=int(offsets[-1]),
        corpus_fingerprint=corpus_fingerprint(corpus),
        bm25=bm25,
        bm25_stopwords=BM25_STOPWORDS if bm25 else None,
        files={},
        **fields,
    )


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def write_index_atomically(index: faiss.Index, path: Path) -> None:
    """`faiss.write_index` to `path` through a temporary name beside it: a killed write
    leaves the temporary file (overwritten next time), never a torn `path`."""
    import faiss

    tmp = path.with_name(path.name + ".tmp")
    faiss.write_index(index, str(tmp))
    os.replace(tmp, path)


def link_or_copy(source: Path | str, target: Path | str) -> None:
    """A hard link (same file system: no extra disk), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)
