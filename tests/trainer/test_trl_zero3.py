"""hdr's scoring inside TRL on two processes under accelerate + DeepSpeed ZeRO-3 (CPU, gloo).

The DeepSpeed settings are configs/trl/accelerate-zero3.yaml's (stage 3, no offload, zero.Init,
16-bit save) with the sizes scaled to a tiny model: `stage3_param_persistence_threshold`,
`stage3_max_reuse_distance` and `stage3_prefetch_bucket_size` 0, so that ZeRO-3 gathers every
module's weights at each call as it must for a 3B model (below those sizes it keeps a tiny
model's weights whole and hides the gathers), and fp32 instead of bf16 on the CPU. accelerate
reads them from the environment `accelerate launch --config_file` sets.

Defect 1 of the TRL review: each process scores its own fresh rows, and the output layer runs
in slices of `HEAD_SLICE` positions, so responses of ~60 tokens on one process and ~700 on the
other made 2 against 22 output-layer calls: ZeRO-3's per-call gathers no longer paired up and
the processes hung or failed. Now every process runs as many forwards and slices as the
busiest one.
"""

from __future__ import annotations

import faulthandler
import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
import yaml
from conftest import replay_state
from servers import free_port

pytest.importorskip("deepspeed")
pytest.importorskip("trl")

TIMEOUT_S = 240  # a hang guard: a loaded 2-core machine needs a minute to start two ranks
RESPONSE_TOKENS = (60, 700)  # per process
G = 8


def ds_config() -> dict:
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "none"},
            "offload_param": {"device": "none"},
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": 0,
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        },
        "bf16": {"enabled": False},
        "fp16": {"enabled": False},
        "steps_per_print": 1_000_000,
    }


def accelerate_env(rank: int, world: int, port: int, ds_json: Path) -> dict[str, str]:
    """What `accelerate launch --config_file` (DeepSpeed, zero3_init_flag) sets per process."""
    return {
        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
        "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(world),
        "ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_CONFIG_FILE": str(ds_json),
        "ACCELERATE_DEEPSPEED_ZERO3_INIT": "true", "ACCELERATE_MIXED_PRECISION": "no",
        "OMP_NUM_THREADS": "1",
    }  # fmt: skip


def tiny_model(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=1024,
        tie_word_embeddings=True,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def scored_groups(model, ids, attn, mask, rewards, advantages, names, agree=None) -> list:
    """Groups of rows as the TRL trainer makes them: behaviour log-probs under `model` (`agree`:
    each process's forwards paired for ZeRO-3), step 1, chunks of 4 rows."""
    from headroom_drift import GroupTensors
    from trainer.scoring import behaviour_logprobs, groups_of_rows

    lp, _, _ = behaviour_logprobs(model, ids, attn, mask, 4, 1.0, agree=agree)
    rows = GroupTensors(ids, attn, mask, lp, rewards.flatten(), advantages.flatten())
    return groups_of_rows(rows, 1, names)


def fresh_rows(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Two groups of G rows: a 12-token prompt, then RESPONSE_TOKENS[rank] policy tokens."""
    g = torch.Generator().manual_seed(100 + rank)
    P, C = 12, RESPONSE_TOKENS[rank]
    ids = torch.randint(3, 64, (2 * G, P + C), generator=g)
    attn = torch.ones_like(ids)
    mask = torch.zeros(2 * G, P + C)
    mask[:, P:] = 1
    return ids, attn, mask


def _zero3_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(accelerate_env(rank, world, port, Path(out_dir) / "ds.json"))
    torch.set_num_threads(1)
    from accelerate import Accelerator

    from trainer.integrations.accelerate_cpu import allow_deepspeed_on_cpu_processes
    from trainer.integrations.trl_processes import zero3_call_agreement

    assert allow_deepspeed_on_cpu_processes()
    accelerator = Accelerator()
    assert accelerator.num_processes == world and accelerator.distributed_type == "DEEPSPEED"
    reference = tiny_model()
    ids, attn, mask = fresh_rows(rank)
    rewards = torch.tensor([[1.0, 0.0] * (G // 2)] * 2)
    names = [f"s1/{rank}/{k}" for k in range(2)]
    with torch.no_grad():
        expected = scored_groups(reference, ids, attn, mask, rewards, rewards, names)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, optimizer = accelerator.prepare(model, optimizer)
    sharded = accelerator.unwrap_model(engine)
    assert all(p.numel() == 0 for p in sharded.parameters())  # ZeRO-3 holds shards only
    started = time.perf_counter()
    with torch.no_grad():
        fresh = scored_groups(
            sharded, ids, attn, mask, rewards, rewards, names, zero3_call_agreement(accelerator)
        )
    total = accelerator.reduce(torch.tensor([float(len(fresh))]), reduction="sum")
    worst = max(
        float((a.gen_logprobs - b.gen_logprobs).abs().max())
        for a, b in zip(fresh, expected, strict=True)
    )
    Path(out_dir, f"rank-{rank}.json").write_text(
        json.dumps({"groups": float(total), "worst": worst, "s": time.perf_counter() - started})
    )
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _ranked(rank: int, worker, *args) -> None:
    """A rank that hangs prints every thread's Python stack to stderr before it is killed."""
    faulthandler.dump_traceback_later(TIMEOUT_S - 15)
    worker(rank, *args)


def run_ranks(worker, out: Path, *args, nprocs: int = 2) -> None:
    """`worker(rank, nprocs, port, out, *args)` on spawned ranks, killed after TIMEOUT_S (as
    test_distributed's run_ranks)."""
    ctx = mp.start_processes(
        _ranked, args=(worker, nprocs, free_port(), str(out), *args), nprocs=nprocs, join=False,
        start_method="spawn",
    )  # fmt: skip
    deadline = time.monotonic() + TIMEOUT_S
    while not ctx.join(timeout=max(deadline - time.monotonic(), 0)):
        if time.monotonic() >= deadline:
            alive = [rank for rank, p in enumerate(ctx.processes) if p.is_alive()]
            for rank in alive:
                ctx.processes[rank].kill()
            raise AssertionError(f"rank(s) {alive} did not finish within {TIMEOUT_S} s")


@pytest.mark.slow
def test_zero3_scoring_of_uneven_responses_pairs_every_gather(tmp_path):
    """60 against 700 response tokens per process: both finish, with the log-probs of the
    unsharded model (defect 1; before the fix the processes hung in ZeRO-3's gathers)."""
    (tmp_path / "ds.json").write_text(json.dumps(ds_config()))
    run_ranks(_zero3_worker, tmp_path)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    assert [r["groups"] for r in ranks] == [4.0, 4.0]
    assert all(r["worst"] < 1e-5 for r in ranks), ranks


# --- the whole `hdr trl-train` under accelerate launch + ZeRO-3, killed and resumed ---------

REPO = Path(__file__).resolve().parents[2]
ENTRY = Path(__file__).with_name("trl_per_process.py")
RUN_TIMEOUT_S = 240  # a hang guard per launch (stacks printed first); ~45 s each on 2 busy cores


def accelerate_config(tmp: Path) -> Path:
    """configs/trl/accelerate-zero3.yaml with only the sizes and the device changed: 2
    processes, no GPU ids, and its DeepSpeed keys (stage 3, no offload, zero.Init, 16-bit save)
    moved into a DeepSpeed file beside the persistence threshold 0 (accelerate takes one or
    the other); bf16 becomes fp32 on the CPU, batch sizes "auto" from TRL's arguments."""
    config = yaml.safe_load((REPO / "configs" / "trl" / "accelerate-zero3.yaml").read_text())
    ds = config.pop("deepspeed_config")
    assert ds["zero_stage"] == 3 and ds["offload_param_device"] == "none"
    assert ds["offload_optimizer_device"] == "none" and ds["zero3_save_16bit_model"]
    zero = {
        **ds_config()["zero_optimization"],
        "stage3_gather_16bit_weights_on_model_save": ds["zero3_save_16bit_model"],
    }
    ds_json = tmp / "ds-auto.json"
    ds_json.write_text(json.dumps({
        **ds_config(), "zero_optimization": zero, "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    }))  # fmt: skip
    config["deepspeed_config"] = {
        "deepspeed_config_file": str(ds_json), "zero3_init_flag": ds["zero3_init_flag"],
        "deepspeed_multinode_launcher": ds["deepspeed_multinode_launcher"],
    }  # fmt: skip
    config.pop("mixed_precision")  # in the DeepSpeed file (fp32 here)
    config.pop("gpu_ids")
    config["num_processes"] = 2
    path = tmp / "accelerate.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def launch(command: list[str], env: dict, log: Path):
    import subprocess

    return subprocess.Popen(command, cwd=REPO, env=env, stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip


def finish(proc, log: Path, timeout: float = RUN_TIMEOUT_S) -> int:
    """The launcher's exit code; past `timeout` every rank prints its stacks and the test
    fails with the log's end."""
    import subprocess

    from processes import dump_stacks_and_kill

    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        dump_stacks_and_kill(proc.pid)
        proc.wait()
        stacks = log.read_text()[-8000:]
        raise AssertionError(f"hung past {timeout} s; stacks:\n{stacks}") from None


def test_trl_train_under_zero3_replays_uneven_ranks_and_resumes_after_a_kill(
    sft_policy, small_qa, retrieval_url, tmp_path
):
    """`accelerate launch` (the 8-GPU recipe's settings, 2 CPU processes) of `hdr trl-train`:
    rank 1's responses ~10x rank 0's; Headroom-Drift Replay replays; rank 1 is SIGKILLed after
    checkpoint-2, and `--resume last` continues at step 3 with the checkpoint's buffer."""
    import signal
    import sys

    from processes import cmdline, descendants, environ

    from trainer.scoring import HEAD_SLICE

    out = tmp_path / "trl"
    config = {
        "model": str(sft_policy), "data": {"train": str(small_qa)}, "max_questions": 16,
        "retrieval": {"urls": [retrieval_url], "topk": 2, "retriever": "bm25"},
        "rollout": {
            "prompt": {
                "template": "Question: {question}\n", "chat_template": False,
                "response_prefix": "<search>", "observation_suffix": "<answer>",
            },
            "max_turns": 1, "max_tokens_per_turn": 16, "max_obs_tokens": 48, "doc_words": 6,
            "max_response_tokens": 600, "reward": "f1", "format_weight": 0.5,
            "on_failure": "keep",
        },
        "replay": {"score_chunk": 8,
                   "replay": {"rule": "headroom_drift", "budget": 2, "capacity": 8, "tau": 10.0}},
        "trl": {
            "output_dir": str(out), "seed": 0, "max_steps": 4, "learning_rate": 1.0e-3,
            "bf16": False, "gradient_checkpointing": False, "per_device_train_batch_size": 8,
            "num_generations": 4, "max_completion_length": 1024, "save_strategy": "steps",
            "save_steps": 2,
        },
    }  # fmt: skip
    run_yaml = tmp_path / "run.yaml"
    run_yaml.write_text(yaml.safe_dump(config))
    env = {
        **os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONFAULTHANDLER": "1",
        "TRL_EXPERIMENTAL_SILENCE": "1", "HDR_TEST_RANK0_ARGS": "",
        # rank 1 searches until it answers (up to 8 turns), each turn up to 300 tokens
        "HDR_TEST_RANK1_ARGS": "rollout.max_turns=8 rollout.max_tokens_per_turn=300"
        " rollout.prompt.observation_suffix='\"\"'",
    }  # fmt: skip

    def command(*extra: str) -> list[str]:
        return [
            sys.executable, "-m", "accelerate.commands.launch", "--config_file",
            str(accelerate_config(tmp_path)), "--main_process_port", str(free_port()),
            str(ENTRY), "trl-train", "--config", str(run_yaml), *extra,
        ]  # fmt: skip

    # first launch: killed (SIGKILL to rank 1) once checkpoint-2 holds the replay state
    first_log = tmp_path / "first.log"
    first = launch(command(), env, first_log)
    saved = out / "checkpoint-2" / "replay_history.json"  # the replay files' last
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not saved.exists() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        workers = [p for p in descendants(first.pid) if ENTRY.name in cmdline(p)]
        ranks = {environ(p).get("RANK"): p for p in workers}
        if first.poll() is None and not saved.exists():  # hung: every rank's stacks
            finish(first, first_log, 0)
        assert saved.exists() and "1" in ranks, first_log.read_text()[-6000:]
        os.kill(ranks["1"], signal.SIGKILL)
    finally:
        rc = finish(first, first_log)
    assert rc != 0
    assert not (out / "checkpoint-4").exists(), "the first run ended before the kill"
    buffered = [g["group_id"] for g in replay_state(out / "checkpoint-2")["groups"]]
    histories = json.loads((out / "checkpoint-2" / "replay_history.json").read_text())["histories"]
    state = json.loads((out / "checkpoint-2" / "trainer_state.json").read_text())
    assert state["global_step"] == 2 and buffered

    # second launch: --resume last
    second_log = tmp_path / "second.log"
    second = launch(command("--resume", "last"), env, second_log)
    assert finish(second, second_log) == 0, second_log.read_text()[-6000:]
    logs = [
        [json.loads(line) for line in (out / f"replay-{rank}.jsonl").read_text().splitlines()]
        for rank in (0, 1)
    ]
    for rank, log in enumerate(logs):
        assert [r["step"] for r in log] == [1, 2, 3, 4]
        assert log[:2] == histories[rank]  # steps 1-2 as the checkpoint holds them
        assert log[2]["buffer"] == buffered  # the buffer came back intact
        assert all(name.startswith("s3/") for name in log[2]["fresh"])
    for mine, theirs in zip(*logs, strict=True):
        assert (mine["replayed"], mine["buffer"]) == (theirs["replayed"], theirs["buffer"])
    resumed = [name for r in logs[0][2:] for name in r["replayed"]]
    assert resumed  # replay after the resume, of groups the buffer held at that step
    assert all(set(r["replayed"]) <= set(r["buffer"]) for r in logs[0])
    final = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    trained_steps = [h["step"] for h in final["log_history"] if "loss" in h]
    assert trained_steps == [1, 2, 3, 4]  # 1-2 restored, 3-4 trained after the resume
    replayed = [h["replay/replayed_groups"] for h in final["log_history"]
                if "replay/replayed_groups" in h]  # fmt: skip
    assert sum(replayed) > 0  # TRL's own log of the run: groups were replayed
    # uneven responses: at step 1 rank 1's fresh rows need several output-layer slices
    # (HEAD_SLICE policy tokens each), rank 0's one
    tokens = [sum(log[0]["policy_tokens"]) for log in logs]
    assert tokens[0] < HEAD_SLICE < 2 * HEAD_SLICE < tokens[1], tokens

    def per_row(key: str) -> list[list[float]]:
        return [[sum(r[key]) / len(r[key]) for r in log] for log in logs]

    summary = {
        "policy_tokens_per_row": per_row("policy_tokens"),
        "response_tokens_per_row": per_row("response_tokens"),
        "scored_rows": [[r["scored_rows"] for r in log] for log in logs],
        "trained_rows": [[r["trained_rows"] for r in log] for log in logs],
    }
    print(json.dumps(summary))


# --- defect 2: one selection for every process, and errors every process meets alike --------


def replay_trainer(policy_dir: str, out_dir: str, rule: str, rows: int):
    """A ReplayGRPOTrainer on two CPU processes (accelerate's MULTI_CPU), `rows` fresh rows in
    groups of 4 per process, not trained: the test calls its replay step on a batch in TRL's
    layout."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig

    from trainer.config import ReplayConfig
    from trainer.integrations.trl import ReplayGRPOTrainer, TRLReplayConfig

    args = GRPOConfig(
        output_dir=out_dir, use_cpu=True, bf16=False, report_to=[], seed=0, max_steps=4,
        per_device_train_batch_size=rows, num_generations=4, gradient_checkpointing=False,
    )  # fmt: skip
    replay = TRLReplayConfig(
        replay=ReplayConfig(rule=rule, budget=4, capacity=8, tau=1.0, scan_chunk=2)
    )
    return ReplayGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32),
        reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
        args=args, train_dataset=Dataset.from_list([{"prompt": "q"}] * 8),
        processing_class=AutoTokenizer.from_pretrained(policy_dir), replay=replay,
    )  # fmt: skip


def trl_batch(seed: int, rows: int, vocab: int, flat: bool = False) -> tuple[dict, torch.Tensor]:
    """A generation batch in TRL's layout (left-padded prompts, right-padded completions of
    different lengths) and its rewards (all equal with `flat`: no gradient in any group)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, vocab, (rows, 6), generator=g)
    completion = torch.randint(3, vocab, (rows, 12), generator=g)
    lengths = torch.randint(4, 13, (rows,), generator=g)
    mask = (torch.arange(12).unsqueeze(0) < lengths.unsqueeze(1)).long()
    rewards = torch.zeros(rows) if flat else torch.tensor([1.0, 0.0] * (rows // 2))
    groups = rewards.view(-1, 4)
    advantages = (groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)
    batch = {
        "prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt),
        "completion_ids": completion * mask, "completion_mask": mask,
        "advantages": advantages.view(-1),
    }  # fmt: skip
    return batch, rewards


def _selection_worker(rank: int, world: int, port: int, out_dir: str, policy_dir: str) -> None:
    """Both cases of `_selection_case` in one pair of processes (one start-up)."""
    env = accelerate_env(rank, world, port, Path(out_dir) / "unused.json")
    env.pop("ACCELERATE_USE_DEEPSPEED")
    os.environ.update(env)
    torch.set_num_threads(1)
    for case in ("straddle", "swap"):
        result = _selection_case(rank, world, out_dir, policy_dir, case)
        Path(out_dir, f"{case}-{rank}.json").write_text(json.dumps(result))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _selection_case(rank: int, world: int, out_dir: str, policy_dir: str, case: str) -> dict:
    """`straddle`: both processes hold the same buffer (step 1's groups of both) and score it
    under weights that differ by a tiny, real amount (rank 1's nudged by 1e-5 noise, as
    kernels that are not bitwise deterministic leave them), with tau between the two
    processes' drifts of one group. `swap`: the zero-variance swap takes rank 1's one group
    (all rewards equal) out of the update; the one stored group drawn in must go to rank 1
    (before, round robin gave it to rank 0 and rank 1 raised "no group to train on" alone
    while rank 0 waited in the next collective)."""
    from accelerate.utils import gather_object

    from headroom_drift import ReplayBuffer, policy_drift
    from trainer.integrations.trl_layout import rows_from_trl
    from trainer.scoring import score_groups

    straddle = case == "straddle"
    rows = 8 if straddle else 4
    rule = "headroom_drift" if straddle else "replay_zero_variance_swap"
    trainer = replay_trainer(policy_dir, str(Path(out_dir) / f"trl-{case}-{rank}"), rule, rows)
    model, replay = trainer.model, trainer.replay
    vocab = model.get_input_embeddings().num_embeddings
    groups = []
    for p in range(world):  # step 1 of every process, the same on both
        batch, rewards = trl_batch(10 + p, rows, vocab)
        r = rows_from_trl(batch)
        names = [f"s1/{p}/{k}" for k in range(rows // 4)]
        with torch.no_grad():
            made = scored_groups(
                model, r.input_ids, r.attention_mask, r.loss_mask, rewards, batch["advantages"],
                names,
            )  # fmt: skip
        groups += made
    with torch.no_grad():  # step 1's update moved the weights; rank 1's by a hair more
        for i, w in enumerate(model.parameters()):
            w.add_(0.02 * torch.randn(w.shape, generator=torch.Generator().manual_seed(i)))
            if rank == 1:
                w.add_(1e-5 * torch.randn(w.shape, generator=torch.Generator().manual_seed(-i)))
        scores = score_groups(model, groups, 4, 1.0)
    drifts = [
        float(policy_drift(s, g.gen_logprobs, g.loss_mask))
        for s, g in zip(scores, groups, strict=True)
    ]
    mine, theirs = gather_object([drifts])
    k = sorted(range(len(groups)), key=lambda i: mine[i])[len(groups) // 2]  # a middle one
    tau = (mine[k] + theirs[k]) / 2
    replay.config.replay.tau = replay.lifecycle.gate.tau = tau
    replay.lifecycle.ingest(groups)
    trainer.state.global_step, trainer.state.max_steps = 1, 4
    calls = []
    model.base_model.register_forward_hook(lambda *a: calls.append(1))
    batch, rewards = trl_batch(20 + rank, rows, vocab, flat=not straddle and rank == 1)
    if not straddle:  # one stored group to draw: the swap replaces one flat group
        replay.lifecycle.buffer = ReplayBuffer(8)
        replay.lifecycle.ingest(groups[:1])
    result = {"drifts": drifts, "straddled": k, "error": None}
    try:
        replay.extend(trainer, batch, rewards)
        record = replay.history[-1]
        result.update(replayed=record["replayed"], scanned=record["drift_scanned"],
                      forwards=len(calls), rows=record["trained_rows"])  # fmt: skip
    except Exception as err:  # every process should meet the same one
        result["error"] = f"{type(err).__name__}: {err}"
    return result


def test_processes_take_one_selection_and_train_alike(sft_policy, tmp_path):
    """Defect 2: with tau between the processes' own drifts of one group both take one
    selection and run as many forwards (`straddle`); when one process's fresh group is
    swapped out, the replayed group goes to it (`swap`); every process trains as many rows."""
    run_ranks(_selection_worker, tmp_path, str(sft_policy))
    for case in ("swap", "straddle"):
        r0, r1 = (json.loads((tmp_path / f"{case}-{r}.json").read_text()) for r in range(2))
        k = r0["straddled"]
        assert r0["drifts"][k] != r1["drifts"][k], case  # the processes' own scores differ
        assert r0["error"] is None and r1["error"] is None, (r0["error"], r1["error"])
        assert r0["replayed"] == r1["replayed"], case  # one selection
        assert r0["rows"] == r1["rows"], case  # as many rows (TRL's per-row all-gathers)
    assert r0["scanned"] == r1["scanned"]
    assert 0 < len(r0["replayed"]) < len(r0["scanned"])  # the gate split the candidates
    assert r0["forwards"] == r1["forwards"]
    assert r0["rows"] + r1["rows"] == 2 * 8 + 4 * len(r0["replayed"])
    swap = json.loads((tmp_path / "swap-0.json").read_text())
    assert swap["replayed"] == ["s1/0/0"] and swap["rows"] == 4


def test_generation_from_sharded_zero3_weights_is_refused(tmp_path):
    """Under ZeRO-3, `ds3_gather_for_generation=False` would make transformers step every
    process's `generate` in lockstep, which a multi-turn rollout (as many calls as its own
    turns) never matches: refused in one line; the default (gathered weights) passes."""
    from transformers.integrations import HfDeepSpeedConfig
    from trl import GRPOConfig

    from trainer.integrations.trl_rollout import check_generation_settings

    zero3 = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}})  # marks ZeRO-3 while alive
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    check_generation_settings(GRPOConfig(**base))
    with pytest.raises(ValueError, match="needs ds3_gather_for_generation=True") as err:
        check_generation_settings(GRPOConfig(**base, ds3_gather_for_generation=False))
    assert "\n" not in str(err.value)
    del zero3
    check_generation_settings(GRPOConfig(**base, ds3_gather_for_generation=False))  # no ZeRO-3


def test_trl_old_logprobs_are_the_stored_behaviour_logprobs(sft_policy, tmp_path):
    """Defect 9: when TRL has run its own no-grad pass over the fresh rows (its vLLM
    importance-sampling correction), those log-probs are stored as the groups' behaviour
    log-probs instead of scoring the rows again."""
    trainer = replay_trainer(str(sft_policy), str(tmp_path), "headroom_drift", 8)
    vocab = trainer.model.get_input_embeddings().num_embeddings
    batch, rewards = trl_batch(3, 8, vocab)
    trainer.state.global_step = 0
    trainer.replay.extend(trainer, dict(batch), rewards)  # no TRL log-probs: hdr scores
    assert trainer.replay.history[-1]["scored_rows"] == 8
    own = [g.gen_logprobs for g in trainer.replay.pending.fresh]
    trainer.replay.pending = None
    # TRL's layout of the same values (completion token j of row i at [i, j]), marked + 0.25
    old = torch.zeros(batch["completion_ids"].shape)
    for i, n in enumerate(batch["completion_mask"].sum(dim=1).tolist()):
        old[i, :n] = own[i // 4][i % 4, -n:] + 0.25
    batch["old_per_token_logps"] = old
    calls = []
    trainer.model.base_model.register_forward_hook(lambda *a: calls.append(1))
    trainer.replay.extend(trainer, batch, rewards)
    assert trainer.replay.history[-1]["scored_rows"] == 0 and not calls  # not scored again
    for g, mine in zip(trainer.replay.pending.fresh, own, strict=True):
        assert torch.allclose(g.gen_logprobs, (mine + 0.25) * g.loss_mask, atol=1e-6)
