"""`run_experiment`: data, server, SFT start, every run, summary, report and charts, in order."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from core.errors import RunInterrupted
from core.paths import EXPERIMENT, check_folder, check_output, write_json_atomic, write_text_atomic
from experiment.config import ExperimentConfig
from experiment.report import results_markdown
from experiment.runs import RunResult, final_eval, heldout_set, run_all
from experiment.server import ensure_index, serve
from experiment.sft_start import ensure_sft
from experiment.summary import ExperimentResults, machine_info, summarize
from experiment.train_configs import base_train_config, shared_train_config


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C (finally blocks run: the server is stopped)."""
    import signal

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def run_experiment(cfg: ExperimentConfig) -> Path:
    """Every step in order; returns the out dir (results.json, results.md, charts/)."""
    import httpx

    from evaluation.plots import load_run, plot_runs

    # an earlier run of the experiment is continued; anything else in the way is refused
    out = check_output(
        cfg.out_dir, EXPERIMENT, reuse=True, inputs=[cfg.data_dir, cfg.base_config], option="--out"
    )
    check_folder(cfg.data_dir, "--data-dir")  # hdr only adds its own, newly named files there
    out.mkdir(parents=True, exist_ok=True)
    log = out / "experiment.log"
    write_json_atomic(out / "experiment_config.json", cfg)
    started = time.perf_counter()
    index = ensure_index(cfg, log)
    datasets = heldout_set(cfg)
    retriever = shared_train_config(cfg).retrieval.retriever
    results: list[RunResult] = []
    try:
        with (
            sigterm_as_exit(),
            serve(index, retriever, out / "server.log", settings=cfg.server_overrides) as url,
        ):
            sft_dir = ensure_sft(cfg, url, log)
            sft_config = base_train_config(cfg, url, sft_dir, out / "sft", 0)
            sft_report = final_eval(cfg, sft_dir, sft_config, datasets, out / "sft_start")
            results = run_all(cfg, url, sft_dir, datasets)
            server_health = httpx.get(f"{url}/health", timeout=30).json()  # emulated cost totals
    except RunInterrupted as err:  # a run kept its checkpoint: the same command continues it
        message = str(err).split("; continue with")[0]
        raise RunInterrupted(f"{message}; rerun the same command to continue", err.signum) from None
    summary = summarize(results, cfg.references, sft_report, cfg)
    total_wall_time = time.perf_counter() - started
    runs = [load_run(r.run_dir, label=r.arm) for r in results]
    modelled = (summary.modelled_cost, cfg.cost_model)
    charts = plot_runs(runs, out / "charts", force=True, modelled_cost=modelled)  # its own
    record = ExperimentResults(
        **vars(summary),
        server=server_health,
        config=cfg,
        machine=machine_info(),
        total_wall_time=total_wall_time,
        sft_dir=str(sft_dir),
        server_url=url,  # stopped by now
        charts=[str(p.relative_to(out)) for p in charts],
    )
    write_json_atomic(out / "results.json", record)
    write_text_atomic(out / "results.md", results_markdown(summary, cfg, charts))
    return out
