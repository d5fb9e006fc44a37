"""hdr's GRPO trainer around the replay primitive (`headroom_drift`): the step and the loop,
teacher-forced scoring, the update, checkpoints, SFT, calibration, several processes, and TRL
and veRL integrations."""
