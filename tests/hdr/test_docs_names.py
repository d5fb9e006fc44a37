"""Every module, class, function and config key that docs/*.md names in backticks resolves, so
the docs cannot drift from the code again: a dotted path that starts with one of hdr's
packages imports (`trainer.replay.headroom`), a path into the repository exists
(`trainer/loop.py`, `configs/tiny-cpu.yaml`), and a dotted key whose first part is a section or
key of one of the commands' configs is a key of one of them (`replay.adaptive_gate.target`)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"core", "headroom_drift", "retrieval_server", "agent_env", "models", "trainer",
            "evaluation", "experiment", "hdr"}  # fmt: skip
FOLDERS = PACKAGES | {"tests", "bench", "configs", "docker", "docs"}
# `eval.jsonl` and `model.safetensors` are files, not the keys `eval.` and `model.` begin
FILE_SUFFIX = re.compile(
    r"\.(py|md|json|jsonl|yaml|yml|safetensors|npy|faiss|txt|gz|sh|png|bin|index|parquet"
    r"|lock|toml|csv|log|pt)$"
)
# veRL's own config keys (docs/integrations.md) whose first part is also one of hdr's names (a
# package, a config section): named as veRL's, not resolved in hdr
FOREIGN = ("trainer.use_v1", "trainer.v1.", "data.tool_config_path")
DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"[\w.\-]+(?:/[\w.\-]*)+")


def named_in_docs() -> list[tuple[str, str, str]]:
    """(page:line, text, the line's whole text) of every inline code span of docs/*.md (fenced
    blocks left out: their commands and sketches are checked where they run)."""
    spans = []
    for page in sorted((REPO / "docs").glob("*.md")):
        text = re.sub(r"```.*?```", lambda m: "\n" * m.group(0).count("\n"), page.read_text(),
                      flags=re.S)  # fmt: skip
        lines = text.splitlines()
        for match in re.finditer(r"`([^`]+)`", text):  # a span may wrap onto the next line
            line = text.count("\n", 0, match.start()) + 1
            span = " ".join(match.group(1).split())
            spans.append((f"{page.name}:{line}", span, lines[line - 1]))
    return spans


def config_keys() -> tuple[set[str], set[str]]:
    """Every dotted key of every config a command reads (sections too), and the keys whose
    value is a free mapping (any key below them is the mapping's)."""
    import hdr.cli  # noqa: F401  (registers every command's config)
    from core.options import CONFIG_MODELS

    keys: set[str] = set()
    free: set[str] = set()

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            annotation = field.annotation
            nested = [
                t for t in (annotation, *getattr(annotation, "__args__", ()))
                if isinstance(t, type) and issubclass(t, BaseModel)
            ]  # fmt: skip
            keys.add(prefix + name)
            if nested:
                walk(nested[0], prefix + name + ".")
            elif getattr(annotation, "__origin__", None) is dict:
                free.add(prefix + name)

    for spec in set(CONFIG_MODELS.values()):
        module, _, name = spec.partition(":")
        walk(getattr(importlib.import_module(module), name), "")
    return keys, free


def resolves(dotted: str) -> bool:
    """Whether `dotted` is a module, or a module's attribute chain (a dataclass's or a pydantic
    model's field counts as an attribute)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            found: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            fields = {
                **getattr(found, "__dataclass_fields__", {}),
                **getattr(found, "model_fields", {}),
            }
            if attr in fields and not hasattr(found, attr):
                return attr == parts[-1]  # a field: nothing to look up below it
            if not hasattr(found, attr):
                return False
            found = getattr(found, attr)
        return True
    return False


def unresolved(spans: list[tuple[str, str, str]]) -> list[str]:
    """One line for each span that names what the code does not have. A key renamed since
    (`trainer.config.history.RENAMED_KEYS`) may be named only beside its new name."""
    from trainer.config.history import RENAMED_KEYS

    keys, free = config_keys()
    tops = {key.split(".")[0] for key in keys}
    bad = []
    for place, span, line in spans:
        where = f"{place}: `{span}`"
        if span.startswith(FOREIGN):
            continue
        first = span.split()[0]
        path = PATH.match(first)
        if path and path.group(0).split("/")[0] in FOLDERS:
            if not (REPO / path.group(0)).exists():
                bad.append(f"{where}: no such file or folder")
            continue
        dotted = DOTTED.match(span)
        if not dotted or FILE_SUFFIX.search(dotted.group(0)):
            continue
        name, after = dotted.group(0), span[dotted.end() :]
        head = name.split(".")[0]
        if head in PACKAGES:
            if not resolves(name):
                bad.append(f"{where}: {name} does not import")
        elif head in tops and not after.startswith("("):  # a call is code, not a key
            known = name in keys or any(name.startswith(f + ".") for f in free)
            if not known and not (name in RENAMED_KEYS and RENAMED_KEYS[name] in line):
                bad.append(f"{where}: no config key {name}")
    return bad


def test_every_name_in_the_docs_resolves() -> None:
    spans = named_in_docs()
    assert len(spans) > 1000  # the docs are read, not skipped
    assert unresolved(spans) == []


@pytest.mark.parametrize(
    ("span", "says"),
    [
        ("trainer.loop.rollout_fresh", "does not import"),
        ("trainer.nowhere", "does not import"),
        ("trainer.replay.StoredGroup", "does not import"),
        ("distributed.strategy", "no config key"),
        ("trainer/nowhere.py", "no such file"),
        ("replay.gate_target", "no config key"),
        ("async_rollout.adapt_rate=0.1", "no config key"),
    ],
)
def test_the_check_finds_a_stale_name(span: str, says: str) -> None:
    """The checker itself: names the code no longer has are found; the ones it has are not."""
    assert [says in line for line in unresolved([("x.md:1", span, span)])] == [True]


@pytest.mark.parametrize(
    "span",
    [
        "trainer.fresh.FreshBatch",
        "headroom_drift.StoredGroup.gen_logprobs",
        "headroom_drift/lifecycle.py",
        "trainer/fresh.py",
        "replay.adaptive_gate.target=0.5",
        "trl.max_steps",
        "eval.jsonl",
        "replay.select(step, score, fresh)",
    ],
)
def test_the_check_passes_a_current_name(span: str) -> None:
    assert unresolved([("x.md:1", span, span)]) == []


def test_an_old_key_is_named_only_beside_its_new_one() -> None:
    beside = "`replay.gate_target` is now `replay.adaptive_gate.target`"
    assert unresolved([("x.md:1", "replay.gate_target", beside)]) == []
    alone = "set `replay.gate_target` to hold the share"
    assert len(unresolved([("x.md:1", "replay.gate_target", alone)])) == 1
