"""`evaluate` end to end: real retrieval server, real rollout loop, real tiny model.

The scripted policy (search the question, answer Doc 1's title) makes correctness checkable
by hand: a question is right exactly when the server's top BM25 document for the question
is the gold title. The tiny hf model checks sampling: same seed, same numbers and responses;
another seed, other responses; an interrupted evaluation resumes to the same result.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import UserError
from evaluation.evaluate import (
    PARTIAL,
    EvalConfig,
    evaluate,
    evaluate_policy,
    load_eval_datasets,
    load_report,
)


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    """A real tiny Llama + BPE tokenizer (untrained), small enough to build in seconds."""
    from models.tiny import TinyPolicyConfig, init_tiny_policy, vital_corpus_texts

    config = TinyPolicyConfig(
        vocab_size=1024,
        hidden_size=64,
        num_layers=2,
        num_heads=2,
        intermediate_size=128,
        max_texts=4000,
    )
    out = tmp_path_factory.mktemp("eval-policy")
    return init_tiny_policy(out, vital_corpus_texts(limit=1000), config)


@pytest.fixture(scope="module")
def vital_questions(small_corpus: Path):
    """wiki-vital questions whose article is in the small index (description -> title)."""
    from agent_env.data import wiki_vital_examples
    from retrieval_server.index.corpus import split_contents

    titles = {
        split_contents(json.loads(line)["contents"])[0]
        for line in small_corpus.read_text().splitlines()
    }
    return [ex for ex in wiki_vital_examples("all") if ex.golden_answers[0] in titles]


def _config(url: str, **kw) -> EvalConfig:
    from agent_env.prompts import PromptConfig

    base = {
        "k": 3,
        "progress": False,
        "chunk_questions": 4,
        "rollout": {
            "prompt": PromptConfig.preset("compact").model_dump(),
            "max_turns": 1,
            "max_tokens_per_turn": 12,
            "doc_words": 6,
        },
        "retrieval": {"urls": [url], "topk": 3, "retriever": "bm25"},
    }
    for key, value in kw.items():
        if isinstance(value, dict):
            base.setdefault(key, {}).update(value)
        else:
            base[key] = value
    return EvalConfig.model_validate(base)


def _top_title(url: str, question: str) -> str:
    from agent_env.rewards import normalize_answer

    response = httpx.post(
        f"{url}/retrieve",
        json={"queries": [question], "topk": 1, "retriever": "bm25"},
        timeout=30,
    )
    contents = response.json()["result"][0][0]["contents"]
    return normalize_answer(contents.split("\n", 1)[0])


def test_scripted_policy_on_flashrag_jsonl_matches_hand_count(
    tmp_path, policy_dir, retrieval_url, vital_questions
):
    from agent_env.rewards import normalize_answer

    picked = vital_questions[:10]
    rows = [
        {"id": f"q{i}", "question": ex.question, "golden_answers": ex.golden_answers}
        for i, ex in enumerate(picked)
    ]
    rows.append({"id": "never", "question": picked[0].question, "golden_answers": ["zzz qqq"]})
    data = tmp_path / "nq" / "test.jsonl"
    data.parent.mkdir()
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))

    # room for the whole question and title: the scripted policy writes them verbatim
    config = _config(
        retrieval_url, generation={"backend": "scripted"}, rollout={"max_tokens_per_turn": 64}
    )
    report = evaluate(policy_dir, [data], config=config, out_dir=tmp_path / "out")

    expected = [
        int(_top_title(retrieval_url, r["question"]) == normalize_answer(r["golden_answers"][0]))
        for r in rows
    ]
    assert 0 < sum(expected) < len(expected), "fixture should mix right and wrong answers"
    (result,) = report.datasets
    assert result.dataset == "nq"  # recognised from the FlashRAG directory name
    assert len(result.question_ids) == len(rows)
    assert result.correct == [[e] * 3 for e in expected]  # deterministic policy: k equal copies
    assert result.greedy == expected
    assert result.correct[-1] == [0, 0, 0]  # the all-wrong question
    assert report.k == 3
    assert result.mean_at_k == pytest.approx(np.mean(expected))
    assert result.best_at_k == pytest.approx(np.mean(expected))
    assert result.greedy_em == pytest.approx(np.mean(expected))
    assert report.env_calls > 0
    # result files: complete JSON and Markdown, no partial file left
    on_disk = load_report(tmp_path / "out")
    assert on_disk.datasets[0].correct == result.correct
    md = (tmp_path / "out" / "eval.md").read_text()
    assert "| nq | 11 |" in md and "Mean@3" in md
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["eval.json", "eval.md"]


def _write_searchr1_parquet(path: Path, questions) -> None:
    rows = []
    for i, ex in enumerate(questions):
        rows.append(
            {
                "data_source": "bamboogle" if i % 3 == 0 else "nq",
                "prompt": [{"role": "user", "content": f"Answer it.\nQuestion: {ex.question}\n"}],
                "reward_model": {"ground_truth": {"target": ex.golden_answers}, "style": "rule"},
                "extra_info": {"index": i, "split": "test"},
            }
        )
    pq.write_table(pa.Table.from_pylist(rows), path)


def test_tiny_model_on_searchr1_parquet_is_reproducible_and_resumable(
    tmp_path, policy_dir, retrieval_url, vital_questions
):
    import torch

    data = tmp_path / "test.parquet"
    _write_searchr1_parquet(data, vital_questions[:6])
    datasets = load_eval_datasets([data])
    assert [(d.name, len(d.examples)) for d in datasets] == [("nq", 4), ("bamboogle", 2)]

    config = _config(retrieval_url, k=2, chunk_questions=2, rollout={"max_tokens_per_turn": 6})
    torch.manual_seed(123)
    rng_before = torch.get_rng_state()
    first = evaluate(policy_dir, [data], config=config)
    assert torch.equal(torch.get_rng_state(), rng_before), "caller's RNG state was changed"
    second = evaluate(policy_dir, [data], config=config)
    assert [d.dataset for d in first.datasets] == ["nq", "bamboogle"]
    for a, b in zip(first.datasets, second.datasets, strict=True):
        assert a.responses_sha == b.responses_sha
        assert (a.correct, a.greedy, a.greedy_answers) == (b.correct, b.greedy, b.greedy_answers)
        assert np.array(a.correct).shape == (a.num_questions, 2)
    assert first.average == second.average
    avg = first.average
    nq, bam = first.datasets
    assert avg["mean_at_k"] == pytest.approx((nq.mean_at_k + bam.mean_at_k) / 2)
    assert avg["weighted_mean_at_k"] == pytest.approx((4 * nq.mean_at_k + 2 * bam.mean_at_k) / 6)

    other = evaluate(policy_dir, [data], config=config.model_copy(update={"seed": 1}))
    assert other.datasets[0].responses_sha != first.datasets[0].responses_sha

    # Interrupt after the second chunk; the rerun resumes and gives the same result.
    out = tmp_path / "resumable"
    _interrupted_eval(policy_dir, datasets, config, out, retrieval_url, after_calls=2)
    assert not (out / "eval.json").exists()
    lines = (out / PARTIAL).read_text().splitlines()
    assert len(lines) == 3  # fingerprint + two finished chunks
    with (out / PARTIAL).open("a") as fh:
        fh.write('{"dataset": "nq", "sta')  # a chunk cut off mid-write
    resumed = evaluate(policy_dir, [data], config=config, out_dir=out)
    for a, b in zip(first.datasets, resumed.datasets, strict=True):
        assert (a.responses_sha, a.correct, a.greedy) == (b.responses_sha, b.correct, b.greedy)
    assert not (out / PARTIAL).exists() and (out / "eval.json").is_file()


class _Interrupt(Exception):
    pass


def _interrupted_eval(policy_dir, datasets, config, out, url, after_calls):
    """Run evaluate_policy with the real hf generator and stop it, as Ctrl-C would, at the
    first generation after `after_calls` chunks have been saved to the partial file."""
    from transformers import AutoTokenizer

    from agent_env.generation import build_generator
    from agent_env.retrieval_client import RetrievalClient
    from evaluation.evaluate import weights_signature

    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir))
    generator = build_generator(
        config.generation, model_dir=policy_dir, tokenizer=tokenizer, prompt=config.rollout.prompt
    )
    real_generate = generator.generate

    def generate(contexts, params):
        partial = out / PARTIAL
        if partial.is_file() and len(partial.read_text().splitlines()) - 1 >= after_calls:
            raise _Interrupt
        return real_generate(contexts, params)

    generator.generate = generate
    client = RetrievalClient(config.retrieval, seed=config.seed)
    with client, pytest.raises(_Interrupt):
        evaluate_policy(
            generator.model,
            tokenizer,
            datasets,
            client,
            config,
            out,
            model_id=str(policy_dir),
            generator=generator,
            resume_key=weights_signature(policy_dir),
        )


def test_user_errors(tmp_path, policy_dir):
    with pytest.raises(UserError, match="no model"):
        evaluate(tmp_path, ["wiki-vital"], config=EvalConfig(progress=False))
    with pytest.raises(UserError, match="not found"):
        load_eval_datasets([tmp_path / "missing.jsonl"])
    with pytest.raises(UserError):
        load_eval_datasets([])
    with pytest.raises(UserError, match="not found"):
        load_report(tmp_path / "nothing")


def test_wiki_vital_by_name_is_its_test_split():
    (d,) = load_eval_datasets(["wiki-vital"], max_questions=5)
    assert d.name == "wiki-vital" and len(d.examples) == 5
    from agent_env.data import is_test_title

    assert all(is_test_title(ex.golden_answers[0]) for ex in d.examples)


def test_hdr_eval_command_two_files_and_errors(
    tmp_path, policy_dir, retrieval_url, vital_questions
):
    """`hdr eval --data A --data B` through the real entry point (scripted backend: fast)."""
    import subprocess
    import sys

    files = []
    for name, chunk in (("hotpotqa", vital_questions[:3]), ("popqa", vital_questions[3:5])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text(
            "".join(
                json.dumps({"id": i, "question": ex.question, "golden_answers": ex.golden_answers})
                + "\n"
                for i, ex in enumerate(chunk)
            )
        )
        files.append(str(path))
    train_cfg = tmp_path / "run" / "config.yaml"
    train_cfg.parent.mkdir()
    train_cfg.write_text(
        "rollout:\n  prompt:\n    template: 'Question: {question}\\n'\n    chat_template: false\n"
        "    response_prefix: '<search>'\n    observation_suffix: '<answer>'\n"
        "  max_turns: 1\n  max_tokens_per_turn: 64\n"
        "retrieval:\n  topk: 3\n  retriever: bm25\n"
    )
    hdr = [sys.executable, "-m", "hdr.cli"]
    out = tmp_path / "out"
    args = ["eval", "--model", str(policy_dir), "--k", "2"]
    args += [arg for path in files for arg in ("--data", path)]  # --data repeats
    args += ["--server", retrieval_url, "--out", str(out), "--train-config", str(train_cfg)]
    args += ["--set", "generation.backend=scripted", "--set", "progress=false"]
    done = subprocess.run(hdr + args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    report = load_report(out)
    assert [d.dataset for d in report.datasets] == ["popqa", "hotpotqa"]  # paper order
    assert [d.num_questions for d in report.datasets] == [2, 3]
    assert report.average["num_questions"] == 5
    assert "**Weighted**" in (out / "eval.md").read_text()

    bad = subprocess.run(
        [*hdr, "eval", "--model", str(tmp_path / "nope"), "--data", "wiki-vital"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert bad.returncode == 2
    assert (
        bad.stderr.strip().startswith("hdr: error:") and len(bad.stderr.strip().splitlines()) == 1
    )


def test_eval_config_takes_the_runs_prompt(tmp_path):
    from evaluation.evaluate import eval_config_for

    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    (run / "config.yaml").write_text(
        "rollout:\n  max_turns: 3\n  temperature: 0.7\nretrieval:\n  topk: 5\n"
    )
    cfg = eval_config_for(run / "final", overrides=["k=4"])
    assert (cfg.rollout.max_turns, cfg.sample_temperature, cfg.retrieval.topk, cfg.k) == (
        3,
        0.7,
        5,
        4,
    )
    with pytest.raises(UserError, match="k"):
        eval_config_for(run / "final", overrides=["k=0"])
    with pytest.raises(UserError, match="bogus"):
        eval_config_for(tmp_path, overrides=["bogus=1"])


def test_a_rerun_of_a_finished_eval_says_so_and_other_settings_are_named(
    tmp_path, policy_dir, retrieval_url, vital_questions
):
    """The same command on a finished evaluation: "already complete", exit 0, nothing run or
    rewritten. Other settings: the refusal names what differs. The default --out lies under
    runs/ (ignored by git like data/). An empty `max_questions=` is refused, not "all"."""
    import subprocess
    import sys

    qa = tmp_path / "nq.jsonl"
    qa.write_text("".join(
        json.dumps({"id": i, "question": ex.question, "golden_answers": ex.golden_answers}) + "\n"
        for i, ex in enumerate(vital_questions[:3])
    ))  # fmt: skip
    hdr = [sys.executable, "-m", "hdr.cli", "eval", "--model", str(policy_dir), "--data", str(qa)]
    settings = ["--server", retrieval_url, "generation.backend=scripted", "progress=false",
                "retrieval.retriever=bm25", "rollout.max_turns=1"]  # fmt: skip

    def run(*args: str):
        return subprocess.run([*hdr, *args, *settings], capture_output=True, text=True,
                              timeout=300, cwd=tmp_path)  # fmt: skip

    first = run("--k", "2")
    assert first.returncode == 0, first.stderr
    out = tmp_path / "runs" / "eval" / policy_dir.name  # the default, under runs/
    written = (out / "eval.json").read_bytes()
    assert load_report(out).settings["settings"]["k"] == 2

    again = run("--k", "2")
    assert again.returncode == 0, again.stderr
    assert again.stdout.strip() == (
        f"already complete: see {Path('runs') / 'eval' / policy_dir.name / 'eval.md'}"
        " (--force evaluates again)"
    )
    assert (out / "eval.json").read_bytes() == written

    other = run("--k", "3", "max_questions=2")
    assert other.returncode == 2 and len(other.stderr.strip().splitlines()) == 1, other.stderr
    assert other.stderr.strip() == (
        f"hdr: error: --out {Path('runs') / 'eval' / policy_dir.name} already holds an evaluation"
        " with other settings (k 2 then, 3 now; max_questions None then, 2 now; questions.nq"
        f" '3 questions, ids {digest(3)}' then, '2 questions, ids {digest(2)}' now); pass"
        " --force to replace it, or choose another --out"
    )

    empty = run("max_questions=")
    assert empty.returncode == 2
    assert empty.stderr.strip() == (
        "hdr: error: max_questions= has no value: give one, or write max_questions=null for"
        " none (its default where that is none)"
    )
    assert (out / "eval.json").read_bytes() == written


def digest(count: int) -> str:
    import hashlib

    ids = [f"nq/{i}" for i in range(count)]
    return hashlib.sha256(json.dumps(ids).encode()).hexdigest()[:8]


def test_a_flashrag_line_names_the_missing_key_and_empty_gold_is_warned(tmp_path, capsys):
    from agent_env.data import load_flashrag_jsonl

    wrong = tmp_path / "answer.jsonl"
    wrong.write_text(json.dumps({"id": 0, "question": "q?", "answer": "a"}) + "\n")
    with pytest.raises(UserError) as refused:
        load_flashrag_jsonl(wrong)
    assert str(refused.value) == (
        f"{wrong}:1: not a FlashRAG QA line: missing key golden_answers (found: id, question,"
        " answer)"
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("".join(
        json.dumps({"id": i, "question": f"q{i}?", "golden_answers": gold}) + "\n"
        for i, gold in enumerate([["a"], [], [""], "b"])
    ))  # fmt: skip
    examples = load_flashrag_jsonl(empty)
    assert [ex.golden_answers for ex in examples] == [["a"], [], [""], ["b"]]
    assert capsys.readouterr().err == (
        f"hdr: warning: {empty}: 2 of 4 questions have no golden answer (an empty"
        " golden_answers; first on line 2): no response can be scored correct on them\n"
    )
