"""``scripts/dev.sh`` installs torch from the public index by default (CI reaches only that) and from
``TRAINPROOF_TORCH_INDEX_URL`` when set (PyTorch's CPU-only wheels). Checked with a stand-in ``python`` in a
throw-away virtualenv folder that records its arguments instead of installing anything."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from tests.support.timing import budget
from tests.test_infra import tool

ROOT = Path(__file__).resolve().parent.parent
STUB = """#!/bin/sh
echo "$*" >> "$(dirname "$0")/../calls.log"
"""


def _setup_calls(tmp_path: Path, **env: str) -> list[str]:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "trainproof"):
        (venv / "bin" / name).write_text(STUB)
        (venv / "bin" / name).chmod(0o755)
    full = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}, "TRAINPROOF_VENV": str(venv), **env}
    result = subprocess.run(["bash", str(ROOT / "scripts" / "dev.sh"), "ls", "--store", "x"], env=full,
                            capture_output=True, text=True, timeout=budget(60))
    assert result.returncode == 0, result.stderr
    return (venv / "calls.log").read_text().splitlines()


def test_torch_comes_from_the_public_index_by_default(tmp_path):
    calls = _setup_calls(tmp_path)
    torch_line = next(c for c in calls if "torch==" in c)
    assert torch_line == "-m pip install -q torch==2.13.0" and "--index-url" not in " ".join(calls)


def test_trainproof_torch_index_url_switches_the_torch_install_only(tmp_path):
    calls = _setup_calls(tmp_path, TRAINPROOF_TORCH_INDEX_URL="https://download.pytorch.org/whl/cpu")
    torch_line = next(c for c in calls if "torch==" in c)
    assert torch_line == "-m pip install -q --index-url https://download.pytorch.org/whl/cpu torch==2.13.0"
    assert sum("--index-url" in c for c in calls) == 1  # the rest (trainproof, its extras) from the usual index
    assert calls[-1] == "ls --store x"


def test_dev_script_passes_shellcheck():
    out = subprocess.run([tool("shellcheck"), "--severity=style", str(ROOT / "scripts" / "dev.sh"),
                          str(ROOT / "scripts" / "loaded-test.sh")],
                         capture_output=True, text=True, timeout=budget(60))
    assert out.returncode == 0, out.stdout
