"""``trainproof plan --measure``: real timings from a scratch run beside the run, fed to the planner."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.timing import budget
from tests.test_train_helpers import ROOT, train_env


def test_measure_plans_from_real_timings_in_a_scratch_run(tmp_path):
    store = tmp_path / "run"
    argv = [sys.executable, "-m", "trainproof", "plan", "--measure", "--store", str(store), "--task", "regression",
            "--rental", "3d", "--steps", "3", "--json"]
    proc = subprocess.run(argv, cwd=ROOT, env=train_env(), capture_output=True, text=True, timeout=budget(300))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    measured = doc["measured"]
    assert measured["step_s"] > 0 and measured["checkpoint_s"] > 0 and measured["export_s"] > 0
    assert measured["checkpoints"] == 3
    assert doc["inputs"]["checkpoint_s"] == measured["checkpoint_s"]
    assert doc["inputs"]["export_s"] == measured["export_s"] and doc["inputs"]["step_s"] == measured["step_s"]
    assert doc["interval_s"] > 0 and doc["interval_steps"] > 0
    # Only the scratch run was written: the run itself holds no generation.
    assert measured["scratch"].startswith(str(store / "plan-measure"))
    assert not list(store.glob("step-*"))


def test_measure_needs_a_store():
    proc = subprocess.run([sys.executable, "-m", "trainproof", "plan", "--measure", "--rental", "3d"], cwd=ROOT,
                          env=train_env(), capture_output=True, text=True, timeout=budget(60))
    assert proc.returncode == 2 and "--store" in proc.stderr
