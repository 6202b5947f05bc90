"""The schedulers users use (issue 38, item 7), on docs/tasks.md's ``schedules.py`` extracted verbatim.

- ``ReduceLROnPlateau`` stepped on the step's training loss trains, and a run stopped by SIGTERM (exit 75) and run
  again ends bit for bit where an uninterrupted run ends (its best value, bad-step count and the learning rates it
  reduced included);
- ``ReduceLROnPlateau`` stepped twice an epoch on the held-out loss passes the default ``verify``;
- a ``OneCycleLR`` sized to the task's own length (``total_steps`` = ``default_steps``) passes the default ``verify``,
  which fits its three epochs into the schedule;
- a run past the ``OneCycleLR``'s end, and a ``verify`` whose command line fixes a longer plan, each stop at once with
  one line naming the schedule's length (exit 2);
- a plateau metric, cadence or pair of schedules ``DatasetTask`` cannot use is refused with one line naming it;
- a ``OneCycleLR`` stepped once on restore, and a data lookahead restarted at the restored step (test wrapper), crash
  only the resumed processes: exit 1 naming the check and the component, never INCOMPLETE (issue 38, item 8).

Real ``python -m trainproof`` processes throughout.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import pytest

from tests.test_data_workers import stop_at
from tests.test_examples import doc_modules
from tests.test_train_helpers import differences, finish, history_rows, load_state, start, trajectory
from tests.test_verify_helpers import read_report, trainproof

TARGET = 18
"""Steps of the training runs: three epochs of the example's 24 rows in batches of 4."""


SLOW = {"TPHOOK_STEP_DELAY": "0.3"}  # test-only (tests/support/hooked.py): 11 steps left take >= 3.3 s


@pytest.fixture
def schedules(tmp_path: Path) -> dict[str, Any]:
    """The docs' module in ``tmp_path``, a config file per schedule, and the environment that imports it."""
    (tmp_path / "schedules.py").write_text(doc_modules()["schedules"])
    configs = {}
    for kind in ("plateau", "plateau_eval", "onecycle"):
        configs[kind] = tmp_path / f"{kind}.json"
        configs[kind].write_text(json.dumps({"schedule": kind}))
    return {"configs": configs, "env": {"PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}}


def _train(schedules: dict[str, Any], store: Path, kind: str, *args: str, hooks: dict[str, str] | None = None):
    return start(store, "--task", "schedules:factory", "--config", str(schedules["configs"][kind]), *args,
                 env={**schedules["env"], **(hooks or {})})


def _comparable(state: dict[str, Any]) -> dict[str, Any]:
    """The trajectory, the scheduler's infinities (ReduceLROnPlateau's ``mode_worse``) as strings: the helper that
    compares refuses any non-finite float, equal or not."""
    sched = {k: repr(v) if isinstance(v, float) and math.isinf(v) else v for k, v in state["scheduler"].items()}
    return {**trajectory(state), "scheduler": sched}


def test_reduce_on_plateau_trains_and_resumes_bitwise_after_sigterm(schedules, tmp_path):
    continuous = _train(schedules, tmp_path / "continuous", "plateau", "--max-steps", str(TARGET))
    stopped = stop_at(_train(schedules, tmp_path / "stopped", "plateau", "--max-steps", str(TARGET),
                             "--checkpoint-every", "100", hooks=SLOW), 7)  # the SIGTERM lands before the end
    assert finish(continuous).code == 0
    assert stopped.code == 75, stopped.stderr
    resumed = finish(_train(schedules, tmp_path / "stopped", "plateau", "--max-steps", str(TARGET)))
    assert resumed.code == 0, resumed.stderr
    assert 7 <= resumed.last("resume")["step"] < TARGET
    expected, got = load_state(tmp_path / "continuous"), load_state(tmp_path / "stopped")
    assert differences(_comparable(expected), _comparable(got)) == []
    rates = [row["lr"] for row in history_rows(got)]
    assert len(set(rates)) >= 3, rates  # the plateau reduced the rate, before and after the resume
    assert got["scheduler"]["last_epoch"] == TARGET and got["progress"]["next_lr"] < rates[0]


@pytest.mark.parametrize("kind", ["plateau_eval", "onecycle", pytest.param("plateau", marks=pytest.mark.slow)])
def test_the_schedules_pass_the_default_verify(schedules, tmp_path, kind):
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", "schedules:factory", "--config",
                        str(schedules["configs"][kind]), "--id", "v", env=schedules["env"])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(store, "v")
    assert report["all_checks_passed"] is True and report["export"]["reload_check"]["passed"] is True
    if kind == "onecycle":  # three epochs of 3 steps on the first 12 samples, within the 10-step schedule
        assert report["settings"]["fitted_to_schedule"] and report["settings"]["samples"] == 12
        assert report["settings"]["steps"] == 10 and report["cuts"]["steps_per_epoch"] == 3
    else:
        assert report["settings"]["fitted_to_schedule"] is None and report["cuts"]["steps"] == TARGET


def test_a_run_or_a_verify_past_the_one_cycle_stops_with_one_line(schedules, tmp_path):
    within = finish(start(tmp_path / "plain", "--task", "schedules:factory", env=schedules["env"]))  # as the docs
    assert within.code == 0 and within.last("done")["step"] == 10, within.stderr
    long_run = finish(_train(schedules, tmp_path / "run", "onecycle", "--max-steps", "12"))
    verify = trainproof("verify", "--store", str(tmp_path / "v"), "--task", "schedules:factory", "--config",
                        str(schedules["configs"]["onecycle"]), "--steps", "20", env=schedules["env"])
    for code, stderr in ((long_run.code, long_run.stderr), (verify.returncode, verify.stderr)):
        assert code == 2, stderr
        lines = [line for line in stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and lines[0].startswith("trainproof: error: "), stderr
        assert "OneCycleLR (total_steps=10) is 10 steps long" in lines[0], stderr
    assert "--max-steps 10" in long_run.stderr and "--steps fixed" in verify.stderr
    assert not list((tmp_path / "run").rglob("COMPLETE.json"))  # refused before the first step


# Real resume bugs that crash only the resumed processes (test wrapper): a OneCycleLR stepped once on restore fails its
# last step ("Tried to step 11 times"), a data lookahead restarted at the restored step fails the first. A failure
# that occurs only on a resumed path is a resume failure (exit 1, the check and the component named, the trainer
# blamed), never INCOMPLETE. Their correct twin: test_the_schedules_pass_the_default_verify[onecycle].
@pytest.mark.parametrize("sabotage,first,failing", [
    ("scheduler_step_on_restore", "the learning-rate scheduler (scheduler.last_epoch)",
     {"resume.finished", "resume.scheduler", "resume.learning_rates", "live_vs_restored.scheduler"}),
    ("lookahead_restart", "the data pipeline (named by the crash), check resume.finished", {"resume.finished"})])
def test_a_resume_bug_that_crashes_the_resumed_process_fails_naming_the_component(schedules, tmp_path, sabotage,
                                                                                  first, failing):
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", "schedules:factory", "--config",
                        str(schedules["configs"]["onecycle"]), "--id", "v", "--cuts", "5", "--no-export",
                        "--no-objective-check", env={**schedules["env"], "TPHOOK_SABOTAGE": sabotage})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    report = read_report(store, "v")
    assert report["completed"] is True and report["error"] is None
    assert failing <= set(report["failing_checks"]), report["failing_checks"]
    assert report["paths"]["continuous"]["exit_code"] == 0 and report["paths"]["resume"]["exit_code"] == 1
    line, cause = [d for d in report["diagnosis"] if d.startswith("resume:")]
    assert "first difference at step 6" in line and first in line, line
    assert "the trainer's resume code, not the task or the store" in cause
    assert not any("state not captured" in d for d in report["diagnosis"]), report["diagnosis"]
    out = " ".join(result.stdout.split())
    assert "resume.finished" in out and "INCOMPLETE" not in out


def test_a_plateau_metric_the_task_cannot_compute_is_refused_by_name(tmp_path, monkeypatch):
    from trainproof.errors import ConfigError
    from trainproof.tasks.adapter import DatasetTask

    (tmp_path / "schedules.py").write_text(doc_modules()["schedules"])
    monkeypatch.syspath_prepend(str(tmp_path))
    import schedules as module

    task = module.factory({"schedule": "plateau_eval"})
    for bad in ({"scheduler_metric": "accuracy"}, {"scheduler_every": 0}, {"lr_schedule": lambda step: 1.0}):
        with pytest.raises(ConfigError) as caught:
            DatasetTask(dataset=task.dataset, build_model=task._build_model, per_sample_loss=module.squared_error,
                        config={}, batch_size=4, eval_dataset=task.eval_dataset, scheduler=task._scheduler, **bad)
        assert "\n" not in str(caught.value) and str(next(iter(bad))) in str(caught.value), caught.value


@pytest.mark.parametrize("kind", ["onecycle", "warmup_then_onecycle", "onecycle_then_constant",
                                  "short_onecycle_then_constant", "warmup_short_onecycle_then_constant",
                                  "onecycle_filling_its_span", "chained", "chained_without_end"])
def test_the_length_of_a_schedule_is_where_torch_refuses_the_next_step(kind):
    """A OneCycleLR inside a SequentialLR or a ChainedScheduler has an end too: the length trainproof computes is the
    number of steps torch's own scheduler takes before it raises (None: it never does within 200)."""
    import warnings

    import torch

    from trainproof.train.schedule import schedule_length

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    sched = torch.optim.lr_scheduler

    def one_cycle(total: int) -> Any:
        return sched.OneCycleLR(opt, max_lr=0.1, total_steps=total)

    scheduler = {"onecycle": lambda: one_cycle(12),
                 "warmup_then_onecycle": lambda: sched.SequentialLR(
                     opt, [sched.LinearLR(opt, start_factor=0.5, total_iters=4), one_cycle(9)], milestones=[5]),
                 "onecycle_then_constant": lambda: sched.SequentialLR(
                     opt, [one_cycle(30), sched.ConstantLR(opt, factor=1.0, total_iters=2)], milestones=[7]),
                 "short_onecycle_then_constant": lambda: sched.SequentialLR(
                     opt, [one_cycle(3), sched.ConstantLR(opt, factor=1.0, total_iters=2)], milestones=[10]),
                 "warmup_short_onecycle_then_constant": lambda: sched.SequentialLR(
                     opt, [sched.LinearLR(opt, total_iters=2), one_cycle(4), sched.ConstantLR(opt, total_iters=2)],
                     milestones=[3, 9]),
                 "onecycle_filling_its_span": lambda: sched.SequentialLR(
                     opt, [one_cycle(5), sched.ConstantLR(opt, total_iters=2)], milestones=[6]),
                 "chained": lambda: sched.ChainedScheduler([sched.ExponentialLR(opt, 0.99), one_cycle(15)]),
                 "chained_without_end": lambda: sched.ChainedScheduler([sched.ExponentialLR(opt, 0.99),
                                                                        sched.StepLR(opt, 3)])}[kind]()
    taken = None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SequentialLR steps its members with an epoch argument (deprecated)
        for n in range(1, 201):
            opt.step()
            try:
                scheduler.step()
            except ValueError:
                taken = n - 1
                break
    assert schedule_length(scheduler) == taken
