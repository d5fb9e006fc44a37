"""GRPO with Headroom-Drift Replay: the training loop, teacher-forced scoring, replay, SFT,
calibration and checkpoints."""
