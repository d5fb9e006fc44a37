"""`hdr index convert` in resumable steps: a convert killed in the middle of adding rows, rerun
with the same options, ends with exactly the index an uninterrupted convert writes; rerun with
other options, it refuses to throw the saved steps away. Real processes, a real SIGKILL, the
session's Flat index (310 passages) converted in chunks of 40 rows (8 steps)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import faiss
import numpy as np
from test_cli_commands import assert_one_line_user_error, hdr

from retrieval_server.index.convert import ADDED_DIR, CONVERT_STATE, TRAINED_FILE
from retrieval_server.index.staging import partial_dir

FACTORY = "IVF4,PQ8x4fs"
CHUNK = "40"

KILLED_AFTER_THREE_STEPS = """
import os, signal, sys
from pathlib import Path
from retrieval_server.index.convert import convert_index

def stop(steps):
    if steps == 3:
        os.kill(os.getpid(), signal.SIGKILL)

convert_index(Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], show_progress=False,
              chunk_size=int(sys.argv[4]), after_step=stop)
"""


def convert(source: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    args = ["--from", str(source), "--out", str(out), "--index-type", FACTORY]
    return hdr("index", "convert", *args, "--chunk-size", CHUNK, *extra)


def test_a_killed_convert_resumes_to_the_uninterrupted_index(
    small_index: Path, tmp_path: Path
) -> None:
    whole = tmp_path / "whole"
    result = convert(small_index, whole)
    assert result.returncode == 0, result.stderr
    assert not partial_dir(whole).exists()
    assert not {CONVERT_STATE, TRAINED_FILE, ADDED_DIR} & {p.name for p in whole.iterdir()}

    out = tmp_path / "resumed"
    killed = subprocess.run(
        [sys.executable, "-c", KILLED_AFTER_THREE_STEPS, str(small_index), str(out), FACTORY,
         CHUNK],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(), check=False,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    partial = partial_dir(out)
    assert not out.exists()
    steps = sorted(p.name for p in (partial / ADDED_DIR).iterdir())
    assert steps == ["000000.faiss", "000001.faiss", "000002.faiss"]
    assert (partial / TRAINED_FILE).is_file()

    other = convert(small_index, out, "--train-sample", "200")
    assert_one_line_user_error(
        other,
        "holds 3 added chunks of an interrupted `hdr index convert` with other settings"
        " (train_sample ",
    )
    assert sorted(p.name for p in (partial / ADDED_DIR).iterdir()) == steps

    resumed = convert(small_index, out)
    assert resumed.returncode == 0, resumed.stderr
    assert "3 of 8 chunks already added" in resumed.stderr
    assert not partial.exists()
    assert not {CONVERT_STATE, TRAINED_FILE, ADDED_DIR} & {p.name for p in out.iterdir()}

    # equal to the uninterrupted index: every row as a query, every list probed, the same ids
    # and scores (fast-scan files are not byte-equal run to run: block padding is not zeroed)
    flat = faiss.read_index(str(small_index / "dense.faiss"))
    queries = flat.reconstruct_n(0, flat.ntotal)
    found = []
    for index_dir in (out, whole):
        index = faiss.read_index(str(index_dir / "dense.faiss"))
        assert index.ntotal == flat.ntotal == 310
        index.nprobe = 4
        found.append(index.search(queries, 10))
    (scores, rows), (whole_scores, whole_rows) = found
    assert np.array_equal(rows, whole_rows) and np.array_equal(scores, whole_scores)
    assert (rows[:, 0] == np.arange(310)).mean() >= 0.5  # ids are the rows they were added as
