"""How the trainer's settings changed since hdr first recorded them: keys renamed and keys
added. A user's config that names an old key is refused in one line naming the new one; what
hdr itself wrote earlier (a run's config.yaml, the settings a finished run or an SFT start
recorded) is read as today's settings."""

from __future__ import annotations

RENAMED_KEYS = {
    "replay.gate_target": "replay.adaptive_gate.target",
    "replay.gate_target_kind": "replay.adaptive_gate.target_kind",
    "replay.gate_rate": "replay.adaptive_gate.rate",
    "async_rollout.target": "async_rollout.adaptive_gate.target",
    "async_rollout.target_kind": "async_rollout.adaptive_gate.target_kind",
    "async_rollout.adapt_rate": "async_rollout.adaptive_gate.rate",
}
"""Keys an earlier hdr read, and the keys their values are under now (the replay and the
staleness gate share one set of names). A config that names one is refused in one line naming
the new key; a config hdr itself wrote (a run's config.yaml, a run's recorded settings: they
hold every key) is read with the values moved (`core.config.move_renamed`)."""

ADDED_KEYS = {
    "data.train_questions": None,
    "rollout.max_query_words": None,
    "sft.query": "verbatim",
    "sft.answer": "gold_if_seen",
    "sft.queries_per_question": 1,
    "async_rollout.devices": [],
}
"""Keys added since hdr first recorded a run's settings, each with the value that does what hdr
did before it: settings recorded without the key are compared as if they held it
(`core.config.fill_added`), so a finished run or SFT start is still reused."""
