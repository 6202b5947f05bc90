"""What a run must not depend on is varied, and what a user gets is compared (issue 38, items 2 and 4).

- The resumed paths of the default ``verify`` run with other ``--data-workers`` counts than the continuous path (a
  task that builds its batches through DataLoader workers): a ``DatasetTask`` whose collate seeds its noise from the
  DataLoader worker id instead of taking the trainer's per-micro-batch generators passes with its own 2 workers
  (each step's micro-batch i is built by worker i) and fails once a resume builds with 0 workers; its correct twin
  passes, and ``verification.json`` records the counts each path ran with.
- The continuous path's export is compared with the resumed path's (weights and metrics.json): an EMA of the weights
  kept on the task object (a class attribute, shared by every instance of the exporting process) that the evaluation
  exports makes two exports of equal states differ, and fails ``export_comparison``; the fresh-process reload check
  alone passes it (a fresh process starts its EMA afresh, as the export did).

Real ``python -m trainproof`` processes throughout; ``--cuts`` and ``--no-objective-check`` keep each verify small.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.test_verify_helpers import checks, read_report, trainproof

TASKS = '''
    import torch
    from torch import nn
    from torch.utils.data import Dataset, default_collate, get_worker_info

    from trainproof.tasks import DatasetTask

    X = torch.linspace(-1, 1, 24).unsqueeze(1)


    class Lines(Dataset):
        def __len__(self):
            return len(X)

        def __getitem__(self, i):
            return X[i], 2 * X[i] + 1


    def noisy(samples):
        """Input noise from torch's global generator: the trainer seeds it from (seed, step, micro-batch) per build."""
        x, y = default_collate(samples)
        return x + 0.05 * torch.randn(x.shape), y


    def noisy_by_worker(samples):
        """The bug: the noise's generator seeded from the DataLoader worker that builds the batch (and its samples),
        not from the micro-batch: right only while worker id == micro-batch index."""
        info = get_worker_info()
        worker = 0 if info is None else info.id
        g = torch.Generator().manual_seed(10000 * worker + 5000 + int(samples[0][0].mul(1000).round()))
        x, y = default_collate(samples)
        return x + 0.05 * torch.randn(x.shape, generator=g), y


    def loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).squeeze(1)


    class WithEMA(DatasetTask):
        """Exports the evaluation of an EMA of the weights it kept, instead of the weights themselves."""

        shared = {}  # the bug (ema "shared"): one EMA for every instance of the process, outside any checkpoint

        def __init__(self, *args, ema, **kwargs):
            super().__init__(*args, **kwargs)
            self.ema = WithEMA.shared if ema == "shared" else {}

        def evaluate_metrics(self, model):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    old = self.ema.get(name)
                    self.ema[name] = p.detach().clone() if old is None else 0.5 * old + 0.5 * p.detach()
                    p.copy_(self.ema[name])
            return super().evaluate_metrics(model)


    def factory(config):
        data = Lines()
        return WithEMA(dataset=data, build_model=lambda: nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Linear(8, 1)),
                       per_sample_loss=loss, config=dict(config), batch_size=4, micro_batch_size=2, optimizer="adam",
                       lr=0.01, collate=noisy_by_worker if config["seeded_by"] == "worker" else noisy,
                       eval_collate=default_collate, eval_dataset=data, num_workers=2, ema=config["ema"])
'''


def _verify(tmp_path: Path, config: dict, *extra: str):
    (tmp_path / "varytask.py").write_text(textwrap.dedent(TASKS))
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", "varytask:factory", "--config", str(tmp_path / "cfg.json"),
                        "--id", "v", "--no-objective-check", *extra, env={"PYTHONPATH": str(tmp_path)})
    return result, read_report(store, "v")


def test_a_correct_task_passes_with_other_worker_counts_and_equal_exports(tmp_path):
    result, report = _verify(tmp_path, {"seeded_by": "micro_batch", "ema": "own"}, "--cuts", "5,9")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workers = report["data_workers"]
    assert workers["task"] == 2 and workers["varied"] == [0, 3]
    assert workers["by_path"]["continuous"] == 2 and workers["by_path"]["resume"] == 0
    assert workers["by_path"]["resume_at_9"] == 3 and workers["exercised"] == [0, 2, 3]
    assert all(c["max_abs_diff"] == 0.0 for c in report["checks"]["resume"])  # bitwise, whatever the workers
    compared = report["export_comparison"]
    assert report["export_comparison_passed"] is True and compared["ran"] is True
    assert {row["name"] for row in report["checks"]["export_comparison"]} == {"weights", "weights_bf16", "metrics"}
    assert all(row["max_abs_diff"] == 0.0 for row in report["checks"]["export_comparison"])


def test_batches_seeded_by_the_worker_id_fail_once_a_resume_has_other_workers(tmp_path):
    result, report = _verify(tmp_path, {"seeded_by": "worker", "ema": "own"}, "--cuts", "5", "--no-export")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["data_workers"]["by_path"]["resume"] == 0
    assert "resume.losses" in report["failing_checks"] and "resume.parameters" in report["failing_checks"]
    assert checks(report, "resume")["losses"]["first_step"] == 6
    assert "resume.losses" in " ".join(result.stdout.split())


def test_an_ema_on_the_task_that_reaches_the_export_fails_the_export_comparison(tmp_path):
    result, report = _verify(tmp_path, {"seeded_by": "micro_batch", "ema": "shared"}, "--cuts", "5")
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    assert report["positive"] is True and report["export_reload_ok"] is True  # every state equal, reload reproduced
    assert report["export_comparison_passed"] is False
    assert report["failing_checks"] == ["export_comparison.metrics"]
    assert "eval" in checks(report, "export_comparison")["metrics"]["detail"]
    out = " ".join(result.stdout.split())
    assert "export_comparison.metrics" in out and "export_comparison_passed: false" in out


@pytest.mark.parametrize("workers,varied", [(0, [1, 2]), (1, [0, 2]), (2, [0, 3]), (4, [0, 3]), (8, [0, 7])])
def test_worker_counts_differ_from_the_tasks_and_stay_capped(workers, varied):
    from trainproof.proof.workers import varied_counts

    assert varied_counts(workers) == varied
