"""A real `redis-server` for tests (and bench/shared_cache.py): started on a free 127.0.0.1
port with a folder of its own, without persistence unless asked (`persist=True`: the
append-only file, fsynced on every write, as a budget needs), and stopped and started again on
the same port and folder (Redis restarted in the middle of a run).

    with redis_server(tmp_path, persist=True) as redis:
        ... cache.backend=redis cache.redis_url={redis.url} ...
        redis.stop(); redis.start()

`make setup` and `.ci/run` install redis-server where it is missing (`make redis-server`);
without it these tests fail, saying so, rather than pass by skipping.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from servers import free_port

START_TIMEOUT_S = 30.0


def redis_server_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "redis-server is not installed: `make redis-server` installs it (Debian's package,"
            " apt-get install redis-server)"
        )
    return found


class RedisServer:
    """One redis-server process on 127.0.0.1:`port`, its data in `folder`."""

    def __init__(self, folder: Path, persist: bool, port: int | None = None) -> None:
        self.folder = Path(folder).resolve()  # redis-server chdirs into it before the log opens
        self.persist = persist
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        command = [
            redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
            "--dir", str(self.folder), "--save", "", "--daemonize", "no",
            "--logfile", str(self.folder / "redis.log"),
            "--appendonly", "yes" if self.persist else "no", "--appendfsync", "always",
        ]  # fmt: skip
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.answers():
            if self.process.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "redis.log").read_text(errors="replace")[-2000:]
                self.kill()
                raise RuntimeError(f"redis-server did not start on {self.port}:\n{log}")
            time.sleep(0.02)

    def answers(self) -> bool:
        """Whether it answers PING now."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=1) as sock:
                sock.sendall(b"PING\r\n")
                return sock.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM (Redis writes what it must and exits) and wait."""
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)
        self.process = None

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=30)
        self.process = None


@contextmanager
def redis_server(folder: Path, persist: bool = False) -> Iterator[RedisServer]:
    """A started `RedisServer` until the block ends."""
    server = RedisServer(folder, persist)
    server.start()
    try:
        yield server
    finally:
        server.kill()
