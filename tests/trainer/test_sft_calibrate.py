"""`hdr sft` (scripted oracle trajectories, RL loss mask) and `hdr calibrate` (tau sweep)."""

import json

import pytest
from conftest import TINY_CPU, tiny_overrides

from core.config import load_config
from trainer.config import TrainConfig
from trainer.tools.calibrate import CalibrationPoint, calibrate, log_spaced, recommend


def test_scripted_sft_rows_train_only_on_policy_tokens(
    tiny_policy, small_qa, retrieval_url, tmp_path
):
    from transformers import AutoTokenizer

    from agent_env.data import load_task
    from agent_env.retrieval_client import RetrievalClient
    from trainer.tools.sft import scripted_rows

    overrides = tiny_overrides(retrieval_url, tmp_path / "m", small_qa, tmp_path / "r")
    cfg = load_config(TrainConfig, TINY_CPU, [*overrides, "rollout.max_tokens_per_turn=48"])
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy))
    examples = load_task(str(small_qa), "train")[:6]
    with RetrievalClient(cfg.retrieval) as client:
        rows = scripted_rows(cfg, tokenizer, client, examples)
    assert len(rows) == 6
    hits = 0
    for (ids, mask), ex in zip(rows, examples, strict=True):
        text = policy_spans(tokenizer, ids, mask)
        # the policy writes the query then the title; prompt and documents are context
        assert len(text) == 2, text
        assert text[0].strip() == f"{ex.question} </search>"
        assert text[1].endswith("</answer>")
        hits += text[1].removesuffix("</answer>").strip() == ex.golden_answers[0]
    assert hits >= 3  # the gold title whenever BM25 retrieved it


def policy_spans(tokenizer, ids, mask) -> list[str]:
    """The decoded runs of a row's mask-1 ids (the policy's own text), in order."""
    spans, cur = [], []
    for tok, m in zip(ids, mask, strict=True):
        if m:
            cur.append(tok)
        elif cur:
            spans.append(cur)
            cur = []
    spans.append(cur) if cur else None
    return [tokenizer.decode(s, skip_special_tokens=False) for s in spans]


def is_subsequence(words: list[str], of: list[str]) -> bool:
    rest = iter(of)
    return all(w in rest for w in words)


@pytest.mark.parametrize("form", ["shuffled", "subset", "mixed", "suffix"])
def test_drawn_sft_queries_vary_the_words_that_reach_the_retriever(
    form, tiny_policy, small_qa, retrieval_url, tmp_path
):
    """`sft.query=shuffled|subset|mixed|suffix`, 3 trajectories per question under a 2-word
    query budget: every scripted search is the question's words in some order (shuffled) or
    some of them in their order (subset; mixed: the whole question half the time; suffix: its
    words from one on), the draws of a question differ, the observation is the server's answer
    to the first two words, a rerun makes the same rows (the draws come from the seed) and the
    next epoch's draw makes others."""
    import httpx
    from transformers import AutoTokenizer

    from agent_env.data import load_task
    from agent_env.prompts import format_documents
    from agent_env.retrieval_client import RetrievalClient
    from trainer.tools.sft import scripted_rows

    extra = ["rollout.max_tokens_per_turn=48", "rollout.max_query_words=2", "rollout.doc_words=8"]
    extra += ["rollout.max_obs_tokens=400", f"sft.query={form}", "sft.queries_per_question=3"]
    overrides = tiny_overrides(retrieval_url, tmp_path / "m", small_qa, tmp_path / "r", *extra)
    cfg = load_config(TrainConfig, TINY_CPU, overrides)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy))
    examples = [ex for ex in load_task(str(small_qa), "train") if len(ex.question.split()) >= 4]
    examples = examples[:5]
    with RetrievalClient(cfg.retrieval) as client:
        rows = scripted_rows(cfg, tokenizer, client, examples)
        again = scripted_rows(cfg, tokenizer, client, examples)
        next_epoch = scripted_rows(cfg, tokenizer, client, examples, draw=1)
    assert rows == again and len(rows) == 15
    assert len(next_epoch) == 15 and next_epoch != rows  # each epoch draws its own words
    verbatim = 0
    for n, ex in enumerate(examples):
        queries = []
        for ids, mask in rows[3 * n : 3 * n + 3]:
            query = policy_spans(tokenizer, ids, mask)[0].removesuffix("</search>").strip()
            if form == "shuffled":
                assert sorted(query.split()) == sorted(ex.question.split())
            elif form == "suffix":
                assert query.split() == ex.question.split()[-len(query.split()) :]
            else:
                assert query and is_subsequence(query.split(), ex.question.split())
            sent = " ".join(query.split()[:2])
            request = {"queries": [sent], "topk": 3, "retriever": cfg.retrieval.retriever}
            raw = httpx.post(f"{retrieval_url}/retrieve", json=request)
            docs = format_documents([d["contents"] for d in raw.json()["result"][0]], 8)
            assert docs in tokenizer.decode(ids, skip_special_tokens=False)
            queries.append(query)
            verbatim += query == ex.question.strip()
        if form in ("shuffled", "subset"):  # mixed, suffix: may draw one query three times
            assert len(set(queries)) > 1, queries  # 3 draws of 4+ words: not all the same
    if form == "mixed":  # 15 draws, each the whole question with probability 1/2
        assert 0 < verbatim < 15
    if form == "suffix":  # 15 draws, each the whole question with probability 1/len(words)
        assert verbatim < 15


def test_sft_answer_doc1_always_answers_the_first_document(
    tiny_policy, small_qa, retrieval_url, tmp_path
):
    """`sft.answer=doc1` under a 2-word budget: every scripted answer is the title of Doc 1 of
    the trajectory's own information block, while the default (`gold_if_seen`) answers the
    gold title in some trajectory where it is not Doc 1's, so the two differ on this data."""
    from transformers import AutoTokenizer

    from agent_env.data import load_task
    from agent_env.generation.scripted import document_titles
    from agent_env.retrieval_client import RetrievalClient
    from trainer.tools.sft import scripted_rows

    extra = ["rollout.max_tokens_per_turn=48", "rollout.max_query_words=2", "rollout.doc_words=8"]
    extra += ["rollout.max_obs_tokens=400", "sft.query=subset", "sft.queries_per_question=3"]
    base = tiny_overrides(retrieval_url, tmp_path / "m", small_qa, tmp_path / "r", *extra)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_policy))
    examples = [ex for ex in load_task(str(small_qa), "train") if len(ex.question.split()) >= 4]
    answers = {}
    for answer in ("doc1", "gold_if_seen"):
        cfg = load_config(TrainConfig, TINY_CPU, [*base, f"sft.answer={answer}"])
        with RetrievalClient(cfg.retrieval) as client:
            rows = scripted_rows(cfg, tokenizer, client, examples[:8])
        pairs = []
        for ids, mask in rows:
            text = tokenizer.decode(ids, skip_special_tokens=False)
            said = policy_spans(tokenizer, ids, mask)[-1].removesuffix("</answer>").strip()
            titles = document_titles(text)
            if not titles:  # a search of stopwords only ("by") retrieves nothing
                assert "<information></information>" in text
                continue
            pairs.append((said, titles[0]))
        answers[answer] = pairs
    assert len(answers["doc1"]) >= 16  # of 24 trajectories
    assert all(said == first for said, first in answers["doc1"])
    assert any(said != first for said, first in answers["gold_if_seen"])


def test_copies_of_a_verbatim_query_are_refused():
    from pydantic import ValidationError

    from trainer.config import SFTConfig

    with pytest.raises(ValidationError, match=r"sft\.query=shuffled or sft\.query=subset"):
        SFTConfig(queries_per_question=2)


def test_sft_loss_falls_and_model_loads(sft_policy):
    from transformers import AutoModelForCausalLM

    log = [
        json.loads(x) for x in sft_policy.with_name("model.sft-log.jsonl").read_text().splitlines()
    ]
    assert [r["epoch"] for r in log] == [1, 2, 3, 4]
    assert log[-1]["loss"] < log[0]["loss"] * 0.9
    AutoModelForCausalLM.from_pretrained(str(sft_policy))


def test_recommend_prefers_the_selective_point():
    pts = [
        CalibrationPoint(0.001, 100, 6, 0.06, 0.0, ""),
        CalibrationPoint(0.01, 100, 40, 0.40, 0.0, ""),
        CalibrationPoint(0.1, 100, 94, 0.94, 0.0, ""),
    ]
    assert recommend(pts) == (0.01, True)
    wide = CalibrationPoint(1.0, 100, 99, 0.99, 0.0, "")
    assert recommend([pts[0], wide]) == (0.001, False)  # nothing selective: flagged
    assert log_spaced(0.01) == pytest.approx([0.001, 0.01, 0.1])


def test_calibrate_closed_and_open_gates(sft_policy, small_qa, retrieval_url, tmp_path):
    overrides = tiny_overrides(retrieval_url, sft_policy, small_qa, tmp_path / "unused")
    cfg = load_config(TrainConfig, TINY_CPU, overrides)
    report = calibrate(cfg, tmp_path / "cal", steps=2, taus=[0.0, 1e9])
    closed, open_ = report.points
    assert closed.scanned > 0 and open_.scanned > 0
    assert closed.acceptance_rate == 0.0  # after an update no group's drift is exactly 0
    assert open_.acceptance_rate == 1.0  # an unbounded gate admits everything it scans
    assert "recommended" in report.table()
    saved = json.loads((tmp_path / "cal" / "calibrate.json").read_text())
    assert [p["tau"] for p in saved["points"]] == [0.0, 1e9]


def test_sft_batches_cover_every_row_once_with_little_padding():
    import random

    from trainer.tools.sft import length_batches

    rng = random.Random(0)
    lengths = [rng.randint(90, 180) for _ in range(1000)]
    batches = length_batches(lengths, 32, random.Random(1))
    assert sorted(i for b in batches for i in b) == list(range(1000))
    assert sum(len(b) != 32 for b in batches) <= 2  # a short batch per pool at most
    padded = sum(max(lengths[i] for i in b) * len(b) for b in batches)
    assert padded < 1.05 * sum(lengths)  # random batches of 32 pad to ~1.3x here


@pytest.mark.slow  # about 20 s: two SFT runs and a kill; the CI budget keeps it to make test-slow
def test_a_killed_sft_resumes_after_its_last_epoch_and_ends_where_an_unbroken_one_does(
    tiny_policy, small_qa, retrieval_url, tmp_path
):
    """SIGKILL after the first epoch's checkpoint; the same command continues from it and
    writes the same weights as a run that was never stopped (plateau stop included)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from safetensors.torch import load_file

    hdr = [sys.executable, "-m", "hdr"]

    def command(name: str) -> list[str]:
        out = tmp_path / name
        settings = tiny_overrides(retrieval_url, out, small_qa, tmp_path / "unused")
        return [*hdr, "sft", "--config", str(TINY_CPU), *settings, f"sft.init_model={tiny_policy}",
                "sft.epochs=3", "sft.max_examples=64", "sft.eval_questions=8", "sft.stop=plateau",
                "sft.patience=3"]  # fmt: skip

    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    whole = subprocess.run(command("whole"), env=env, capture_output=True, text=True)
    assert whole.returncode == 0, whole.stderr[-2000:]
    assert not (tmp_path / ".whole.sft-resume").exists()  # removed once the model is saved

    checkpoint = tmp_path / ".broken.sft-resume" / "state.json"
    proc = subprocess.Popen(command("broken"), env=env, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while not checkpoint.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert json.loads(checkpoint.read_text())["epoch"] == 1
    assert not (tmp_path / "broken").exists()

    again = subprocess.run(command("broken"), env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "resuming after epoch 1" in again.stderr
    a = load_file(tmp_path / "whole" / "model.safetensors")
    b = load_file(tmp_path / "broken" / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    logs = [tmp_path / f"{n}.sft-log.jsonl" for n in ("whole", "broken")]
    assert [json.loads(x)["epoch"] for x in logs[1].read_text().splitlines()] == [1, 2, 3]
    assert [json.loads(x)["loss"] for x in logs[0].read_text().splitlines()] == [
        json.loads(x)["loss"] for x in logs[1].read_text().splitlines()
    ]


def test_a_kill_between_the_epoch_checkpoints_renames_resumes_from_the_earlier_epoch(tmp_path):
    """`save` sets the last epoch's folder aside before renaming the new one in; a kill in
    between leaves no `.sft-resume` folder, and the rerun resumes from the one set aside."""
    import os
    import random

    import torch
    from conftest import tiny_llama

    from trainer.tools.sft import Best, EpochCheckpoint

    out = tmp_path / "policy"
    config = TrainConfig.model_validate({"model": {"path": str(out)}})
    model = tiny_llama(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    rng, best = random.Random(0), Best()
    checkpoint = EpochCheckpoint(out, config)
    checkpoint.save(1, model, optimizer, scheduler, rng, best)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    checkpoint.save(2, model, optimizer, scheduler, rng, best)
    assert checkpoint.path.is_dir() and not checkpoint.previous.exists()

    os.replace(checkpoint.path, checkpoint.previous)  # epoch 3's save: its first rename, killed
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    log = tmp_path / "policy.sft-log.jsonl"
    assert checkpoint.restore(model, optimizer, scheduler, rng, best, log) == 2
    assert all((model.state_dict()[k] == v).all() for k, v in saved.items())
    assert checkpoint.path.is_dir() and not checkpoint.previous.exists()

    checkpoint.save(3, model, optimizer, scheduler, rng, best)
    checkpoint.remove()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
