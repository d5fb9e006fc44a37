"""The replay rules of `trainer.replay`, registered by name, as configs name them (`arm:`):
an unknown name is one line listing the valid ones, a duplicate name is refused. Kept apart
from `trainer.replay` so that the primitive itself imports nothing but torch."""

from __future__ import annotations

from core.registry import Registry
from trainer.replay import RULES, Selector

SELECTORS: Registry[Selector] = Registry("replay selector")
for _name, _rule in RULES.items():
    SELECTORS.register(_name)(_rule)
