"""Processes seen through /proc (no psutil): a process's children and descendants, whether one
still runs, its command line and environment, and stopping a hung process tree with every
Python's stacks printed first.

Import it as `from processes import alive, children` (pytest puts `tests/` on sys.path).
"""

from __future__ import annotations

import contextlib
from pathlib import Path


def _stat_fields(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def children(pid: int) -> list[int]:
    """Pids whose parent is `pid`."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            if int(_stat_fields(entry.name)[1]) == pid:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found


def alive(pid: int) -> bool:
    """Whether `pid` exists and is not a zombie."""
    try:
        return _stat_fields(pid)[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children first, then theirs)."""
    found, frontier = [], [pid]
    while frontier:
        below = [c for p in frontier for c in children(p)]
        found += below
        frontier = below
    return found


def cmdline(pid: int) -> str:
    """A process's command line, arguments joined by spaces (empty when it is gone)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def environ(pid: int) -> dict[str, str]:
    """A process's environment as it started (empty when it is gone)."""
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    items = raw.decode(errors="replace").split("\0")
    return dict(item.split("=", 1) for item in items if "=" in item)


def dump_stacks_and_kill(pid: int) -> None:
    """A hung launcher and its ranks: SIGABRT to every process below `pid` (a Python started
    with PYTHONFAULTHANDLER=1 prints every thread's stack to its stderr on it, as `run_ranks`'
    ranks do before their time bound), then SIGKILL to all of them and to `pid`."""
    import os
    import signal
    import time

    below = descendants(pid)
    for p in below:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGABRT)
    time.sleep(2)
    for p in [*below, pid]:
        with contextlib.suppress(OSError):
            os.kill(p, signal.SIGKILL)
