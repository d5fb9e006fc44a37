"""Writing index directories: build from a corpus, convert to another FAISS index, import one.

Every writer follows the same steps: check where it writes (`DIR` new, empty, or an index it
may replace with `force`; never one of its inputs: `core.paths`) and all its input (the whole
corpus, the factory string, the encoder), then work in `DIR.partial/`, then write the manifest
and move the new index into `DIR`, replacing only an older index's own files. An interrupted
or failed run never leaves a directory that looks like an index; `DIR.partial` (marked as
hdr's) is only ever read by the next build of the same `DIR`.

- `build_index`: passages are encoded in chunks of `chunk_size`, each saved as
  `DIR.partial/vectors/NNNNNN.npy` as soon as it is done, so a rerun with the same corpus and
  encoder spec resumes after the last finished chunk (a different spec starts over). Then the
  FAISS index is made from the chunks: "Flat" is streamed to disk chunk by chunk (the full
  matrix is never in memory); other factory strings are trained on a sample of
  `train_sample` vectors and filled chunk by chunk.
- `convert_index`: the same FAISS step from an existing index's stored vectors (Flat or
  HNSW..Flat), e.g. an imported wiki-18 Flat index into IVF-PQ, without re-encoding, in
  resumable steps: the trained empty index is saved (`trained.faiss`), then each
  `chunk_size` rows are added to a copy of it saved as `added/NNNNNN.faiss`, then the copies
  are merged in row order; a rerun with the same settings resumes after the last saved step.
- `import_index`: adopts an existing FAISS file (Search-R1's or FlashRAG's `e5_Flat.index`) and
  its corpus: links it (or copies it), writes offsets and the manifest, after re-encoding a
  sample of passages and comparing with the stored vectors.

BM25 is built when asked, and by default only for corpora up to `BM25_AUTO_MAX_DOCUMENTS`
passages: bm25s indexes from token ids held in memory (a few GB per million passages).
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from core.errors import UserError
from core.paths import INDEX, check_output, swap_in
from retrieval_server.build_defaults import (
    BM25_AUTO_MAX_DOCUMENTS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_CONVERT_CHUNK,
    DEFAULT_TRAIN_SAMPLE,
)
from retrieval_server.corpus import read_contents, scan_corpus
from retrieval_server.encoder import (
    DEFAULT_ENCODER,
    Encoder,
    EncoderSpec,
    encoder_spec,
    resolve_encoder,
)
from retrieval_server.index import (
    BM25_DIR,
    BM25_STOPWORDS,
    COMPACT_FILE,
    DENSE_FILE,
    FLAT_FACTORY,
    FORMAT_VERSION,
    MANIFEST,
    OFFSETS_FILE,
    REFINE_FILE,
    IndexManifest,
    corpus_fingerprint,
    first_line,
    make_bm25_tokenizer,
    read_dense,
    relative_corpus_path,
    validate_index,
)

if TYPE_CHECKING:
    import faiss
    import numpy as np

    from retrieval_server.config import EncoderConfig

VECTORS_DIR = "vectors"
BUILD_STATE = "build.json"
STAGING_MARK = ".hdr-partial"  # marks DIR.partial as hdr's own unfinished build
CONVERT_STATE = "convert.json"  # an unfinished convert's settings, compared on resume
TRAINED_FILE = "trained.faiss"  # the trained, empty index of an unfinished convert
ADDED_DIR = "added"  # an unfinished convert's steps: the trained index + one chunk's rows
INDEX_ALIASES = {"flat": FLAT_FACTORY, "hnsw": "HNSW32,Flat"}
IMPORT_MIN_COSINE = 0.98  # re-encoded vs stored; fp16 GPU builds agree to ~0.999
IMPORT_MIN_SELF_RECALL = 0.9  # lossy indexes: share of sampled passages found in their top 10
# faiss-cpu 1.15's OPQ training corrupts the heap on small samples (310 and 1,000 vectors
# aborted the process here; 4,000 trained), so OPQ needs FAISS's own recommended sample for
# 256-centroid codebooks (39 x 256).
OPQ_MIN_TRAIN = 39 * 256


FAST_SCAN_ALIAS = "fast-scan"


def fast_scan_factory(vectors: int, dimension: int) -> str:
    """The compressed layout chosen by measurement (docs/retrieval.md, "Operating points"):
    IVF lists near sqrt(vectors) (a power of two, 16..65,536, at least 39 vectors a list to
    train: IVF1024 at 1M, IVF4096 at 10M and 21M), 4-bit fast-scan PQ with one sub-quantizer
    per 8 dimensions (768-d: PQ96x4fs, half the bytes of PQ96 and 3-4x faster to scan).
    Served with `--refine`: on real MiniLM vectors and on the synthetic ones, re-ranking
    32 x k candidates exactly gives the recall of 8-bit PQ + refine at a fraction of the
    scan. Fewer lists than FAISS's 4-16 x sqrt(n) guideline: fast-scan makes the longer lists
    cheap to scan (910 q/s a thread at 10M, nprobe 64), and assigning 10M vectors to 4x the
    lists would take 4x the build's longest step on a CPU."""
    import math

    lists = 2 ** round(math.log2(max(1.0, math.sqrt(vectors))))
    lists = max(16, min(65_536, lists, 2 ** int(math.log2(max(16, vectors // 39)))))
    # sub-quantizers: the largest even divisor of the dimension up to dimension / 8
    sub = next((m for m in range(dimension // 8, 1, -1) if m % 2 == 0 and dimension % m == 0), 2)
    return f"IVF{lists},PQ{sub}x4fs"


def factory_string(
    index_type: str, vectors: int | None = None, dimension: int | None = None
) -> str:
    """A FAISS factory string from `--index-type`: the aliases flat, hnsw and fast-scan (sized
    for `vectors` of `dimension`: `fast_scan_factory`), or a factory string."""
    if index_type == FAST_SCAN_ALIAS:
        if vectors is None or dimension is None:
            raise UserError(f"--index-type {FAST_SCAN_ALIAS} needs the vector count and size")
        return fast_scan_factory(vectors, dimension)
    return INDEX_ALIASES.get(index_type, index_type)


def check_trainable(factory: str, vectors: int, train_sample: int) -> None:
    """Refuse, before any work, a factory string that cannot be trained on what there is."""
    if "OPQ" in factory.upper() and min(vectors, train_sample) < OPQ_MIN_TRAIN:
        raise UserError(
            f"{factory!r} needs at least {OPQ_MIN_TRAIN:,} training vectors for its OPQ rotation"
            f" ({min(vectors, train_sample):,} available): use IVF..,PQ.. without OPQ here"
        )


def new_faiss_index(factory: str, dimension: int) -> faiss.Index:
    """An empty inner-product index from a factory string; a bad string is a UserError."""
    import faiss

    try:
        return faiss.index_factory(dimension, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise UserError(
            f"{factory!r} is not a FAISS factory string for {dimension}-d vectors "
            f"(e.g. Flat, HNSW32,Flat, IVF1024,SQ8, IVF4096,PQ96, OPQ96,IVF4096,PQ96): "
            f"{first_line(err)}"
        ) from None


class FlatFileWriter:
    """Writes an inner-product `IndexFlat` file chunk by chunk, byte for byte what
    `faiss.write_index` writes, without holding the vectors: header (taken from faiss's own
    serialisation of an empty index, with the count set), then the float32 rows."""

    def __init__(self, path: Path, dimension: int, total: int) -> None:
        import faiss
        import numpy as np

        empty = faiss.serialize_index(faiss.IndexFlatIP(dimension)).tobytes()
        # fourcc, d (int32), ntotal (int64) at bytes 8..16, ..., then the code vector's length
        # (uint64, in floats) as the last 8 bytes of an empty index, then the floats.
        header = bytearray(empty[:-8])
        header[8:16] = np.int64(total).tobytes()
        self.dimension, self.total, self.written = dimension, total, 0
        self._file = path.open("wb")
        self._file.write(bytes(header) + np.uint64(total * dimension).tobytes())

    def add(self, vectors: np.ndarray) -> None:
        import numpy as np

        vectors = np.ascontiguousarray(vectors, dtype=np.float32)  # (n, dimension)
        if vectors.ndim != 2 or vectors.shape[1] != self.dimension:
            raise ValueError(f"expected (n, {self.dimension}) vectors, got {vectors.shape}")
        self._file.write(vectors.tobytes())
        self.written += len(vectors)

    def abandon(self) -> None:
        """Close after a failure, without the row check (a second full-disk error on the
        final flush is dropped: the first one is what the caller reports)."""
        with suppress(OSError):
            self._file.close()

    def close(self) -> None:
        self._file.close()
        if self.written != self.total:
            raise ValueError(f"flat file has {self.written} rows, its header says {self.total}")


class VectorSource(Protocol):
    """Passage vectors in row order, read a chunk at a time."""

    count: int
    dimension: int

    def chunks(self) -> Iterator[np.ndarray]:
        """(n, dimension) float32 blocks, in row order, covering every row once."""
        ...

    def rows(self, rows: np.ndarray) -> np.ndarray:
        """(len(rows), dimension) float32 vectors of the given (sorted) rows."""
        ...


class ChunkFiles:
    """The `vectors/NNNNNN.npy` chunks of a build."""

    def __init__(self, paths: list[Path]) -> None:
        import numpy as np

        self.paths = paths
        shapes = [np.load(path, mmap_mode="r").shape for path in paths]
        self.starts = np.cumsum([0] + [shape[0] for shape in shapes])  # (chunks + 1,)
        self.count, self.dimension = int(self.starts[-1]), shapes[0][1]

    def chunks(self) -> Iterator[np.ndarray]:
        import numpy as np

        for path in self.paths:
            yield np.load(path)

    def rows(self, rows: np.ndarray) -> np.ndarray:
        import numpy as np

        chunk_of_row = np.searchsorted(self.starts, rows, side="right") - 1
        parts = []
        for chunk in np.unique(chunk_of_row):
            vectors = np.load(self.paths[chunk], mmap_mode="r")
            parts.append(vectors[rows[chunk_of_row == chunk] - self.starts[chunk]])
        return np.ascontiguousarray(np.concatenate(parts), dtype=np.float32)


class StoredVectors:
    """The vectors an existing FAISS index stores (Flat, HNSW..Flat), read back by row."""

    def __init__(self, index: faiss.Index, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        self.index, self.chunk_size = index, chunk_size
        self.count, self.dimension = index.ntotal, index.d

    def chunks(self) -> Iterator[np.ndarray]:
        for start in range(0, self.count, self.chunk_size):
            yield self.block(start, min(self.chunk_size, self.count - start))

    def block(self, start: int, count: int) -> np.ndarray:
        """(count, dimension) float32 vectors of rows [start, start + count)."""
        return self.index.reconstruct_n(start, count)

    def rows(self, rows: np.ndarray) -> np.ndarray:
        return self.index.reconstruct_batch(rows)


def training_rows(count: int, sample: int) -> np.ndarray:
    """A fixed pseudo-random sorted sample of rows to train on (all rows if fewer)."""
    import numpy as np

    if sample >= count:
        return np.arange(count)
    return np.sort(np.random.default_rng(0).choice(count, sample, replace=False))


def write_dense(
    source: VectorSource,
    factory: str,
    path: Path,
    train_sample: int = DEFAULT_TRAIN_SAMPLE,
    on_chunk: Callable[[int], None] = lambda rows: None,
) -> None:
    """Make the FAISS index `factory` over every vector of `source` and write it to `path`."""
    import faiss

    if factory == FLAT_FACTORY:
        writer = FlatFileWriter(path, source.dimension, source.count)
        try:
            for vectors in source.chunks():
                writer.add(vectors)
                on_chunk(len(vectors))
        except BaseException:
            writer.abandon()  # the error says why (a full disk, Ctrl-C), not the row count
            raise
        writer.close()
        return
    index = new_faiss_index(factory, source.dimension)
    if not index.is_trained:
        try:
            index.train(source.rows(training_rows(source.count, train_sample)))
        except RuntimeError as err:
            raise UserError(f"cannot train {factory!r}: {first_line(err)}") from None
    for vectors in source.chunks():
        index.add(vectors)
        on_chunk(len(vectors))
    faiss.write_index(index, str(path))


def write_bm25(
    corpus: Path, offsets: np.ndarray, bm25_dir: Path, chunk_size: int, show_progress: bool
) -> None:
    """Tokenise every passage, index with bm25s, save with the vocabulary (npy + JSON only)."""
    import bm25s
    from bm25s.tokenization import Tokenized

    tokenizer = make_bm25_tokenizer()
    token_ids: list[list[int]] = []
    documents = len(offsets) - 1
    for start in range(0, documents, chunk_size):
        passages = read_contents(corpus, offsets, start, min(start + chunk_size, documents))
        token_ids += tokenizer.tokenize(
            passages, update_vocab=True, return_as="ids", show_progress=False, allow_empty=False
        )
    retriever = bm25s.BM25()
    retriever.index(  # bm25s draws its own bars: only on a terminal, where they redraw in place
        Tokenized(ids=token_ids, vocab=tokenizer.get_vocab_dict()),
        show_progress=show_progress and sys.stderr.isatty(),
    )
    retriever.save(str(bm25_dir), allow_pickle=False, show_progress=False)
    tokenizer.save_vocab(str(bm25_dir))


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
    state_file = partial / BUILD_STATE
    if is_unfinished_build(partial):
        try:
            earlier = json.loads(state_file.read_text())
        except (OSError, ValueError):
            earlier = None
        if earlier == state:
            return partial
        chunks = encoded_chunks(partial)
        if chunks and isinstance(earlier, dict):
            raise UserError(
                f"{partial} holds {len(chunks)} encoded chunks of an interrupted build with"
                f" other settings ({'; '.join(state_differences(earlier, state))}): rerun with"
                f" the earlier settings to resume, or remove them with `rm -r {partial}` to"
                " start over"
            )
    partial = fresh_partial(out_dir)
    (partial / VECTORS_DIR).mkdir()
    state_file.write_text(json.dumps(state, indent=2) + "\n")
    return partial


BUILD_OPTION_OF = {
    "chunk_size": "--chunk-size",
    "name": "--encoder",
    "query_prefix": "--query-prefix",
    "passage_prefix": "--passage-prefix",
    "pooling": "--pooling",
}


def state_differences(earlier: dict, now: dict) -> list[str]:
    """Each setting of a build state that differs, as `--chunk-size 1000 then, 500 now`."""
    differences = []
    if earlier.get("corpus_fingerprint") != now.get("corpus_fingerprint") or earlier.get(
        "corpus_bytes"
    ) != now.get("corpus_bytes"):
        differences.append("the corpus file changed since")
    flat_earlier = {"chunk_size": earlier.get("chunk_size"), **(earlier.get("encoder") or {})}
    flat_now = {"chunk_size": now.get("chunk_size"), **(now.get("encoder") or {})}
    for key in sorted(set(flat_earlier) | set(flat_now)):
        if flat_earlier.get(key) != flat_now.get(key):
            name = BUILD_OPTION_OF.get(key, f"encoder {key}")
            differences.append(f"{name} {flat_earlier.get(key)!r} then, {flat_now.get(key)!r} now")
    return differences or ["an older build format"]


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
    state_file = partial / CONVERT_STATE
    if is_unfinished_build(partial) and state_file.is_file():
        try:
            earlier = json.loads(state_file.read_text())
        except (OSError, ValueError):
            earlier = None
        if earlier == state:
            return partial
        steps = len(added_steps(partial))
        if isinstance(earlier, dict) and (steps or (partial / TRAINED_FILE).is_file()):
            differences = [
                f"{key} {earlier.get(key)!r} then, {value!r} now"
                for key, value in state.items()
                if earlier.get(key) != value
            ]
            raise UserError(
                f"{partial} holds an interrupted `hdr index convert` ({steps} chunks added) with"
                f" other settings ({'; '.join(differences)}): rerun it with the earlier settings"
                f" to resume, or remove it with `rm -r {partial}` to start over"
            )
    partial = fresh_partial(out_dir)
    write_atomically(state_file, (json.dumps(state, indent=2) + "\n").encode())
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
                raise UserError(f"cannot train {factory!r}: {first_line(err)}") from None
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


def link_or_copy(source: Path | str, target: Path | str) -> None:
    """A hard link (same file system: no extra disk), else a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


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
