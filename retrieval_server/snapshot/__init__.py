"""Frozen snapshots of what a server answered, and serving one back offline, byte for byte.

A live web search answers a query differently from one week to the next, so an evaluation run
against it cannot be rerun exactly, and a rerun pays again. A snapshot fixes that: a server
started with `snapshot.record_path=FILE` (`hdr serve ... --record-snapshot FILE`) writes, to
that new file, every answer its clients received (one per query: the first), and `hdr serve
--snapshot FILE` answers from it, offline and without a call, with the same bytes: a rerun's
responses are byte for byte the recorded run's. A query the snapshot does not hold is refused
in one line (404), or, with `snapshot.on_miss=forward` and a live backend beside it, fetched,
served and added: the recording (`record_path`, a new file) is then the served snapshot grown
by what was fetched.

The file is JSON Lines: a header (`kind`, `version`, the backend the answers came from as the
proxy describes it (its URL without secrets, the web API and its settings), when it was
written, the number of entries and the SHA-256 of the entry lines), then one line per answer:
the query, topk, return_scores, retriever, when a client first received it (`received_at`, unix
seconds) and the answer as the JSON text that went into the response. It is checked whole on
load (kind, version, checksum, count, every field, every answer a valid Search-R1 result list):
a damaged file is refused in one line, never served in part.

In a fleet each replica records what its own clients received (give each its own file).

Files: a recording is written only to a path that does not exist when the server starts
(created there at once, empty, so a wrong path fails at start), and is then replaced only while
it is still the file this server created (same inode): every `flush_s` seconds while answers
come in, and when the server stops. A file it did not create is never written over.

The modules: `config.py` (the settings), `file.py` (the format, reading and writing),
`backend.py` (serving and recording).
"""
