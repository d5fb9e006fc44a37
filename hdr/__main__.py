"""`python -m hdr ...` runs the `hdr` command (what torchrun launches, one per process)."""

from hdr.cli import main

main()
