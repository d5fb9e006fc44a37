"""Named variants (replay selectors, retrievers, generation backends) chosen from config.

A registry refuses a duplicate name and lists the valid names on a miss, so a typo in a
config file is one clear line instead of a KeyError deep in a run.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

from core.errors import UserError

T = TypeVar("T")


class Registry(Generic[T]):
    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._entries: dict[str, T] = {}

    def register(self, name: str) -> Callable[[T], T]:
        def add(entry: T) -> T:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered")
            self._entries[name] = entry
            return entry

        return add

    def unregister(self, name: str) -> None:
        """Remove `name` (a test's temporary entry); unknown names are an error."""
        del self._entries[name]

    def get(self, name: str) -> T:
        try:
            return self._entries[name]
        except KeyError:
            raise UserError(self._miss(name)) from None

    def check(self, name: str) -> str:
        """`name` if registered; else ValueError with the valid names, for a pydantic
        validator (which turns it into the config's own one-line error)."""
        if name not in self._entries:
            raise ValueError(self._miss(name))
        return name

    def _miss(self, name: str) -> str:
        return f"unknown {self.kind} {name!r}; valid: {', '.join(sorted(self._entries))}"

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries
