"""Atomic, restricted-format training checkpoints.

A checkpoint `checkpoints/step-XXXXXX/` holds everything to continue a run exactly: the model
(and tokenizer) as `save_pretrained` writes them, the optimizer (`optimizer.pt`) and scheduler
(`scheduler.json`) states, the replay lifecycle's state (`replay.pt`: the buffer and the
drift gates, `headroom_drift.GroupReplay.state_dict`, read with `weights_only=True`), the RNG
states of python, numpy and torch of every process (`rng/rank-R.safetensors` + `.json`), the
trainer's counters and the number of processes (`state.json`) and the run config
(`config.yaml`).

A checkpoint written before the replay state had a format of its own (hdr until fb200a9) held
the buffer in `buffer.safetensors` + `buffer.json` and the gates' taus among `state.json`'s
counters; it is read into the same state (`legacy_replay_state`), so such a run resumes.

Across processes (trainer/distributed.py) rank 0 writes the checkpoint. The replay buffer is
replicated, so it is written once; each rank's RNG state is its own file. Resuming under the
same number of processes restores each rank's own state; under another number it restores
the common state when every rank's was the same (the trainer keeps them equal), and refuses
with one line otherwise.

Atomic: everything is written into a hidden temporary directory next to the final one, then
`manifest.json` (every file's size and sha256) is written last, then the directory is renamed
into place. A directory without a manifest, or whose files disagree with it, is refused with
one line. Only the last `keep_last` checkpoints are kept.

Restricted loading: safetensors, JSON, YAML (safe loader) and `torch.load(weights_only=True)`;
never unrestricted pickle.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from core.errors import UserError
from core.paths import MODEL, model_files_in, staging_dir, swap_in
from core.progress import say
from headroom_drift import GroupReplay, StoredGroup
from headroom_drift.lifecycle import STATE_FORMAT
from trainer.frozen_bottom import attached

REPLAY_STATE = "replay.pt"
LEGACY_GATES = ("replay_gate", "staleness_gate")  # counters of checkpoints before replay.pt

MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


# --- RNG ---------------------------------------------------------------------------------


def capture_rng() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Python, numpy and torch (CPU, and CUDA when present) RNG states: tensors + JSON."""
    version, py_state, gauss = random.getstate()
    name, np_keys, pos, has_gauss, cached = np.random.get_state()
    tensors = {"torch": torch.get_rng_state(), "numpy_keys": torch.from_numpy(np_keys.copy())}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"cuda{i}"] = s
    info = {
        "python": [version, list(py_state), gauss],
        "numpy": [name, int(pos), int(has_gauss), float(cached)],
    }
    return tensors, info


def restore_rng(tensors: dict[str, torch.Tensor], info: dict[str, Any]) -> None:
    version, py_state, gauss = info["python"]
    random.setstate((version, tuple(py_state), gauss))
    name, pos, has_gauss, cached = info["numpy"]
    np.random.set_state((name, tensors["numpy_keys"].numpy(), pos, has_gauss, cached))
    torch.set_rng_state(tensors["torch"])
    cuda = [tensors[k] for k in sorted(tensors) if k.startswith("cuda")]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


# --- writing -----------------------------------------------------------------------------


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1))


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


@dataclass
class TrainState:
    """What is saved besides weights and optimizer: enough to continue exactly."""

    model: Any
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scheduler: Any
    replay: GroupReplay
    counters: dict[str, Any]
    config_yaml: str
    model_files: dict[str, str] = field(default_factory=dict)  # name -> text, beside weights
    rng_states: list | None = None  # capture_rng() of every rank; None: this process alone
    model_state: dict | None = None  # a gathered full state dict (FSDP); None: the module's
    optimizer_state: dict | None = None  # likewise; None: `optimizer.state_dict()`


def save_checkpoint(root: Path, step: int, state: TrainState, keep_last: int) -> Path:
    """Write `root/step-XXXXXX` atomically and keep only the last `keep_last` checkpoints."""
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{step_dir_name(step)}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    state.model.save_pretrained(
        tmp / "model", state_dict=state.model_state, safe_serialization=True
    )
    if state.tokenizer is not None:
        state.tokenizer.save_pretrained(tmp / "model")
    for name, text in state.model_files.items():
        (tmp / "model" / name).write_text(text)
    optimizer_state = state.optimizer_state or state.optimizer.state_dict()
    torch.save(optimizer_state, tmp / "optimizer.pt")
    _write_json(tmp / "scheduler.json", state.scheduler.state_dict())
    state.replay.save(tmp / REPLAY_STATE)
    rng_states = state.rng_states or [capture_rng()]
    (tmp / "rng").mkdir()
    for rank, (rng_tensors, rng_info) in enumerate(rng_states):
        save_file(rng_tensors, tmp / "rng" / f"rank-{rank}.safetensors")
        _write_json(tmp / "rng" / f"rank-{rank}.json", rng_info)
    _write_json(tmp / "state.json", {"step": step, **state.counters, "world_size": len(rng_states)})
    (tmp / "config.yaml").write_text(state.config_yaml)
    files = sorted(p for p in tmp.rglob("*") if p.is_file())
    manifest = {
        "step": step,
        "files": {str(p.relative_to(tmp)): [p.stat().st_size, _sha256(p)] for p in files},
    }
    _fsync_tree(tmp)
    _write_json(tmp / MANIFEST, manifest)
    if final.exists():  # a rerun of the same step after a resume: replace it whole
        shutil.rmtree(final)
    os.replace(tmp, final)
    prune_checkpoints(root, keep_last)
    return final


def list_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """Finished checkpoint directories under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name))]
    return sorted(found)


def prune_checkpoints(root: Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints, and stale temporary directories."""
    for p in root.glob(".tmp-step-*"):
        if not p.name.endswith(f"-{os.getpid()}"):
            shutil.rmtree(p, ignore_errors=True)
    for _, path in list_checkpoints(root)[: -keep_last or None]:
        shutil.rmtree(path, ignore_errors=True)


# --- reading -----------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A verified checkpoint directory; the `load_*` methods read its parts."""

    path: Path
    step: int

    @property
    def model_dir(self) -> Path:
        return self.path / "model"

    @property
    def run_dir(self) -> Path:
        return self.path.parent.parent

    def config_yaml(self) -> str:
        return (self.path / "config.yaml").read_text()

    def counters(self) -> dict[str, Any]:
        """The trainer's counters and `step` (not the number of processes, nor the gates an
        older checkpoint kept there: they are the replay state's)."""
        state = json.loads((self.path / "state.json").read_text())
        for key in ("world_size", *LEGACY_GATES):
            state.pop(key, None)
        return state

    @property
    def world_size(self) -> int:
        """How many processes wrote this checkpoint's run."""
        return int(json.loads((self.path / "state.json").read_text()).get("world_size", 1))

    def optimizer_state(self) -> dict:
        return torch.load(self.path / "optimizer.pt", map_location="cpu", weights_only=True)

    def scheduler_state(self) -> dict:
        return json.loads((self.path / "scheduler.json").read_text())

    def restore_replay(self, replay: GroupReplay) -> list[StoredGroup]:
        """The replay lifecycle's state as this checkpoint holds it (either format); returns
        the stored groups beyond `replay`'s capacity, which left (`GroupReplay.load_state_dict`)."""
        if (self.path / REPLAY_STATE).is_file():
            return replay.load(self.path / REPLAY_STATE)
        state = json.loads((self.path / "state.json").read_text())
        return replay.load_state_dict(
            legacy_replay_state(
                load_file(self.path / "buffer.safetensors"),
                json.loads((self.path / "buffer.json").read_text()),
                gate=state.get("replay_gate"),
                late_gate=state.get("staleness_gate"),
            )
        )

    def rng_states(self) -> list[tuple[dict[str, torch.Tensor], dict[str, Any]]]:
        """Every rank's saved RNG state, in rank order."""
        if not (self.path / "rng").is_dir():  # written before checkpoints knew of ranks
            legacy = json.loads((self.path / "rng.json").read_text())
            return [(load_file(self.path / "rng.safetensors"), legacy)]
        return [
            (
                load_file(self.path / "rng" / f"rank-{r}.safetensors"),
                json.loads((self.path / "rng" / f"rank-{r}.json").read_text()),
            )
            for r in range(self.world_size)
        ]

    def restore_rng(self, rank: int = 0, world: int = 1) -> None:
        """Restore this rank's RNG state. Under another number of processes than wrote the
        checkpoint, every saved state must be the same one (then any rank may take it)."""
        states = self.rng_states()
        if world == len(states):
            restore_rng(*states[rank])
            return
        first_tensors, first_info = states[0]
        same = all(
            info == first_info
            and tensors.keys() == first_tensors.keys()
            and all(torch.equal(tensors[k], first_tensors[k]) for k in tensors)
            for tensors, info in states[1:]
        )
        if not same:
            raise UserError(
                f"checkpoint {self.path} was written by {len(states)} processes whose random"
                f" states differ; resume it with {len(states)} processes, not {world}"
            )
        restore_rng(first_tensors, first_info)


def legacy_replay_state(
    tensors: dict[str, torch.Tensor],
    meta: dict[str, Any],
    gate: dict | None = None,
    late_gate: dict | None = None,
) -> dict[str, Any]:
    """A `GroupReplay.state_dict()` from the replay files hdr wrote before they had a format of
    their own: the buffer's tensors keyed `"{i}.{name}"` and its metadata (`capacity`,
    `groups`, and in a TRL checkpoint's `hdr_replay.json` also `stored` and `gate`), with the
    gates' states an hdr checkpoint kept among its counters (`gate`, `late_gate`: a
    `state_dict()` or None)."""
    names = StoredGroup.TENSORS + StoredGroup.OPTIONAL_TENSORS
    groups = [
        {**info, "tensors": {n: tensors[f"{i}.{n}"] for n in names if f"{i}.{n}" in tensors}}
        for i, info in enumerate(meta["groups"])
    ]
    if gate is None and "gate" in meta:  # the TRL checkpoint's own: {"tau", "state"?}
        gate = meta["gate"].get("state")
    return {
        "format": STATE_FORMAT,
        "version": 1,
        "capacity": meta["capacity"],
        "rule": meta.get("rule"),
        "stored": meta.get("stored", 0),  # what an hdr run resumed with then
        "gate": {"state": gate},
        "late_gate": {"state": late_gate},
        "groups": groups,
    }


def _verify(path: Path) -> int:
    """The step of a complete checkpoint; UserError (one line) for anything else."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise UserError(f"checkpoint {path} is incomplete (no {MANIFEST}); refusing to load it")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        step = int(manifest["step"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
        raise UserError(
            f"checkpoint {path} has a corrupt {MANIFEST}; refusing to load it"
        ) from None
    for rel, (size, digest) in files.items():
        file = path / rel
        if not file.is_file():
            raise UserError(f"checkpoint {path} is missing {rel}; refusing to load it")
        if file.stat().st_size != size or _sha256(file) != digest:
            raise UserError(f"checkpoint {path} is corrupt ({rel} changed); refusing to load it")
    return step


def restore_buffer(ckpt: Checkpoint, replay: GroupReplay, logs, model, compute, start: int) -> None:
    """The checkpoint's stored groups into `replay`, at its (the run's) `replay.capacity`:
    groups beyond a smaller one leave at `start` (logged to `logs` as leaving then). With a
    frozen bottom on `model`, the kept groups' states are computed now, under `compute` (the
    run's autocast), as the steps before the stop left them, so the first scans after a
    resume cost what they would have."""
    left = ckpt.restore_replay(replay)
    if left:
        say(
            f"hdr train: replay.capacity {replay.buffer.capacity} holds fewer groups than"
            f" the checkpoint's {len(left) + len(replay)}: the oldest {len(left)} leave"
        )
        logs.groups_left(left, start)
    if (bottom := attached(model)) is not None:
        with compute():
            bottom.warm(model, replay.groups())


def open_checkpoint(path: str | Path) -> Checkpoint:
    """A checkpoint directory, or a run directory (its newest checkpoint), verified."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"resume path not found: {path}")
    if not (path / MANIFEST).exists() and (path / "checkpoints").is_dir():
        found = list_checkpoints(path / "checkpoints")
        if not found:
            raise UserError(f"run directory {path} has no finished checkpoint to resume from")
        path = found[-1][1]
    elif not (path / MANIFEST).exists() and not STEP_DIR.match(path.name):
        raise UserError(f"{path} is neither a checkpoint nor a run directory with checkpoints")
    return Checkpoint(path=path, step=_verify(path))


def save_model(
    model,
    tokenizer,
    out: Path,
    extra_files: dict[str, str] | None = None,
    state_dict: dict | None = None,
) -> Path:
    """`save_pretrained` (model and tokenizer) and `extra_files` (name -> text, e.g. the
    rollout settings) into a staging folder beside `out`, then moved in: a new `out` is one
    rename; an older model there has only its own files replaced (`core.paths.swap_in`), so
    nothing else in the folder is touched. The caller has checked `out` (`check_output`).
    `state_dict`: weights gathered elsewhere (FSDP), instead of the module's own."""
    out = Path(out)
    if out.exists() and any(out.iterdir()) and not MODEL.recognise(out):
        raise UserError(f"{out} holds other files, not a model; not writing a model there")
    staged = staging_dir(out)
    model.save_pretrained(staged, state_dict=state_dict, safe_serialization=True)
    tokenizer.save_pretrained(staged)
    for name, text in (extra_files or {}).items():
        (staged / name).write_text(text)
    return swap_in(staged, out, model_files_in(out) if out.is_dir() else [])
