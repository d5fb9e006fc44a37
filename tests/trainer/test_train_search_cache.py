"""The result cache never changes what is trained: `hdr train` against a server with the cache
(first cold, then again with every search already cached) and against one without it gives the
same tokens, rewards and losses, bit for bit. Only what the server billed differs."""

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest
from conftest import TINY_CPU, replay_state, same_state, tiny_overrides
from safetensors.torch import load_file
from servers import running_server

# what two identical runs may differ in: times, random group ids, and the ledger of what the
# server billed (the cache's whole point)
VARYING = ("time", "_s", "seconds", "group_ids", "billed", "cached")


def hdr(*args: str) -> list[str]:
    return [sys.executable, "-m", "hdr.cli", *args]


def rows(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def steady(row: dict) -> dict:
    """A metrics row without what may vary between identical runs."""
    return {k: v for k, v in row.items() if not any(part in k for part in VARYING)}


def example_ids(groups: list[dict]) -> list[tuple]:
    """groups.jsonl rows with each group id cut to its question's id (the rest is random)."""
    return [(g["group_id"].split("#")[0], g["entered_step"], g["replay_count"]) for g in groups]


@pytest.fixture(scope="module")
def runs(sft_policy, small_qa, small_index, tmp_path_factory):
    """Three 3-step runs: against a cached server, cold, then again in the same directory
    (the run's cache scope) with every search already cached, kept as `cold` and `warm`; and
    against an uncached server. The cached server's cache counts after each."""
    root = tmp_path_factory.mktemp("search-cache")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    counts = {}
    with (
        running_server(small_index) as cached,
        running_server(small_index, cache={"enabled": False}) as uncached,
    ):
        for name, url in (("cold", cached.url), ("warm", cached.url), ("off", uncached.url)):
            out = root / ("off" if name == "off" else "run")
            overrides = tiny_overrides(url, sft_policy, small_qa, out, "steps=3")
            command = hdr("train", "--config", str(TINY_CPU), *overrides, "--force")
            subprocess.run(command, env=env, check=True)
            counts[name] = httpx.get(f"{cached.url}/health").json()["cache"]
            if name != "off":
                shutil.copytree(out, root / name)  # the next run replaces it
    return root, counts


def test_training_with_and_without_the_cache_is_identical(runs) -> None:
    root, _ = runs
    cold = root / "cold"
    for other in (root / "warm", root / "off"):
        assert [steady(r) for r in rows(other / "metrics.jsonl")] == [
            steady(r) for r in rows(cold / "metrics.jsonl")
        ]
        assert example_ids(rows(other / "groups.jsonl")) == example_ids(rows(cold / "groups.jsonl"))
        step = "checkpoints/step-000003"
        assert same_state(replay_state(other / step), replay_state(cold / step))
        for name in ("final/model.safetensors",):
            tensors, reference = load_file(other / name), load_file(cold / name)
            assert tensors.keys() == reference.keys()
            assert all(torch_equal(tensors[k], reference[k]) for k in tensors), name
    assert any(r["loss"] for r in rows(cold / "metrics.jsonl"))  # it trained


def test_the_warm_run_was_answered_from_the_cache(runs) -> None:
    root, counts = runs
    cold, warm = counts["cold"], counts["warm"]
    assert cold["misses"] > 0
    assert warm["misses"] == cold["misses"]  # the warm run computed nothing new
    assert warm["hits"] - cold["hits"] > 0
    # and its metrics say so: every search cached, none billed; the cold run billed some
    warm_rows, cold_rows = (
        rows(root / "warm" / "metrics.jsonl"),
        rows(root / "cold" / "metrics.jsonl"),
    )
    assert all(r["cost_billed_search_calls"] == 0 for r in warm_rows)
    assert all(
        r["cost_billed_search_calls"] + r["cost_cached_search_calls"] == r["cost_search_calls"]
        for r in warm_rows + cold_rows
    )
    assert sum(r["cost_billed_search_calls"] for r in cold_rows) > 0
    last = cold_rows[-1]
    assert last["billed_search_calls_total"] == sum(
        r["cost_billed_search_calls"] for r in cold_rows
    )


def torch_equal(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a == b).all())
