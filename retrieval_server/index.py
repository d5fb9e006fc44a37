"""Build, validate and load a retrieval index directory.

Layout of an index directory (no pickle anywhere: FAISS's own format, `.npy` without object
arrays, bm25s's npy+JSON format, JSON):

    dense.faiss        FAISS inner-product index over L2-normalised passage vectors; row i = line i
    offsets.npy        int64 (documents + 1,): byte offset of each corpus line, then the file size,
                       so a passage is read with one positioned read and the corpus stays on disk
    bm25/              bm25s index (scores as CSC .npy, vocab/params JSON) and tokenizer vocab JSON
    manifest.json      encoder, dimension, metric, index type, document count, corpus path and
                       fingerprint, byte size of every file above; written last, so its absence
                       marks an interrupted build

The corpus is not copied: the manifest records its path relative to the index directory (so
`data/` can move as a whole) and a fingerprint that `load_index` checks.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from hdr.errors import UserError
from retrieval_server.encoder import DEFAULT_ENCODER

if TYPE_CHECKING:
    import bm25s
    import faiss
    import numpy as np
    from bm25s.tokenization import Tokenizer

MANIFEST = "manifest.json"
DENSE_FILE = "dense.faiss"
OFFSETS_FILE = "offsets.npy"
BM25_DIR = "bm25"
BM25_STOPWORDS = "en"
FORMAT_VERSION = 1
FINGERPRINT_BLOCK = 1 << 20  # bytes hashed per sampled block
FINGERPRINT_BLOCKS = 16  # files up to this many blocks are hashed whole
IndexType = Literal["flat", "hnsw"]


class IndexManifest(BaseModel):
    """What an index was built from and with; checked before the index is served."""

    model_config = ConfigDict(extra="forbid")

    format_version: int
    encoder: str
    dimension: int
    metric: Literal["inner_product"] = "inner_product"
    index_type: IndexType
    hnsw_m: int | None = None
    documents: int
    corpus_path: str  # relative to the index directory where possible
    corpus_bytes: int
    corpus_fingerprint: str
    bm25: bool
    bm25_stopwords: str | None = None
    files: dict[str, int]  # path relative to the index directory -> size in bytes
    build_seconds: float


def corpus_fingerprint(path: Path) -> str:
    """sha256 over the file size and its bytes; a large file is sampled at 16 evenly spaced 1 MiB
    blocks (first and last included), so checking a 14 GB corpus at startup takes milliseconds."""
    size = path.stat().st_size
    digest = hashlib.sha256(str(size).encode())
    with path.open("rb") as file:
        if size <= FINGERPRINT_BLOCK * FINGERPRINT_BLOCKS:
            digest.update(file.read())
        else:
            last_start = size - FINGERPRINT_BLOCK
            for block in range(FINGERPRINT_BLOCKS):
                file.seek(last_start * block // (FINGERPRINT_BLOCKS - 1))
                digest.update(file.read(FINGERPRINT_BLOCK))
    return digest.hexdigest()


def make_bm25_tokenizer() -> Tokenizer:
    """The one tokenizer used for passages and queries: lower-case words, English stopwords."""
    from bm25s.tokenization import Tokenizer

    return Tokenizer(lower=True, stopwords=BM25_STOPWORDS, stemmer=None)


def count_lines(path: Path) -> int:
    """Number of lines (a last line without a newline counts)."""
    count, last = 0, b"\n"
    with path.open("rb") as file:
        while chunk := file.read(1 << 24):
            count += chunk.count(b"\n")
            last = chunk[-1:]
    return count + (last != b"\n")


def iter_corpus(path: Path) -> Iterator[tuple[int, str]]:
    """(byte offset, contents) per line of a Search-R1 JSONL corpus; a bad line is a UserError."""
    offset = 0
    with path.open("rb") as file:
        for line_number, raw in enumerate(file, start=1):
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                raise UserError(f"{path}:{line_number}: not a JSON object") from None
            if not (isinstance(record, dict) and isinstance(record.get("contents"), str)):
                raise UserError(f'{path}:{line_number}: needs a string field "contents"')
            if "id" not in record:
                raise UserError(f'{path}:{line_number}: needs a field "id"')
            yield offset, record["contents"]
            offset += len(raw)


def new_dense_index(dimension: int, index_type: IndexType, hnsw_m: int) -> faiss.Index:
    import faiss

    if index_type == "flat":
        return faiss.IndexFlatIP(dimension)
    index = faiss.IndexHNSWFlat(dimension, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = 128
    return index


def relative_corpus_path(corpus: Path, out_dir: Path) -> str:
    """The corpus path as recorded: relative to the index directory, absolute across drives."""
    try:
        return os.path.relpath(corpus.resolve(), out_dir.resolve())
    except ValueError:
        return str(corpus.resolve())


def build_index(
    corpus: Path,
    out_dir: Path,
    encoder: str = DEFAULT_ENCODER,
    index_type: IndexType = "flat",
    bm25: bool = True,
    hnsw_m: int = 32,
    batch_size: int = 256,
    show_progress: bool = True,
) -> IndexManifest:
    """Index every passage of `corpus` into `out_dir` in one streaming pass; manifest last.

    Passages are read in chunks of `batch_size`: encoded and added to FAISS, and tokenised for
    BM25, so only BM25's token ids (which bm25s needs at once) grow with the corpus.
    """
    corpus, out_dir = Path(corpus), Path(out_dir)
    if not corpus.is_file():
        raise UserError(f"corpus file not found: {corpus}")
    started = time.perf_counter()
    documents = count_lines(corpus)
    if documents == 0:
        raise UserError(f"corpus {corpus} is empty")
    # every line is checked before any encoding: a bad line deep in a large corpus would
    # otherwise surface only after hours of work, with a half-made index left behind
    for _ in iter_corpus(corpus):
        pass
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)  # a half-rebuilt index must not look complete
    try:
        return _build_into(
            corpus, out_dir, documents, started, encoder, index_type, bm25, hnsw_m, batch_size,
            show_progress,
        )  # fmt: skip
    except BaseException:
        if created:  # never leave a half-made directory behind (Ctrl-C, a failure)
            import shutil

            shutil.rmtree(out_dir, ignore_errors=True)
        raise


def _build_into(
    corpus: Path,
    out_dir: Path,
    documents: int,
    started: float,
    encoder: str,
    index_type: IndexType,
    bm25: bool,
    hnsw_m: int,
    batch_size: int,
    show_progress: bool,
) -> IndexManifest:
    """`build_index` after the corpus was checked: encode, write the files, manifest last."""
    import faiss
    import numpy as np

    from hdr.progress import progress as progress_bar
    from retrieval_server.encoder import Encoder

    model = Encoder(encoder)
    dense = new_dense_index(model.dimension, index_type, hnsw_m)
    tokenizer = make_bm25_tokenizer() if bm25 else None
    token_ids: list[list[int]] = []
    offsets = np.zeros(documents + 1, dtype=np.int64)  # (documents + 1,)
    chunk: list[str] = []

    def flush() -> None:
        dense.add(model.encode_passages(chunk, batch_size=64))  # (len(chunk), dimension)
        if tokenizer is not None:
            token_ids.extend(
                tokenizer.tokenize(
                    chunk,
                    update_vocab=True,
                    return_as="ids",
                    show_progress=False,
                    allow_empty=False,
                )
            )
        progress.update(len(chunk))
        chunk.clear()

    row = 0
    with progress_bar(
        total=documents, desc="encode passages", unit="doc", enabled=show_progress
    ) as progress:
        for row, (offset, contents) in enumerate(iter_corpus(corpus)):
            offsets[row] = offset
            chunk.append(contents)
            if len(chunk) == batch_size:
                flush()
        if chunk:
            flush()
    offsets[documents] = corpus.stat().st_size

    faiss.write_index(dense, str(out_dir / DENSE_FILE))
    np.save(out_dir / OFFSETS_FILE, offsets, allow_pickle=False)
    if tokenizer is not None:
        # bm25s draws its own bars: only on a terminal, where they redraw in place
        write_bm25(out_dir / BM25_DIR, token_ids, tokenizer, show_progress and sys.stderr.isatty())

    files = [out_dir / DENSE_FILE, out_dir / OFFSETS_FILE]
    if bm25:
        files += sorted(p for p in (out_dir / BM25_DIR).iterdir() if p.is_file())
    manifest = IndexManifest(
        format_version=FORMAT_VERSION,
        encoder=encoder,
        dimension=model.dimension,
        index_type=index_type,
        hnsw_m=hnsw_m if index_type == "hnsw" else None,
        documents=documents,
        corpus_path=relative_corpus_path(corpus, out_dir),
        corpus_bytes=int(offsets[documents]),
        corpus_fingerprint=corpus_fingerprint(corpus),
        bm25=bm25,
        bm25_stopwords=BM25_STOPWORDS if bm25 else None,
        files={p.relative_to(out_dir).as_posix(): p.stat().st_size for p in files},
        build_seconds=round(time.perf_counter() - started, 1),
    )
    (out_dir / MANIFEST).write_text(manifest.model_dump_json(indent=2) + "\n")
    return manifest


def write_bm25(
    bm25_dir: Path, token_ids: list[list[int]], tokenizer: Tokenizer, show_progress: bool
) -> None:
    """Index token ids with bm25s and save it with the tokenizer vocabulary (JSON + npy only)."""
    import bm25s
    from bm25s.tokenization import Tokenized

    retriever = bm25s.BM25()
    retriever.index(
        Tokenized(ids=token_ids, vocab=tokenizer.get_vocab_dict()), show_progress=show_progress
    )
    retriever.save(str(bm25_dir), allow_pickle=False, show_progress=False)
    tokenizer.save_vocab(str(bm25_dir))


@dataclass
class IndexFiles:
    """A validated index directory: its manifest and the corpus it was built from."""

    index_dir: Path
    manifest: IndexManifest
    corpus: Path


def build_command_hint(index_dir: Path) -> str:
    return f"build it with `hdr index build --corpus FILE --out {index_dir}`"


def read_manifest(index_dir: Path) -> IndexManifest:
    if not index_dir.is_dir():
        raise UserError(
            f"index directory {index_dir} does not exist; {build_command_hint(index_dir)}"
        )
    path = index_dir / MANIFEST
    if not path.is_file():
        raise UserError(
            f"index directory {index_dir} is incomplete: no {MANIFEST} (interrupted build?); "
            f"{build_command_hint(index_dir)}"
        )
    try:
        manifest = IndexManifest.model_validate_json(path.read_text())
    except ValidationError as err:
        raise UserError(f"{path} is not a valid index manifest: {err.errors()[0]['msg']}") from None
    if manifest.format_version != FORMAT_VERSION:
        raise UserError(
            f"{path} has format version {manifest.format_version}, this hdr reads "
            f"{FORMAT_VERSION}; rebuild the index"
        )
    return manifest


def validate_index(index_dir: Path, corpus: Path | None = None) -> IndexFiles:
    """Check an index directory without loading it: manifest, file sizes, corpus fingerprint.

    Raises UserError naming the first problem: missing, incomplete, or not matching its corpus.
    `corpus` overrides the path recorded in the manifest (e.g. inside a container).
    """
    index_dir = Path(index_dir)
    manifest = read_manifest(index_dir)
    for name, size in manifest.files.items():
        path = index_dir / name
        if not path.is_file():
            raise UserError(f"index directory {index_dir} is incomplete: {name} is missing")
        if path.stat().st_size != size:
            raise UserError(
                f"index directory {index_dir} is incomplete: {name} has "
                f"{path.stat().st_size} bytes, the manifest says {size}"
            )
    corpus = Path(corpus) if corpus is not None else index_dir / manifest.corpus_path
    if not corpus.is_file():
        raise UserError(
            f"corpus {corpus} of index {index_dir} not found; pass its path with --corpus"
        )
    mismatch = f"index {index_dir} does not match its corpus {corpus}"
    if corpus.stat().st_size != manifest.corpus_bytes:
        raise UserError(
            f"{mismatch}: {corpus.stat().st_size} bytes, built from {manifest.corpus_bytes}; "
            "rebuild the index"
        )
    if corpus_fingerprint(corpus) != manifest.corpus_fingerprint:
        raise UserError(f"{mismatch}: its contents changed since the build; rebuild the index")
    return IndexFiles(index_dir=index_dir, manifest=manifest, corpus=corpus)


class DocumentStore:
    """Corpus lines read on demand by byte offset; thread-safe (positioned reads, no seek state)."""

    def __init__(self, corpus: Path, offsets: np.ndarray) -> None:
        self.corpus = corpus
        self.offsets = offsets  # (documents + 1,) int64
        self._fd = os.open(corpus, os.O_RDONLY)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def get(self, row: int) -> dict[str, Any]:
        """The parsed JSON object of corpus line `row`."""
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        return json.loads(os.pread(self._fd, end - start, start))

    def close(self) -> None:
        os.close(self._fd)


@dataclass
class LoadedIndex:
    """Everything a retriever searches: the FAISS index, BM25 (if built) and the documents."""

    files: IndexFiles
    dense: faiss.Index
    bm25: bm25s.BM25 | None
    bm25_tokenizer: Tokenizer | None
    documents: DocumentStore

    @property
    def manifest(self) -> IndexManifest:
        return self.files.manifest

    def close(self) -> None:
        self.documents.close()


def load_index(
    index_dir: Path, corpus: Path | None = None, hnsw_ef_search: int = 128
) -> LoadedIndex:
    """Validate, then load an index directory (see `validate_index` for the errors raised)."""
    import bm25s
    import faiss
    import numpy as np

    files = validate_index(index_dir, corpus)
    manifest, index_dir = files.manifest, files.index_dir
    dense = faiss.read_index(str(index_dir / DENSE_FILE))
    offsets = np.load(index_dir / OFFSETS_FILE, mmap_mode="r", allow_pickle=False)
    if dense.ntotal != manifest.documents or dense.d != manifest.dimension:
        raise UserError(f"{index_dir / DENSE_FILE} does not match {index_dir / MANIFEST}")
    if len(offsets) != manifest.documents + 1 or int(offsets[-1]) != manifest.corpus_bytes:
        raise UserError(f"{index_dir / OFFSETS_FILE} does not match {index_dir / MANIFEST}")
    if manifest.index_type == "hnsw":
        dense.hnsw.efSearch = hnsw_ef_search
    bm25_index, tokenizer = None, None
    if manifest.bm25:
        bm25_index = bm25s.BM25.load(str(index_dir / BM25_DIR), allow_pickle=False)
        tokenizer = make_bm25_tokenizer()
        tokenizer.load_vocab(str(index_dir / BM25_DIR))
    return LoadedIndex(
        files=files,
        dense=dense,
        bm25=bm25_index,
        bm25_tokenizer=tokenizer,
        documents=DocumentStore(files.corpus, offsets),
    )
