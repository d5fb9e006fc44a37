"""Files `hdr serve` writes over themselves (the persisted cache, the spend file): written whole
(core.paths.atomic_file: a temporary file renamed over the old one) and with the mode of the
file they replace, so a user's `chmod 640` survives every save. atomic_file alone leaves the
temporary file's 0600 on the result."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from core.paths import atomic_file


def _process_umask() -> int:
    """This process's umask, read once at import (os.umask can only read it by setting it, so
    it is not done from the threads that write)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


UMASK = _process_umask()


@contextmanager
def replaced_keeping_mode(path: Path) -> Iterator[IO[bytes]]:
    """A binary file to write `path` through: whole or not at all, with the mode `path` has
    now (a new file: 0666 less the umask, as open() would give it)."""
    path = Path(path)
    mode = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~UMASK
    with atomic_file(path, "wb") as file:
        os.fchmod(file.fileno(), mode)
        yield file
