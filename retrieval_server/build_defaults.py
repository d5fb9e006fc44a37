"""Defaults of `hdr index build|convert|import`, in a module of their own so that the command
line (imported by every `hdr` call, `--help` included) shows them without importing the index
writers and their encoder stack."""

BM25_AUTO_MAX_DOCUMENTS = 1_000_000
DEFAULT_CHUNK_SIZE = 8192
DEFAULT_TRAIN_SAMPLE = 262_144  # faiss's k-means uses at most 256 points per centroid
