"""Defaults of `hdr index build|convert|import`, in a module of their own so that the command
line (imported by every `hdr` call, `--help` included) shows them without importing the index
writers and their encoder stack."""

BM25_AUTO_MAX_DOCUMENTS = 1_000_000
DEFAULT_CHUNK_SIZE = 8192
DEFAULT_TRAIN_SAMPLE = 262_144  # faiss's k-means uses at most 256 points per centroid
# rows added per resumable step of `hdr index convert` (768-d: 0.8 GB of vectors read a step)
DEFAULT_CONVERT_CHUNK = 262_144
