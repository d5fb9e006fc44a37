"""Fixtures of the stack tests: the compose files as compose resolves their defaults."""

from __future__ import annotations

import pytest
import yaml
from stackfiles import COMPOSE, REPLICAS, interpolate


@pytest.fixture(scope="session")
def compose() -> dict:
    """docker-compose.yml with every ${VAR:-default} resolved to its default."""
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


@pytest.fixture(scope="session")
def replicas() -> dict:
    """docker-compose.replicas.yml with every ${VAR:-default} resolved to its default."""
    return interpolate(yaml.safe_load(REPLICAS.read_text()))
