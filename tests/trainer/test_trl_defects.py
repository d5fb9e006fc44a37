"""The TRL review's defects 3, 6 and 8 on one process: colocated-vLLM settings refused in one
line, completions that were not cut end on EOS (TRL's clipped_ratio reads real truncation), and
the replay buffer travels in TRL's checkpoints and comes back on resume. And sampling settings
TRL's loss does not apply (top_p < 1, top_k, min_p, a repetition penalty) refused in one line,
in Python and through `hdr trl-train`."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("trl")

from conftest import REPO
from test_trl import G, make_trainer
from trl import GRPOConfig

from agent_env.data import QAExample
from agent_env.rollout import Trajectory
from trainer.checkpoint import Checkpoint
from trainer.config import ReplayConfig
from trainer.integrations.trl import TRLReplayConfig
from trainer.integrations.trl_rollout import check_sampling_settings, check_vllm_settings, ended


def trajectory(ids: list[int], truncated: bool = False) -> Trajectory:
    example = QAExample(id="q", question="?", golden_answers=["a"], data_source="t")
    return Trajectory(group_id="g", example=example, prompt_ids=[1, 2], response_ids=ids,
                      loss_mask=[1] * len(ids), truncated=truncated)  # fmt: skip


def test_only_cut_completions_stay_without_eos():
    """Defect 6: an answer ends on `</answer>` (not EOS); it gets EOS so TRL does not count it
    truncated; a cut one (response budget reached) does not; one already on EOS is left."""
    assert ended(trajectory([5, 6, 7]), eos_id=2) == [2]
    assert ended(trajectory([5, 6, 7], truncated=True), eos_id=2) == []
    assert ended(trajectory([5, 6, 2]), eos_id=2) == []


def test_trl_clipped_ratio_reads_real_truncation(sft_policy, retrieval_url, small_qa, tmp_path):
    replay = TRLReplayConfig(replay=ReplayConfig(rule="on_policy", budget=0, capacity=0))
    trainer = make_trainer(sft_policy, retrieval_url, small_qa, tmp_path, replay, max_steps=1)
    trainer.train()
    clipped = [h["completions/clipped_ratio"] for h in trainer.state.log_history
               if "completions/clipped_ratio" in h]  # fmt: skip
    trajs = [t for group in trainer.rollout_func.last.groups for t in group]
    assert clipped == [pytest.approx(sum(t.truncated for t in trajs) / len(trajs))]


def test_colocate_settings_the_rollout_cannot_honour_are_refused(tmp_path):
    """Defect 3: one line naming the supported alternative."""
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    args = GRPOConfig(**base)
    for key, value in (("vllm_tensor_parallel_size", 2), ("vllm_enable_sleep_mode", True)):
        args.use_vllm, args.vllm_mode = True, "colocate"
        setattr(args, key, value)
        with pytest.raises(ValueError, match="use vllm_mode=server") as err:
            check_vllm_settings(args)
        assert "\n" not in str(err.value)
        setattr(args, key, GRPOConfig(**base).__dict__[key])
    check_vllm_settings(args)  # tp 1, no sleep: accepted


@pytest.mark.parametrize(
    "key, value",
    [("top_p", 0.9), ("top_k", 20), ("min_p", 0.05), ("repetition_penalty", 1.05),
     ("generation_kwargs", {"top_p": 0.8})],
)  # fmt: skip
def test_sampling_the_loss_does_not_apply_is_refused(tmp_path, key, value):
    """TRL's loss applies the temperature only: a sampler truncated or penalised otherwise
    would train on log-probs of another distribution. TRL's defaults pass."""
    base = dict(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to=[])
    check_sampling_settings(GRPOConfig(**base))
    check_sampling_settings(GRPOConfig(**base, min_p=0.0, top_k=0, top_p=1.0))
    with pytest.raises(ValueError, match="samples with the temperature only") as err:
        check_sampling_settings(GRPOConfig(**base, **{key: value}))
    assert f"{key}={value!r}" in str(err.value) and "\n" not in str(err.value)


def test_trl_train_refuses_top_p_below_one_in_one_line(tmp_path):
    """Before any question, server or model is touched (no server runs here): exit 2 and one
    `hdr: error:` line naming the setting."""
    done = subprocess.run(
        [sys.executable, "-m", "hdr", "trl-train", "--config",
         str(REPO / "configs/trl/tiny-cpu.yaml"), f"trl.output_dir={tmp_path}", "trl.top_p=0.9"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    # (transformers may warn above it about the config's `gradient_checkpointing` key)
    (line,) = [x for x in done.stderr.splitlines() if x.startswith("hdr: error:")]
    assert done.stderr.strip().endswith(line)
    assert line.startswith("hdr: error: hdr's rollout in TRL samples with the temperature only")
    assert "top_p=0.9" in line
    assert not any(tmp_path.iterdir())  # nothing written


def test_resume_from_a_trl_checkpoint_keeps_the_buffer(
    sft_policy, retrieval_url, small_qa, tmp_path
):
    """Defect 8: the buffer is in TRL's checkpoint and a resumed trainer starts with it."""
    replay = TRLReplayConfig(
        replay=ReplayConfig(rule="headroom_drift", budget=2, capacity=8, tau=10.0)
    )
    first = make_trainer(sft_policy, retrieval_url, small_qa, tmp_path, replay, max_steps=2,
                         save_strategy="steps", save_steps=2)  # fmt: skip
    first.train()
    saved = [(g.group_id, g.replay_count, g.headroom) for g in first.replay.lifecycle.groups()]
    checkpoint = tmp_path / "trl" / "checkpoint-2"
    # the replay state in the one format hdr's own checkpoints hold, read by their reader
    assert saved and (checkpoint / "replay.pt").is_file()
    read_back = replay.replay.make_replay(0, 2)
    Checkpoint(checkpoint, 2).restore_replay(read_back)
    assert [(g.group_id, g.replay_count, g.headroom) for g in read_back.groups()] == saved
    again = make_trainer(sft_policy, retrieval_url, small_qa, tmp_path, replay, max_steps=3)
    again.train(resume_from_checkpoint=str(tmp_path / "trl" / "checkpoint-2"))
    assert [h["step"] for h in again.replay.history] == [1, 2, 3]  # restored, then step 3
    step3 = again.replay.history[-1]
    assert step3["step"] == 3 and step3["replayed"]  # step 3 replays the restored groups
    assert set(step3["replayed"]) <= {name for name, _, _ in saved}
    assert G == 4
