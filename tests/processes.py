"""Processes seen through /proc (no psutil): a process's children, and whether one still runs.

Import it as `from processes import alive, children` (pytest puts `tests/` on sys.path).
"""

from __future__ import annotations

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
