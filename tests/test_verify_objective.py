"""The objective-equivalence check (trainproof.proof.objective): one micro-batch, unequal micro-batches and W ranks
train the same step within 1e-9 in float64, the mean-of-micro-batch-means negative control is detected (tinylm,
one rank and two), and a user's ``loss_sum`` that returns a mean fails ``verify`` with the objective check named.

Real ``train`` processes throughout (the W-rank runs through the real launcher); the world-2 case runs the check's
own processes directly (``ObjectiveCheck.jobs``), without the rest of the protocol, to keep the suite's time.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.test_verify_helpers import clean_env, read_report, trainproof

TINYLM_CONFIG = {"n_sequences": 37}


def _run_check(tmp_path: Path, task: str, world: int, config: dict | None = None):
    """Plan the check for ``task``, run its processes, compare (as the protocol does)."""
    import os

    from trainproof.proof.check import REFERENCE, Results
    from trainproof.proof.objective import ObjectiveCheck
    from trainproof.proof.paths import run_processes
    from trainproof.tasks import load_task
    from trainproof.storage import open_store

    cfg = None
    if config is not None:
        cfg = tmp_path / "config.json"
        cfg.write_text(json.dumps(config))
    check = ObjectiveCheck(task=load_task(task, config or {}), task_name=task, config=None if cfg is None else str(cfg),
                           seed=1234, device="cpu", world=world, root_url=str(tmp_path / "objective"), store_args=[],
                           opener=open_store)
    saved = dict(os.environ)
    os.environ.update(clean_env())
    try:
        results = run_processes(check.jobs(REFERENCE, tmp_path, Results()), timeout=600)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    check.record(REFERENCE, results)
    check.compare(REFERENCE, results, Results())
    return check


# world 2 is slow: the --fsdp protocol (tests/test_verify_fsdp.py) runs the objective check over 2 ranks by default.
@pytest.mark.parametrize("world", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tinylm_splits_agree_and_the_mean_of_means_control_is_detected(tmp_path, world):
    check = _run_check(tmp_path, "tinylm", world, TINYLM_CONFIG)
    report = check.to_json()
    assert report["global_batch"] == 8 * world
    names = {"unequal", "mean_of_means"} | ({"w_ranks", "w_mean_of_means"} if world > 1 else set())
    assert set(report["splits"]) == {"single"} | names
    assert report["splits"]["unequal"]["micro"] == 8 * world // 2 + 1  # (5, 3) or (9, 7): unequal parts
    assert check.passed and check.negative_detected, report
    for name, diffs in report["max_abs_diff"].items():
        assert all(v <= 1e-9 for v in diffs.values()), (name, diffs)  # measured, recorded
    for name, diffs in report["negative_control"]["max_abs_diff"].items():
        assert diffs["optimizer"] > 1e-6, (name, diffs)  # far beyond the tolerance
    if world > 1:
        assert "--nproc-per-node 2" in report["paths"]["w_ranks"]["command"]
        assert '"negative_control": "mean-of-microbatch-means"' in report["paths"]["w_mean_of_means"]["command"]
    declared = report["declared_objective"]  # tinylm gives each sequence's token losses: the token mean is checked
    assert declared["passed"] is True and all(r["target_losses"] == r["count_targets"] for r in declared["steps"])
    assert check.failing() == [] and check.diagnosis() == []


MEAN_LOSS = '''
    import torch
    from torch import nn

    from trainproof.tasks import Task, sha256_of

    X = torch.linspace(-1, 1, 12, dtype=torch.float64).unsqueeze(1)


    class MeanLoss(Task):
        objective = "mse_mean_v1"
        cpu_threads = 1
        dtype = torch.float64

        def __init__(self, reduce):
            self.reduce = reduce

        @property
        def batch_size(self):
            return 4

        def config(self):
            return {"reduce": self.reduce}

        def num_samples(self):
            return len(X)

        def data_identity(self):
            return sha256_of("meanloss", X)

        def build_model(self):
            return nn.Linear(1, 1)

        def build_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.1)

        def make_batch(self, sample_ids, ctx):
            idx = torch.tensor(sample_ids)
            return X[idx], 3 * X[idx] - 1

        def loss_sum(self, model, batch):
            x, y = batch
            err = (model(x) - y) ** 2
            return err.mean() if self.reduce == "mean" else err.sum()  # "mean": the pitfall


    def factory(config):
        return MeanLoss(config.get("reduce", "sum"))
'''


# "mean" (the pitfall, caught) runs by default; "sum" (a user task that passes) is slow: the reference verifications
# of tests/test_verify.py and the README's task pass the same check. --cuts 5: the extra cuts add nothing here.
@pytest.mark.parametrize("reduce", ["mean", pytest.param("sum", marks=pytest.mark.slow)])
def test_a_loss_sum_that_returns_a_mean_fails_verify_naming_the_objective_check(tmp_path, reduce):
    (tmp_path / "meanloss.py").write_text(textwrap.dedent(MEAN_LOSS))
    (tmp_path / "cfg.json").write_text(json.dumps({"reduce": reduce}))
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", "meanloss:factory",
                        "--config", str(tmp_path / "cfg.json"), "--id", "m", "--no-export", "--cuts", "5",
                        env={"PYTHONPATH": str(tmp_path)})
    report = read_report(store, "m")
    objective = report["objective_equivalence"]
    assert objective["tolerance"] == {"atol": 1e-9, "rtol": 0.0, "dtype": "float64"}
    assert objective["declared_objective"]["not_applicable"].startswith("the task gives no per-target losses")
    assert "declared_objective: not applicable: the task gives no per-target losses" in " ".join(result.stdout.split())
    if reduce == "sum":
        assert result.returncode == 0, result.stdout + result.stderr
        assert report["objective_equivalence_passed"] is True and report["objective_negative_detected"] is True
        assert objective["max_abs_diff"]["unequal"]["parameters"] <= 1e-9
        return
    assert result.returncode == 1, result.stdout + result.stderr
    assert report["positive"] is True  # the resume itself is fine: only the objective is wrong
    assert report["objective_equivalence_passed"] is False
    assert {"objective.unequal.parameters", "objective.unequal.losses"} <= set(report["failing_checks"])
    assert objective["max_abs_diff"]["unequal"]["parameters"] > 1e-6
    assert any("loss_sum must return the SUM" in d for d in report["diagnosis"])
    assert "objective.unequal" in result.stdout and "loss_sum must return the SUM" in " ".join(result.stdout.split())


SEQUENCES = '''
    import torch
    from torch import nn

    from trainproof.tasks import Task, sha256_of

    # 12 sequences of 1 to 6 values: one target per value, so a step's targets are its tokens.
    LENGTHS = [1, 6, 2, 5, 3, 4, 6, 1, 5, 2, 4, 3]
    SEQS = [torch.linspace(-1, 1, n, dtype=torch.float64) * (i + 1) / 12 for i, n in enumerate(LENGTHS)]


    class Sequences(Task):
        objective = "token_mse_mean_v1"  # declared: the mean over every token of the step
        cpu_threads = 1
        dtype = torch.float64

        def __init__(self, reduce):
            self.reduce = reduce

        @property
        def batch_size(self):
            return 4

        def config(self):
            return {"reduce": self.reduce}

        def num_samples(self):
            return len(SEQS)

        def data_identity(self):
            return sha256_of("sequences", *SEQS)

        def build_model(self):
            return nn.Linear(1, 1)

        def build_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=0.1)

        def count_targets(self, sample_ids):
            return sum(LENGTHS[i] for i in sample_ids)  # tokens

        def make_batch(self, sample_ids, ctx):
            width = max(LENGTHS[i] for i in sample_ids)
            x = torch.zeros(len(sample_ids), width, dtype=torch.float64)
            real = torch.zeros(len(sample_ids), width, dtype=torch.bool)
            for row, i in enumerate(sample_ids):
                x[row, :LENGTHS[i]], real[row, :LENGTHS[i]] = SEQS[i], True
            return x.to(ctx.device), real.to(ctx.device)

        def token_losses(self, model, batch):
            x, real = batch
            err = (model(x.unsqueeze(-1)).squeeze(-1) - (3 * x - 1)) ** 2
            return err * real  # padding contributes 0

        def target_losses(self, model, batch):
            _, real = batch
            return [row[mask] for row, mask in zip(self.token_losses(model, batch), real)]  # one tensor a sequence

        def loss_sum(self, model, batch):
            err = self.token_losses(model, batch)
            if self.reduce == "sequence_mean":  # the pitfall: per-sequence means, summed
                return (err.sum(dim=1) / batch[1].sum(dim=1)).sum()
            return err.sum()  # every token's loss, summed


    def factory(config):
        return Sequences(config.get("reduce", "token"))
'''


def _sequences(tmp_path: Path, reduce: str, monkeypatch) -> str:
    (tmp_path / "sequences.py").write_text(textwrap.dedent(SEQUENCES))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "sequences:factory"


# The correct twin, on the check's own processes only (split invariance holds for both: a sum of per-sequence means
# is a sum over samples, which any split adds up alike; only the declared token mean tells them apart).
def test_a_token_mean_task_passes_the_declared_objective_check(tmp_path, monkeypatch):
    check = _run_check(tmp_path, _sequences(tmp_path, "token", monkeypatch), 1, {"reduce": "token"})
    declared = check.to_json()["declared_objective"]
    assert check.passed and check.negative_detected, check.to_json()
    assert declared["passed"] is True and len(declared["steps"]) == 2, declared
    for row in declared["steps"]:
        assert row["ok"] and row["target_losses"] == row["count_targets"] > 4  # tokens, not sequences
        assert abs(row["trained_loss"] - row["declared_mean"]) <= 1e-9 * row["declared_mean"]
    assert check.failing() == [] and check.diagnosis() == []


def test_a_sum_of_per_sequence_means_posing_as_a_token_mean_fails_verify(tmp_path, monkeypatch):
    task = _sequences(tmp_path, "sequence_mean", monkeypatch)
    (tmp_path / "cfg.json").write_text(json.dumps({"reduce": "sequence_mean"}))
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", task, "--config", str(tmp_path / "cfg.json"),
                        "--id", "s", "--no-export", "--cuts", "5", env={"PYTHONPATH": str(tmp_path)})
    assert result.returncode == 1, result.stdout + result.stderr
    report = read_report(store, "s")
    assert report["positive"] is True  # the resume itself is fine: only the objective is wrong
    assert report["objective_equivalence_passed"] is False
    assert report["failing_checks"] == ["objective.declared_reduction"]  # split invariance holds: not what fails
    assert report["objective_equivalence"]["max_abs_diff"]["unequal"]["parameters"] <= 1e-9
    row = report["objective_equivalence"]["declared_objective"]["steps"][0]
    assert not row["ok"] and row["target_losses"] == row["count_targets"]
    assert row["looks_like"].startswith("a sum of per-sample means"), row
    assert row["loss_sum_is_the_sum"] is False
    text = " ".join(result.stdout.split())
    assert "objective.declared_reduction" in text and "a sum of per-sample means" in text, result.stdout
