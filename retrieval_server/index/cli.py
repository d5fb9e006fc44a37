"""`hdr index prepare-wiki|build|convert|import|export-encoder`: the index commands, mounted
under `hdr index` by `retrieval_server.cli`.

Heavy imports (torch, faiss, sentence-transformers) happen inside the command bodies so that
`hdr --help` answers at once. User mistakes raise `UserError` (one line, exit 2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from core.options import force_option
from retrieval_server.index.defaults import (
    BM25_AUTO_MAX_DOCUMENTS,
    DEFAULT_CHUNK_SIZE,
    DEFAULT_CONVERT_CHUNK,
    DEFAULT_TRAIN_SAMPLE,
)

PREPARE_EXAMPLE = """Example:

  hdr index prepare-wiki --out data/wiki-vital.jsonl
"""
BUILD_EXAMPLE = """Example:

  hdr index build --corpus data/wiki-vital.jsonl --out data/index
"""
CONVERT_EXAMPLE = """Example:

  hdr index convert --from data/wiki18-flat --index-type fast-scan --refine --out data/wiki18-fs
  hdr index convert --from data/wiki18-flat --index-type fast-scan --refine --compact PQ192 \
      --out data/wiki18-fs-compact
"""
IMPORT_EXAMPLE = """Example:

  hdr index import --faiss e5_Flat.index --corpus wiki-18.jsonl --encoder /models/e5-base-v2 \\
      --out data/wiki18-flat
"""

index_app = typer.Typer(
    help="Build the retrieval corpus and index.",
    no_args_is_help=True,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


@index_app.command("prepare-wiki", epilog=PREPARE_EXAMPLE)
def prepare_wiki_command(
    out: Path = typer.Option(..., "--out", help="Corpus JSONL to write."),
    limit: int | None = typer.Option(
        None, "--limit", min=1, help="Only the first N articles (file order)."
    ),
    force: bool = force_option(),
) -> None:
    """Write the embedded corpus (~10,000 Wikipedia vital-article summaries) as Search-R1 JSONL."""
    from retrieval_server.index.corpus import prepare_wiki

    count = prepare_wiki(out, limit, force=force)
    typer.echo(f"wrote {count} passages to {out}")


def encoder_options(
    backend: str, device: str, fp16: bool, batch_size: int, threads: int | None = None
):
    """An `EncoderConfig` from command-line options (validated: a bad value is one line)."""
    from core.config import build_config
    from retrieval_server.index.config import EncoderConfig

    values = {"backend": backend, "device": device, "fp16": fp16, "batch_size": batch_size}
    if threads is not None:
        values["threads"] = threads
    return build_config(EncoderConfig, values)


def spec_options(
    encoder: str, query_prefix: str | None, passage_prefix: str | None, pooling: str | None
):
    """The `EncoderSpec` of a new index: the model's defaults, overridden where given."""
    from core.errors import UserError
    from retrieval_server.index.encoder import encoder_spec

    if pooling not in (None, "mean", "cls", "max"):
        raise UserError(f"--pooling must be mean, cls or max, not {pooling!r}")
    return encoder_spec(encoder, query_prefix, passage_prefix, pooling)  # type: ignore[arg-type]


ENCODER_HELP = "Packaged name (all-MiniLM-L6-v2) or local model directory."
INDEX_TYPE_HELP = (
    "FAISS factory string (Flat, HNSW32,Flat, IVF1024,SQ8, IVF4096,PQ96, OPQ96,IVF4096,PQ96, "
    "...) or the aliases flat, hnsw and fast-scan (IVF lists near sqrt(passages), 4-bit "
    "fast-scan PQ: the measured choice for large corpora; convert it with --refine)."
)
BM25_HELP = (
    f"Also build BM25 (default: only for corpora of at most {BM25_AUTO_MAX_DOCUMENTS:,} passages)."
)


# Options that mean the same in `index build`, `convert` and `import` (one definition each).
def train_sample_option() -> Any:
    return typer.Option(
        DEFAULT_TRAIN_SAMPLE,
        "--train-sample",
        min=1,
        help="Vectors to train IVF/PQ/SQ/OPQ indexes on.",
    )


def bm25_option() -> Any:
    return typer.Option(None, "--bm25/--no-bm25", help=BM25_HELP)


def pooling_option() -> Any:
    return typer.Option(None, "--pooling", help="mean, cls or max (default: the model's).")


def passage_prefix_option(help: str) -> Any:
    return typer.Option(None, "--passage-prefix", help=help)


def query_prefix_option(help: str) -> Any:
    return typer.Option(None, "--query-prefix", help=help)


def encoder_backend_option() -> Any:
    return typer.Option("onnx", "--encoder-backend", help="onnx (CPU) or torch.")


def encoder_device_option() -> Any:
    return typer.Option("cpu", "--encoder-device", help="cpu or cuda (torch).")


@index_app.command("build", epilog=BUILD_EXAMPLE)
def build_command(
    corpus: Path = typer.Option(..., "--corpus", help="Search-R1 JSONL corpus."),
    out: Path = typer.Option(..., "--out", help="Index directory to write."),
    encoder: str = typer.Option("all-MiniLM-L6-v2", "--encoder", help=ENCODER_HELP),
    index_type: str = typer.Option("Flat", "--index-type", help=INDEX_TYPE_HELP),
    bm25: bool | None = bm25_option(),
    query_prefix: str | None = query_prefix_option(
        "Recorded for queries (default: guessed: e5, bge)."
    ),
    passage_prefix: str | None = passage_prefix_option(
        "Put before each passage (default: guessed: e5)."
    ),
    pooling: str | None = pooling_option(),
    backend: str = encoder_backend_option(),
    device: str = encoder_device_option(),
    fp16: bool = typer.Option(False, "--fp16", help="Half precision (cuda only)."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Passages per forward pass."),
    chunk_size: int = typer.Option(
        DEFAULT_CHUNK_SIZE,
        "--chunk-size",
        min=1,
        help="Passages per saved chunk (the unit of resuming).",
    ),
    train_sample: int = train_sample_option(),
    dense: bool = typer.Option(
        True,
        "--dense/--no-dense",
        help="Build the dense index (--no-dense: BM25 only, nothing encoded: seconds, not"
        " minutes, on a CPU).",
    ),
    force: bool = force_option(),
) -> None:
    """Encode the corpus into a FAISS index (+ BM25) with a manifest; resumes when rerun."""
    from retrieval_server.index.build import build_index

    result = build_index(
        corpus,
        out,
        spec=spec_options(encoder, query_prefix, passage_prefix, pooling),
        index_type=index_type,
        bm25=bm25,
        encoder_config=encoder_options(backend, device, fp16, batch_size),
        chunk_size=chunk_size,
        train_sample=train_sample,
        dense=dense,
        force=force,
    )
    manifest = result.manifest
    resumed = f", resumed after {result.chunks_reused} chunks" if result.chunks_reused else ""
    typer.echo(
        f"indexed {manifest.documents} passages into {out} "
        f"({manifest.index_factory or 'no dense index'}, {manifest.dimension}-d,"
        f" bm25={manifest.bm25}) in {manifest.build_seconds:.0f}s{resumed}"
    )


@index_app.command("convert", epilog=CONVERT_EXAMPLE)
def convert_command(
    source: Path = typer.Option(..., "--from", help="Index directory with a Flat index."),
    out: Path = typer.Option(..., "--out", help="Index directory to write."),
    index_type: str = typer.Option(..., "--index-type", help=INDEX_TYPE_HELP),
    train_sample: int = train_sample_option(),
    refine: bool = typer.Option(
        False,
        "--refine",
        help="Keep the Flat vectors (hard-linked) to re-rank the compressed index's candidates"
        " exactly at serve time (memory-mapped; dense.refine_k_factor).",
    ),
    compact: str | None = typer.Option(
        None,
        "--compact",
        help="With --refine: also write finer codes (a factory string without lists, e.g."
        " PQ192 for 768-d) that the server holds in RAM to rank the candidates, reading only"
        " k x dense.exact_k_factor of them from the flat vectors (where those do not fit in"
        " memory).",
    ),
    chunk_size: int = typer.Option(
        DEFAULT_CONVERT_CHUNK,
        "--chunk-size",
        min=1,
        help="Rows added per resumable step (rerun the same command to resume).",
    ),
    force: bool = force_option(),
) -> None:
    """Remake an index's FAISS part as another index type from its stored vectors (no
    re-encoding): e.g. an imported wiki-18 Flat index into IVF-PQ. Resumable: an interrupted
    convert, rerun with the same options, continues after its last saved step."""
    from retrieval_server.index.convert import convert_index

    manifest = convert_index(
        source, out, index_type, train_sample, refine=refine, force=force,
        chunk_size=chunk_size, compact=compact,
    )  # fmt: skip
    size = manifest.files["dense.faiss"] / 2**30
    typer.echo(
        f"wrote {out}: {manifest.index_factory} over {manifest.documents} vectors, "
        f"{size:.2f} GiB, in {manifest.build_seconds:.0f}s"
    )


@index_app.command("import", epilog=IMPORT_EXAMPLE)
def import_command(
    faiss_file: Path = typer.Option(..., "--faiss", help="Existing FAISS index file."),
    corpus: Path = typer.Option(..., "--corpus", help="Its JSONL corpus (row i = line i)."),
    encoder: str = typer.Option(..., "--encoder", help=ENCODER_HELP),
    out: Path = typer.Option(..., "--out", help="Index directory to write."),
    query_prefix: str | None = query_prefix_option(
        "Put before queries (default: guessed: e5, bge)."
    ),
    passage_prefix: str | None = passage_prefix_option(
        "The passages' prefix (default: guessed: e5)."
    ),
    pooling: str | None = pooling_option(),
    bm25: bool | None = bm25_option(),
    verify_sample: int = typer.Option(
        64, "--verify-sample", min=1, help="Passages re-encoded to check the stored vectors."
    ),
    copy: bool = typer.Option(
        False, "--copy", help="Copy the FAISS file (default: hard link, else symlink)."
    ),
    backend: str = encoder_backend_option(),
    device: str = encoder_device_option(),
    force: bool = force_option(),
) -> None:
    """Adopt an existing FAISS index and its corpus without re-encoding (e.g. Search-R1's
    e5_Flat.index + wiki-18.jsonl); refuses when re-encoded passages do not match it."""
    from retrieval_server.index.importing import import_index

    manifest, summary = import_index(
        faiss_file,
        corpus,
        out,
        spec_options(encoder, query_prefix, passage_prefix, pooling),
        encoder_config=encoder_options(backend, device, False, 64),
        bm25=bm25,
        verify_sample=verify_sample,
        copy=copy,
        force=force,
    )
    typer.echo(
        f"imported {manifest.documents} vectors ({manifest.index_factory}, "
        f"{manifest.dimension}-d, bm25={manifest.bm25}) into {out}; {summary}"
    )


EXPORT_ENCODER_EXAMPLE = """Example (the retrieval image, without torch, then serves its indexes):

  hdr index export-encoder /models/e5-base-v2
"""


@index_app.command("export-encoder", epilog=EXPORT_ENCODER_EXAMPLE)
def export_encoder_command(
    encoder: str = typer.Argument(..., help=ENCODER_HELP),
    out: Path | None = typer.Option(
        None, "--out", help="Folder to write (default: the model directory's hdr-onnx/)."
    ),
) -> None:
    """Export an encoder to ONNX ahead of time (needs torch), into its model directory, where
    the onnx backend finds it on a machine without torch (docs/stack.md)."""
    from core.errors import UserError
    from retrieval_server.index.encoder import (
        SHIPPED_ONNX_DIR,
        export_to_model_dir,
        resolve_encoder,
        shipped_onnx,
    )

    model_dir = resolve_encoder(encoder)
    if out is None and shipped_onnx(model_dir) is not None:
        typer.echo(
            f"{model_dir} already holds an ONNX export of its weights: {shipped_onnx(model_dir)}"
        )
        return
    folder = out or model_dir / SHIPPED_ONNX_DIR
    if folder.exists():  # another model's export, an older one, or not ours: never replaced
        raise UserError(f"{folder} exists; remove it (or name another --out) to export again")
    path = export_to_model_dir(model_dir, out)
    typer.echo(f"exported {encoder} to {path} ({path.stat().st_size / 1e6:.0f} MB)")
