"""`hdr` subcommands of the retrieval_server package: `hdr index prepare-wiki|build`, `hdr serve`.

Heavy imports (torch, faiss, sentence-transformers, uvicorn) happen inside the command bodies so
that `hdr --help` answers at once. User mistakes raise `UserError` (one line, exit 2).
"""

from __future__ import annotations

import os
from pathlib import Path

import typer

from hdr.options import all_overrides, overrides_argument, set_option

PREPARE_EXAMPLE = """Example:

  hdr index prepare-wiki --out data/wiki-vital.jsonl
"""
BUILD_EXAMPLE = """Example:

  hdr index build --corpus data/wiki-vital.jsonl --out data/index
"""
SERVE_EXAMPLES = """Examples:

  hdr serve --index data/index

  hdr serve --index data/index --port 8001 --retriever bm25 max_topk=20
"""

index_app = typer.Typer(
    help="Build the retrieval corpus and index.", no_args_is_help=True, add_completion=False
)


@index_app.command("prepare-wiki", epilog=PREPARE_EXAMPLE)
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


@index_app.command("build", epilog=BUILD_EXAMPLE)
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
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port."),
    retriever: str = typer.Option(
        "dense", "--retriever", help="Default retriever (dense or bm25); requests may override."
    ),
    corpus: Path | None = typer.Option(
        None, "--corpus", help="Corpus path, if not where the manifest says."
    ),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="YAML with ServerConfig fields (limits, batching)."
    ),
    access_log: bool = typer.Option(
        True, "--access-log/--no-access-log", help="Log one line per request."
    ),
    overrides: list[str] = overrides_argument("ServerConfig", "max_topk=20 batch_wait_ms=2"),
    set_: list[str] = set_option(),
) -> None:
    """Serve an index over HTTP (Search-R1 compatible POST /retrieve). Token: $HDR_API_TOKEN.

    The port is taken before the index loads, so a busy port fails at once; a problem found
    while loading (an index that does not match its manifest) is one line and exit code 2."""
    from hdr.config import load_config
    from hdr.errors import UserError, warn
    from retrieval_server.config import API_TOKEN_ENV, ServerConfig
    from retrieval_server.index import validate_index
    from retrieval_server.retrievers import RETRIEVERS

    settings = [f"index_dir={index}", f"default_retriever={retriever}"]
    if corpus is not None:
        settings.append(f"corpus={corpus}")
    server_config = load_config(ServerConfig, config, [*settings, *all_overrides(overrides, set_)])
    RETRIEVERS.get(server_config.default_retriever)  # unknown name: one line listing valid ones
    files = validate_index(server_config.index_dir, server_config.corpus)  # cheap: no loading
    if server_config.default_retriever == "bm25" and not files.manifest.bm25:
        raise UserError(f"index {index} was built with --no-bm25; cannot serve bm25")
    token = os.environ.get(API_TOKEN_ENV)
    if token:
        server_config.api_token = token
    elif host not in ("127.0.0.1", "localhost", "::1"):
        warn(f"serving on {host} without {API_TOKEN_ENV}; anyone can query")
    sock = bind_port(host, port)
    try:
        run_server(server_config, sock, f"http://{host}:{sock.getsockname()[1]}", access_log)
    finally:
        sock.close()


def bind_port(host: str, port: int):
    """A socket bound to (host, port), handed to uvicorn later; a busy port is a UserError
    now, before seconds (or, at wiki-18 scale, minutes) of index loading."""
    import socket

    from hdr.errors import UserError

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # held from now on: a second server's bind fails (SO_REUSEADDR)
    except OSError as err:
        sock.close()
        reason = err.strerror or str(err)
        raise UserError(
            f"cannot listen on {host}:{port}: {reason} (is another server there? choose --port)"
        ) from None
    return sock


def run_server(server_config, sock, url: str, access_log: bool) -> None:
    """uvicorn on the bound socket. A UserError raised while the app starts (loading the
    index) stops the server quietly and is re-raised here, so `hdr` reports it in one line
    instead of uvicorn's traceback and exit code 3."""
    import logging
    from contextlib import asynccontextmanager

    import uvicorn

    from hdr.errors import UserError
    from retrieval_server.app import create_app

    app = create_app(server_config)
    startup_errors: list[UserError] = []
    inner = app.router.lifespan_context
    uvicorn_log = logging.getLogger("uvicorn.error")

    @asynccontextmanager
    async def lifespan(app_):
        context = inner(app_)
        try:
            await context.__aenter__()
        except UserError as err:
            startup_errors.append(err)
            server.should_exit = True
            yield
            return
        uvicorn_log.setLevel(logging.INFO)  # from here on: uvicorn's own lines, requests
        uvicorn_log.info(
            "hdr serve: %s ready, %d passages (Ctrl-C stops)",
            url,
            len(app_.state.serving.index.documents),
        )
        try:
            yield
        finally:
            await context.__aexit__(None, None, None)

    app.router.lifespan_context = lifespan
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="info",
            access_log=access_log,
            lifespan="on",
            timeout_keep_alive=server_config.keep_alive_s,
        )
    )
    # until the index has loaded, say nothing: a failure is then hdr's one line alone
    uvicorn_log.setLevel(logging.WARNING)
    server.run(sockets=[sock])
    if startup_errors:
        raise startup_errors[0]


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.add_typer(index_app, name="index")
    app.command("serve", epilog=SERVE_EXAMPLES)(serve_command)
