"""`hdr plot` on synthetic run dirs written here in the run-dir format of docs/design.md ("The run
directory")."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import yaml

from core.errors import UserError
from evaluation.plots import load_run, plot_run_dirs, read_jsonl, run_label

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    assert data[-8:-4] == b"IEND", f"{path} is truncated"
    return width, height


def _write_run(run_dir: Path, arm: str, seed: int, steps: int = 12, replay: bool = True) -> Path:
    rng = np.random.default_rng(seed)
    run_dir.mkdir(parents=True)
    config = {"seed": seed, "steps": steps, "replay": {"rule": arm}}
    config["grpo"] = {"batch_prompts": 12 if arm == "on_policy" else 8, "group_size": 5}
    (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    metrics, evals, groups = [], [], []
    calls = 0
    for step in range(1, steps + 1):
        calls += 16
        ages = [int(a) for a in rng.integers(1, 6, size=3)] if replay else []
        metrics.append(
            {
                "step": step,
                "reward_mean": float(rng.uniform()),
                "acceptance_rate": float(rng.uniform(0.2, 0.6)) if replay else None,
                "replay_ages": ages,
                "env_calls_total": calls,
                "wall_time_total": 3.0 * step,
                "time_step": 3.0,
            }
        )
        if step % 4 == 0:
            evals.append(
                {
                    "step": step,
                    "env_calls_total": calls,
                    "wall_time_total": 3.0 * step,
                    "mean_at_k": 0.3 + 0.01 * step + 0.01 * seed,
                    "best_at_k": 0.5,
                    "greedy_em": 0.4,
                    "k": 4,
                    "num_questions": 20,
                }
            )
        groups.append(
            {
                "group_id": f"g{step}",
                "entered_step": step,
                "initial_headroom": float(rng.uniform(0.5, 1.0)),
                "replay_count": int(rng.integers(0, 3)) if replay else 0,
            }
        )
    for name, rows in (("metrics", metrics), ("eval", evals), ("groups", groups)):
        (run_dir / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run_dir


def test_plots_from_run_dirs_are_valid_pngs(tmp_path):
    runs = [
        _write_run(tmp_path / "exp" / "headroom_drift" / "seed-1", "headroom_drift", 1),
        _write_run(tmp_path / "exp" / "headroom_drift" / "seed-2", "headroom_drift", 2),
        _write_run(tmp_path / "exp" / "replay_recency" / "seed-1", "replay_recency", 1),
        _write_run(tmp_path / "exp" / "on_policy_larger" / "seed-1", "on_policy", 1, replay=False),
    ]
    made = plot_run_dirs(runs, tmp_path / "charts")
    names = sorted(p.name for p in made)
    assert names == [
        "acceptance_rate.png",
        "heldout_vs_env_calls.png",
        "heldout_vs_wall_time.png",
        "replay_age.png",
        "replay_count_vs_headroom.png",
    ]
    for path in made:
        width, height = _png_size(path)
        assert width > 300 and height > 200
    # nothing but the charts and their index is left in the out dir (no temp files)
    assert sorted(p.name for p in (tmp_path / "charts").iterdir()) == sorted(
        [*names, "charts.json"]
    )


def test_on_policy_only_runs_skip_replay_charts(tmp_path):
    run = _write_run(tmp_path / "op" / "seed-3", "on_policy", 3, replay=False)
    made = plot_run_dirs([run], tmp_path / "charts")
    assert sorted(p.name for p in made) == ["heldout_vs_env_calls.png", "heldout_vs_wall_time.png"]


def test_labels_come_from_layout_then_config(tmp_path):
    rule = {"replay": {"rule": "on_policy"}}
    assert run_label(tmp_path / "on_policy_larger" / "seed-2", rule) == "on_policy_larger"
    assert run_label(tmp_path / "myrun", {"replay": {"rule": "drift_only"}}) == "drift_only"
    assert run_label(tmp_path / "myrun", {"arm": "headroom_drift"}) == "headroom_drift"  # before
    assert run_label(tmp_path / "myrun", {}) == "myrun"
    run = load_run(_write_run(tmp_path / "r" / "seed_7", "drift_only", 7))
    assert (run.label, run.seed, len(run.metrics), len(run.evals)) == ("r", 7, 12, 3)
    # environment episodes: step x b x G from the config, not batched HTTP requests
    assert [r["rollouts_total"] for r in run.evals] == [4 * 40, 8 * 40, 12 * 40]


def test_missing_run_dir_or_metrics_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="not found"):
        plot_run_dirs([tmp_path / "nope"], tmp_path / "charts")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"metrics\.jsonl"):
        plot_run_dirs([tmp_path / "empty"], tmp_path / "charts")


def test_nothing_to_plot_is_a_user_error(tmp_path):
    run = tmp_path / "fresh"
    run.mkdir()
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "acceptance_rate": None}) + "\n")
    with pytest.raises(UserError, match="nothing to plot"):
        plot_run_dirs([run], tmp_path / "charts")


def test_half_written_last_line_is_ignored_but_a_broken_middle_is_not(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "los')
    assert [r["step"] for r in read_jsonl(path)] == [1, 2]
    path.write_text('{"step": 1}\n{"step": \n{"step": 3}\n')
    with pytest.raises(UserError, match="line 2"):
        read_jsonl(path)


def test_plot_command_writes_charts_and_reports_missing_dirs(tmp_path):
    import typer
    from typer.testing import CliRunner

    from evaluation.cli import register

    app = typer.Typer()
    app.callback()(lambda: None)  # a group, as the root `hdr` app is
    register(app)
    run = _write_run(tmp_path / "headroom_drift" / "seed-1", "headroom_drift", 1)
    result = CliRunner().invoke(app, ["plot", str(run), "--out", str(tmp_path / "c")])
    assert result.exit_code == 0, result.output
    assert "replay_age.png" in result.output
    assert (tmp_path / "c" / "replay_age.png").read_bytes()[:8] == PNG_MAGIC
    result = CliRunner().invoke(app, ["plot", str(tmp_path / "missing"), "--out", str(tmp_path)])
    assert isinstance(result.exception, UserError)


def test_final_evaluation_is_read_beside_the_in_training_curve(tmp_path: Path) -> None:
    """The experiment's final evaluation of a run (heldout/eval.json) is what the tables
    report; the held-out charts mark it, so load_run must find it."""
    run = _write_run(tmp_path / "headroom_drift" / "seed-1", "headroom_drift", 1)
    (run / "heldout").mkdir()
    report = {"k": 5, "average": {"mean_at_k": 0.34, "best_at_k": 0.5, "greedy_em": 0.45}}
    report["datasets"] = [{"num_questions": 300}, {"num_questions": 200}]
    (run / "heldout" / "eval.json").write_text(json.dumps(report))
    loaded = load_run(run)
    assert loaded.final == {
        "mean_at_k": 0.34, "best_at_k": 0.5, "greedy_em": 0.45, "k": 5, "num_questions": 500
    }  # fmt: skip
    assert load_run(_write_run(tmp_path / "other", "on_policy", 2)).final is None
    names = {p.name for p in plot_run_dirs([run, tmp_path / "other"], tmp_path / "charts")}
    assert {"heldout_vs_env_calls.png", "heldout_vs_wall_time.png"} <= names


def test_hdr_plot_draws_a_line_per_run_and_never_counts_one_seed_twice(tmp_path):
    a = _write_run(tmp_path / "runs" / "a", "headroom_drift", 0)
    b = _write_run(tmp_path / "runs" / "b", "headroom_drift", 0)
    c = _write_run(tmp_path / "runs" / "c", "headroom_drift", 1)
    made = plot_run_dirs([a, b, c], tmp_path / "charts")
    lines = json.loads((tmp_path / "charts" / "charts.json").read_text())["lines"]
    # one line per run; the two seed-0 runs are told apart by their folders
    assert sorted(lines) == [
        "headroom_drift seed 0 [a]", "headroom_drift seed 0 [b]", "headroom_drift seed 1"
    ]  # fmt: skip
    assert all(len(runs) == 1 for runs in lines.values())
    assert {p.name for p in made} >= {"heldout_vs_env_calls.png"}


def test_the_experiment_averages_seeds_but_labels_other_settings_apart(tmp_path):
    from evaluation.plots import line_groups

    def run_with_lr(path: Path, seed: int, lr: float) -> Path:
        run = _write_run(path, "headroom_drift", seed)
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["grpo"]["lr"] = lr
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        return run

    runs = [
        load_run(run_with_lr(tmp_path / "e" / "headroom_drift" / f"seed-{s}", s, 5e-5))
        for s in (1, 2)
    ]
    other = load_run(run_with_lr(tmp_path / "lr" / "headroom_drift" / "seed-3", 3, 1e-4))
    groups = line_groups([*runs, other], per_seed=False)
    assert list(groups) == ["headroom_drift (grpo.lr=5e-05)", "headroom_drift (grpo.lr=0.0001)"]
    assert [len(v) for v in groups.values()] == [2, 1]
    # the same seed twice is never averaged as two seeds
    import shutil

    copy = shutil.copytree(runs[0].path, tmp_path / "copy" / "headroom_drift" / "seed-1")
    twice = [runs[0], load_run(copy)]
    assert [len(v) for v in line_groups(twice, per_seed=False).values()] == [1, 1]


def test_seeds_served_on_other_ports_or_logged_otherwise_are_still_one_arm(tmp_path):
    """A resumed experiment starts its server on a new port: its seeds stay one line."""
    from evaluation.plots import line_groups

    runs = []
    for seed, port in ((1, 43951), (2, 44383)):
        run = _write_run(tmp_path / "headroom_drift" / f"seed-{seed}", "headroom_drift", seed)
        config = yaml.safe_load((run / "config.yaml").read_text())
        config["retrieval"] = {"urls": [f"http://127.0.0.1:{port}"]}
        config["log"] = {"progress": seed == 1}
        (run / "config.yaml").write_text(yaml.safe_dump(config))
        runs.append(load_run(run))
    groups = line_groups(runs, per_seed=False)
    assert list(groups) == ["headroom_drift"] and len(groups["headroom_drift"]) == 2


def test_charts_replace_earlier_charts_only_with_force(tmp_path):
    run = _write_run(tmp_path / "headroom_drift" / "seed-1", "headroom_drift", 1)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="holds other files"):
        plot_run_dirs([run], tmp_path / "mine")
    plot_run_dirs([run], tmp_path / "charts")
    (tmp_path / "charts" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="--force"):
        plot_run_dirs([run], tmp_path / "charts")
    assert plot_run_dirs([run], tmp_path / "charts", force=True)
    assert (tmp_path / "charts" / "notes.txt").read_text() == "mine"  # not hdr's: untouched


def test_the_modelled_cost_chart_draws_declared_contrasts_only(tmp_path):
    from evaluation.costs import MEASURED_HERE, ModelledCostRow
    from evaluation.plots import plot_modelled_cost

    def row(rho, fraction, arm, reference, values):
        mean = float(np.mean(values))
        return ModelledCostRow(rho, fraction, 1.0, arm, reference, [1, 2], values,
                               mean, mean - 0.01, mean + 0.01)  # fmt: skip

    per_arm = [row(rho, 1.0, "headroom_drift", None, [0.4, 0.41]) for rho in (10.0, 1e3)]
    assert plot_modelled_cost(per_arm, MEASURED_HERE, tmp_path) is None  # no contrast: no chart
    contrasts = [
        row(rho, fraction, "headroom_drift", "on_policy", [0.01 * i, 0.02 * i])
        for i, rho in enumerate((10.0, 1e3, 1e5))
        for fraction in (0.5, 1.0)
    ]
    path = plot_modelled_cost(per_arm + contrasts, MEASURED_HERE, tmp_path)
    assert path == tmp_path / "contrasts_vs_modelled_cost.png"
    width, height = _png_size(path)
    assert width > 300 and height > 200
