"""Nothing named by a stored file is ever imported: the task comes from the command line or the environment.

A hostile writer of the bucket plants a module name in ``plan.json`` (or an export bundle's ``config.json``)
and a module of that name next to the process (here: in its working directory, which ``--task`` modules are
imported from). Importing it would run the writer's code with the pod's credentials; the module's only
effect on import is to create a canary file. Each entry point that reads a stored task name must refuse
with a one-line exit 2 naming both names, and the canary must stay absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trainproof.storage import open_store
from tests.support.timing import budget
from tests.test_train_helpers import ROOT, run

EVIL = "evilmod"
EVIL_SOURCE = """
import pathlib
pathlib.Path(__file__).with_name("CANARY").write_text("imported")
def factory(config):
    raise SystemExit(0)
"""


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """A regression run (4 steps) whose plan.json was rewritten to name the planted module."""
    d = tmp_path_factory.mktemp("trust")
    trained = run(d / "run", "--max-steps", "4")
    assert trained.code == 0, trained.stderr
    (d / f"{EVIL}.py").write_text(EVIL_SOURCE)
    plan_path = d / "run" / "plan.json"
    plan = json.loads(plan_path.read_text())
    plan["task"] = f"{EVIL}:factory"
    plan_path.write_text(json.dumps(plan))
    return d


def job(cwd: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m trainproof ARGS`` from ``cwd`` (where the planted module lies), this checkout importable."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}
    base["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "trainproof", *args], cwd=cwd, env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=budget(300))


def _refused(result: subprocess.CompletedProcess, cwd: Path) -> str:
    assert not (cwd / "CANARY").exists(), "the module named by a stored file was imported"
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("trainproof: error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_the_planted_module_would_run_if_imported(planted):
    """The fixture is armed: importing the planted module does create the canary (then it is removed)."""
    result = subprocess.run([sys.executable, "-c", f"import {EVIL}"], cwd=planted, capture_output=True)
    assert result.returncode == 0 and (planted / "CANARY").exists()
    (planted / "CANARY").unlink()


def test_export_never_imports_the_task_named_by_plan_json(planted):
    line = _refused(job(planted, "export", "--store", str(planted / "run")), planted)
    assert f"'{EVIL}:factory'" in line and "not a built-in task" in line and "--task" in line


def test_export_refuses_a_task_that_differs_from_plan_json(planted):
    line = _refused(job(planted, "export", "--store", str(planted / "run"), "--task", "regression"), planted)
    assert "--task 'regression'" in line and f"'{EVIL}:factory'" in line


def test_the_audit_never_imports_the_task_named_by_plan_json(planted):
    line = _refused(job(planted, "verify", "--store", str(planted / "run"), "--audit"), planted)
    assert f"'{EVIL}:factory'" in line
    line = _refused(job(planted, "verify", "--store", str(planted / "run"), "--audit", "--task", "regression"),
                    planted)
    assert "--task 'regression'" in line


def test_train_with_a_deadline_compares_plan_json_and_imports_nothing(planted):
    result = job(planted, "train", "--store", str(planted / "run"), "--task", "regression", "--max-steps", "6",
                 "--deadline", "10m")
    assert not (planted / "CANARY").exists()
    assert result.returncode == 2 and "task" in result.stderr, result.stderr


def test_the_reload_check_never_imports_the_task_named_by_a_bundle(tmp_path):
    """An export bundle whose config.json was rewritten (hashes recomputed, so it verifies) names the module."""
    trained = run(tmp_path / "run", "--max-steps", "4")
    assert trained.code == 0, trained.stderr
    assert job(tmp_path, "export", "--store", str(tmp_path / "run"), "--dest", str(tmp_path / "dest")).returncode == 0
    (tmp_path / f"{EVIL}.py").write_text(EVIL_SOURCE)
    source = open_store(str(tmp_path / "dest")).load(4)
    files = dict(source.files)
    config = json.loads(files["config.json"])
    config["task"] = f"{EVIL}:factory"
    files["config.json"] = json.dumps(config).encode()
    files["SHA256SUMS"] = "".join(f"{hashlib.sha256(v).hexdigest()}  {k}\n" for k, v in sorted(files.items())
                                  if k != "SHA256SUMS").encode()
    from trainproof.export.bundle import check_file

    forged = open_store(str(tmp_path / "forged"))
    forged.commit(4, files, contract="c", world=1, code_version="test", check=check_file,
                  digests={"export": "model_bf16.pt"})
    result = job(tmp_path, "reload-check", "--bundle", str(tmp_path / "forged"), "--step", "4", "--task", "regression")
    line = _refused(result, tmp_path)
    assert "--task 'regression'" in line and f"'{EVIL}:factory'" in line
