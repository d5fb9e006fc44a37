"""Running the app as a process: bind the port first, then uvicorn on that socket.

`hdr serve` (retrieval_server/cli.py) parses options and checks the index; this module owns what
happens after: `bind_port` takes the port before the index loads, so a busy port fails at once
rather than after minutes of loading, and `run_server` starts uvicorn on that socket with a
lifespan wrapper that turns a `UserError` raised while loading into hdr's one line (uvicorn
alone would print a traceback and exit 3). `uvicorn_config` is how every hdr server (tests'
included) runs: guarded connections (`retrieval_server.serving.connections`) and its keep-alive.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from core.errors import UserError
from retrieval_server.serving.connections import (
    default_max_connections,
    guarded_protocol,
    raise_open_file_limit,
)

if TYPE_CHECKING:
    import uvicorn
    from fastapi import FastAPI

    from retrieval_server.config import ServerConfig

uvicorn_log = logging.getLogger("uvicorn.error")

# FAISS's OpenMP (libgomp) reads this once, when it loads (the index loads after this module is
# imported): its idle threads then sleep instead of spinning. Spinning threads take the 2 cores
# the event loop and the encoder need between two searches: one client's one-query requests
# went from 42 to 96 q/s with it (bench/retrieval.py --cells limit, docs/notebook/retrieval.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to (host, port), handed to uvicorn later; a busy port is a UserError
    now, before seconds (or, at wiki-18 scale, minutes) of index loading."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when
    # the listener says TCP; without it a keep-alive response's body waits for the ACK of
    # its headers (Nagle + delayed ACK: 40 ms on every request after a connection's first)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
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


def uvicorn_config(
    app: FastAPI, config: ServerConfig, access_log: bool, log_level: str
) -> uvicorn.Config:
    """How uvicorn runs hdr's app: its keep-alive, and connections guarded by a request-head
    deadline and a bound on their number (`retrieval_server.serving.connections`)."""
    import uvicorn

    max_connections = config.max_connections or default_max_connections()
    return uvicorn.Config(
        app,
        log_level=log_level,
        access_log=access_log,
        lifespan="on",
        timeout_keep_alive=config.keep_alive_s,
        http=guarded_protocol(
            config.head_timeout_s, max_connections, app.state.metrics.connection_event
        ),
    )


def describe(app: FastAPI, config: ServerConfig) -> str:
    """What a started server serves, for its ready line."""
    state = app.state.serving
    if state.index is not None:
        served = f"{len(state.index.documents)} passages"
    elif state.snapshot is not None:
        served = f"snapshot {state.snapshot.path} ({len(state.snapshot.snapshot.answers)} answers)"
        if state.upstream is not None:
            served += f", what it lacks fetched from {config.upstream.shown_url}"
    elif config.upstream.web is not None:
        served = f"{config.upstream.web.api} web search at {config.upstream.shown_url}"
    else:
        served = f"proxy of {config.upstream.shown_url}"
    cache = state.answers.cache
    if cache is None:
        return f"{served}, no cache"
    loaded = f", {cache.stats.loaded} answers loaded" if cache.stats.loaded else ""
    shared = state.answers.shared
    fleet = "" if shared is None else f", shared with the replicas on {shared.link.shown_url}"
    return f"{served}, cache of {cache.max_bytes / 2**20:g} MiB{loaded}{fleet}"


def run_server(config: ServerConfig, sock: socket.socket, url: str, access_log: bool) -> None:
    """uvicorn on the bound socket until it stops. A UserError raised while the app starts
    (loading the index) stops the server quietly and is re-raised here, so `hdr` reports it in
    one line instead of uvicorn's traceback and exit code 3."""
    import uvicorn

    from retrieval_server.serving.app import create_app

    app = create_app(config)
    startup_errors: list[UserError] = []
    inner = app.router.lifespan_context

    @asynccontextmanager
    async def lifespan(app_: FastAPI) -> AsyncIterator[None]:
        context = inner(app_)
        try:
            await context.__aenter__()
        except UserError as err:
            startup_errors.append(err)
            server.should_exit = True
            yield
            return
        uvicorn_log.setLevel(logging.INFO)  # from here on: uvicorn's own lines, requests
        uvicorn_log.info("hdr serve: %s ready, %s (Ctrl-C stops)", url, describe(app_, config))
        try:
            yield
        finally:
            await context.__aexit__(None, None, None)

    app.router.lifespan_context = lifespan
    raise_open_file_limit()  # before the connection bound is derived from it
    server = uvicorn.Server(uvicorn_config(app, config, access_log=access_log, log_level="info"))
    # until the index has loaded, say nothing: a failure is then hdr's one line alone
    uvicorn_log.setLevel(logging.WARNING)
    server.run(sockets=[sock])
    if startup_errors:
        raise startup_errors[0]
