"""The `snapshot` section of `ServerConfig`: a snapshot to serve, what a query it lacks gets,
and where to record one."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field

from core.config import StrictModel


class SnapshotConfig(StrictModel):
    """Serving a frozen snapshot (exact, offline), and recording one."""

    path: Path | None = Field(
        default=None,
        description="A snapshot to serve (`hdr serve --snapshot FILE`): every answer read from "
        "it, byte for byte what the recorded run received, without a call.",
    )
    on_miss: Literal["refuse", "forward"] = Field(
        default="refuse",
        description="A query the snapshot does not hold: refuse (404, one line), or forward "
        "it to the live backend given beside (--web or --upstream) and add its answer to "
        "the recording (needs record_path).",
    )
    record_path: Path | None = Field(
        default=None,
        description="A new file to record a snapshot in (`--record-snapshot FILE`): every "
        "answer a client received, one per query (the first), and the served snapshot's "
        "entries, if any. Written every flush_s seconds and when the server stops.",
    )
    flush_s: float = Field(
        default=30.0, gt=0, description="Seconds between writes of the recording (if it grew)."
    )
