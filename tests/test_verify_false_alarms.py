"""Correct tasks a user writes from docs/tasks.md pass the default ``verify`` (issue 38, item 6):

- a model that normalises over the batch (BatchNorm in training mode): the objective check's unequal split changes
  the batch statistics, so it is reported not applicable with the reason (never a failure blaming the loss), and,
  when the task itself accumulates micro-batches, a finding naming the BatchNorm modules;
- a ``DatasetTask`` whose collate draws random numbers (mixup): the export's evaluation, and its reload check in a
  fresh process, draw from generators seeded from a constant, so the metric is reproduced; the objective check is
  not applicable (the split draws other numbers) unless ``eval_collate`` switches the draws off.

The three verifications run concurrently (real ``python -m trainproof verify`` processes, 8 samples: epochs of 2
steps). The audit across a world change is in tests/test_verify_audit.py.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tests.test_verify_helpers import ROOT, clean_env, read_report

TASKS = '''
    import numpy as np
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset, default_collate

    from trainproof.tasks import DatasetTask

    X = torch.linspace(-1, 1, 24).unsqueeze(1)


    def squared_error(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).squeeze(1)


    def normalised():
        return nn.Sequential(nn.Linear(1, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


    def grouped():
        return nn.Sequential(nn.Linear(1, 8), nn.GroupNorm(2, 8), nn.Tanh(), nn.Linear(8, 1))


    def plain():
        return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1))


    def mixup(samples):
        x, y = default_collate(samples)
        lam = float(np.random.beta(0.4, 0.4))  # NumPy's and torch's global generators
        perm = torch.randperm(len(x))
        return lam * x + (1 - lam) * x[perm], lam * y + (1 - lam) * y[perm]


    def factory(config):
        kind = config["kind"]
        data = TensorDataset(X, 2 * X + 1)
        model = {"bn": normalised, "bn_accum": normalised, "groupnorm": grouped}.get(kind, plain)
        return DatasetTask(
            dataset=data, build_model=model, per_sample_loss=squared_error, config=dict(config), batch_size=4,
            micro_batch_size=2 if kind == "bn_accum" else None, optimizer="adam", lr=0.01,
            collate=mixup if kind.startswith("mixup") else default_collate,
            eval_collate=default_collate if kind == "mixup_eval" else None, eval_dataset=data, verify_samples=8)
'''
RUNS = {"bn": [], "bn_accum": ["--no-export"], "mixup": []}
"""The verifications, each the default one (the accumulating variant without its export, which the first has)."""


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """Each kind's verify (exit code, output, report), run together."""
    d = tmp_path_factory.mktemp("falsealarm")
    (d / "falsealarm.py").write_text(textwrap.dedent(TASKS))
    procs = {}
    for kind, extra in RUNS.items():
        (d / f"{kind}.json").write_text(json.dumps({"kind": kind}))
        argv = [sys.executable, "-m", "trainproof", "verify", "--store", str(d / kind), "--task", "falsealarm:factory",
                "--config", str(d / f"{kind}.json"), "--id", "v", *extra]
        procs[kind] = subprocess.Popen(argv, cwd=ROOT, env=clean_env({"PYTHONPATH": str(d)}), text=True,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    out = {}
    for kind, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=900)
        out[kind] = (proc.returncode, " ".join((stdout + stderr).split()), read_report(str(d / kind), "v"))
    return out


def test_a_batchnorm_model_passes_with_the_objective_check_not_applicable(verified):
    code, output, report = verified["bn"]
    assert code == 0, output[-3000:]
    assert report["all_checks_passed"] is True and report["failing_checks"] == [] and report["diagnosis"] == []
    why = "the model normalises over the batch (BatchNorm: 1 (BatchNorm1d)): a split changes its statistics"
    assert report["objective_equivalence"] == {"not_applicable": why, "batch_norm": ["1 (BatchNorm1d)"]}
    assert "objective_equivalence_passed" not in report  # no verdict: nothing was judged
    assert f"objective_equivalence: not applicable: {why}" in output
    assert report["findings"] == []  # one micro-batch a step, one rank: nothing is trained otherwise
    assert report["export"]["reload_check"]["passed"] is True


def test_a_batchnorm_model_that_accumulates_micro_batches_is_a_finding_naming_batchnorm(verified):
    code, output, report = verified["bn_accum"]
    assert code == 0, output[-3000:]
    assert report["all_checks_passed"] is True and report["diagnosis"] == []
    assert report["objective_equivalence"]["not_applicable"].startswith("the model normalises over the batch")
    [finding] = report["findings"]
    assert finding["check"] == "objective_equivalence" and finding["modules"] == ["1 (BatchNorm1d)"]
    assert "micro-batches of 2 in steps of 4" in finding["finding"] and "BatchNorm: 1 (BatchNorm1d)" in finding["finding"]
    assert "finding: BatchNorm over a split step" in output


def test_a_mixup_collate_passes_with_its_export_reproduced_in_a_fresh_process(verified):
    code, output, report = verified["mixup"]
    assert code == 0, output[-3000:]
    assert report["all_checks_passed"] is True
    reload = report["export"]["reload_check"]
    assert reload["passed"] is True, reload
    assert "still draw random numbers" in report["objective_equivalence"]["not_applicable"]


def test_the_objective_check_applies_to_groupnorm_and_to_mixup_with_an_eval_collate(tmp_path, monkeypatch):
    """GroupNorm normalises each sample on its own, and an eval_collate switches mixup's draws off: the check applies
    (in-process: what the verifier decides before it starts any run)."""
    from trainproof.proof.objective import not_applicable
    from trainproof.tasks import load_task

    (tmp_path / "falsealarm.py").write_text(textwrap.dedent(TASKS))
    monkeypatch.syspath_prepend(str(tmp_path))
    for kind in ("groupnorm", "mixup_eval", "plain"):
        assert not_applicable(load_task("falsealarm:factory", {"kind": kind}), 1) is None, kind
    assert not_applicable(load_task("falsealarm:factory", {"kind": "mixup"}), 1) is not None
    bn = not_applicable(load_task("falsealarm:factory", {"kind": "bn"}), 2)  # two ranks split the step too
    assert bn is not None and "2 ranks" in bn.findings()[0]["finding"]
