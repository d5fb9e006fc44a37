"""hdr's GRPO trainer around the replay primitive (`headroom_drift`): the step, its record and
the loop, teacher-forced scoring, the update, checkpoints and several processes in this folder;
the settings in `config/`, rollout workers in `async_rollout/`, SFT, calibration and memory
planning in `tools/`, TRL and veRL in `integrations/`."""
