"""Shared plumbing for hdr's three packages: the `hdr` command, registries, config loading.

The method lives in `retrieval_server`, `agent_env` and `trainer`; this package only holds
what all three use so that none of them has to import another for plumbing.
"""

__version__ = "0.1.0"
