"""The repository stands on its own (no file points outside it to the project's notes), and
its packages import one another only as docs/design.md's table of rooms allows."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_no_file_refers_to_shared_notes_outside_the_repository() -> None:
    files = subprocess.run(
        ["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    assert "README.md" in files and "docs/design.md" in files and "docs/cpu-bed.md" in files
    outside = "../" + "shared"  # spelled in two parts so this file does not match itself
    offenders = [
        name
        for name in files
        if (REPO / name).is_file()
        and outside in (REPO / name).read_bytes().decode("utf-8", errors="ignore")
    ]
    assert offenders == []


ROOMS_TABLE = REPO / "docs" / "design.md"
PRIMITIVE = {
    "trainer/grpo.py": {"torch"},
    "trainer/replay.py": {"torch", "trainer.grpo"},
    "trainer/gate.py": {"torch"},
    "trainer/primitive.py": {"torch", "trainer.gate", "trainer.grpo", "trainer.replay"},
}


def design_rules() -> dict[str, set[str]]:
    """docs/design.md's table of rooms: room -> the hdr modules or packages it may import
    ("everything" for the command on top)."""
    rules: dict[str, set[str]] = {}
    for line in ROOMS_TABLE.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`") and cells[0].endswith("/`"):
            room = cells[0].strip("`/")
            allowed = cells[2]
            if allowed == "everything":
                rules[room] = {"*"}
            elif allowed == "nothing of hdr":
                rules[room] = set()
            else:  # "`core`, `retrieval_server.api` (why), ..."
                rules[room] = set(re.findall(r"`([a-z_.]+)`", allowed))
    return rules


def imports_of(path: Path) -> set[str]:
    """Every module `path` imports, at any depth of the file (absolute imports)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_every_import_follows_the_rooms_of_docs_design() -> None:
    rules = design_rules()
    assert set(rules) == {
        "core", "retrieval_server", "agent_env", "models", "trainer", "evaluation", "hdr"
    }  # fmt: skip
    rooms = set(rules)
    broken = []
    for room, allowed in rules.items():
        for path in sorted((REPO / room).rglob("*.py")):
            for module in imports_of(path):
                top = module.split(".")[0]
                if top not in rooms or top == room or "*" in allowed:
                    continue
                if not any(module == a or module.startswith(a + ".") for a in allowed):
                    broken.append(f"{path.relative_to(REPO)} imports {module}")
    assert broken == [], "\n".join(sorted(set(broken)))


def test_the_replay_primitive_imports_only_torch() -> None:
    for name, allowed in PRIMITIVE.items():
        outside = {
            m
            for m in imports_of(REPO / name)
            if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"}
            and not any(m == a or m.startswith(a + ".") for a in allowed)
        }
        assert outside == set(), f"{name} imports {sorted(outside)}"


def test_the_rule_catches_a_forbidden_import(tmp_path: Path) -> None:
    """The checker itself: a trainer module importing evaluation is found."""
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from evaluation.metrics import mean_at_k\n")
    assert "evaluation.metrics" in imports_of(bad)
    assert not any(
        m == a or m.startswith(a + ".")
        for m in imports_of(bad)
        if m.startswith("evaluation")
        for a in design_rules()["trainer"]
    )
