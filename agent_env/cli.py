"""`hdr` subcommands of the agent_env package."""

from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    """Add this package's subcommands to the root `hdr` app."""
