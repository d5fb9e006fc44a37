"""Real retrieval servers for tests: uvicorn on a free 127.0.0.1 port, in a background thread.

    with running_server(index_dir, max_topk=5) as server:
        httpx.post(f"{server.url}/retrieve", json={"queries": ["Accordion"]})
        server.stop()  # e.g. to test a client's behaviour when the server goes away

Import it as `from servers import running_server` (pytest puts `tests/` on sys.path).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
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
    index_dir: Path, port: int = 0, **server_config_overrides: Any
) -> Iterator[RunningServer]:
    """Serve `index_dir` with `ServerConfig(index_dir=..., **overrides)` until the block ends,
    on a free port (or `port`)."""
    import uvicorn

    from retrieval_server.app import create_app
    from retrieval_server.config import ServerConfig

    config = ServerConfig(index_dir=index_dir, **server_config_overrides)
    sock = bind_loopback(port)
    port = sock.getsockname()[1]
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(config),
            log_level="warning",
            lifespan="on",
            access_log=False,
            timeout_keep_alive=config.keep_alive_s,
        )
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
            raise RuntimeError(f"retrieval server for {index_dir} did not start (see log above)")
        time.sleep(0.05)
    running = RunningServer(server, thread, f"http://127.0.0.1:{port}")
    try:
        yield running
    finally:
        running.stop()
        sock.close()
