"""ruff (pycodestyle, pyflakes, import order; line length 120; configured in pyproject.toml) over the product, the
benchmarks, the examples and the tests: part of the test command, so a lint failure fails the suite like any test."""

from __future__ import annotations

import collections
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tests.support.timing import budget

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
                            timeout=budget(120))
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_catches_a_violation(tmp_path):
    """The check can fail: an unused import and an over-long line in a file under the same configuration."""
    bad = tmp_path / "bad.py"
    bad.write_text("import os\n" + "x = '" + "y" * 130 + "'\n")
    result = subprocess.run([_ruff(), "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"), str(bad)],
                            capture_output=True, text=True, timeout=budget(120))
    assert result.returncode == 1 and "F401" in result.stdout and "E501" in result.stdout, result.stdout


# --- Complexity and types: ceilings that may only fall ------------------------------------------------------------

COMPLEXITY_CEILING = 10
"""Functions of the product over ruff's McCabe limit (``[tool.ruff.lint.mccabe]``); lower it when one is simplified."""
BASELINE = ROOT / "tests" / "typecheck-baseline.txt"


def _complex_functions() -> list[str]:
    result = subprocess.run([_ruff(), "check", "--no-cache", "--select", "C901", "--output-format", "concise",
                             "trainproof"], cwd=ROOT, capture_output=True, text=True, timeout=budget(120))
    return [line for line in result.stdout.splitlines() if " C901 " in line]


def test_no_new_complex_function():
    found = _complex_functions()
    assert len(found) <= COMPLEXITY_CEILING, "more functions over the complexity limit than the ceiling:\n" + "\n".join(found)
    assert len(found) == COMPLEXITY_CEILING, f"{len(found)} now: lower COMPLEXITY_CEILING in tests/test_lint.py to it"


def _mypy_errors(*paths: str) -> list[str]:
    """mypy's errors as ``path: message  [code]`` (line numbers dropped: they move with every edit), sorted."""
    mypy = Path(sys.executable).parent / "mypy"
    if not mypy.exists():
        pytest.skip("mypy is not installed (it comes with the test extras: pip install -e '.[test]')")
    result = subprocess.run([str(mypy), *paths], cwd=ROOT, capture_output=True, text=True, timeout=budget(900))
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 2: mypy itself failed
    return sorted(re.sub(r"^([^:]+):\d+: error: ", r"\1: ", line) for line in result.stdout.splitlines()
                  if ": error: " in line)


def _excess(now: list[str], allowed: list[str]) -> list[str]:
    left = collections.Counter(allowed)
    left.subtract(collections.Counter(now))
    return sorted(line for line, n in left.items() if n < 0 for _ in range(-n))


def test_type_errors_only_shrink():
    """No error beyond the committed baseline; a fixed one must leave the baseline too, so it only shrinks."""
    now, allowed = _mypy_errors(), BASELINE.read_text().splitlines()
    new = _excess(now, allowed)
    assert not new, f"{len(new)} type error(s) not in {BASELINE.name}:\n" + "\n".join(new)
    fixed = _excess(allowed, now)
    assert not fixed, (f"{len(fixed)} error(s) of {BASELINE.name} are fixed: run `python tests/test_lint.py "
                       "--update-baseline` to shrink it")


def test_the_type_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("x: int = 'not a number'\n")
    assert any("Incompatible types in assignment" in line for line in _mypy_errors(str(bad)))


if __name__ == "__main__" and sys.argv[1:] == ["--update-baseline"]:
    errors = _mypy_errors()
    BASELINE.write_text("".join(f"{line}\n" for line in errors))
    print(f"{BASELINE}: {len(errors)} errors")
