"""`hdr` subcommands of the trainer package."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
