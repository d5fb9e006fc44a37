"""`hdr` subcommands of the retrieval_server package: `hdr serve`, and `hdr index ...` from
`retrieval_server.index.cli`.

Heavy imports (torch, faiss, sentence-transformers, uvicorn) happen inside the command bodies so
that `hdr --help` answers at once. User mistakes raise `UserError` (one line, exit 2).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer

from core.options import (
    all_overrides,
    overrides_argument,
    register_config,
    set_option,
)
from retrieval_server.index.cli import index_app

SERVE_EXAMPLES = """Examples:

  hdr serve --index data/index

  hdr serve --index data/index --port 8001 --retriever bm25 max_topk=20

  hdr serve --index data/index cache.max_bytes=1073741824 cache.persist_path=data/cache.bin

  hdr serve --upstream http://search.example:8000 --port 8001 \
      upstream.price_per_call=0.015 upstream.max_spend=50 upstream.spend_path=data/spend.json \
      cache.ttl_s=86400

  hdr serve --index data/index cache.backend=redis cache.redis_url=redis://10.0.0.5:6379/0

  SERPER_API_KEY=... hdr serve --web serper --record-snapshot data/eval.snapshot \
      upstream.price_per_call=0.001 upstream.max_spend=20 upstream.spend_path=data/spend.json

  hdr serve --snapshot data/eval.snapshot
"""


def serve_command(
    index: Path | None = typer.Option(
        None, "--index", help="Index directory from `hdr index build` (or give --upstream)."
    ),
    upstream: str | None = typer.Option(
        None,
        "--upstream",
        help="Proxy mode: forward what the cache cannot answer to this Search-R1-compatible "
        "server (URL) instead of searching an index; limits and budget: upstream.* settings.",
    ),
    web: str | None = typer.Option(
        None,
        "--web",
        help="Live web search: serper or serpapi (key in $SERPER_API_KEY / $SERPAPI_API_KEY),"
        " behind the same cache, budget and fleet as --upstream (which then overrides the API's"
        " URL); settings: upstream.web.*, upstream.*.",
    ),
    snapshot: Path | None = typer.Option(
        None,
        "--snapshot",
        help="Serve a snapshot recorded with --record-snapshot, offline and byte for byte; a"
        " query it lacks is refused (snapshot.on_miss=forward with --web/--upstream fetches it).",
    ),
    record_snapshot: Path | None = typer.Option(
        None,
        "--record-snapshot",
        help="Record what clients receive to this new file (a snapshot --snapshot serves).",
    ),
    host: str = typer.Option("127.0.0.1", "--host", help="Bind address (loopback by default)."),
    port: int = typer.Option(8000, "--port", min=0, max=65535, help="TCP port."),
    retriever: str | None = typer.Option(
        None,
        "--retriever",
        help="Default retriever (dense or bm25; default: the first of --retrievers, else dense,"
        " or bm25 on a --no-dense index); requests may override.",
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
    retrievers: str | None = typer.Option(
        None, "--retrievers", help="Comma-separated retrievers to load (default: all built)."
    ),
    backend: str | None = typer.Option(None, "--encoder-backend", help="onnx (default) or torch."),
    device: str | None = typer.Option(None, "--encoder-device", help="cpu (default) or cuda."),
    query_prefix: str | None = typer.Option(
        None, "--query-prefix", help="Override the manifest's query prefix."
    ),
    nprobe: int | None = typer.Option(None, "--nprobe", min=1, help="IVF lists per query."),
    ef_search: int | None = typer.Option(None, "--ef-search", min=1, help="HNSW efSearch."),
    mmap: bool | None = typer.Option(
        None, "--mmap/--no-mmap", help="Memory-map flat vectors (default) or read them in."
    ),
) -> None:
    """Serve an index over HTTP (Search-R1 compatible POST /retrieve), or proxy an upstream
    server (--upstream), with a result cache in front. Token: $HDR_API_TOKEN.

    The port is taken before the index loads, so a busy port fails at once; a problem found
    while loading (an index that does not match its manifest) is one line and exit code 2."""
    from core.errors import UserError, warn
    from retrieval_server.config import API_TOKEN_ENV
    from retrieval_server.serving.runtime import bind_port, run_server

    if (index is None) == (upstream is None and web is None and snapshot is None):
        raise UserError(
            "give --index DIR (serve an index), --upstream URL (proxy), --web API (live web "
            "search) or --snapshot FILE, one of them (--snapshot beside --web or --upstream only "
            "with snapshot.on_miss=forward)"
        )
    served_names = None
    if retrievers is not None:
        served_names = [name.strip() for name in retrievers.split(",") if name.strip()]
    if retriever is None and served_names:
        retriever = served_names[0]
    options = {
        "index_dir": index,
        "default_retriever": retriever,
        "corpus": corpus,
        "retrievers": served_names,
        "query_prefix": query_prefix,
        "encoder": {"backend": backend, "device": device},
        "dense": {"nprobe": nprobe, "ef_search": ef_search, "mmap": mmap},
    }
    if upstream is not None or web is not None:
        options["upstream"] = {"url": upstream, "web": None if web is None else {"api": web}}
    options["snapshot"] = {"path": snapshot, "record_path": record_snapshot}
    server_config = server_config_from(config, options, all_overrides(overrides, set_))
    if server_config.index_dir is not None:
        check_served_index(server_config, retrievers)
    check_written_files(server_config)
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


def check_served_index(server_config, retrievers: str | None) -> None:
    """The index and retrievers `hdr serve` was asked for, checked cheaply before the port is
    taken (nothing loaded): unknown retriever names, a missing or mismatched index, BM25 asked
    of an index without it."""
    from core.errors import UserError
    from retrieval_server.index.files import validate_index
    from retrieval_server.serving.retrievers import RETRIEVERS

    RETRIEVERS.get(server_config.default_retriever)  # unknown name: one line listing valid ones
    for name in server_config.retrievers or []:
        RETRIEVERS.get(name)
    files = validate_index(server_config.index_dir, server_config.corpus)
    served = server_config.retrievers or RETRIEVERS.names()
    if server_config.default_retriever not in served:
        raise UserError(
            f"--retriever {server_config.default_retriever} is not among --retrievers {retrievers}"
        )
    if "bm25" in (server_config.retrievers or [server_config.default_retriever]) and not (
        files.manifest.bm25
    ):
        raise UserError(
            f"index {server_config.index_dir} was built without BM25; cannot serve bm25"
        )


def check_written_files(server_config) -> None:
    """The files `hdr serve` would write, checked before anything loads: a query log must be
    new, a cache file must be one hdr wrote (it is replaced when the server stops)."""
    from core.errors import UserError
    from retrieval_server.serving.cache import FILE_MAGIC, check_cache_file
    from retrieval_server.snapshot.file import check_new_record_path

    check_new_record_path(server_config.snapshot.record_path)
    if server_config.query_log is not None and server_config.query_log.exists():
        raise UserError(
            f"query_log {server_config.query_log} exists; hdr writes a query log only to a new"
            " file: move it or choose another path"
        )
    path = server_config.cache.persist_path
    if path is not None and path.is_file():
        with path.open("rb") as file:
            check_cache_file(path, file.read(len(FILE_MAGIC)))


def server_config_from(config_file: Path | None, options: dict[str, Any], overrides: list[str]):
    """The `ServerConfig` of `hdr serve`: the YAML file's fields, then the options given on the
    command line (typed values, nested by section; None: not given), then KEY=VALUE overrides."""
    from core.config import build_config, read_config_file
    from retrieval_server.config import ServerConfig

    data = read_config_file(config_file) if config_file is not None else {}
    set_given(data, options)
    return build_config(ServerConfig, data, overrides)


def set_given(data: dict[str, Any], values: dict[str, Any]) -> None:
    """Put each value that is not None into `data`, section by section (an option left unset
    leaves the config file's value, or the default, alone)."""
    for key, value in values.items():
        if isinstance(value, dict):
            section = data.setdefault(key, {})
            if isinstance(section, dict):  # otherwise validation names the file's bad value
                set_given(section, value)
        elif value is not None:
            data[key] = value


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
    app.add_typer(index_app, name="index")
    app.command("serve", epilog=SERVE_EXAMPLES)(serve_command)
    register_config("serve", "retrieval_server.config:ServerConfig")
