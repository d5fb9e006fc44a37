"""`hdr` subcommands of the retrieval_server package: `hdr index prepare-wiki|build`, `hdr serve`.

Heavy imports (torch, faiss, sentence-transformers, uvicorn) happen inside the command bodies so
that `hdr --help` answers at once. User mistakes raise `UserError` (one line, exit 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

index_app = typer.Typer(
    help="Build the retrieval corpus and index.", no_args_is_help=True, add_completion=False
)


@index_app.command("prepare-wiki")
def prepare_wiki_command(
    out: Path = typer.Option(..., "--out", help="Corpus JSONL to write."),
    limit: int | None = typer.Option(
        None, "--limit", min=1, help="Only the first N articles (file order)."
    ),
) -> None:
    """Write the embedded corpus (~10,000 Wikipedia vital-article summaries) as Search-R1 JSONL."""
    from retrieval_server.corpus import prepare_wiki

    count = prepare_wiki(out, limit)
    typer.echo(f"wrote {count} passages to {out}")


@index_app.command("build")
def build_command(
    corpus: Path = typer.Option(..., "--corpus", help="Search-R1 JSONL corpus."),
    out: Path = typer.Option(..., "--out", help="Index directory to write."),
    encoder: str = typer.Option(
        "all-MiniLM-L6-v2", "--encoder", help="Packaged name, local path, or model name."
    ),
    index_type: str = typer.Option("flat", "--index-type", help="flat (exact) or hnsw."),
    bm25: bool = typer.Option(True, "--bm25/--no-bm25", help="Also build a BM25 index."),
    batch_size: int = typer.Option(256, "--batch-size", min=1, help="Passages per chunk."),
) -> None:
    """Encode the corpus into a FAISS index (+ BM25) with a manifest."""
    from hdr.errors import UserError
    from retrieval_server.index import build_index

    if index_type not in ("flat", "hnsw"):
        raise UserError(f"--index-type must be flat or hnsw, not {index_type!r}")
    manifest = build_index(
        corpus, out, encoder=encoder, index_type=index_type, bm25=bm25, batch_size=batch_size
    )
    typer.echo(
        f"indexed {manifest.documents} passages into {out} "
        f"({manifest.index_type}, {manifest.dimension}-d, bm25={manifest.bm25}) "
        f"in {manifest.build_seconds:.0f}s"
    )


def serve_command(
    index: Path = typer.Option(..., "--index", help="Index directory from `hdr index build`."),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, "--port", help="TCP port."),
    retriever: str = typer.Option(
        "dense", "--retriever", help="Default retriever (dense or bm25); requests may override."
    ),
    corpus: Path | None = typer.Option(
        None, "--corpus", help="Corpus path, if not where the manifest says."
    ),
    config: Path | None = typer.Option(
        None, "--config", help="YAML with ServerConfig fields (limits, batching)."
    ),
    access_log: bool = typer.Option(
        True, "--access-log/--no-access-log", help="Log one line per request."
    ),
    overrides: list[str] = typer.Option(
        [], "--set", help="ServerConfig override key=value, e.g. --set max_topk=20 (repeatable)."
    ),
) -> None:
    """Serve an index over HTTP (Search-R1 compatible POST /retrieve). Token: $HDR_API_TOKEN."""
    from hdr.config import load_config
    from hdr.errors import UserError
    from retrieval_server.config import API_TOKEN_ENV, ServerConfig
    from retrieval_server.index import validate_index
    from retrieval_server.retrievers import RETRIEVERS

    settings = [f"index_dir={index}", f"default_retriever={retriever}", *overrides]
    if corpus is not None:
        settings.append(f"corpus={corpus}")
    server_config = load_config(ServerConfig, config, settings)
    RETRIEVERS.get(server_config.default_retriever)  # unknown name: one line listing valid ones
    files = validate_index(server_config.index_dir, server_config.corpus)
    if server_config.default_retriever == "bm25" and not files.manifest.bm25:
        raise UserError(f"index {index} was built with --no-bm25; cannot serve bm25")
    token = os.environ.get(API_TOKEN_ENV)
    if token:
        server_config.api_token = token
    elif host not in ("127.0.0.1", "localhost", "::1"):
        typer.echo(
            f"warning: serving on {host} without {API_TOKEN_ENV}; anyone can query", err=True
        )

    import uvicorn

    from retrieval_server.app import create_app

    uvicorn.run(
        create_app(server_config),
        host=host,
        port=port,
        log_level="info",
        access_log=access_log,
        timeout_keep_alive=server_config.keep_alive_s,
    )


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.add_typer(index_app, name="index")
    app.command("serve")(serve_command)
