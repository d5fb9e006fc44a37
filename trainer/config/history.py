"""How the trainer's settings changed since hdr first recorded them: keys renamed, added and
removed. A user's config that names an old key is refused in one line naming the new one (or
saying it went); what hdr itself wrote earlier (a run's config.yaml, the settings a finished
run or an SFT start recorded) is read as today's settings (`read_as_today`)."""

from __future__ import annotations

from typing import Any

from core.config import drop_removed, move_renamed

RENAMED_KEYS = {
    "arm": "replay.rule",
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
    "retrieval.routing": "rotate",
    "model.train_layers": None,
    "model.bottom_cache_dtype": "bfloat16",
    "model.bottom_cache_mib": 1024,
    "sft.train_layers": None,
    "grpo.skip_zero_advantage": False,
    "generation.kv_cache_gib": None,
    "replay.survey": "off",
}
"""Keys added since hdr first recorded a run's settings, each with the value that does what hdr
did before it: settings recorded without the key are compared as if they held it
(`core.config.fill_added`), so a finished run or SFT start is still reused."""

REMOVED_KEYS: dict[str, tuple[Any, str]] = {
    "distributed.strategy": (
        "ddp",
        "hdr's loop trains with DistributedDataParallel only; sharded training (FSDP, ZeRO) is"
        " the TRL integration's (docs/integrations.md)",
    ),
    "async_rollout.over_gate": (
        "buffer",
        "a late group the staleness rule rejects always enters the replay buffer, where the"
        " replay gate decides whether it trains again",
    ),
}
"""Keys an earlier hdr read and today's does not, each with the value that did what hdr does
now and why it went. A run or recorded settings holding that value are read without the key;
any other value is refused (hdr no longer does what it asked for)."""


def read_as_today(written: dict[str, Any]) -> dict[str, Any]:
    """Settings hdr wrote earlier, under today's keys: renamed keys moved, removed keys that
    held today's behaviour dropped."""
    return drop_removed(move_renamed(written, RENAMED_KEYS), REMOVED_KEYS)
