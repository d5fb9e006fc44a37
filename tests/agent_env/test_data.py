"""QA data: both file formats load; the embedded wiki-vital task has its documented split."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agent_env.data import (
    SPLITS,
    is_test_title,
    load_flashrag_jsonl,
    load_searchr1_parquet,
    load_task,
    wiki_vital_examples,
)
from core.errors import UserError


def test_flashrag_jsonl(tmp_path: Path) -> None:
    path = tmp_path / "nq" / "test.jsonl"
    path.parent.mkdir()
    rows = [
        {"id": "test_0", "question": "who wrote hamlet", "golden_answers": ["Shakespeare"]},
        {"id": "test_1", "question": "capital of peru", "golden_answers": ["Lima", "Lima, Peru"]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    examples = load_task(str(path))
    assert [ex.id for ex in examples] == ["nq/test_0", "nq/test_1"]
    assert examples[1].golden_answers == ["Lima", "Lima, Peru"]
    assert {ex.data_source for ex in examples} == {"nq"}
    assert load_flashrag_jsonl(path, data_source="x")[0].id == "x/test_0"


def test_flashrag_bad_line_is_one_user_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"question": "q"}\n')
    with pytest.raises(UserError, match=r"bad.jsonl:1"):
        load_flashrag_jsonl(path)


def test_searchr1_parquet(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompt = "Answer the given question... For example, <answer> Beijing </answer>. Question: "
    table = pa.table(
        {
            "data_source": ["nq", "hotpotqa"],
            "prompt": [
                [{"role": "user", "content": prompt + "who wrote hamlet?\n"}],
                [{"role": "user", "content": prompt + "which river is longer?\n"}],
            ],
            "ability": ["fact-reasoning", "fact-reasoning"],
            "reward_model": [
                {"style": "rule", "ground_truth": {"target": ["Shakespeare"]}},
                {"style": "rule", "ground_truth": {"target": ["Nile", "the Nile"]}},
            ],
            "extra_info": [{"split": "train", "index": 0}, {"split": "train", "index": 7}],
        }
    )
    path = tmp_path / "train.parquet"
    pq.write_table(table, path)
    examples = load_searchr1_parquet(path)
    assert [ex.id for ex in examples] == ["nq/0", "hotpotqa/7"]
    assert examples[0].question == "who wrote hamlet?"
    assert examples[1].golden_answers == ["Nile", "the Nile"]
    assert examples[1].data_source == "hotpotqa"
    assert load_task(str(path))[1].question == "which river is longer?"


def test_wiki_vital_split_is_the_documented_one() -> None:
    train, test = wiki_vital_examples("train"), wiki_vital_examples("test")
    assert (len(train), len(test)) == (8139, 910)
    assert not {ex.id for ex in train} & {ex.id for ex in test}
    assert all(is_test_title(ex.golden_answers[0]) for ex in test)
    questions = [ex.question for ex in train + test]
    assert len(set(questions)) == len(questions)  # shared descriptions were dropped
    by_title = {ex.golden_answers[0]: ex for ex in train + test}
    assert by_title["2001: A Space Odyssey"].question == "1968 film by Stanley Kubrick"
    assert by_title["2001: A Space Odyssey"].id == "wiki-vital/1"  # corpus line 1
    assert by_title["Apology (Plato)"] in test


def test_unknown_task_is_a_user_error() -> None:
    with pytest.raises(UserError, match="wiki-vital"):
        load_task("nope.csv")


def test_sft_rl_and_test_questions_are_disjoint_and_train_is_sft_plus_rl():
    from agent_env.data import split_of

    ids = {split: {ex.id for ex in wiki_vital_examples(split)} for split in SPLITS}
    assert not ids["sft"] & ids["rl"] and not ids["sft"] & ids["test"]
    assert not ids["rl"] & ids["test"]
    assert ids["sft"] | ids["rl"] == ids["train"]
    assert ids["train"] | ids["test"] == ids["all"]
    assert 0.1 < len(ids["rl"]) / len(ids["train"]) < 0.15  # an eighth, by the title's hash
    for ex in wiki_vital_examples("rl")[:50]:
        assert split_of(ex.golden_answers[0]) == "rl"
    with pytest.raises(UserError, match="valid: all, train, sft, rl, test"):
        wiki_vital_examples("validation")


def test_the_question_pool_is_a_fixed_subset_in_the_tasks_order() -> None:
    """`data.train_questions`: the same 32 `rl` questions for every run seed, in their order;
    None (or a pool as large as the split) keeps every question."""
    from agent_env.data import question_pool

    rl = wiki_vital_examples("rl")
    pool = question_pool(rl, 32)
    assert len(pool) == 32 and len(set(pool)) == 32
    assert pool == question_pool(rl, 32)  # no seed of the run in it
    positions = [rl.index(ex) for ex in pool]
    assert positions == sorted(positions) and positions[-1] > 64  # drawn, not the first 32
    assert question_pool(rl, None) is rl and question_pool(rl, len(rl)) is rl
    assert set(question_pool(rl, 8)) < set(pool)  # a smaller pool lies inside a larger one


def test_training_reads_only_the_pool() -> None:
    from agent_env.data import DataConfig, load_questions

    data = DataConfig(train_split="rl", train_questions=32)
    train, _ = load_questions(data, seed=0, heldout=8)
    assert len(train) == 32 and {ex.id for ex in train} <= {
        ex.id for ex in wiki_vital_examples("rl")
    }
