"""Settings fingerprints: what a folder of unfinished or finished work was made with, and what
changed since.

Three kinds of work are kept to be resumed or reused (an index build's encoded chunks, an
index convert's added chunks, an evaluation's finished question chunks, an experiment's runs
and SFT starts); each records the settings it was made with and compares them with the
settings of the command that finds it. One set of tools serves them all:

- `digest(settings)`: the SHA-256 of the settings as canonical JSON;
- `flatten(settings)`: nested mappings as `{dotted.key: leaf}`;
- `differences(earlier, now)`: each dotted key whose value differs, as `key X then, Y now`,
  and `summary` of those lines for one error line;
- `resume_or_refuse(state_file, state, held, what)`: the check of a half-finished folder: resume
  it when it was started with these settings; when not, start over, unless it holds work worth
  keeping, which is never discarded silently (one line naming what differs).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from core.errors import UserError


class _Unset:
    """A key one side of a comparison does not have."""

    def __repr__(self) -> str:
        return "unset"


UNSET = _Unset()


def digest(settings: Any, length: int | None = None, compact: bool = True) -> str:
    """The SHA-256 (hex, cut to `length` digits if given) of `settings` as JSON with sorted keys
    (values JSON cannot hold as their `str`). `compact` drops the whitespace after separators;
    evaluation fingerprints were always made with it (`compact=False`), and stay so, so that
    evaluations made earlier still resume."""
    separators = (",", ":") if compact else (", ", ": ")
    text = json.dumps(settings, sort_keys=True, separators=separators, default=str)
    sha = hashlib.sha256(text.encode()).hexdigest()
    return sha if length is None else sha[:length]


def flatten(settings: Any, prefix: str = "") -> dict[str, Any]:
    """Nested mappings as `{dotted.key: leaf}` (an empty mapping adds no key)."""
    if not isinstance(settings, Mapping):
        return {prefix: settings}
    out: dict[str, Any] = {}
    for key, value in settings.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def differences(
    earlier: Mapping[str, Any],
    now: Mapping[str, Any],
    label: Callable[[str], str] = str,
    order: Callable[[str], Any] | None = None,
) -> list[str]:
    """`label(key) X then, Y now` for each dotted key (`flatten`) whose value differs, sorted by
    key (or by `order`); a key one side lacks shows as `unset` there."""
    a, b = flatten(earlier), flatten(now)
    keys = sorted(set(a) | set(b), key=order)
    return [
        f"{label(key)} {a.get(key, UNSET)!r} then, {b.get(key, UNSET)!r} now"
        for key in keys
        if a.get(key, UNSET) != b.get(key, UNSET)
    ]


def summary(changes: list[str], most: int = 4) -> str:
    """The first `most` of `differences`' lines and how many more, for one error line."""
    more = f"; {len(changes) - most} more" if len(changes) > most else ""
    return "; ".join(changes[:most]) + more


def read_state(path: Path) -> Any:
    """The JSON a state file holds; None when it is missing or unreadable (a torn write)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def resume_or_refuse(
    state_file: Path,
    state: Mapping[str, Any],
    held: str | None,
    what: str,
    explain: Callable[[Mapping[str, Any], Mapping[str, Any]], list[str]] = differences,
) -> bool:
    """Whether the unfinished work in `state_file`'s folder, which recorded its settings there,
    is resumed: True when they are `state`. Otherwise it is to be started over (False), unless
    it holds work worth keeping (`held`, e.g. "3 encoded chunks"; None: nothing) and its
    settings can be read: then it is never discarded silently, and one UserError line names
    each setting that differs (`explain`) and how to resume or start over."""
    earlier = read_state(state_file)
    if earlier == state:
        return True
    if held and isinstance(earlier, dict):
        folder = state_file.parent
        raise UserError(
            f"{folder} holds {held} of an interrupted {what} with other settings"
            f" ({'; '.join(explain(earlier, state)) or 'an older format'}): rerun with the"
            f" earlier settings to resume, or remove it with `rm -r {folder}` to start over"
        )
    return False
