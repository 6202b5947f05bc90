"""``verify`` on the user's own task, in the user's dtype and batch types (issue 26, part 1).

- float32 adapter tasks (an MLP, a CNN, a dict batch, a dataclass batch, a named-tuple batch) pass the default
  ``verify``: the objective check trains them in float64 and converts the model *and* every floating tensor of every
  batch, whatever container holds it;
- docs/tasks.md's ``DatasetTask`` example, extracted verbatim, passes the default ``verify`` (export included);
- the objective check trains the user's own task: a task built on a built-in keeps its own ``loss_sum`` in the
  check (a mean is caught), and a ``deterministic_objective()`` that returns another class is refused with exit 2
  and one line saying what to implement.

Real ``python -m trainproof`` processes throughout.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from tests.test_examples import doc_modules
from tests.test_verify_helpers import checks, read_report, trainproof

USER_TASKS = '''
    from dataclasses import dataclass
    from typing import NamedTuple

    import torch
    from torch import nn
    from torch.utils.data import Dataset, TensorDataset, default_collate

    from trainproof.tasks import DatasetTask

    X = torch.linspace(-1, 1, 24).unsqueeze(1)  # float32, the adapter's default dtype
    IMAGES = torch.linspace(-1, 1, 24 * 16).reshape(24, 1, 4, 4).sin()


    @dataclass
    class Pair:
        x: torch.Tensor
        y: torch.Tensor


    class NamedPair(NamedTuple):
        x: torch.Tensor
        y: torch.Tensor


    class Dicts(Dataset):
        def __len__(self):
            return len(X)

        def __getitem__(self, i):
            return {"x": X[i], "y": 2 * X[i] + 1}


    def pairs(samples):
        return Pair(x=torch.stack([s[0] for s in samples]), y=torch.stack([s[1] for s in samples]))


    def named(samples):
        return NamedPair(x=torch.stack([s[0] for s in samples]), y=torch.stack([s[1] for s in samples]))


    def mlp():
        return nn.Sequential(nn.Linear(1, 8), nn.Tanh(), nn.Dropout(0.1), nn.Linear(8, 1))


    def cnn():
        return nn.Sequential(nn.Conv2d(1, 2, 3), nn.ReLU(), nn.Flatten(), nn.Linear(8, 1))


    def tuple_loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).squeeze(1)


    def dict_loss(model, batch):
        return ((model(batch["x"]) - batch["y"]) ** 2).squeeze(1)


    def attr_loss(model, batch):
        return ((model(batch.x) - batch.y) ** 2).squeeze(1)


    def factory(config):
        kind = config.get("kind", "mlp")
        lines = TensorDataset(X, 2 * X + 1)
        data, model, loss, collate = {
            "mlp": (lines, mlp, tuple_loss, default_collate),
            "cnn": (TensorDataset(IMAGES, IMAGES.mean(dim=(1, 2, 3)).unsqueeze(1)), cnn, tuple_loss, default_collate),
            "dict": (Dicts(), mlp, dict_loss, default_collate),
            "dataclass": (lines, mlp, attr_loss, pairs),
            "namedtuple": (lines, mlp, attr_loss, named),
        }[kind]
        return DatasetTask(dataset=data, build_model=model, per_sample_loss=loss, config=dict(config), batch_size=4,
                           optimizer="adam", lr=0.01, collate=collate, eval_dataset=data,
                           verify_samples=config.get("verify_samples"))
'''


def _verify(tmp_path: Path, module: str, source: str, config: dict | None, *extra: str):
    (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
    args = []
    if config is not None:
        (tmp_path / "cfg.json").write_text(json.dumps(config))
        args = ["--config", str(tmp_path / "cfg.json")]
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", f"{module}:factory", *args, "--id", "v", *extra,
                        env={"PYTHONPATH": str(tmp_path)})
    return result, store


# The dataclass batch runs by default (the container today's code lost); the others are slow (each a full verify).
@pytest.mark.parametrize("kind", ["dataclass", pytest.param("mlp", marks=pytest.mark.slow),
                                  pytest.param("cnn", marks=pytest.mark.slow),
                                  pytest.param("dict", marks=pytest.mark.slow),
                                  pytest.param("namedtuple", marks=pytest.mark.slow)])
def test_float32_adapter_tasks_pass_the_default_verify(tmp_path, kind):
    result, store = _verify(tmp_path, "usertasks", USER_TASKS, {"kind": kind}, "--no-export")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(store, "v")
    assert report["all_checks_passed"] is True and report["objective_equivalence_passed"] is True
    assert report["environment"]["precision"].startswith("float32")
    assert report["objective_equivalence"]["tolerance"]["dtype"] == "float64"
    declared = report["objective_equivalence"]["declared_objective"]  # per_sample_loss's values: the mean is checked
    assert declared["passed"] is True and all(r["target_losses"] == r["count_targets"] == 4 for r in declared["steps"])


@pytest.mark.parametrize("declared", [True, False], ids=["task-verify_samples", "verify--samples"])
def test_verify_on_a_subset_of_the_samples_crosses_its_short_epochs(tmp_path, declared):
    """A task's ``verify_samples`` (or ``verify --samples``) has every path train on the first 8 of 24 samples:
    epochs of 2 steps instead of 6, every one crossed and resumed at, the negative control still caught; the runs'
    own plans say so, and verification.json records it."""
    config = {"kind": "dataclass", **({"verify_samples": 8} if declared else {})}
    result, store = _verify(tmp_path, "usertasks", USER_TASKS, config, "--no-export", "--no-objective-check",
                            *([] if declared else ["--samples", "8"]))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "trains on the first 8 of the task's 24 samples" in result.stderr
    report = read_report(store, "v")
    assert report["all_checks_passed"] is True and report["settings"]["samples"] == 8
    plans = list((Path(store) / "verification" / "v").rglob("plan.json"))
    assert len(plans) >= 4
    for plan in plans:
        assert json.loads(plan.read_text())["epoch_plan"]["samples"] == 8, plan
    cuts = report["cuts"]  # every boundary of the three short epochs (steps 2 and 4) resumed at and passed
    assert cuts["steps_per_epoch"] == 2 and {2, 4} <= set(cuts["all"]) and all(cuts["passed"].values()), cuts


def test_the_docs_adapter_example_verbatim_passes_the_default_verify(tmp_path):
    source = doc_modules()["mytask"]
    result, store = _verify(tmp_path, "mytask", source, None)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(store, "v")
    assert report["all_checks_passed"] is True and report["objective_equivalence_passed"] is True
    assert report["export"]["reload_check"]["passed"] is True


DERIVED = '''
    import copy

    from trainproof.tasks import DatasetTask
    from trainproof.tasks.regression import RegressionConfig, RegressionTask


    class MeanRegression(RegressionTask):
        """A user's task on the built-in fixture, with its own loss: a mean (the pitfall)."""

        def loss_sum(self, model, batch):
            x, y = batch
            return ((model(x) - y) ** 2).mean()


    class Other(RegressionTask):
        def deterministic_objective(self):
            return RegressionTask(RegressionConfig(dropout=0.0, gain=0.0, noise=0.0))  # another class: refused


    def factory(config):
        return {"mean": MeanRegression, "other": Other}[config["kind"]](RegressionConfig())
'''


def test_a_task_built_on_a_builtin_keeps_its_own_loss_in_the_objective_check(tmp_path, monkeypatch):
    """The built-in's deterministic_objective() returns the user's subclass, so the check trains the user's mean and
    fails it (today it trained the built-in's sum and passed)."""
    from tests.test_verify_objective import _run_check

    (tmp_path / "derived.py").write_text(textwrap.dedent(DERIVED))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the check's processes import it too
    check = _run_check(tmp_path, "derived:factory", 1, {"kind": "mean"})
    assert not check.passed, check.to_json()
    assert "objective.unequal.parameters" in check.failing()


def test_a_deterministic_objective_of_another_class_is_refused_with_one_line(tmp_path):
    result, store = _verify(tmp_path, "derived", DERIVED, {"kind": "other"}, "--no-export")
    assert result.returncode == 2, result.stdout[-3000:] + result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("trainproof: error:")]
    assert len(lines) == 1, result.stderr
    assert "deterministic_objective()" in lines[0] and "Other" in lines[0] and "RegressionTask" in lines[0]
    assert "Traceback" not in result.stderr


CLIPPED = '''
    from trainproof.tasks.regression import RegressionConfig, RegressionTask


    class Clipped(RegressionTask):
        def __init__(self, cfg, clip):
            super().__init__(cfg)
            self.grad_clip, self.clip = clip, clip

        def config(self):
            return {**super().config(), "grad_clip": self.clip}


    def factory(config):
        return Clipped(RegressionConfig(), config["grad_clip"])
'''


# 1e6: never reached in the window (reported, not counted as proved); 1e-3: clips every step (nothing reported).
@pytest.mark.parametrize("clip", [1e6, 1e-3])
def test_a_clip_threshold_never_reached_is_reported_not_exercised(tmp_path, clip):
    result, store = _verify(tmp_path, "clipped", CLIPPED, {"grad_clip": clip}, "--no-export", "--cuts", "5",
                            "--no-objective-check")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(store, "v")
    clipping = report["exercised"]["resume"]["clipping"]
    missing = {m["what"] for m in report["not_exercised"]}
    own = report["clipping"]
    if clip > 1:
        # The verifier made clipping bite on runs of its own (half the smallest norm it measured), resumed, compared.
        assert own["ran"] is True and own["threshold"] < clipping["max_grad_norm"] and report["clip_passed"] is True
        assert own["exercised"]["clip_resume"]["clipping"]["active_steps"] == 3
        # and a resume of a resume: from the generation clip_resume (a resumed process) wrote one step after the cut
        assert own["resume_of_resume_at"] == 6
        assert own["paths"]["clip_resume_again"]["resumed_from"] == 6
        assert own["exercised"]["clip_resume_again"]["clipping"]["active_steps"] == 2
        assert own["clipped_on"] == ["clip_resume", "clip_resume_again"]
        assert all(c["max_abs_diff"] == 0.0 for p in ("clip_resume", "clip_resume_again")
                   for c in report["checks"][p])
        assert clipping["active_steps"] == 0 and clipping["of_steps"] == 5 and clipping["max_grad_norm"] < clip
        assert "gradient clipping" in missing
        assert "not exercised: gradient clipping" in " ".join(result.stdout.split())
        (item,) = [m for m in report["not_exercised"] if m["what"] == "gradient clipping"]
        assert item["covered_by"].startswith("clip_resume, clip_resume_again:")
    else:  # clipping bit on the protocol's own paths: no runs of its own
        assert clipping == {"active_steps": 5, "of_steps": 5, "max_grad_norm": clipping["max_grad_norm"]}
        assert "gradient clipping" not in missing
        assert own["ran"] is False and "clip_passed" not in report


def test_clipping_restored_wrong_fails_on_the_verifiers_own_clipping_runs(tmp_path):
    """A resume that halves grad_clip (test wrapper, clip_after_resume) on a task whose threshold never bites: the
    protocol's paths are equal (vacuously), the clipping check's runs, where every step clips, are not."""
    (tmp_path / "clipped.py").write_text(textwrap.dedent(CLIPPED))
    (tmp_path / "cfg.json").write_text(json.dumps({"grad_clip": 1e6}))
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", "clipped:factory", "--config", str(tmp_path / "cfg.json"),
                        "--id", "v", "--no-export", "--cuts", "5", "--no-objective-check",
                        env={"PYTHONPATH": str(tmp_path), "TPHOOK_SABOTAGE": "clip_after_resume"})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(store, "v")
    assert report["positive"] is True  # the task's own threshold never bites: nothing differs there
    assert report["clip_passed"] is False and "clip_resume.parameters" in report["failing_checks"]
    assert "clip_resume.parameters" in " ".join(result.stdout.split())


def test_clipping_changed_only_on_a_resume_of_a_resume_fails_the_clipping_check(tmp_path):
    """grad_clip halved only when the restored state was written by a process that had itself resumed (test wrapper,
    clip_second_resume): clip_resume (from a fresh process's generation) is equal; clip_resume_again is not."""
    (tmp_path / "clipped.py").write_text(textwrap.dedent(CLIPPED))
    (tmp_path / "cfg.json").write_text(json.dumps({"grad_clip": 1e6}))
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", "clipped:factory", "--config", str(tmp_path / "cfg.json"),
                        "--id", "v", "--no-export", "--cuts", "5", "--no-objective-check",
                        env={"PYTHONPATH": str(tmp_path), "TPHOOK_SABOTAGE": "clip_second_resume"})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(store, "v")
    assert report["positive"] is True and report["clip_passed"] is False
    assert not any(f.startswith("clip_resume.") for f in report["failing_checks"]), report["failing_checks"]
    assert "clip_resume_again.parameters" in report["failing_checks"]
    assert checks(report, "clip_resume_again")["parameters"]["first_step"] == 7
    assert "clip_resume_again.parameters" in " ".join(result.stdout.split())
