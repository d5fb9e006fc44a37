"""DeepSpeed sits in every dependency set that runs `hdr trl-train` across processes (the
CPU tests' environments and the GPU set), pinned alike, and is the version installed here."""

from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib")  # Python 3.11+
ROOT = Path(__file__).resolve().parents[2]


def extras() -> dict[str, dict[str, Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {
        extra: {Requirement(line).name: Requirement(line) for line in lines}
        for extra, lines in project["optional-dependencies"].items()
    }


def test_deepspeed_is_pinned_alike_in_its_extra_and_the_gpu_set() -> None:
    sets = extras()
    pin = sets["deepspeed"]["deepspeed"]
    assert str(pin.specifier).startswith("=="), pin
    assert sets["gpu"]["deepspeed"].specifier == pin.specifier


def test_the_gpu_set_holds_a_trl_inside_the_trl_extras_range() -> None:
    """`hdr trl-train` runs in the GPU image, which installs the `gpu` extra only."""
    sets = extras()
    pin = sets["gpu"]["trl"]
    assert str(pin.specifier).startswith("=="), pin
    assert sets["trl"]["trl"].specifier.contains(str(pin.specifier).removeprefix("=="))


def test_both_test_environments_install_the_deepspeed_extra() -> None:
    makefile = (ROOT / "Makefile").read_text()
    for target in ("$(VENV)/.installed:", "$(VENV_VLLM)/.installed:"):
        recipe = makefile.split(target, 1)[1].split("\n\n", 1)[0]
        installs = re.findall(r'pip install -q -e "\.\[([^\]]+)\]"', recipe)
        assert installs and "deepspeed" in installs[0].split(","), (target, installs)


def test_the_installed_deepspeed_is_the_pinned_one() -> None:
    pin = extras()["deepspeed"]["deepspeed"]
    assert pin.specifier.contains(metadata.version("deepspeed")), metadata.version("deepspeed")
