"""GRPO with Headroom-Drift Replay, teacher-forced scoring, evaluation and checkpoints."""
