"""A run or an SFT start is reused only when its stored config hash is that of the config just
built; otherwise one line names what differs (experiment/fingerprint.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from core.config import merge_settings
from core.errors import UserError
from core.fingerprint import digest
from experiment.config import experiment_config
from experiment.fingerprint import (
    HASH_FILE,
    START_LOCATION,
    check_reuse,
    run_settings,
    sft_settings,
    write_hash,
)
from experiment.runs import run_arm, run_environment
from experiment.sft_start import ensure_sft, init_identity, sft_train_config
from experiment.train_configs import arm_train_config

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "configs" / "tiny-cpu.yaml"
URL = "http://127.0.0.1:9"
LR_2E5 = {"grpo": {"lr": 2e-5}}


def _run_config(tmp_path, port_url=URL, out="o", **fields):
    cfg = experiment_config(base_config=str(BASE), data_dir=str(tmp_path / "data"), **fields)
    sft = tmp_path / "data" / "tiny-sft"
    run_dir = tmp_path / out / "runs" / "on_policy" / "seed-1"
    return cfg, arm_train_config(cfg, cfg.arm("on_policy"), port_url, sft, run_dir, 1), sft


def test_the_hash_ignores_the_port_and_the_folder_and_sees_every_setting(tmp_path):
    _, a, sft = _run_config(tmp_path)
    _, moved, _ = _run_config(tmp_path, "http://127.0.0.1:4242", out="elsewhere")
    _, other_lr, _ = _run_config(tmp_path, train={"grpo": {"lr": 1e-4}})
    assert digest(run_settings(a, sft)) == digest(run_settings(moved, sft))
    assert digest(run_settings(a, sft)) != digest(run_settings(other_lr, sft))
    assert digest(run_settings(a, sft)) != digest(run_settings(a, sft, {"corpus_limit": 2000}))


def test_a_mismatch_is_refused_in_one_line_naming_what_differs(tmp_path):
    _, a, sft = _run_config(tmp_path)
    _, b, _ = _run_config(tmp_path, train={"steps": 70, "grpo": {"lr": 1e-4}})
    folder = tmp_path / "run"
    folder.mkdir()
    stored = write_hash(folder, run_settings(a, sft))
    assert json.loads((folder / HASH_FILE).read_text())["sha256"] == stored
    check_reuse(folder, run_settings(a, sft), "run")  # the same config: reused
    with pytest.raises(UserError) as err:
        check_reuse(folder, run_settings(b, sft), "run")
    line = str(err.value)
    assert "\n" not in line and "grpo.lr 5e-05 then, 0.0001 now" in line
    assert "steps 60 then, 70 now" in line
    with pytest.raises(UserError, match=f"has no {HASH_FILE}"):
        check_reuse(tmp_path / "bare", run_settings(a, sft), "run")
    # without a hash file, the settings read back from what the folder holds are compared
    check_reuse(tmp_path / "bare", run_settings(a, sft), "run", run_settings(a, sft))
    with pytest.raises(UserError, match=r"grpo\.lr"):
        check_reuse(tmp_path / "bare", run_settings(b, sft), "run", run_settings(a, sft))


def test_a_finished_run_made_with_another_config_is_refused_before_any_work(tmp_path):
    cfg, config, sft = _run_config(tmp_path, out_dir=str(tmp_path / "o"))
    run_dir = Path(config.out_dir)
    (run_dir / "final").mkdir(parents=True)
    (run_dir / "final" / "config.json").write_text("{}")
    write_hash(run_dir, run_settings(config, sft, run_environment(cfg)))
    changed = cfg.model_copy(update={"train": merge_settings(cfg.train, LR_2E5)})
    with pytest.raises(UserError, match=r"run .*seed-1 was made with other settings \(grpo.lr"):
        run_arm(changed, changed.arm("on_policy"), 1, URL, sft, [])
    # a finished run from before runs carried a hash: checked through its own config.yaml
    (run_dir / HASH_FILE).unlink()
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json")))
    with pytest.raises(UserError, match=r"grpo\.lr 5e-05 then, 2e-05 now"):
        run_arm(changed, changed.arm("on_policy"), 1, URL, sft, [])


def test_a_run_carried_by_its_exported_evidence_is_checked_like_a_finished_one(tmp_path):
    """No model, only what `hdr report --export` keeps (hash, metrics, gzipped held-out
    evaluation): it counts as finished, and is refused when the config built now differs."""
    from experiment.runs import carried

    cfg, config, sft = _run_config(tmp_path, out_dir=str(tmp_path / "o"))
    run_dir = Path(config.out_dir)
    (run_dir / "heldout").mkdir(parents=True)
    (run_dir / "metrics.jsonl").write_text("")
    assert not carried(run_dir)  # an unfinished run's folder
    (run_dir / "heldout" / "eval.json.gz").write_bytes(b"")
    assert not carried(run_dir)  # no hash: what it was made with is unknown
    write_hash(run_dir, run_settings(config, sft, run_environment(cfg)))
    assert carried(run_dir)
    changed = cfg.model_copy(update={"train": merge_settings(cfg.train, LR_2E5)})
    with pytest.raises(UserError, match=r"run .*seed-1 was made with other settings \(grpo.lr"):
        run_arm(changed, changed.arm("on_policy"), 1, URL, sft, [])


def test_the_sft_key_holds_the_base_configs_sft_section_and_the_train_settings(tmp_path):
    def settings(**fields):
        cfg = experiment_config(data_dir=str(tmp_path), **fields)
        init = tmp_path / "tiny-policy"
        return digest(sft_settings(sft_train_config(cfg, URL, tmp_path / "s", init),
                                   init_identity(cfg, init)))  # fmt: skip

    base = yaml.safe_load(BASE.read_text())
    base["sft"]["lr"] = 1e-3
    other_base = tmp_path / "other-base.yaml"
    other_base.write_text(yaml.safe_dump(base))
    default = settings(base_config=str(BASE))
    assert settings(base_config=str(other_base)) != default  # the base config's sft: section
    assert settings(base_config=str(BASE), train={"rollout": {"max_turns": 2}}) != default
    assert settings(base_config=str(BASE), sft_overrides=["sft.epochs=3"]) != default
    # what SFT does not read leaves its key alone: the RL learning rate, steps, the port
    assert settings(base_config=str(BASE), train={"steps": 7, "grpo": {"lr": 1e-4}}) == default


def test_an_sft_start_made_with_other_settings_is_refused_not_reused(tmp_path):
    small = ["policy.hidden_size=32", "policy.num_layers=1", "policy.intermediate_size=64"]
    made = experiment_config(data_dir=str(tmp_path), base_config=str(BASE), overrides=small)
    now = experiment_config(
        data_dir=str(tmp_path),
        base_config=str(BASE),
        overrides=[*small, "train.rollout.max_tokens_per_turn=9"],
    )
    from experiment.sft_start import ensure_policy, sft_start_dir

    init = ensure_policy(made)  # the real tiny policy: the start's identity starts from it
    start = sft_start_dir(made)
    assert start == sft_start_dir(now)  # the same readable name: only the hash tells them apart
    start.mkdir()
    (start / "config.json").write_text("{}")
    write_hash(start, sft_settings(sft_train_config(made, URL, start, init),
                                   init_identity(made, init)))  # fmt: skip
    log = tmp_path / "log"
    assert ensure_sft(made, URL, log) == start  # the same settings: reused, nothing trained
    changed = r"SFT start .* \(rollout.max_tokens_per_turn 32 then, 9 now\)"
    with pytest.raises(UserError, match=changed):
        ensure_sft(now, URL, log)


def test_a_run_recorded_before_the_gate_keys_were_renamed_is_reused(tmp_path):
    """config_hash.json of a run an earlier hdr finished holds the gate's old key names: the
    same settings under them are the same run; another value under them is not."""
    from core.config import move_renamed
    from trainer.config.history import RENAMED_KEYS

    _, config, sft = _run_config(tmp_path)
    now = run_settings(config, sft)
    old_names = {new: old for old, new in RENAMED_KEYS.items()}
    then = move_renamed(now, old_names)  # the settings as they were recorded then
    for section in ("replay", "async_rollout"):
        assert then[section].pop("adaptive_gate") == {}  # its keys moved out
    assert "gate_target" in then["replay"] and "adaptive_gate" not in then["replay"]
    folder = tmp_path / "run"
    folder.mkdir()
    write_hash(folder, then)
    with pytest.raises(UserError, match="other settings"):
        check_reuse(folder, now, "run")  # compared as written: the names differ
    check_reuse(folder, now, "run", renamed=RENAMED_KEYS)
    then["replay"]["gate_target"] = 0.25
    write_hash(folder, then)
    with pytest.raises(UserError, match=r"replay\.adaptive_gate\.target 0\.25 then, 0\.5 now"):
        check_reuse(folder, now, "run", renamed=RENAMED_KEYS)


RECORDED_BEFORE = (
    Path(__file__).resolve().parents[2]
    / "docs/results/pilot-small-groups/runs/on_policy_b12/seed-2"
)


def test_a_run_an_earlier_hdr_recorded_is_reused_by_todays(tmp_path):
    """A run the pilot committed (its config_hash.json written before the gate keys were
    renamed and before data.train_questions, rollout.max_query_words, sft.query, ... existed)
    is the same run under today's settings, which hold every key; a key added since, set to
    anything but what hdr did before it existed, is another run."""
    from core.config import build_config
    from experiment.fingerprint import RUN_VOLATILE
    from trainer.config import TrainConfig
    from trainer.config.history import ADDED_KEYS, REMOVED_KEYS, RENAMED_KEYS, read_as_today

    recorded = json.loads((RECORDED_BEFORE / "config_hash.json").read_text())["settings"]
    assert "train_questions" not in recorded["data"]  # recorded before the key existed
    train = {k: v for k, v in recorded.items() if k not in ("sft_start_sha256", "environment")}
    config = build_config(TrainConfig, read_as_today(train))
    now = config.model_dump(mode="json")
    for dotted in RUN_VOLATILE:  # what the run's hash leaves out, as the experiment does
        *parents, last = dotted.split(".")
        node = now
        for part in parents:
            node = node[part]
        node.pop(last)
    now |= {
        "sft_start_sha256": recorded["sft_start_sha256"],
        "environment": recorded["environment"],
    }
    with pytest.raises(UserError, match="other settings"):
        check_reuse(RECORDED_BEFORE, now, "run", renamed=RENAMED_KEYS)  # the added keys differ
    with pytest.raises(UserError, match="other settings"):  # the removed keys differ
        check_reuse(RECORDED_BEFORE, now, "run", renamed=RENAMED_KEYS, added=ADDED_KEYS)
    removed = {"renamed": RENAMED_KEYS, "added": ADDED_KEYS, "removed": REMOVED_KEYS}
    check_reuse(RECORDED_BEFORE, now, "run", **removed)
    now["data"]["train_questions"] = 32
    with pytest.raises(UserError, match=r"data\.train_questions None then, 32 now"):
        check_reuse(RECORDED_BEFORE, now, "run", **removed)


def test_the_running_comparisons_committed_run_is_reused_by_its_preset_as_written_now(tmp_path):
    """docs/results/smollm2-replay's finished run, checked against the config the comparison's
    preset builds today for it: the same run, so the comparison goes on without training it
    again, from a data folder anywhere (the run recorded its start's absolute path; a start
    is named by its hash, and is checked on its own)."""
    from experiment.sft_start import sft_start_dir
    from trainer.config.history import ADDED_KEYS, REMOVED_KEYS, RENAMED_KEYS

    run = REPO / "docs/results/smollm2-replay/runs/on_policy/seed-1"
    recorded = json.loads((run / HASH_FILE).read_text())["settings"]
    assert recorded["model"]["path"].startswith("/work/")  # another machine's folder
    cfg = experiment_config(
        "smollm2-replay-comparison", data_dir=str(tmp_path / "data"), out_dir="runs/x"
    )
    sft = sft_start_dir(cfg)
    sft.mkdir(parents=True)  # the same start (by hash) in this data folder
    (sft / HASH_FILE).write_text(json.dumps({"sha256": recorded["sft_start_sha256"]}))
    config = arm_train_config(cfg, cfg.arm("on_policy"), URL, sft, Path("runs/x/seed-1"), 1)
    now = run_settings(config, sft, run_environment(cfg))
    assert "path" not in now["model"]
    history = {"renamed": RENAMED_KEYS, "added": ADDED_KEYS, "removed": REMOVED_KEYS}
    check_reuse(run, now, "run", **history, ignored=START_LOCATION)
    with pytest.raises(UserError, match=r"model\.path"):  # without `ignored`, the path differs
        check_reuse(run, now, "run", **history)
    now["replay"]["capacity"] = 64  # the base config's: what the preset's train sets counts
    with pytest.raises(UserError, match=r"replay\.capacity 32 then, 64 now"):
        check_reuse(run, now, "run", **history, ignored=START_LOCATION)
    now["replay"]["capacity"] = 32
    now["sft_start_sha256"] = "0" * 64  # another start: another run
    with pytest.raises(UserError, match=r"sft_start_sha256"):
        check_reuse(run, now, "run", **history, ignored=START_LOCATION)
