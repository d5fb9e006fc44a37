"""Config hashes of runs and SFT starts: a cached folder is reused only when it was made with
the config just built.

A folder's readable name (`runs/<arm>/seed-<n>`, `tiny-sft-e10-splitsft`) says roughly what
it holds; the folder's `config_hash.json` says exactly: the SHA-256 of the fully resolved
settings that determine its contents, and those settings themselves, so that a mismatch can
be refused in one line naming what differs (`check_reuse`). Settings that do not change the
contents are left out of the hash: where the retrieval server listened (a free port each
time), the folder's own path (a run copied into another experiment stays the same run),
progress bars, TensorBoard and W&B. The SFT start's own hash is folded into every run trained
from it, so a start rebuilt with other settings invalidates the runs made from it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from core.config import drop_removed, fill_added, lookup, move_renamed
from core.errors import UserError
from core.fingerprint import differences, digest, summary
from core.paths import write_json_atomic

HASH_FILE = "config_hash.json"


def _without(settings: dict[str, Any], dotted: tuple[str, ...]) -> dict[str, Any]:
    out = json.loads(json.dumps(settings, default=str))  # a deep copy of plain JSON values
    for key in dotted:
        *parents, last = key.split(".")
        node = out
        for part in parents:
            node = node.get(part, {})
        node.pop(last, None)
    return out


# What a training run's contents do not depend on.
RUN_VOLATILE = ("out_dir", "retrieval.urls", "log.progress", "log.tensorboard", "log.wandb")
# What an SFT start reads (trainer/tools/sft.py: seed, sft, data, rollout, and the model it is
# initialised from), less where it is written and where the server listened.
SFT_SECTIONS = ("seed", "sft", "data", "rollout", "model", "retrieval")
SFT_VOLATILE = ("model.path", "retrieval.urls", "sft.init_model")  # init: by identity
# Where a run's SFT start lies (`--data-dir data` and its absolute spelling are one start): a
# run names its start by the start's hash, and runs recorded with the path are read without it.
START_LOCATION = ("model.path",)


def run_ignored(settings: Mapping[str, Any]) -> tuple[str, ...]:
    """What `check_reuse` leaves out of a run's recording for `settings` (`run_settings`):
    the start's path, where the start is known by its hash."""
    return START_LOCATION if settings.get("sft_start_sha256") is not None else ()


def stored_hash(folder: Path) -> str | None:
    """The SHA-256 in `folder`'s `config_hash.json`, None when it has none."""
    path = Path(folder) / HASH_FILE
    if not path.is_file():
        return None
    return json.loads(path.read_text())["sha256"]


def run_settings(
    train_config, sft_dir: Path, environment: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """What a run's contents depend on: its resolved TrainConfig (less `RUN_VOLATILE`), the
    hash of the SFT start it was trained from, and `environment`, what the retrieval server
    it talked to was started with (the corpus it indexes, its settings)."""
    settings = _without(train_config.model_dump(mode="json"), RUN_VOLATILE)
    settings["sft_start_sha256"] = stored_hash(sft_dir)
    settings = _without(settings, run_ignored(settings))  # the start is its hash, wherever it lies
    settings["environment"] = dict(environment or {})
    return settings


def sft_settings(train_config, init: Mapping[str, Any]) -> dict[str, Any]:
    """What an SFT start's weights depend on: the sections `run_sft` reads (less
    `SFT_VOLATILE`) and `init`, the identity of the model it starts from (the tiny policy's
    sizes, or the prerequisite start's hash)."""
    dumped = train_config.model_dump(mode="json")
    settings = _without({s: dumped[s] for s in SFT_SECTIONS}, SFT_VOLATILE)
    settings["init"] = dict(init)
    return settings


def write_hash(folder: Path, settings: Mapping[str, Any]) -> str:
    """Write `folder/config_hash.json` (atomically); returns the hash."""
    sha = digest(settings)
    write_json_atomic(Path(folder) / HASH_FILE, {"sha256": sha, "settings": dict(settings)})
    return sha


def check_reuse(
    folder: Path,
    settings: Mapping[str, Any],
    what: str,
    fallback: Mapping[str, Any] | None = None,
    renamed: dict[str, str] | None = None,
    added: dict[str, Any] | None = None,
    removed: dict[str, tuple[Any, str]] | None = None,
    ignored: tuple[str, ...] = (),
) -> None:
    """Nothing when `folder`'s stored hash is that of `settings`; otherwise one UserError line
    naming what differs. A folder without `config_hash.json` (one being made, or made before
    folders carried one) is compared through `fallback`, the settings read back from what it
    does hold (a run's own config.yaml); with neither, what it was made with cannot be told,
    and it is refused too. `renamed` (old dotted key -> new): keys renamed since the folder
    was made, whose recorded values are compared under their new names; `added` (dotted key ->
    the value that did what hdr did before the key existed): keys added since, which the
    recording is compared as holding at that value; `removed` (dotted key -> (the value that did
    what hdr does now, why)): keys removed since, dropped from the recording where they hold
    that value; `ignored`: keys the recording may hold and the comparison leaves out (what
    today's settings no longer record)."""
    path = Path(folder) / HASH_FILE
    remedy = "use another folder (--out / --data-dir) or remove it to rebuild it"
    if path.is_file():
        stored = json.loads(path.read_text())
        sha, recorded = stored.get("sha256"), stored.get("settings", {})
    elif fallback is not None:
        sha, recorded = digest(fallback), fallback
    else:
        raise UserError(
            f"{what} {folder} has no {HASH_FILE}, so what it was made with cannot be checked;"
            f" {remedy}"
        )
    if renamed or added or removed:  # made by an earlier hdr: older names, keys it did not
        # have yet, keys it had and today's does not
        recorded = fill_added(move_renamed(dict(recorded), renamed or {}), added or {})
        recorded = drop_removed(recorded, removed or {})
        sha = digest(recorded)
    if any(lookup(recorded, key) is not None for key in ignored):
        recorded = _without(recorded, ignored)
        sha = digest(recorded)
    if sha == digest(settings):
        return
    changed = summary(differences(recorded, settings)) or "its stored hash differs"
    raise UserError(f"{what} {folder} was made with other settings ({changed}); {remedy}")
