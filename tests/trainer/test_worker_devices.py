"""Where asynchronous rollout workers run (trainer/async_rollout/devices.py,
`async_rollout.devices`): the device map read from the config, applied in each worker's own
process (it sees its one GPU: CUDA_VISIBLE_DEVICES), vLLM engines sharing a GPU started one at
a time, and the map refused in one line where it cannot be honoured. The engines are
tests/fakes/vllm (vLLM 0.31 on CUDA, recorded): this machine has no GPU, so what each worker's
engine was built under is what can be checked; the workers themselves are real processes with
the tiny policy, a real retrieval server and the small task.
"""

from __future__ import annotations

import json
import multiprocessing
import os

import pytest
from conftest import TINY_CPU, tiny_overrides

from core.config import load_config
from core.errors import UserError
from trainer.async_rollout.devices import place_worker, shared_vllm_gpus, worker_placement
from trainer.config import TrainConfig


def async_config(url, model, qa, out, *extra: str) -> TrainConfig:
    overrides = tiny_overrides(url, model, qa, out, "steps=2", "eval.every=0", *extra)
    return load_config(TrainConfig, TINY_CPU, overrides)


def bare(*extra: str) -> TrainConfig:
    """A config with `extra` settings and no server, model or data behind it."""
    return load_config(TrainConfig, TINY_CPU, ["model.path=unused", *extra])


def test_each_worker_sees_the_gpu_the_map_names_among_those_this_process_sees():
    hf = bare("async_rollout.workers=3", "async_rollout.devices=[cuda:1,cuda:3,cpu]")
    # CUDA_VISIBLE_DEVICES unset: GPU N is N; set: the N-th one listed
    assert worker_placement(hf, 0, None) == ("1", "cuda:0")
    assert worker_placement(hf, 1, "4,5,6,7") == ("7", "cuda:0")
    assert worker_placement(hf, 2, "4,5,6,7") == ("", "cpu")  # a cpu entry sees no GPU
    with pytest.raises(UserError, match="maps worker 1 to cuda:3, but this process sees 2"):
        worker_placement(hf, 1, "4,5")
    # a vLLM worker's engine takes the GPU; its module (the copy new weights pass through)
    # stays on the CPU
    vllm = bare("generation.backend=vllm", "async_rollout.workers=2",
                "async_rollout.devices=[cuda:2,cuda]")  # fmt: skip
    assert worker_placement(vllm, 0, None) == ("2", "cpu")
    assert worker_placement(vllm, 1, "3,1") == ("3", "cpu")  # `cuda` is the first one
    # no map: every worker on model.device (here the CPU), as before
    assert worker_placement(bare("async_rollout.workers=2"), 1, None) == (None, "cpu")


def test_engines_sharing_a_gpu_start_one_at_a_time():
    shared = ["generation.backend=vllm", "async_rollout.workers=2"]
    assert shared_vllm_gpus(bare(*shared, "async_rollout.devices=[cuda:1,cuda:1]"))
    assert shared_vllm_gpus(bare(*shared, "model.device=cuda:0"))  # both on model.device
    assert not shared_vllm_gpus(bare(*shared, "async_rollout.devices=[cuda:1,cuda:2]"))
    assert not shared_vllm_gpus(bare("async_rollout.workers=2", "model.device=cuda:0"))  # hf


@pytest.mark.parametrize(
    "setting, message",
    [
        ("async_rollout.devices=[cuda:1]", "one async_rollout.devices entry per worker (2), not 1"),
        ("async_rollout.devices=[gpu1,cpu]", "'gpu1' is not cpu, cuda or cuda:N"),
    ],
)
def test_a_bad_map_is_one_line_at_config_load(setting, message, tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "hdr.cli", "plan-memory", "--config", str(TINY_CPU),
         "--gpu-gb", "80", "model.path=unused", "async_rollout.workers=2", setting],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("hdr: error: ") and message in line, line


def _placed(config: TrainConfig, index: int, out) -> None:
    placed = place_worker(config, index)
    out.put((os.environ.get("CUDA_VISIBLE_DEVICES"), placed.model.device,
             placed.generation.device))  # fmt: skip


def test_a_worker_process_restricts_itself_to_its_gpu():
    """`place_worker`, which `worker_main` runs first, in a process of its own as a worker's:
    it narrows the inherited CUDA_VISIBLE_DEVICES to its GPU and moves its module there (an
    hf worker: `cuda:0` is now that GPU)."""
    ctx = multiprocessing.get_context("spawn")
    config = bare("async_rollout.workers=2", "async_rollout.devices=[cuda:0,cuda:1]")
    out = ctx.Queue()
    os.environ["CUDA_VISIBLE_DEVICES"] = "4,5"
    try:
        proc = ctx.Process(target=_placed, args=(config, 1, out))
        proc.start()
        proc.join(timeout=120)
    finally:
        del os.environ["CUDA_VISIBLE_DEVICES"]
    assert proc.exitcode == 0
    assert out.get(timeout=10) == ("5", "cuda:0", "cuda:0")


@pytest.mark.parametrize(
    "devices, one_at_a_time",
    [("[cuda:1,cuda:1]", True), ("[cuda:1,cuda:2]", False)],
    ids=["shared-gpu", "a-gpu-each"],
)
def test_vllm_workers_build_their_engines_on_their_gpus(
    devices, one_at_a_time, fake_vllm, tiny_policy, small_qa, retrieval_url, tmp_path,
    monkeypatch,
):  # fmt: skip
    """Two rollout workers with (fake) vLLM engines: each engine is built in its worker's
    process under CUDA_VISIBLE_DEVICES = the GPU the map names, on that process's cuda:0 (the
    uniprocess executor's device); where both share a GPU the second worker is started only
    once the first reported ready (its engine built)."""
    from agent_env.retrieval_client import connect
    from trainer.async_rollout.workers import RolloutWorkers
    from trainer.run import load_policy

    monkeypatch.setenv("FAKE_VLLM_LOG", str(tmp_path / "engines"))
    (tmp_path / "engines").mkdir()
    config = async_config(
        retrieval_url, tiny_policy, small_qa, tmp_path / "run", "generation.backend=vllm",
        "async_rollout.workers=2", "async_rollout.split=shards", "distributed.rollout_shards=2",
        f"async_rollout.devices={devices}", "async_rollout.worker_threads=1",
    )  # fmt: skip
    model, _ = load_policy(config.model.path, config)
    client = connect(config.retrieval, seed=0)
    # what RolloutWorkers.start reads of a run: its config, its weights, its client's counters
    run = type("RunHandle", (), {"config": config, "model": model, "client": client})()
    try:
        workers = RolloutWorkers.start(run, start=1)
        ready, spawned = dict(workers.ready_at), dict(workers.spawned_at)
        workers.close()
    finally:
        client.close()
    engines = [json.loads(p.read_text()) for p in sorted((tmp_path / "engines").glob("*.json"))]
    assert len(engines) == 2
    wanted = devices.strip("[]").replace("cuda:", "").split(",")
    assert sorted(e["env"]["CUDA_VISIBLE_DEVICES"] for e in engines) == sorted(wanted)
    assert all(e["device"] == "cuda:0" for e in engines)
    assert (spawned[1] >= ready[0]) == one_at_a_time
