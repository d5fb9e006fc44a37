"""The `hdr` command: the top of the project, which registers every package's subcommands
(`hdr.cli`). Nothing below imports it; the plumbing the packages share is `core`."""

__version__ = "0.1.0"
