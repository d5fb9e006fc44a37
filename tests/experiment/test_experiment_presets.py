"""The experiment's presets: every YAML under configs/experiments/ is a valid ExperimentConfig,
a mistake in one is one line naming the file, and `--preset` takes a name or a path."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from core.config import merge_settings
from core.errors import UserError
from experiment.cli import command_config
from experiment.config import (
    PRESETS_DIR,
    ExperimentConfig,
    experiment_config,
    preset_names,
    read_preset,
)

HDR = str(Path(sys.executable).with_name("hdr"))
REPO = Path(__file__).resolve().parents[2]
PRESET_FILES = sorted(PRESETS_DIR.glob("*.yaml"))
# the quick overlay stores zero-advantage groups, which the real model's base config skips in
# the update: --quick on its presets is refused when the config is built
QUICK_REFUSED = {"configs/smollm2-cpu.yaml": "grpo.skip_zero_advantage needs"}


def test_the_shipped_presets_are_there():
    shipped = {"main", "ablations", "bridge", "demo", "quick", "quick-bridge", "powered"}
    assert shipped | {"powered-ablations"} <= set(preset_names())


def test_every_demo_model_has_its_preset():
    from experiment.cli import DEMO_PRESETS

    assert set(DEMO_PRESETS.values()) <= set(preset_names())


@pytest.mark.parametrize("path", PRESET_FILES, ids=lambda p: p.stem)
def test_every_preset_file_is_a_valid_experiment_config(path):
    settings = read_preset(path)
    assert settings, f"{path} sets nothing"
    alone = ExperimentConfig.model_validate(settings).model_dump()
    resolved = experiment_config(path.stem).model_dump()  # read on main: arms known, refs run
    laid = {key: resolved[key] for key in settings if key != "train"}
    assert laid == {key: alone[key] for key in settings if key != "train"}
    assert merge_settings(resolved["train"], alone["train"]) == resolved["train"]  # all of it
    refused = QUICK_REFUSED.get(resolved["base_config"])
    if refused is None:
        experiment_config(path.stem, quick=True)  # and with its task's quick overlay
    else:
        with pytest.raises(UserError, match=refused) as err:
            experiment_config(path.stem, quick=True)
        assert "\n" not in str(err.value)


def test_main_is_the_base_every_preset_is_read_on():
    main = read_preset("main")
    assert experiment_config().model_dump() == experiment_config("main").model_dump()
    ablations = experiment_config("ablations")
    assert (ablations.train, ablations.seeds, ablations.task) == (
        main["train"],
        main["seeds"],
        main["task"],
    )
    assert ablations.arms == read_preset("ablations")["arms"]


def test_quick_lays_the_tasks_own_overlay_over_the_preset():
    vital = experiment_config(quick=True)
    assert vital.corpus_limit == read_preset("quick")["corpus_limit"]
    bridge = experiment_config("bridge", quick=True)
    assert bridge.task == "wiki-bridge" and bridge.corpus_limit is None
    assert bridge.train["rollout"] == read_preset("quick-bridge")["train"]["rollout"]
    assert bridge.seeds == read_preset("bridge")["seeds"]  # what quick does not set stays
    assert bridge.train["replay"]["tau"] == read_preset("bridge")["train"]["replay"]["tau"]


def test_later_presets_explicit_fields_then_overrides_win(tmp_path):
    mine = tmp_path / "mine.yaml"
    mine.write_text("seeds: [3]\ntrain: {steps: 7}\n")
    cfg = experiment_config("bridge", mine, train={"steps": 9}, overrides=["jobs=1"])
    assert (cfg.task, cfg.seeds, cfg.train["steps"], cfg.jobs) == ("wiki-bridge", [3], 9, 1)


def test_a_preset_by_name_and_by_path_are_the_same(tmp_path):
    copy = tmp_path / "bridge.yaml"
    copy.write_text((PRESETS_DIR / "bridge.yaml").read_text())
    by_name = experiment_config("bridge").model_dump()
    assert experiment_config(PRESETS_DIR / "bridge.yaml").model_dump() == by_name
    assert experiment_config(str(copy)).model_dump() == by_name


def test_an_unknown_key_in_a_preset_is_one_line_naming_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("seedz: [1, 2]\n")
    with pytest.raises(UserError) as err:
        experiment_config(bad)
    message = str(err.value)
    assert "\n" not in message
    assert str(bad) in message and "seedz" in message and "did you mean seeds?" in message


def test_an_unknown_preset_name_lists_the_valid_ones():
    with pytest.raises(UserError, match=r"unknown experiment preset 'brige'; valid: .*bridge"):
        experiment_config("brige")
    with pytest.raises(UserError, match="config file not found"):
        experiment_config("no/such/preset.yaml")


def _experiment(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`hdr experiment` on a data dir whose index is not one: the experiment resolves its
    config, writes experiment_config.json, then stops in one line when `hdr serve` refuses
    the index (before any SFT or training)."""
    data = cwd / "data"
    if not (cwd / "configs").exists():  # the presets' base configs, as from the repository
        (cwd / "configs").symlink_to(REPO / "configs")
    (data / "index-bm25").mkdir(parents=True, exist_ok=True)
    (data / "index-bm25" / "manifest.json").write_text("{}")
    cmd = [HDR, "experiment", "--data-dir", str(data), *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)


def _resolved(out: Path, done: subprocess.CompletedProcess[str]) -> dict:
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith("hdr: error: hdr serve exited")
    assert "Traceback" not in done.stderr
    return json.loads((out / "experiment_config.json").read_text())


def test_cli_preset_by_name_and_by_path(tmp_path):
    by_name = _experiment("--preset", "ablations", cwd=tmp_path)
    resolved = _resolved(tmp_path / "runs" / "ablations", by_name)  # default out: its name
    assert resolved["arms"] == read_preset("ablations")["arms"]
    assert resolved["train"]["steps"] == read_preset("main")["train"]["steps"]

    mine = tmp_path / "mine.yaml"
    mine.write_text("arms: [on_policy]\nreferences: []\nseeds: [7]\n")
    by_path = _experiment("--preset", str(mine), "--out", str(tmp_path / "o"), cwd=tmp_path)
    resolved = _resolved(tmp_path / "o", by_path)
    assert (resolved["arms"], resolved["seeds"]) == (["on_policy"], [7])

    laid = _experiment("--preset", "powered", "--preset", "powered-ablations", cwd=tmp_path)
    resolved = _resolved(tmp_path / "runs" / "powered-ablations", laid)  # the last one's name
    assert resolved["arms"] == read_preset("powered-ablations")["arms"]
    train = resolved["train"]
    assert (train["steps"], train["data"]["train_split"]) == (80, "rl")  # powered's, kept


def test_cli_a_bad_preset_is_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("arms: [on_policy]\nseedz: [3]\n")
    done = _experiment("--preset", str(bad), cwd=tmp_path)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hdr: error: preset "), done.stderr
    assert str(bad) in lines[0] and "did you mean seeds?" in lines[0]
    assert not (tmp_path / "runs").exists()  # refused before anything was written


def test_hdr_experiment_keeps_a_presets_base_config_unless_config_names_one(tmp_path):
    # `--config` once defaulted to the tiny bed's YAML and replaced every preset's own
    def run(presets, base_config=None):
        return command_config(presets, [], False, [], tmp_path, None, base_config)

    smollm2 = run(["smollm2-diagnostics"])
    assert smollm2.base_config == read_preset("smollm2-diagnostics")["base_config"]
    assert smollm2.out_dir == "runs/smollm2-diagnostics"
    mine = tmp_path / "mine.yaml"
    mine.write_text((REPO / "configs" / "smollm2-cpu.yaml").read_text())
    assert run(["smollm2-diagnostics"], mine).base_config == str(mine)
    with pytest.raises(UserError, match=r"base config not found: no-such\.yaml"):
        run(["smollm2-diagnostics"], Path("no-such.yaml"))  # before anything runs
    assert run([]).base_config == "configs/tiny-cpu.yaml"


def test_the_smollm2_query_budget_command_trains_from_the_plain_start(tmp_path):
    """The 2-word variant in smollm2-diagnostics.yaml's header cuts RL's searches, not the
    start's: its SFT settings hash is the plain start's, and its RL runs send two words."""
    from experiment.fingerprint import digest, sft_settings
    from experiment.sft_start import init_identity, sft_start_dir, sft_train_config
    from experiment.train_configs import base_train_config

    header = (PRESETS_DIR / "smollm2-diagnostics.yaml").read_text()
    variant = header.split("--out runs/diag-smollm2-q2", 1)[1].split("\nbase_config:", 1)[0]
    overrides = [w for w in shlex.split(variant.replace("#", "")) if "=" in w]
    keys = {o.split("=", 1)[0] for o in overrides}
    assert keys == {"train.rollout.max_query_words", "sft_overrides", "arms"}

    def start_and_run(extra):
        cfg = command_config(["smollm2-diagnostics"], [], False, extra, tmp_path, None, None)
        start = sft_start_dir(cfg)
        sft = sft_train_config(cfg, "http://127.0.0.1:1", start, tmp_path / "smollm2")
        settings = digest(sft_settings(sft, init_identity(cfg, tmp_path / "smollm2")))
        run = base_train_config(cfg, "http://127.0.0.1:1", start, tmp_path / "run", 1)
        return start, settings, sft.rollout.max_query_words, run.rollout.max_query_words

    plain_start, plain_settings, _, plain_words = start_and_run([])
    q2_start, q2_settings, q2_sft_words, q2_words = start_and_run(overrides)
    assert q2_settings == plain_settings and q2_sft_words is None
    assert (plain_words, q2_words) == (None, 2)
    assert q2_start != plain_start  # sft_overrides name the folder; the hash is what is checked
    assert q2_start.name == "smollm2-sft-s150ffde3-splitsft"  # the name the header gives
