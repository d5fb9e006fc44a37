"""hdr's agent-side parts inside other trainers: the search tool for veRL (`verl_tool.py`, the
`hdr[verl]` extra)."""
