"""A paid search API's stand-in for proxy-mode tests: a real HTTP server on 127.0.0.1 (through
`servers.http_handler_server`) that counts every query it receives, answers each query with
one document naming it (and the retriever it was asked for), and misbehaves on purpose when
told: it answers late, never, with an error status, or with a body it chooses.

    with fake_upstream(delay_s=1.0) as upstream:
        ... hdr serve --upstream upstream.url ...
        assert upstream.queries == 3

Import it as `from fake_upstream import fake_upstream` (pytest puts this folder on sys.path).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler
from typing import Any

from servers import http_handler_server


@dataclass
class FakeUpstream:
    """What the fake has received, and how it behaves (change it while it runs)."""

    url: str = ""
    delay_s: float = 0.0  # before answering a POST /retrieve
    stall: bool = False  # never answer a POST (until the test ends)
    status: int = 200  # of POST /retrieve
    body: bytes | None = None  # POST /retrieve's body instead of the answers
    health: bytes = b'{"status": "ok", "default_retriever": "dense"}'
    health_status: int = 200
    queries: int = 0  # queries received in POST /retrieve bodies
    received: list[str] = field(default_factory=list)  # those queries, in arrival order
    requests: int = 0
    paths: list[str] = field(default_factory=list)  # of every request, query string included
    authorizations: list[str | None] = field(default_factory=list)
    released: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def wait_for_queries(self, count: int, timeout_s: float = 30) -> None:
        """Return once `count` queries have arrived (a forward is known to be on its way)."""
        deadline = time.monotonic() + timeout_s
        while self.queries < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the fake upstream received {self.queries} of {count}")
            time.sleep(0.01)

    def answer(self, request: dict[str, Any]) -> bytes:
        retriever = request.get("retriever") or "default"
        result = []
        for query in request["queries"]:
            document = {"id": query, "contents": f'"{query}"\nfound by {retriever}'}
            hit = {"document": document, "score": 1.0}
            result.append([hit] if request.get("return_scores") else [document])
        return json.dumps({"result": result}).encode()


def handler_for(fake: FakeUpstream) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:
            self.record()
            if self.path.split("?")[0].endswith("/health"):
                self.reply(fake.health_status, fake.health)
            else:
                self.reply(404, b'{"detail": "Not Found"}')

        def do_POST(self) -> None:
            self.record()
            request = json.loads(self.rfile.read(int(self.headers["content-length"])))
            with fake.lock:
                fake.requests += 1
                fake.queries += len(request["queries"])
                fake.received += request["queries"]
            if fake.stall:
                fake.released.wait(60)
                return
            if fake.delay_s:
                time.sleep(fake.delay_s)
            self.reply(fake.status, fake.body if fake.body is not None else fake.answer(request))

        def record(self) -> None:
            with fake.lock:
                fake.paths.append(self.path)
                fake.authorizations.append(self.headers.get("authorization"))

        def reply(self, status: int, body: bytes) -> None:
            try:
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
            except (BrokenPipeError, ConnectionResetError):  # the proxy gave up on it
                pass

        def log_message(self, *args: object) -> None:  # quiet
            pass

    return Handler


@contextmanager
def fake_upstream(**behaviour: Any) -> Iterator[FakeUpstream]:
    """A `FakeUpstream` serving on a free port until the block ends."""
    fake = FakeUpstream(**behaviour)
    with http_handler_server(handler_for(fake)) as url:
        fake.url = url
        try:
            yield fake
        finally:
            fake.released.set()  # a stalled handler returns before the shutdown
