"""An index directory: its format, its checks, and loading it for serving.

Layout of an index directory (no pickle anywhere: FAISS's own format, `.npy` without object
arrays, bm25s's npy+JSON format, JSON):

    dense.faiss        FAISS inner-product index, any factory string (Flat, HNSW32,Flat,
                       IVF4096,PQ96, OPQ...); row i = corpus line i. May be a link to an imported
                       file.
    offsets.npy        int64 (documents + 1,): byte offset of each corpus line, then the file size,
                       so a passage is read with one positioned read and the corpus stays on disk
    bm25/              bm25s index (scores as CSC .npy, vocab/params JSON) and tokenizer vocab JSON
    manifest.json      the encoder spec (name, query/passage prefixes, pooling, truncation,
                       normalisation), dimension, FAISS factory string, document count, corpus
                       path and fingerprint, byte size of every file above

Builds, converts and imports write into `DIR.partial/` and rename it to `DIR` when complete
(`retrieval_server.index.staging`), so a directory with a manifest is always whole.
The corpus is not copied: the manifest records its path relative to the index directory (so
`data/` can move as a whole) and a fingerprint that `validate_index` checks.

Serving: flat vectors are memory-mapped read-only (faiss IO_FLAG_MMAP_IFC) unless disabled, so
start-up does not read them and replicas on one machine share one copy in the page cache;
`nprobe` / `efSearch` are set from the serving config; `dense.gpus` clones the index to the GPUs
it names (`retrieval_server.index.gpu_faiss`: written against faiss's GPU API, its limits checked
first; untested on a GPU).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import orjson
from pydantic import BaseModel, ConfigDict, ValidationError

from core.errors import UserError, error_reason
from retrieval_server.index.encoder import EncoderSpec, guess_prefixes

if TYPE_CHECKING:
    import bm25s
    import faiss
    import numpy as np
    from bm25s.tokenization import Tokenizer

    from retrieval_server.index.config import DenseSearchConfig
    from retrieval_server.index.rerank import ExactRerank

MANIFEST = "manifest.json"
DENSE_FILE = "dense.faiss"
REFINE_FILE = "refine.faiss"  # the exact (Flat) vectors a compressed index re-ranks with
COMPACT_FILE = "compact.faiss"  # finer codes (e.g. PQ192) that rank candidates before REFINE_FILE
OFFSETS_FILE = "offsets.npy"
BM25_DIR = "bm25"
BM25_STOPWORDS = "en"
FORMAT_VERSION = 2
FINGERPRINT_BLOCK = 1 << 20  # bytes hashed per sampled block
FINGERPRINT_BLOCKS = 16  # files up to this many blocks are hashed whole
FLAT_FACTORY = "Flat"


class IndexManifest(BaseModel):
    """What an index was built from and with; checked before the index is served."""

    model_config = ConfigDict(extra="forbid")

    format_version: int
    encoder: EncoderSpec
    dimension: int
    metric: Literal["inner_product"] = "inner_product"
    # FAISS index_factory string, e.g. "Flat", "HNSW32,Flat", "IVF1024,PQ64"; None: no dense
    # index (`hdr index build --no-dense`, BM25 only); `encoder` is then what one would use
    index_factory: str | None
    documents: int
    corpus_path: str  # relative to the index directory where possible
    corpus_bytes: int
    corpus_fingerprint: str
    bm25: bool
    bm25_stopwords: str | None = None
    files: dict[str, int]  # path relative to the index directory -> size in bytes
    build_seconds: float
    imported_from: str | None = None  # the FAISS file adopted by `hdr index import`, if any
    refine: bool = False  # REFINE_FILE holds the flat vectors (`hdr index convert --refine`)
    # COMPACT_FILE's factory string (`hdr index convert --refine --compact PQ192`); None: none
    compact_factory: str | None = None


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


def relative_corpus_path(corpus: Path, out_dir: Path) -> str:
    """The corpus path as recorded: relative to the index directory, absolute across drives."""
    try:
        return os.path.relpath(corpus.resolve(), out_dir.resolve())
    except ValueError:
        return str(corpus.resolve())


@dataclass
class IndexFiles:
    """A validated index directory: its manifest and the corpus it was built from."""

    index_dir: Path
    manifest: IndexManifest
    corpus: Path


def build_command_hint(index_dir: Path) -> str:
    return f"build it with `hdr index build --corpus FILE --out {index_dir}`"


def upgrade_manifest(data: dict[str, Any]) -> dict[str, Any]:
    """A format 1 manifest (encoder by name, index_type flat|hnsw) as format 2: the prefixes
    format 1 guessed from the name, the packaged models' mean pooling, 256 tokens, normalised."""
    query_prefix, passage_prefix = guess_prefixes(data["encoder"])
    data["encoder"] = EncoderSpec(
        name=data["encoder"],
        query_prefix=query_prefix,
        passage_prefix=passage_prefix,
        pooling="mean",
        max_length=256,
        normalize=True,
    ).model_dump()
    index_type, hnsw_m = data.pop("index_type", "flat"), data.pop("hnsw_m", None)
    data["index_factory"] = FLAT_FACTORY if index_type == "flat" else f"HNSW{hnsw_m},Flat"
    data["format_version"] = FORMAT_VERSION
    return data


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
        data = json.loads(path.read_text())
        if isinstance(data, dict) and data.get("format_version") == 1:
            data = upgrade_manifest(data)
        manifest = IndexManifest.model_validate(data)
    except (ValidationError, ValueError, KeyError, TypeError) as err:
        reason = err.errors()[0]["msg"] if isinstance(err, ValidationError) else str(err)
        raise UserError(f"{path} is not a valid index manifest: {reason}") from None
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
        return json.loads(self.get_raw(row))

    def get_raw(self, row: int) -> bytes:
        """Corpus line `row` as it is on disk (one JSON object, its newline included)."""
        start, end = int(self.offsets[row]), int(self.offsets[row + 1])
        return os.pread(self._fd, end - start, start)

    def get_json(self, row: int) -> bytes:
        """Corpus line `row` as the JSON of a response's document: the line's own bytes when
        its `id` is already a string (no re-encoding), else re-encoded with `id` as a string."""
        raw = self.get_raw(row)
        record = loads_json(raw)
        if isinstance(record.get("id"), str):
            return raw.strip()
        record["id"] = str(record["id"])
        return dumps_json(record)

    def close(self) -> None:
        os.close(self._fd)


def loads_json(data: bytes) -> Any:
    """JSON text parsed with orjson (several times faster), or the standard library where
    orjson refuses what JSON allows (a lone surrogate escape)."""
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError:
        return json.loads(data)


def dumps_json(value: Any) -> bytes:
    """Compact JSON; text that is not valid Unicode (a lone surrogate) is escaped."""
    try:
        return orjson.dumps(value)
    except TypeError:
        return json.dumps(value, ensure_ascii=True, separators=(",", ":")).encode()


def read_dense(path: Path, mmap: bool) -> faiss.Index:
    """Read a FAISS file; with `mmap`, flat vectors (IndexFlatCodes storage, also inside HNSW)
    are mapped read-only from the file instead of copied into memory."""
    import faiss

    flags = faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY if mmap else 0
    try:
        return faiss.read_index(str(path), flags)
    except RuntimeError as err:
        raise UserError(f"{path} is not a readable FAISS index: {error_reason(err)}") from None


def set_search_parameters(index: faiss.Index, nprobe: int, ef_search: int) -> None:
    """nprobe on an IVF index, efSearch on an HNSW one (also when wrapped, e.g. by OPQ)."""
    import faiss

    space = faiss.ParameterSpace()
    if faiss.try_extract_index_ivf(index) is not None:
        space.set_index_parameter(index, "nprobe", nprobe)
    if has_hnsw(index):
        space.set_index_parameter(index, "efSearch", ef_search)


def has_hnsw(index: faiss.Index) -> bool:
    import faiss

    index = faiss.downcast_index(index)
    while isinstance(index, faiss.IndexPreTransform):
        index = faiss.downcast_index(index.index)
    return hasattr(index, "hnsw")


def check_matches_manifest(
    path: Path, index: faiss.Index, manifest_path: Path, manifest: IndexManifest
) -> None:
    """One line naming the manifest field a FAISS file disagrees with, and both values."""
    for field, holds, says in (
        ("dimension", index.d, manifest.dimension),
        ("documents", index.ntotal, manifest.documents),
    ):
        if holds != says:
            raise UserError(
                f"{path} does not match {manifest_path}: the index's {field} is {holds}, the"
                f" manifest's {field} is {says}"
            )


def open_dense(
    files: IndexFiles, config: DenseSearchConfig, max_topk: int | None
) -> faiss.Index | ExactRerank:
    """The served FAISS index: read (or mapped), checked against the manifest, parameters set,
    on the GPUs `config.gpus` names (if any); `max_topk` is the most results a search asks."""
    manifest, index_dir = files.manifest, files.index_dir
    dense = read_dense(index_dir / DENSE_FILE, config.mmap)
    check_matches_manifest(index_dir / DENSE_FILE, dense, index_dir / MANIFEST, manifest)
    set_search_parameters(dense, config.nprobe, config.ef_search)
    k_factor = config.refine_k_factor if manifest.refine else 0
    if config.gpus is not None:
        dense, k_factor = to_gpus(dense, manifest.index_factory or "", config, max_topk, k_factor)
    if k_factor > 0:
        from retrieval_server.index.rerank import with_compact_refine, with_exact_rerank

        flat_path = index_dir / REFINE_FILE
        flat = read_dense(flat_path, mmap=True)
        check_matches_manifest(flat_path, flat, index_dir / MANIFEST, manifest)
        if manifest.compact_factory is not None and config.exact_k_factor > 0:
            compact = read_dense(index_dir / COMPACT_FILE, mmap=False)  # in RAM: the point
            check_matches_manifest(
                index_dir / COMPACT_FILE, compact, index_dir / MANIFEST, manifest
            )
            return with_compact_refine(dense, compact, flat_path, k_factor, config.exact_k_factor)
        return with_exact_rerank(dense, flat_path, k_factor)
    return dense


def to_gpus(
    dense: faiss.Index,
    factory: str,
    config: DenseSearchConfig,
    max_topk: int | None,
    k_factor: int,
) -> tuple[faiss.Index, int]:
    """`dense` cloned to `config.gpus`, and the refine factor (`k_factor`, 0: none) a GPU
    search allows; FAISS-GPU's limits are checked first, each refused in one line."""
    import faiss

    from retrieval_server.index import gpu_faiss

    gpus = config.gpus or []
    gpu_faiss.check_gpus(gpus, *gpu_faiss.gpu_faiss_available())
    gpu_faiss.check_gpu_index(factory, has_hnsw(dense))
    ivf = faiss.try_extract_index_ivf(dense) is not None
    k_factor = gpu_faiss.fit_gpu_search(
        max_topk or gpu_faiss.GPU_MAX_K, config.nprobe if ivf else None, k_factor
    )
    return gpu_faiss.clone_to_gpus(dense, gpus), k_factor


@dataclass
class LoadedIndex:
    """What the retrievers search: the FAISS index and/or BM25 (whichever are served), and the
    documents."""

    files: IndexFiles
    dense: faiss.Index | ExactRerank | None
    bm25: bm25s.BM25 | None
    bm25_tokenizer: Tokenizer | None
    documents: DocumentStore

    @property
    def manifest(self) -> IndexManifest:
        return self.files.manifest

    def close(self) -> None:
        self.documents.close()


def load_index(
    index_dir: Path,
    corpus: Path | None = None,
    dense: DenseSearchConfig | None = None,
    with_dense: bool = True,
    with_bm25: bool = True,
    max_topk: int | None = None,
) -> LoadedIndex:
    """Validate, then load the parts of an index directory that will be served.

    `with_bm25` loads BM25 only if the index has it; see `validate_index` for the errors raised.
    BM25's arrays are memory-mapped, like flat vectors. `max_topk` (ServerConfig.max_topk) is
    the most results one search asks for, which bounds a GPU search; None assumes the GPU's
    limit itself.
    """
    import bm25s
    import numpy as np

    from retrieval_server.index.config import DenseSearchConfig

    files = validate_index(index_dir, corpus)
    manifest, index_dir = files.manifest, files.index_dir
    offsets = np.load(index_dir / OFFSETS_FILE, mmap_mode="r", allow_pickle=False)
    if len(offsets) != manifest.documents + 1:
        raise UserError(
            f"{index_dir / OFFSETS_FILE} does not match {index_dir / MANIFEST}: it holds"
            f" {len(offsets) - 1} passages, the manifest's documents is {manifest.documents}"
        )
    if int(offsets[-1]) != manifest.corpus_bytes:
        raise UserError(
            f"{index_dir / OFFSETS_FILE} does not match {index_dir / MANIFEST}: it covers"
            f" {int(offsets[-1])} corpus bytes, the manifest's corpus_bytes is"
            f" {manifest.corpus_bytes}"
        )
    has_dense = with_dense and manifest.index_factory is not None
    dense_config = dense or DenseSearchConfig()
    dense_index = open_dense(files, dense_config, max_topk) if has_dense else None
    bm25_index, tokenizer = None, None
    if with_bm25 and manifest.bm25:
        bm25_index = bm25s.BM25.load(
            str(index_dir / BM25_DIR), mmap=True, allow_pickle=False, show_progress=False
        )
        tokenizer = make_bm25_tokenizer()
        tokenizer.load_vocab(str(index_dir / BM25_DIR))
    return LoadedIndex(
        files=files,
        dense=dense_index,
        bm25=bm25_index,
        bm25_tokenizer=tokenizer,
        documents=DocumentStore(files.corpus, offsets),
    )
