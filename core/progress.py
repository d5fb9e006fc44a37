"""Progress that reads well anywhere: a tqdm bar on a terminal, plain lines in a file or pipe.

A bar redraws itself with carriage returns, which in a log file become thousands of frames on
one line. When stderr is not a terminal, `progress` prints one ordinary line at most every
`HDR_PROGRESS_INTERVAL` seconds (default 30) and one when the work ends, e.g.

    sft epoch 3: 120/255 (47%) elapsed 00:41, remaining 00:46, 2.9 batch/s, loss=1.23
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Iterable
from typing import Any

from tqdm import tqdm

INTERVAL_ENV = "HDR_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 30.0


def line_interval() -> float:
    """Seconds between plain progress lines (`$HDR_PROGRESS_INTERVAL`, default 30)."""
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


class LineProgress(tqdm):
    """tqdm that prints whole lines (no carriage return, no bar): one at the start, then at
    most one every `mininterval` seconds, and one at the end."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._printed_at = -float("inf")
        self._printed_n = None
        super().__init__(*args, **kwargs)

    def display(self, msg: str | None = None, pos: int | None = None) -> bool:
        if msg is not None and not msg.strip():
            return False  # tqdm's "clear the line": nothing to clear
        now = time.monotonic()
        first = self._printed_n is None
        if not first and now - self._printed_at < self.mininterval:
            return True  # a redraw on demand (postfix, a message): wait for the next line
        self.fp.write((msg or self.format_meter(**self.format_dict)).strip() + "\n")
        self.fp.flush()
        self._printed_at, self._printed_n = now, self.n
        return True

    def clear(self, nolock: bool = False) -> None:
        """Nothing to clear in a file."""

    def close(self) -> None:
        """A last line when something happened since the previous one; no trailing newline."""
        if not self.disable and self._printed_n != self.n:
            self._printed_at = -float("inf")
            self.display()
        self.leave = False
        super().close()


def _line_format(total: Any) -> str:
    if total:
        return (
            "{desc}: {n_fmt}/{total_fmt} ({percentage:.0f}%) elapsed {elapsed}, "
            "remaining {remaining}, {rate_fmt}{postfix}"
        )
    return "{desc}: {n_fmt} elapsed {elapsed}, {rate_fmt}{postfix}"


def progress(
    iterable: Iterable | None = None,
    *,
    desc: str,
    total: float | None = None,
    unit: str = "it",
    enabled: bool = True,
    initial: float = 0,
    leave: bool = True,
) -> tqdm:
    """A progress bar on a terminal, periodic plain lines on stderr otherwise (see module)."""
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)  # type: ignore[arg-type]
    common = dict(desc=desc, total=total, unit=unit, initial=initial, file=sys.stderr)
    if not enabled:
        return tqdm(iterable, disable=True, **common)
    if sys.stderr.isatty():
        return tqdm(iterable, dynamic_ncols=True, leave=leave, **common)
    return LineProgress(
        iterable,
        mininterval=line_interval(),
        maxinterval=float("inf"),
        miniters=1,
        bar_format=_line_format(total),
        **common,
    )


def say(message: str) -> None:
    """A line on stderr that does not break a progress bar on the terminal."""
    tqdm.write(message, file=sys.stderr)
