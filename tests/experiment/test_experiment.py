"""The experiment: arm configs, the summary arithmetic, and (slow) `hdr experiment --quick`."""

from __future__ import annotations

import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from processes import alive, children

from core.errors import UserError
from evaluation.evaluate import DatasetResult, EvalReport
from experiment.arms import ARMS
from experiment.config import experiment_config, read_preset
from experiment.report import results_markdown
from experiment.runs import RunResult, run_order
from experiment.sft_start import ensure_policy, sft_prerequisite, sft_start_dir
from experiment.summary import run_costs, summarize
from experiment.train_configs import arm_train_config
from trainer.telemetry import StepCost

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "configs" / "tiny-cpu.yaml"
MAIN_ARMS = read_preset("main")["arms"]


def _report(correct, greedy) -> EvalReport:
    correct = np.asarray(correct)
    q, k = correct.shape
    ds = DatasetResult(
        dataset="wiki-vital",
        sources=["wiki-vital"],
        num_questions=q,
        k=k,
        mean_at_k=float(correct.mean()),
        best_at_k=float(correct.any(1).mean()),
        greedy_em=float(np.mean(greedy)),
        question_ids=[f"wiki-vital/{i}" for i in range(q)],
        correct=correct.tolist(),
        greedy=list(greedy),
        greedy_answers=[None] * q,
        env_calls=1,
        responses_sha="x",
    )
    avg = {
        "mean_at_k": ds.mean_at_k,
        "best_at_k": ds.best_at_k,
        "greedy_em": ds.greedy_em,
        "num_questions": q,
    }
    return EvalReport(
        model="m",
        k=k,
        temperature=1.0,
        greedy=True,
        seed=0,
        datasets=[ds],
        average=avg,
        env_calls=1,
        wall_time=1.0,
        gen_time=0.5,
        retrieval_time=0.1,
    )


def _metrics(steps: int, calls_per_step: int, replay: bool):
    rows, total = [], 0
    for step in range(1, steps + 1):
        total += calls_per_step
        rows.append(
            {
                "step": step,
                "env_calls": calls_per_step,
                "env_calls_total": total,
                "search_calls": 40 * calls_per_step,
                "search_calls_total": 40 * total,
                "wall_time_total": 2.0 * step,
                "time_step": 2.0,
                "time_generation": 1.0,
                "time_retrieval": 0.2,
                "time_scoring": 0.3,
                "time_selection": 0.1 if replay else 0.0,
                "time_update": 0.3,
                "replayed_groups": 2 if replay else 0,
                "acceptance_rate": 0.5 if replay else None,
                "fresh_tokens": 100,
                "replay_tokens": 50 if replay else 0,
                **StepCost(
                    prompt_tokens=400,
                    generated_tokens=100,
                    behaviour_tf_tokens=500,
                    scan_tf_tokens=300 if replay else 0,
                    update_tf_tokens=700,
                    fresh_groups=8,
                    search_calls=40 * calls_per_step,
                    billed_search_calls=30 * calls_per_step,  # a quarter its own repeats
                    cached_search_calls=10 * calls_per_step,
                    env_requests=calls_per_step,
                    passages=120,
                    update_groups=10 if replay else 8,
                    informative_groups=6 if replay else 4,
                    replayed_groups=2 if replay else 0,
                    scanned_groups=4 if replay else 0,
                    cpu_rollout_s=1.0,
                    cpu_update_s=0.5,
                ).record(),
            }
        )
    return rows


def test_summary_pairs_arms_on_the_same_questions(tmp_path):
    # 4 questions, k=2. Reference arm: seed means 0.25 and 0.5; arm: 0.5 and 0.75.
    ref = [
        _report([[1, 0], [0, 0], [0, 0], [1, 0]], [1, 0, 0, 0]),
        _report([[1, 1], [0, 0], [1, 0], [1, 0]], [1, 0, 1, 0]),
    ]
    arm = [
        _report([[1, 1], [1, 0], [0, 0], [1, 0]], [1, 1, 0, 0]),
        _report([[1, 1], [1, 1], [1, 0], [1, 0]], [1, 1, 1, 1]),
    ]
    results = [
        RunResult("on_policy_larger", s, tmp_path / f"r{s}", ref[i], _metrics(3, 1, False), 60)
        for i, s in enumerate((1, 2))
    ] + [
        RunResult("headroom_drift", s, tmp_path / f"h{s}", arm[i], _metrics(3, 1, True), 40)
        for i, s in enumerate((1, 2))
    ]
    summary = summarize(results, ["on_policy_larger"])
    hd = summary.arms["headroom_drift"]
    assert hd.mean_at_k.mean == pytest.approx((0.5 + 0.75) / 2)
    assert hd.mean_at_k.std == pytest.approx(np.std([0.5, 0.75], ddof=1))
    d = hd.diffs["on_policy_larger"].mean_at_k
    # seed-averaged per question: arm [1, .75, .25, .5], ref [.75, 0, .25, .5]
    per_q = np.array([0.25, 0.75, 0.0, 0.0])
    assert d.diff == pytest.approx(per_q.mean())
    assert d.se == pytest.approx(per_q.std(ddof=1) / 2)
    assert d.per_seed == [pytest.approx(0.25), pytest.approx(0.25)]
    g = hd.diffs["on_policy_larger"].greedy_em
    assert g.diff == pytest.approx((0.5 + 1.0) / 2 - (0.25 + 0.5) / 2)
    assert "on_policy_larger" not in summary.arms["on_policy_larger"].diffs
    costs = hd.costs
    assert costs["env_calls"].mean == 3 and costs["rollouts"].mean == 3 * 40
    assert costs["search_calls"].mean == 3 * 40
    assert costs["wall_time"].mean == 6.0
    assert costs["step_time_mean"].mean == 2.0
    assert costs["time_other"].mean == pytest.approx(3 * (2.0 - 1.9))
    assert summary.arms["on_policy_larger"].costs["rollouts"].mean == 3 * 60

    cfg = experiment_config(
        arms=["on_policy_larger", "headroom_drift"], references=["on_policy_larger"], seeds=[1, 2]
    )
    md = results_markdown(summary, cfg)
    assert "| headroom_drift | 2 | 0.625 ± 0.177 |" in md
    # per-seed differences 0.25 and 0.25: a seed t-interval of width 0; the crossed interval
    # also carries the question effects, which vary
    stats = hd.seed_stats["on_policy_larger"].mean_at_k
    assert stats.seeds == [1, 2] and stats.seed_t.low == pytest.approx(0.25)
    assert stats.crossed.low < 0.25 < stats.crossed.high
    assert "| headroom_drift | on_policy_larger | 2 | +0.250 [" in md
    assert "<br>seed t [+0.250, +0.250]" in md
    # the ledger: fresh groups, generated/behaviour/scan/update tokens (k), search calls, of
    # them billed (the server computed them), env requests, passages,
    # informative/update groups per step, replayed/scanned, CPU minutes
    assert (
        "| headroom_drift | 24 | 0.3 | 1.5 | 0.9 | 2.1 | 120 | 90 | 3 | 360 | 6.0 / 10.0 | 6 / 12 "
        "| 0.1 |" in md
    )
    assert hd.costs["cost_cpu_s"].mean == pytest.approx(4.5)


def test_summary_refuses_runs_on_different_questions(tmp_path):
    a = _report([[1], [0]], [1, 0])
    b = _report([[1], [0]], [1, 0])
    b.datasets[0].question_ids = ["wiki-vital/9", "wiki-vital/1"]
    results = [
        RunResult("on_policy", 1, tmp_path, a, _metrics(1, 1, False), 4),
        RunResult("headroom_drift", 1, tmp_path, b, _metrics(1, 1, True), 4),
    ]
    with pytest.raises(UserError, match="other questions"):
        summarize(results, [])


def test_each_pair_of_arms_is_compared_once(tmp_path):
    rep = _report([[1], [0]], [1, 0])
    names = ["on_policy", "on_policy_larger", "replay_recency", "headroom_drift"]
    results = [RunResult(n, 1, tmp_path, rep, _metrics(1, 1, False), 4) for n in names]
    summary = summarize(results, ["on_policy_larger", "replay_recency"])
    pairs = [(n, ref) for n, a in summary.arms.items() for ref in a.diffs]
    assert pairs == [
        ("on_policy", "on_policy_larger"),
        ("on_policy", "replay_recency"),
        ("replay_recency", "on_policy_larger"),
        ("headroom_drift", "on_policy_larger"),
        ("headroom_drift", "replay_recency"),
    ]


def test_run_costs_without_replay_has_no_acceptance():
    costs = run_costs(_metrics(2, 5, replay=False), 12)
    assert costs["env_calls"] == 10 and costs["rollouts"] == 24 and costs["replayed_groups"] == 0
    assert math.isnan(costs["acceptance_rate_mean"])


def test_arm_configs_share_everything_but_the_arm(tmp_path):
    cfg = experiment_config(
        train={"grpo": {"batch_prompts": 8}}, replay_ratio=0.5, base_config=str(BASE)
    )
    args = ("http://127.0.0.1:9", tmp_path / "sft", tmp_path / "run", 3)
    configs = {name: arm_train_config(cfg, ARMS.get(name), *args) for name in ARMS.names()}
    assert configs["on_policy"].grpo.batch_prompts == 8
    assert configs["on_policy_larger"].grpo.batch_prompts == 12
    assert not configs["on_policy"].replays and not configs["on_policy_larger"].replays
    for name in ("replay_recency", "headroom_drift", "headroom_only", "drift_only"):
        c = configs[name]
        assert (c.replay.rule, c.grpo.batch_prompts, c.replay.budget) == (name, 8, 4)
    l1 = configs["headroom_drift_l1"]
    assert l1.replay.tau == pytest.approx(math.sqrt(configs["headroom_drift"].replay.tau))
    for c in configs.values():
        assert (c.seed, c.model.path, c.retrieval.urls) == (3, str(tmp_path / "sft"), [args[0]])
        assert c.retrieval.retriever == "bm25" and c.steps == read_preset("main")["train"]["steps"]


def test_presets_and_errors():
    assert experiment_config().arms == MAIN_ARMS
    abl = experiment_config("ablations")
    assert abl.arms == read_preset("ablations")["arms"] and abl.references == ["headroom_drift"]
    quick = experiment_config(quick=True, overrides=["seeds=[5]"])
    assert quick.train["steps"] < experiment_config().train["steps"] and quick.seeds == [5]
    with pytest.raises(UserError, match="unknown experiment arm"):
        experiment_config(arms=["on_policy", "bogus"])
    with pytest.raises(UserError, match="reference"):
        experiment_config(arms=["on_policy"], references=["replay_recency"])
    with pytest.raises(UserError, match="nope"):
        experiment_config(overrides=["nope=1"])


def test_a_non_default_policy_is_built_once_under_its_own_name(tmp_path):
    """The demo's smaller policy must not overwrite (or be mistaken for) the experiment's."""
    from transformers import AutoConfig

    demo = experiment_config("demo")
    assert (demo.policy.hidden_size, demo.policy.intermediate_size) == (64, 256)
    cfg = experiment_config(
        data_dir=str(tmp_path), overrides=["policy.hidden_size=32", "policy.num_layers=1"]
    )
    path = ensure_policy(cfg)
    assert path.parent == tmp_path and path.name.startswith("tiny-policy-")
    built = AutoConfig.from_pretrained(path)
    assert (built.hidden_size, built.num_hidden_layers, built.intermediate_size) == (32, 1, 512)
    stamp = (path / "config.json").stat().st_mtime_ns
    assert ensure_policy(cfg) == path and (path / "config.json").stat().st_mtime_ns == stamp
    assert ensure_policy(experiment_config(data_dir=str(tmp_path))) == tmp_path / "tiny-policy"


def test_a_pretrained_init_model_names_the_start_and_is_its_identity(tmp_path):
    """An SFT start trained from a pretrained model (SmolLM2) is cached under that model's
    name, and its identity is what the model is (the file it was converted from), not where
    or when it was written."""
    import shutil

    from experiment.sft_start import init_identity, model_identity

    model = tmp_path / "smollm2"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "config.json").write_text("{}")
    cfg = experiment_config(data_dir=str(tmp_path), overrides=["init_model=smollm2"])
    assert ensure_policy(cfg) == model  # a model folder there: used as it is
    assert sft_start_dir(cfg).name.startswith("smollm2-sft")
    identity = init_identity(cfg, model)
    assert identity["init_model"] == {"smollm2": model_identity(model)}
    assert "policy" not in identity
    copy = tmp_path / "copy"
    shutil.copytree(model, copy)
    assert model_identity(copy) == model_identity(model)  # same weights, another folder
    (copy / "model.safetensors").write_bytes(b"other weights")
    assert model_identity(copy) != model_identity(model)
    (model / "hdr_source.json").write_text('{"gguf_sha256": "abc"}')
    assert model_identity(model) == "abc"  # converted: the source file's hash


def test_sft_starts_of_different_tasks_or_settings_get_different_names(tmp_path):
    """A wiki-vital start must never be reused for the bridge task (or the other way round)."""
    vital = experiment_config(data_dir=str(tmp_path))
    assert sft_start_dir(vital) == tmp_path / "tiny-sft"
    vital_12 = sft_start_dir(experiment_config(data_dir=str(tmp_path), sft_epochs=12))
    bridge = sft_start_dir(experiment_config("bridge", data_dir=str(tmp_path)))
    assert bridge.name == "tiny-sft-wiki-bridge-e3-from-wiki-vital"
    assert vital_12.name == "tiny-sft-e12"
    demo = sft_start_dir(experiment_config("demo", data_dir=str(tmp_path)))
    assert len({sft_start_dir(vital), vital_12, bridge, demo}) == 4


def test_the_bridge_start_is_fine_tuned_from_the_default_wiki_vital_start(tmp_path):
    """Its prerequisite is wiki-vital on the defaults: not the bridge's turns or prompt."""
    bridge = experiment_config("bridge", data_dir=str(tmp_path), out_dir=str(tmp_path / "o"))
    first = sft_prerequisite(bridge)
    assert first is not None and sft_prerequisite(first) is None
    assert sft_start_dir(first) == sft_start_dir(experiment_config(data_dir=str(tmp_path)))
    assert first.train == {
        "retrieval": {"retriever": "bm25"}
    }  # the server's, nothing of the bridge's
    assert first.server_overrides == []
    assert (first.policy, first.out_dir) == (bridge.policy, bridge.out_dir)


@pytest.mark.slow
def test_quick_experiment_end_to_end(tmp_path):
    """`hdr experiment --quick`: corpus, index, server, SFT, every main arm x 2 seeds, eval,
    results and charts, through the real entry point."""
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "hdr.cli",
        "experiment",
        "--quick",
        "--data-dir",
        str(tmp_path / "data"),
        "--out",
        str(out),
        "--config",
        str(BASE),
        "progress=false",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=3600)
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert list(results["arms"]) == MAIN_ARMS
    for name, arm in results["arms"].items():
        assert arm["seeds"] == [1, 2]
        assert 0.0 <= arm["mean_at_k"]["mean"] <= arm["best_at_k"]["mean"] <= 1.0
        assert arm["costs"]["env_calls"]["mean"] > 0
        if name not in ("on_policy_larger",):
            assert "on_policy_larger" in arm["diffs"]
    larger = results["arms"]["on_policy_larger"]["costs"]["fresh_tokens"]["mean"]
    assert larger > results["arms"]["on_policy"]["costs"]["fresh_tokens"]["mean"]
    assert results["arms"]["headroom_drift"]["costs"]["replayed_groups"]["mean"] >= 0
    assert results["arms"]["replay_recency"]["costs"]["replayed_groups"]["mean"] > 0
    md = (out / "results.md").read_text()
    assert "Δ Mean@" in md and "headroom_drift" in md
    for chart in ("heldout_vs_env_calls.png", "heldout_vs_wall_time.png", "replay_age.png"):
        assert (out / "charts" / chart).read_bytes()[:4] == b"\x89PNG"
    # the server subprocess was stopped: its port no longer answers
    import httpx

    with pytest.raises(httpx.TransportError):
        httpx.get(results["server_url"] + "/health", timeout=5)
    # the runs' exported evidence, copied into a new out dir (another session's machine keeps
    # the data dir's cached SFT start, not the run folders): every run is taken as finished,
    # none is trained again, and the tables come out the same
    evidence = tmp_path / "evidence"
    exported = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "report", "--from", str(out), "--export", str(evidence)],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert exported.returncode == 0, exported.stderr[-3000:]
    assert list(evidence.glob("runs/*/seed-*/config_hash.json"))
    carried_out = tmp_path / "carried"
    shutil.copytree(evidence, carried_out)
    again = subprocess.run(
        [*cmd[: cmd.index("--out") + 1], str(carried_out), *cmd[cmd.index("--out") + 2 :]],
        capture_output=True, text=True, cwd=REPO, timeout=3600,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "experiment: training" not in again.stderr
    assert not list(carried_out.glob("runs/*/seed-*/final"))
    rerun = json.loads((carried_out / "results.json").read_text())
    for name, arm in results["arms"].items():
        assert rerun["arms"][name]["mean_at_k"] == arm["mean_at_k"]


@pytest.mark.slow  # about 20 s of real runs; the CI budget keeps it to make test-slow
def test_an_interrupted_parallel_experiment_stops_its_runs_and_server_at_once(tmp_path):
    """SIGTERM (or Ctrl-C) while runs train in worker processes: the workers are killed, not
    asked to finish their step (which, with the server stopping, waited 300 s for retrieval
    on a multi-turn task), and nothing is left behind."""
    out, log = tmp_path / "out", tmp_path / "experiment.log"
    cmd = [sys.executable, "-m", "hdr.cli", "experiment", "--quick", "--data-dir",
           str(tmp_path / "data"), "--out", str(out), "--config", str(BASE), "progress=false",
           "jobs=2", "train.steps=500", "arms=[on_policy,replay_recency]", "references=[]",
           "seeds=[1]"]  # fmt: skip
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 900
        while not list(out.glob("runs/*/seed-1/metrics.jsonl")):  # a run is mid-training
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "no run started training"
            time.sleep(1)
        family = children(proc.pid)
        family += [grandchild for child in family for grandchild in children(child)]
        assert len(family) >= 3  # the server and two workers (and the pool's helpers)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) != 0
        time.sleep(1)
        assert [pid for pid in family if alive(pid)] == []
        assert "stopping after this step" not in log.read_text()  # no run tried to finish
    finally:
        proc.kill()


def test_bridge_preset_runs_the_multi_turn_task_against_an_emulated_api(tmp_path):
    cfg = experiment_config("bridge", base_config=str(BASE))
    assert cfg.task == "wiki-bridge" and len(cfg.seeds) >= 5 and cfg.arms == MAIN_ARMS
    assert any(s.startswith("emulated_cost.request_latency_ms=") for s in cfg.server_overrides)
    args = ("http://127.0.0.1:9", tmp_path / "sft", tmp_path / "run", 1)
    for name in cfg.arms:
        c = arm_train_config(cfg, ARMS.get(name), *args)
        assert (c.data.train, c.data.eval) == ("wiki-bridge", "wiki-bridge")
        assert c.rollout.max_turns == 2 and c.rollout.prompt.observation_suffix == ""
        assert c.replay.tau_age == cfg.train["steps"] / 4
    filtered = arm_train_config(cfg, ARMS.get("on_policy_filtered"), *args)
    assert filtered.grpo.dynamic_sampling and not filtered.replays
    quick = experiment_config("bridge", quick=True)
    assert quick.corpus_limit is None and quick.train["rollout"]["max_turns"] == 2
    assert quick.sft_from_task is None  # the quick check does not first train a full start


def test_runs_are_interleaved_so_every_arm_meets_the_same_machine():
    cfg = experiment_config(arms=["on_policy", "headroom_drift"], references=[], seeds=[1, 2])
    assert run_order(cfg) == [
        ("on_policy", 1), ("headroom_drift", 1), ("on_policy", 2), ("headroom_drift", 2)
    ]  # fmt: skip
    by_arm = cfg.model_copy(update={"schedule": "by_arm"})
    assert run_order(by_arm)[:2] == [("on_policy", 1), ("on_policy", 2)]


def _runs(tmp_path, arm: str, shift: float, seeds=(1, 2, 3), questions=40, k=4):
    """Runs of `arm` whose per-question correctness is drawn at p = 0.3 + shift."""
    rng = np.random.default_rng(abs(hash(arm)) % 2**32)
    out = []
    for s in seeds:
        correct = (rng.random((questions, k)) < 0.3 + shift).astype(int)
        report = _report(correct, correct[:, 0])
        out.append(
            RunResult(
                arm, s, tmp_path / "runs" / arm / f"seed-{s}", report, _metrics(2, 1, False), 4
            )
        )
    return out


def test_declared_contrasts_are_read_from_the_config_and_the_secondary_ones_holm_corrected(
    tmp_path,
):
    from evaluation.statistics import crossed_interval, holm

    cfg = experiment_config(
        "powered", seeds=[1, 2, 3], arms=["on_policy", "on_policy_larger", "replay_recency",
                                          "headroom_drift", "on_policy_lr0"],
    )  # fmt: skip
    results = [
        *_runs(tmp_path, "on_policy", 0.05),
        *_runs(tmp_path, "on_policy_larger", 0.06),
        *_runs(tmp_path, "replay_recency", 0.05),
        *_runs(tmp_path, "headroom_drift", 0.07),
        *_runs(tmp_path, "on_policy_lr0", 0.0),
    ]
    summary = summarize(results, cfg.references, cfg=cfg)
    got = summary.contrasts
    assert [(c.arm, c.reference, c.metric) for c in got[:2]] == [
        ("headroom_drift", "on_policy_larger", "mean_at_k"),
        ("headroom_drift", "replay_recency", "best_at_k"),
    ]
    assert all(c.primary and c.p_holm is None for c in got[:2])
    assert len(got) == len(cfg.contrasts) and not any(c.primary for c in got[2:])
    assert [c.p_holm for c in got[2:]] == pytest.approx(holm([c.p for c in got[2:]]))
    # the estimate is the paired grand mean; its interval the crossed random-effects one
    first = got[0]
    hd = {r.seed: r.report.per_question("mean") for r in results if r.arm == "headroom_drift"}
    big = {r.seed: r.report.per_question("mean") for r in results if r.arm == "on_policy_larger"}
    d = np.stack([hd[s] - big[s] for s in (1, 2, 3)])
    expected = crossed_interval(d)
    assert (first.estimate, first.low, first.high) == pytest.approx(
        (expected.estimate, expected.low, expected.high)
    )
    assert first.mde > 0 and first.method == expected.method  # its fallback, when it took one
    assert first.verdict == ("0" if expected.p >= 0.05 else "+" if d.mean() > 0 else "−")
    md = results_markdown(summary, cfg)
    assert md.index("**primary**") < md.index("Held-out:")  # the contrasts lead


def test_variants_and_contrasts_name_only_known_arms():
    cfg = experiment_config("powered")
    assert cfg.arm("on_policy_lr0").overrides == ("grpo.lr=0",)
    with pytest.raises(UserError, match="unknown experiment arm 'nope'"):
        experiment_config("powered", overrides=["contrasts=[{arm: nope, reference: on_policy}]"])
    with pytest.raises(UserError, match="not among the arms"):
        experiment_config("powered", overrides=["arms=[on_policy, headroom_drift]"])


def test_the_sft_start_of_another_split_gets_its_own_name(tmp_path):
    base = experiment_config(data_dir=tmp_path)
    disjoint = experiment_config("powered", data_dir=tmp_path)
    assert "split" not in sft_start_dir(base).name
    assert "splitsft" in sft_start_dir(disjoint).name


def test_power_from_a_pilot_dir_matches_the_components_formula(tmp_path):
    from evaluation.statistics import minimum_detectable_effect
    from experiment.power import Design, power_table

    for run in [*_runs(tmp_path, "on_policy", 0.05), *_runs(tmp_path, "headroom_drift", 0.08)]:
        (run.run_dir / "heldout").mkdir(parents=True)
        (run.run_dir / "heldout" / "eval.json").write_text(run.report.model_dump_json())
    start = _report(np.zeros((40, 4), dtype=int), [0] * 40)
    (tmp_path / "sft_start").mkdir()
    (tmp_path / "sft_start" / "eval.json").write_text(start.model_dump_json())
    designs = [Design(5, 40, 4), Design(8, 400, 8)]
    rows, notes = power_table(
        [tmp_path], designs, [("headroom_drift", "on_policy", "mean_at_k", True)]
    )
    (row,) = rows
    assert row.source == "paired"
    for d in designs:
        assert row.mde[d] == pytest.approx(
            minimum_detectable_effect(row.parts, d.seeds, d.questions, d.k)
        )
    assert row.mde[designs[1]] < row.mde[designs[0]]  # more seeds, questions and samples
    # go/no-go: every pilot run's gain over the (all-wrong) SFT start against 3 x MDE
    assert len(notes) == 6 and all("GO" in n for n in notes)
    # one arm only: the proxy from that arm's own seeds
    rows, _ = power_table(
        [tmp_path], designs[:1], [("replay_recency", "on_policy", "mean_at_k", True)]
    )
    assert rows[0].source == "proxy: on_policy's 3 seeds" and rows[0].parts.question == 0.0


def test_quality_at_matched_cost_reads_each_seed_off_its_curve(tmp_path):
    from experiment.summary import matched_cost

    cfg = experiment_config(
        arms=["on_policy", "headroom_drift"],
        references=[],
        budget_fractions=[0.5, 1.0],
        contrasts=[{"arm": "headroom_drift", "reference": "on_policy"}],
    )
    results = []
    for arm, end in (("on_policy", 0.4), ("headroom_drift", 0.3)):
        for seed, lift in ((1, 0.0), (2, 0.02)):
            run = _runs(tmp_path, arm, 0.0, seeds=(seed,))[0]
            run.run_dir.mkdir(parents=True)
            rows = [{"step": 0, "mean_at_k": 0.2 + lift}, {"step": 2, "mean_at_k": end + lift}]
            (run.run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            results.append(run)
    arms = {"on_policy": results[:2], "headroom_drift": results[2:]}
    rows = {(r.axis, r.budget, r.arm): r for r in matched_cost(arms, cfg) if not r.reference}
    paired = [r for r in matched_cost(arms, cfg) if r.reference == "on_policy"]
    half_paired = next(r for r in paired if r.axis == "generated_tokens" and r.budget == 100.0)
    # headroom_drift 0.25 (+lift) against on_policy 0.30 (+lift), seed by seed
    assert half_paired.per_seed == pytest.approx([-0.05, -0.05]) and half_paired.seeds == [1, 2]
    # 100 generated tokens a step (_metrics): 200 reached; half of it is step 1 of 2
    half = rows["generated_tokens", 100.0, "on_policy"]
    assert half.per_seed == pytest.approx([0.3, 0.32])
    assert half.estimate == pytest.approx(0.31) and half.low < 0.31 < half.high
    assert rows["generated_tokens", 200.0, "headroom_drift"].per_seed == pytest.approx([0.3, 0.32])
    assert {axis for axis, _, _ in rows} == {
        "generated_tokens", "env_requests", "cpu_seconds", "wall_seconds"
    }  # fmt: skip


def test_the_rise_over_the_start_is_the_paired_difference_with_its_interval(tmp_path):
    from experiment.report import rise_lines

    start_correct = np.zeros((40, 4), dtype=int)
    start_correct[:8] = 1  # the start answers 8 of 40 questions, always
    start = _report(start_correct, [1] * 8 + [0] * 32)
    learned = _runs(tmp_path, "headroom_drift", 0.4)  # p = 0.7 a sample
    unchanged = [
        RunResult("on_policy", s, tmp_path / f"op-{s}", start, _metrics(2, 1, False), 4)
        for s in (1, 2, 3)
    ]
    summary = summarize([*learned, *unchanged], [], sft_report=start)
    rise = summary.rise["headroom_drift"].mean_at_k
    mine = np.mean([r.report.per_question("mean") for r in learned], axis=0)
    assert rise.diff == pytest.approx(mine.mean() - 0.2)
    assert rise.diff - 1.96 * rise.se > 0  # a rise far above the noise
    same = summary.rise["on_policy"].mean_at_k
    assert same.diff == 0 and same.se == 0
    md = "\n".join(rise_lines(summary))
    assert f"| headroom_drift | {rise.diff:+.3f} [" in md and "| on_policy | +0.000 [+0.000" in md
    # without the start's evaluation there is nothing to rise over
    assert summarize(learned, []).rise == {} and rise_lines(summarize(learned, [])) == []
