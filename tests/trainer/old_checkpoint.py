"""The settings of the run in tests/fixtures/old-checkpoint: its make.py ran them, and
test_old_checkpoint.py resumes its checkpoint with them."""

# 3 steps of 4 prompts x 4 responses, Headroom-Drift Replay with an adaptive gate, a
# checkpoint after every step, no held-out evaluation
OVERRIDES = [
    "steps=3", "grpo.batch_prompts=4", "grpo.group_size=4", "grpo.warmup_steps=1",
    "grpo.lr=1e-3", "grpo.micro_batch=8", "replay.budget=2", "replay.capacity=6",
    "replay.tau=1.0", "replay.gate=adaptive", "replay.adaptive_gate.target=0.5",
    "rollout.max_tokens_per_turn=16", "rollout.reward=f1", "rollout.format_weight=0.5",
    "eval.every=0", "checkpoint.save_every=1", "checkpoint.keep_last=3",
    "log.progress=false", "log.tensorboard=false",
]  # fmt: skip
