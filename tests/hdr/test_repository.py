"""The repository stands on its own (no file points outside it to the project's notes), its
packages import one another only as docs/design.md's table of rooms allows, the replay
primitive imports torch and numpy only, the trainer's and the retrieval server's modules import
one another without a circle, and no file of the retrieval server is over 500 lines."""

from __future__ import annotations

import ast
import graphlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
PRIMITIVE = "headroom_drift"
PRIMITIVE_MAY_IMPORT = {"torch", "numpy", PRIMITIVE}  # and the standard library


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
        "core", "headroom_drift", "retrieval_server", "agent_env", "models", "trainer",
        "evaluation", "experiment", "hdr",
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


def test_evaluation_imports_nothing_from_the_trainer() -> None:
    """Evaluating a saved model needs no trainer: the experiment, which trains, is a room above
    both (the table allows evaluation only `core` and `agent_env`; this says so on its own)."""
    assert design_rules()["evaluation"].isdisjoint({"trainer", "experiment"})
    found = [
        f"{path.relative_to(REPO)} imports {module}"
        for path in sorted((REPO / "evaluation").rglob("*.py"))
        for module in imports_of(path)
        if module.split(".")[0] in ("trainer", "experiment")
    ]
    assert found == []


def module_graph(room: str, root: Path = REPO) -> dict[str, set[str]]:
    """The modules of `room` (dotted names) and, for each, the modules of `room` it imports
    (at any depth of the file, under TYPE_CHECKING too)."""
    paths = {
        ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): path
        for path in (root / room).rglob("*.py")
    }
    return {
        name: {m for m in imports_of(path) if m in paths and m != name}
        for name, path in paths.items()
    }


def test_the_trainers_modules_import_one_another_without_a_circle() -> None:
    graph = module_graph("trainer")
    workers = "trainer.async_rollout.workers"
    assert {"trainer.step", "trainer.loop", "trainer.fresh", workers, "trainer.run",
            "trainer.tools.sft", "trainer.config"} <= set(graph)  # fmt: skip
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(f"the trainer's imports run in a circle: {err.args[1]}") from None
    assert len(order) == len(graph)
    # the rooms the issue of the circle named: the step and the workers share fresh.py
    assert "trainer.fresh" in graph["trainer.step"] & graph[workers]
    assert workers not in graph["trainer.step"] | graph["trainer.run"]
    assert "trainer.step" not in graph[workers]
    # the loop's modules need none of the tools beside it (SFT, calibration, memory planning)
    loop = {"trainer.step", "trainer.loop", "trainer.run", "trainer.update", "trainer.fresh"}
    assert not any(m.startswith("trainer.tools.") for name in loop for m in graph[name])


def test_the_trainers_files_stay_readable() -> None:
    """One step reads in one short file, and no file of the trainer grows past 500 lines."""
    lines = {
        str(path.relative_to(REPO)): len(path.read_text().splitlines())
        for path in (REPO / "trainer").rglob("*.py")
    }
    assert lines["trainer/step.py"] <= 200
    assert {name: n for name, n in lines.items() if n > 500} == {}


def test_the_circle_check_finds_a_circle(tmp_path: Path) -> None:
    """The checker itself: a module importing another inside a function, which imports it
    back under TYPE_CHECKING, is a circle."""
    (tmp_path / "room").mkdir()
    (tmp_path / "room" / "a.py").write_text("def f():\n    from room.b import g\n")
    (tmp_path / "room" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from room import a\n"
    )
    graph = module_graph("room", tmp_path)
    assert graph == {"room.a": {"room.b"}, "room.b": {"room.a"}}
    with pytest.raises(graphlib.CycleError):
        list(graphlib.TopologicalSorter(graph).static_order())


def outside_the_primitive(path: Path) -> set[str]:
    """What `path` imports beyond the standard library, torch, numpy and the package itself."""
    return {
        m
        for m in imports_of(path)
        if m.split(".")[0] not in sys.stdlib_module_names | {"__future__"} | PRIMITIVE_MAY_IMPORT
    }


def test_the_replay_primitive_imports_only_torch_and_numpy() -> None:
    files = sorted((REPO / PRIMITIVE).rglob("*.py"))
    assert {"lifecycle.py", "selection.py", "rules.py", "gates.py"} <= {f.name for f in files}
    found = {f"{f.relative_to(REPO)}": sorted(outside_the_primitive(f)) for f in files}
    assert {name: out for name, out in found.items() if out} == {}


def test_the_primitive_rule_catches_an_hdr_import(tmp_path: Path) -> None:
    """The checker itself: an import of hdr's own plumbing, even lazily, or of another library,
    is found."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import numpy as np\nimport safetensors\ndef f():\n    from core.errors import UserError\n"
    )
    assert outside_the_primitive(bad) == {"safetensors", "core.errors", "core.errors.UserError"}


def test_no_file_under_the_primitive_is_over_400_lines() -> None:
    long = {
        f.name: n
        for f in (REPO / PRIMITIVE).rglob("*.py")
        if (n := len(f.read_text().splitlines())) > 400
    }
    assert long == {}


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


RETRIEVAL = "retrieval_server"
RETRIEVAL_WINGS = ("serving", "index", "upstream", "fleet", "web", "snapshot")


def test_the_retrieval_servers_modules_import_one_another_without_a_circle() -> None:
    graph = module_graph(RETRIEVAL)
    assert {f"{RETRIEVAL}.{wing}" for wing in RETRIEVAL_WINGS} <= set(graph)
    try:
        order = list(graphlib.TopologicalSorter(graph).static_order())
    except graphlib.CycleError as err:
        raise AssertionError(
            f"the retrieval server's imports run in a circle: {err.args[1]}"
        ) from None
    assert len(order) == len(graph)
    # the spend ledger knows the proxy's settings, never the proxy
    assert "retrieval_server.upstream.proxy" not in graph["retrieval_server.upstream.spend"]
    # an index is built and opened without the server: the index wing imports no other wing
    index = {name for name in graph if name.startswith(f"{RETRIEVAL}.index")}
    assert {m for name in index for m in graph[name]} <= index


def test_no_file_of_the_retrieval_server_is_over_500_lines() -> None:
    long = {
        str(f.relative_to(REPO)): n
        for f in (REPO / RETRIEVAL).rglob("*.py")
        if (n := len(f.read_text().splitlines())) > 500
    }
    assert long == {}
