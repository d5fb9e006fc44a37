"""Real retrieval servers for tests: uvicorn on a free 127.0.0.1 port, in a background thread.

    with running_server(index_dir, max_topk=5) as server:
        httpx.post(f"{server.url}/retrieve", json={"queries": ["Accordion"]})
        server.stop()  # e.g. to test a client's behaviour when the server goes away

`http_handler_server(Handler)` serves a plain `http.server` handler (a stand-in for another
project's server, such as Search-R1's or a failing upstream) and yields its URL.

`serve_process(index_dir, "max_topk=5")` runs the `hdr serve` command instead, in a process of
its own (an environment of its own, a signal, a whole process stopped); `serve_process(None,
upstream=URL)` runs a proxy.

Import it as `from servers import running_server` (pytest puts `tests/` on sys.path).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

START_TIMEOUT_S = 120.0


class RunningServer:
    """A started uvicorn server: `url` (http://127.0.0.1:PORT) and `stop()` (idempotent)."""

    def __init__(self, server: Any, thread: threading.Thread, url: str) -> None:
        self._server = server
        self._thread = thread
        self.url = url

    def stop(self) -> None:
        """Shut the server down and wait for it; afterwards connections are refused."""
        self._server.should_exit = True
        self._thread.join(timeout=30)


def bind_loopback(port: int = 0) -> socket.socket:
    """A listening-ready TCP socket on 127.0.0.1 (handed to uvicorn, so no race); port 0 is a
    free port, another number reuses a port (a restarted server at the same URL)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # see bind_port
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    return sock


def free_port() -> int:
    """A port free on 127.0.0.1 now, for a process that binds it itself (it may be taken by
    then; a server we start in-process gets `bind_loopback`'s socket instead)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def running_server(
    index_dir: Path | None, port: int = 0, **server_config_overrides: Any
) -> Iterator[RunningServer]:
    """Serve `index_dir` with `ServerConfig(index_dir=..., **overrides)` until the block ends,
    on a free port (or `port`); `index_dir` None with `upstream={...}` is a proxy."""
    import uvicorn

    from retrieval_server.config import ServerConfig
    from retrieval_server.serving.app import create_app
    from retrieval_server.serving.runtime import uvicorn_config

    config = ServerConfig(index_dir=index_dir, **server_config_overrides)
    sock = bind_loopback(port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn_config(create_app(config), config, access_log=False, log_level="warning")
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name=f"uvicorn-{port}", daemon=True
    )
    thread.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            sock.close()
            served = index_dir or server_config_overrides.get("upstream")
            raise RuntimeError(f"retrieval server for {served} did not start (see log above)")
        time.sleep(0.05)
    running = RunningServer(server, thread, f"http://127.0.0.1:{port}")
    try:
        yield running
    finally:
        running.stop()
        sock.close()


class ServeProcess:
    """A running `hdr serve` process: `url`, `stop()` (idempotent), `output` once stopped."""

    def __init__(self, process: subprocess.Popen, url: str) -> None:
        self.process = process
        self.url = url
        self.output = ""

    def stop(self) -> None:
        """SIGTERM and wait; afterwards connections to `url` are refused."""
        if self.process.poll() is None:
            self.process.terminate()
        if not self.output:
            self.output = self.process.communicate(timeout=60)[0] or ""


@contextmanager
def serve_process(
    index_dir: Path | None,
    *settings: str,
    env: dict[str, str] | None = None,
    retriever: str | None = None,
    timeout_s: float = 300,
    upstream: str | None = None,
) -> Iterator[ServeProcess]:
    """`hdr serve --index index_dir` (or `--upstream upstream`: a proxy; the `hdr` beside
    this interpreter) on a free 127.0.0.1 port with dotted `settings`, `retriever` (None: the
    server's default) and `env` on top of this environment, until the block ends; waits for
    /health. `timeout_s`: a loaded shared machine can take minutes to start."""
    import httpx

    port = free_port()
    hdr = str(Path(sys.executable).with_name("hdr"))
    served = ["--index", str(index_dir)] if upstream is None else ["--upstream", upstream]
    command = [hdr, "serve", *served, "--port", str(port)]
    command += ["--no-access-log", *(["--retriever", retriever] if retriever else [])]
    command += [arg for setting in settings for arg in ("--set", setting)]
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )
    running = ServeProcess(process, f"http://127.0.0.1:{port}")
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None:
                running.stop()
                raise RuntimeError(f"hdr serve exited {process.returncode}:\n{running.output}")
            try:
                httpx.get(f"{running.url}/health", timeout=5).raise_for_status()
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"hdr serve did not answer within {timeout_s:g} s") from None
                time.sleep(0.2)
        yield running
    finally:
        running.stop()


@contextmanager
def http_handler_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    """`handler` served on a free 127.0.0.1 port in a daemon thread; yields its URL and shuts
    the server down on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
