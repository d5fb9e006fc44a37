"""A log of the queries a server was asked, one JSON line per `/retrieve` request, for studying
what repeats (bench/search_cache.py reads it):

    {"time": 1767225600.12, "scope": "", "retriever": "bm25", "topk": 3,
     "return_scores": true, "queries": ["...", ...], "billed": 5, "cached": 123}

`queries` are as searched (after the server's truncation); `billed` and `cached` are the
request's ledger (the X-HDR-* headers). Requests refused before an answer are not logged. The
file must be new: hdr never appends to a file it did not create.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import IO

import orjson

from core.errors import UserError


class QueryLog:
    """Appends one line per answered request (line-buffered: a line is whole once written)."""

    def __init__(self, path: Path) -> None:
        path = Path(path)
        if path.exists():
            raise UserError(
                f"query_log {path} exists; hdr writes a query log only to a new file: move it "
                "or choose another path"
            )
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._file: IO[bytes] = path.open("xb")

    def write(
        self,
        queries: list[str],
        topk: int,
        retriever: str,
        return_scores: bool,
        scope: str,
        billed: int,
        cached: int,
    ) -> None:
        record = {
            "time": round(time.time(), 3),
            "scope": scope,
            "retriever": retriever,
            "topk": topk,
            "return_scores": return_scores,
            "queries": queries,
            "billed": billed,
            "cached": cached,
        }
        self._file.write(orjson.dumps(record) + b"\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
