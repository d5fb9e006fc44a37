"""Typed configs: pydantic models, YAML files as their instances, dotted CLI overrides.

`load_config(TrainConfig, "configs/tiny-cpu.yaml", ["replay.tau=0.05"])` reads the file,
applies each `a.b.c=value` override (value parsed as YAML, so numbers and lists work; an empty
value is refused, `key=null` is None), and validates. Unknown keys are errors (`StrictModel`
forbids extras) and every failure becomes one `UserError` line naming the offending key.
"""

from __future__ import annotations

import copy
import difflib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from core.errors import UserError

M = TypeVar("M", bound=BaseModel)


class StrictModel(BaseModel):
    """Base for every config section: unknown keys are refused, assignments re-validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set `a.b.c=value` in a nested dict, creating sections on the way."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise UserError(
            f"argument {override!r} is not a KEY=VALUE override (an option with several values"
            " is repeated: --data a.jsonl --data b.jsonl)"
        )
    parts = key.strip().split(".")
    node = data
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise UserError(f"override {override!r}: {part!r} is not a section")
        node = child
    if not raw.strip():  # `max_questions=` reads as a forgotten value, not as "no limit"
        raise UserError(
            f"{key.strip()}= has no value: give one, or write {key.strip()}=null for none"
            " (its default where that is none)"
        )
    node[parts[-1]] = yaml.safe_load(raw)


def _section(model: type[BaseModel], path: Sequence[Any]) -> type[BaseModel] | None:
    """The config model at dotted `path` below `model` (None where it is not a model)."""
    for part in path:
        field = model.model_fields.get(str(part))
        candidates = [field.annotation] if field is not None else []
        candidates += list(getattr(field.annotation, "__args__", ())) if field else []
        nested = [c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)]
        if not nested:
            return None
        model = nested[0]
    return model


def unknown_key_hint(model: type[BaseModel], loc: Sequence[Any]) -> str:
    """ "did you mean grpo.lr?" for an unknown key, else the valid keys of its section."""
    section = _section(model, loc[:-1])
    if section is None:
        return ""
    prefix = "".join(f"{p}." for p in loc[:-1])
    names = list(section.model_fields)
    close = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {prefix}{close[0]}?"
    return f"; valid keys{' in ' + prefix[:-1] if prefix else ''}: {', '.join(names)}"


def format_validation_error(err: ValidationError, model: type[BaseModel] | None = None) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"]) or "<root>"
    more = f" (and {err.error_count() - 1} more)" if err.error_count() > 1 else ""
    if first["type"] == "extra_forbidden":
        hint = unknown_key_hint(model, first["loc"]) if model is not None else ""
        return f"unknown config key {where}{hint}{more}"
    message = first["msg"].removeprefix("Value error, ")  # our validators' own sentences
    if not first["loc"]:  # a check across keys: its message names them and the fix
        return f"config: {message}{more}"
    return f"config key {where}: {message}{more}"


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping a YAML config file holds ({} for an empty file); UserError otherwise."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise UserError(f"config file {path} is not valid YAML: {err}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise UserError(f"config file {path} must hold a mapping at the top level")
    return loaded or {}


def merge_settings(under: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A copy of `under` with `over` laid on it section by section: a key `over` sets replaces
    the same key below it, the keys it leaves out stay (a list is one value, replaced whole)."""
    out = copy.deepcopy(under)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge_settings(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def build_config(model: type[M], data: dict[str, Any], overrides: Sequence[str] = ()) -> M:
    """Apply each `a.b.c=value` override to `data` (in place), then validate it as `model`."""
    for override in overrides:
        apply_override(data, override)
    try:
        return model.model_validate(data)
    except ValidationError as err:
        raise UserError(format_validation_error(err, model)) from None


def load_config(model: type[M], path: str | Path | None = None, overrides: Sequence[str] = ()) -> M:
    """`model` from the YAML file at `path` (or nothing) and dotted overrides."""
    return build_config(model, read_config_file(path) if path is not None else {}, overrides)


def lookup(data: Any, dotted: str) -> tuple[dict[str, Any], str] | None:
    """The mapping that holds the last part of `dotted` in `data`, and that part; None when
    `data` does not hold the key."""
    *parents, last = dotted.split(".")
    for part in parents:
        data = data.get(part) if isinstance(data, dict) else None
    return (data, last) if isinstance(data, dict) and last in data else None


def renamed_in(data: Any, renamed: dict[str, str]) -> str | None:
    """One line for the first old key of `renamed` (old dotted key -> new) that `data` holds:
    it names the new key and how to write the value there; None when it holds none."""
    for old, new in renamed.items():
        found = lookup(data, old)
        if found is not None:
            return f"{old} is now {new}: write {new}={found[0][found[1]]}"
    return None


def move_renamed(data: dict[str, Any], renamed: dict[str, str]) -> dict[str, Any]:
    """A copy of `data` with the value of each old dotted key of `renamed` moved to its new
    key: how hdr reads a config it wrote itself before a key was renamed."""
    out = copy.deepcopy(data)
    for old, new in renamed.items():
        found = lookup(out, old)
        if found is None:
            continue
        value = found[0].pop(found[1])
        *parents, last = new.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[last] = value
    return out


def fill_added(data: dict[str, Any], added: dict[str, Any]) -> dict[str, Any]:
    """A copy of `data` holding each dotted key of `added` (key -> the value that does what hdr
    did before the key existed) that it lacks, where its section is there: how settings hdr
    recorded before a key was added compare with today's."""
    out = copy.deepcopy(data)
    for dotted, value in added.items():
        *parents, last = dotted.split(".")
        node: Any = out
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last not in node:
            node[last] = copy.deepcopy(value)
    return out


def removed_in(data: Any, removed: dict[str, tuple[Any, str]]) -> str | None:
    """One line for the first key of `removed` (dotted key -> (the value that does what hdr
    does now, why it went)) that `data` holds; None when it holds none."""
    for dotted, (_, why) in removed.items():
        if lookup(data, dotted) is not None:
            return f"{dotted} was removed: {why}; drop it from the config"
    return None


def drop_removed(data: dict[str, Any], removed: dict[str, tuple[Any, str]]) -> dict[str, Any]:
    """A copy of `data` without each key of `removed` that holds the value doing what hdr does
    now: how hdr reads what it wrote itself before a key was removed (a key set otherwise is
    kept, for `removed_in` to refuse)."""
    out = copy.deepcopy(data)
    for dotted, (today, _) in removed.items():
        found = lookup(out, dotted)
        if found is not None and found[0][found[1]] == today:
            del found[0][found[1]]
    return out


def dump_config(config: BaseModel) -> str:
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
