"""ruff (pycodestyle, pyflakes, import order; line length 120; configured in pyproject.toml) over the product, the
benchmarks, the examples and the tests: part of the test command, so a lint failure fails the suite like any test."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECKED = ("trainproof", "bench", "examples", "tests")


def _ruff() -> str:
    beside = Path(sys.executable).parent / "ruff"  # the virtualenv's own (test extras), not whatever is on PATH
    found = str(beside) if beside.exists() else shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (it comes with the test extras: pip install -e '.[test]')")
    return found


def test_ruff_is_clean():
    result = subprocess.run([_ruff(), "check", "--no-cache", *CHECKED], cwd=ROOT, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_catches_a_violation(tmp_path):
    """The check can fail: an unused import and an over-long line in a file under the same configuration."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n" + "x = '" + "y" * 130 + "'\n")
    result = subprocess.run([_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "F401" in result.stdout and "E501" in result.stdout, result.stdout
