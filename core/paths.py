"""Paths a command reads and writes, checked before any work so that hdr never loses a file.

The rule every writing command follows (docs/mistakes.md lists what each mistake gets):

- An output that does not exist yet is created; its nearest existing parent must be a
  writable folder, which is probed (a temporary file, gone at once) before any work.
- An output that exists must be an artifact of the same kind (an index with its manifest, a
  model with its config.json, a run with its config.yaml, ...). Replacing it needs `--force`;
  a folder holding anything else, a file where a folder is wanted (or the reverse), is refused
  in one line. An empty folder is used as it is.
- An output equal to, inside or holding one of the command's inputs is refused, with or
  without `--force`.
- Builds write into a staging folder beside the output and `swap_in` moves in only what they
  made: files of the replaced artifact are removed only when hdr made them, and nothing else
  in the folder is touched.

Model arguments are resolved locally first (`local_model`): a path that does not exist is one
line naming the command that writes it, without asking any model hub.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import stat
import tempfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any

from core.errors import UserError

FORCE_HELP = "Replace an existing output of the same kind (never other files, never inputs)."


@dataclass(frozen=True)
class Artifact:
    """A kind of output: what it is called, whether it is a folder, and how one is recognised."""

    name: str  # "an index", "a model", ... as it reads in a sentence
    is_dir: bool
    recognise: Callable[[Path], bool]
    made_by: str  # the command that writes one, for messages


def _json_file(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _first_json_line(path: Path) -> dict | None:
    try:
        with path.open() as f:
            line = f.readline()
        data = json.loads(line)
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return data if isinstance(data, dict) else None


def _is_index(path: Path) -> bool:
    manifest = _json_file(path / "manifest.json")
    return manifest is not None and "corpus_fingerprint" in manifest


def _is_model(path: Path) -> bool:
    config = _json_file(path / "config.json")
    return config is not None and ("model_type" in config or "architectures" in config)


def _is_run(path: Path) -> bool:
    """A folder `hdr train` wrote: its config.yaml is a training config (grpo, replay, ...;
    before `replay.rule`, the rule was a top-level `arm`)."""
    import yaml

    try:
        config = yaml.safe_load((path / "config.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return False
    return isinstance(config, dict) and {"grpo", "replay", "model"} <= set(config)


def _is_corpus(path: Path) -> bool:
    first = _first_json_line(path)
    return first is not None and "contents" in first


def _is_trajectories(path: Path) -> bool:
    first = _first_json_line(path)
    return first is not None and "response_ids" in first and "loss_mask" in first


INDEX = Artifact("an index", True, _is_index, "hdr index build")
MODEL = Artifact("a model", True, _is_model, "hdr init-model or hdr sft")
RUN = Artifact("a training run", True, _is_run, "hdr train")
EVAL = Artifact(
    "an evaluation",
    True,
    lambda p: (p / "eval.json").is_file() or (p / "partial.jsonl").is_file(),
    "hdr eval",
)
CHARTS = Artifact(
    "charts",
    True,
    lambda p: (p / "charts.json").is_file() or all(f.suffix == ".png" for f in p.iterdir()),
    "hdr plot",
)
CALIBRATION = Artifact(
    "a calibration", True, lambda p: (p / "calibrate.json").is_file(), "hdr calibrate"
)


def _is_experiment(path: Path) -> bool:
    """A folder `hdr experiment` wrote, or one holding only runs copied from one (and the
    start's evaluation) for a new experiment to reuse, as the ablations of
    docs/notebook/experiments.md do."""
    if (path / "experiment_config.json").is_file():
        return True
    if not {p.name for p in path.iterdir()} <= {"runs", "sft_start"}:
        return False
    seeds = list((path / "runs").glob("*/seed-*"))
    return bool(seeds) and all(_is_run(seed) for seed in seeds)


EXPERIMENT = Artifact("an experiment", True, _is_experiment, "hdr experiment")
CORPUS = Artifact("a corpus", False, _is_corpus, "hdr index prepare-wiki")
TRAJECTORIES = Artifact("trajectories", False, _is_trajectories, "hdr rollout")


def _overlap(out: Path, inputs: Iterable[str | Path], option: str) -> None:
    for given in inputs:
        source = Path(given).resolve()
        if out == source:
            raise UserError(f"{option} {out} is the command's input; write somewhere else")
        if source in out.parents:
            raise UserError(f"{option} {out} is inside the input {source}; write somewhere else")
        if out in source.parents:
            raise UserError(f"{option} {out} holds the input {source}; write somewhere else")


def _listing(path: Path, limit: int = 3) -> str:
    names = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_writable(path: Path, option: str = "--out") -> None:
    """The nearest existing ancestor of `path` is a folder this process can write into
    (probed with a nameless temporary file); else one UserError line."""
    ancestor = path.parent
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir():
        raise UserError(f"{option} {path}: {ancestor} is a file, not a folder")
    try:
        with tempfile.TemporaryFile(dir=ancestor):
            pass
    except OSError as err:
        raise UserError(f"{option} {path}: cannot write in {ancestor} ({err.strerror})") from None


def check_folder(path: str | Path, option: str) -> Path:
    """A folder that hdr only adds its own, newly named files to (a data or cache folder): it
    may hold anything else. It must be a folder, or not exist yet, and be writable."""
    folder = Path(path).expanduser().resolve()
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{option} {folder} is a file; {option} takes a folder")
    check_writable(folder / "x", option)
    return folder


def check_output(
    path: str | Path,
    artifact: Artifact,
    *,
    force: bool = False,
    inputs: Sequence[str | Path] = (),
    option: str = "--out",
    reuse: bool = False,
) -> Path:
    """Refuse, in one UserError line and before any work, an output path that would lose a
    file (see the module's rule). `reuse`: an existing artifact of the same kind is
    continued rather than replaced (a resumable evaluation or experiment), so it needs no
    `--force`. Returns the path, resolved."""
    out = Path(path).expanduser().resolve()
    _overlap(out, inputs, option)
    if not out.exists():
        check_writable(out, option)
        return out
    kind = "folder" if artifact.is_dir else "file"
    if artifact.is_dir and not out.is_dir():
        raise UserError(f"{option} {out} is a file; {option} takes a folder for {artifact.name}")
    if not artifact.is_dir and out.is_dir():
        raise UserError(f"{option} {out} is a folder; {option} takes a file for {artifact.name}")
    if artifact.is_dir and not any(out.iterdir()):
        check_writable(out / "x", option)
        return out
    if not artifact.recognise(out):
        what = f"holds other files ({_listing(out)})" if artifact.is_dir else "is another file"
        raise UserError(
            f"{option} {out} {what}, not {artifact.name}; hdr writes {artifact.name} only into a"
            f" new {'or empty ' if artifact.is_dir else ''}{kind} (or over {artifact.name} with"
            " --force)"
        )
    if not (force or reuse):
        raise UserError(
            f"{option} {out} already holds {artifact.name} (from {artifact.made_by}); pass --force"
            " to replace it, or choose another path"
        )
    check_writable(out / "x" if artifact.is_dir else out, option)
    return out


def staging_dir(out: Path) -> Path:
    """A new empty folder beside `out` that a build writes into before `swap_in`."""
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".staging", dir=out.parent))


def swap_in(staged: Path, out: Path, previous: Iterable[str] = (), last: str | None = None) -> Path:
    """Move the artifact built in `staged` into `out`, replacing only what hdr made.

    `out` new or an empty folder: one rename. Otherwise every file of `staged` replaces its
    namesake in `out` (renames on one filesystem: each file is whole, old or new), the files
    of the replaced artifact listed in `previous` (paths relative to `out`) that the new one
    lacks are removed, and nothing else in `out` is touched. `last` (e.g. a manifest, whose
    presence means "complete") is removed first and moved in last. `staged` is gone after."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        os.replace(staged, out)
        return out
    made = sorted(p.relative_to(staged).as_posix() for p in staged.rglob("*") if p.is_file())
    if last is not None:
        (out / last).unlink(missing_ok=True)
    for name in set(previous) - set(made):
        target = out / name
        if target.is_file() or target.is_symlink():
            target.unlink()
    for name in sorted(made, key=lambda n: n == last):
        target = out / name
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staged / name, target)
    shutil.rmtree(staged)
    emptied = {(out / name).parent for name in previous}
    for folder in sorted(emptied, key=lambda p: len(p.parts), reverse=True):
        if folder != out and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()  # a folder of the replaced artifact, now empty
    return out


# --- files written whole ---------------------------------------------------------------------


def _process_umask() -> int:
    """This process's umask, read once at import (os.umask reads it only by setting it, which
    is not done from threads that write)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


UMASK = _process_umask()


@contextmanager
def atomic_file(path: str | Path, mode: str = "w") -> Iterator[IO[Any]]:
    """A file to write `path` through, so that `path` holds either its old content or all of
    the new, never part: a temp file in the same directory (so `os.replace` is a rename on one
    filesystem), fsynced and renamed over `path` when the block ends; removed on any failure.
    The result has the mode `path` had (a user's `chmod 640` survives every save), or for a new
    file what `open` would give it (0666 less the umask), not the temp file's 0600."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    keep = stat.S_IMODE(path.stat().st_mode) if path.exists() else 0o666 & ~UMASK
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, keep)
        with os.fdopen(fd, mode, encoding=None if "b" in mode else "utf-8") as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write `text` so that `path` holds either its old content or all of the new, never part."""
    with atomic_file(path) as fh:
        fh.write(text)
    return Path(path)


def _jsonable(obj: Any) -> Any:
    import numpy as np

    if hasattr(obj, "__dataclass_fields__"):
        return _jsonable(asdict(obj))
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return None  # JSON has no NaN; a missing number reads as null
    if isinstance(obj, Path):
        return str(obj)
    return obj


def write_json_atomic(path: str | Path, obj: Any) -> Path:
    """`obj` (dicts, lists, dataclasses, pydantic models, numpy values) as indented JSON.

    NaN and infinities become null, so the file is strict JSON.
    """
    return write_text_atomic(path, json.dumps(_jsonable(obj), indent=2, allow_nan=False) + "\n")


# --- models ----------------------------------------------------------------------------------

# A relative name with one slash is a Hub id (Org/name) unless it starts in a local folder, or
# in one of the folders hdr itself writes into (data/, runs/) where a model is a path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
LOCAL_ROOTS = ("data", "runs")

MODEL_FILES = re.compile(
    r"^(config\.json|generation_config\.json|.*\.safetensors|model\.safetensors\.index\.json"
    r"|tokenizer(_config)?\.json|special_tokens_map\.json|vocab\.json|merges\.txt"
    r"|added_tokens\.json|chat_template\.(jinja|json)|hdr_rollout\.yaml)$"
)
"""Files `save_pretrained` (model and tokenizer) and hdr write into a model folder."""


def looks_like_hub_id(spec: str) -> bool:
    """Whether `spec` names a model on a hub (Org/name) rather than a local path."""
    if not _HUB_ID.match(spec):
        return False  # absolute, ./, ../, ~, several folders deep, a trailing slash
    first = spec.split("/", 1)[0]
    return first not in LOCAL_ROOTS and not Path(first).exists()


def local_model(spec: str | Path, hint: str = "") -> str:
    """`spec` if it is a model folder or a Hub id; else one UserError line, at once and
    without any network call. `hint` says which command writes the missing model."""
    text = str(spec)
    path = Path(text).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"no model at {path}: the folder has no config.json")
        return str(path)
    if path.exists():
        raise UserError(f"{path} is a file, not a model folder")
    if looks_like_hub_id(text):
        return text
    raise UserError(f"no model at {text}" + (f"; {hint}" if hint else ""))


def model_files_in(path: Path) -> list[str]:
    """The files of a model folder that hdr or save_pretrained made (what `--force` replaces)."""
    return [p.name for p in path.iterdir() if p.is_file() and MODEL_FILES.match(p.name)]
