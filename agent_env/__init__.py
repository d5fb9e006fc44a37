"""The Search-R1 style multi-turn rollout loop, rewards, QA data and generation backends."""
