"""What an incomplete or failed verification says, without processes: the failing path's last error lines (not its
whole traceback), the diagnosis naming the state component that differs first before guessing a cause (the task only
on evidence against the task, the trainer otherwise), and which failed paths are a resume failure (exit 1) rather than
an incomplete verification (exit 2).

The end-to-end versions run real paths: tests/test_verify.py (a crashing resume: INCOMPLETE; each sabotage's first
component), tests/test_verify_cuts.py (hidden task state: the first difference, then the guess).
"""

from __future__ import annotations

import pytest

from trainproof.proof.compare import Diff
from trainproof.proof.cuts import crash_after_resume, resume_checks
from trainproof.proof.diagnose import crashed_component, diagnose_path
from trainproof.proof.paths import PathResult, VerificationIncomplete, error_lines

TRACEBACK = """\
warning: something harmless
Traceback (most recent call last):
  File "/x/job/__main__.py", line 3, in <module>
    main()
  File "/x/job/train/run.py", line 150, in train_step
    loss_sum = task.loss_sum(run.ddp or run.model, batch)
  File "/tmp/usertask.py", line 12, in squared_error
    return ((model(x) - y) ** 2).squeeze(1)
RuntimeError: mat1 and mat2 must have the same dtype, but got Float and Double
"""


def test_error_lines_keep_the_exception_and_where_it_was_raised_not_the_traceback():
    lines = error_lines(TRACEBACK).splitlines()
    assert lines == ["RuntimeError: mat1 and mat2 must have the same dtype, but got Float and Double",
                     '(raised at File "/tmp/usertask.py", line 12, in squared_error)']


def test_error_lines_prefer_the_processes_own_error_line():
    err = "some log\ntrainproof: error: --device cuda, but no CUDA device is visible\n"
    assert error_lines(err) == "trainproof: error: --device cuda, but no CUDA device is visible"
    assert error_lines("a\nb\nc\nd\n") == "b\nc\nd"  # otherwise its last lines


def _failed(detail: str, step: int = 6) -> Diff:
    return Diff(max_abs=1.0, exceeded=True, detail=detail, first_step=step)


def test_the_diagnosis_names_what_differs_first_before_a_cause():
    # A reset optimizer: its step counters first, and no "hidden state" guess (the trainer's restore is at fault).
    lines = diagnose_path("resume", {"optimizer": _failed("optimizer.state.0.step: 6.0 vs 1.0"),
                                     "losses": _failed("losses[5]: 0.1 vs 0.2"),
                                     "parameters": _failed("parameters.0.weight: max |diff| 0.01")}, 6)
    assert len(lines) == 1 and "first difference at step 6" in lines[0]
    assert "the optimizer's step counters (optimizer.state.0.step)" in lines[0]
    # A rebuilt scheduler moves the optimizer's learning rate too: the scheduler is named, not the optimizer.
    (line,) = diagnose_path("resume", {"optimizer": _failed("optimizer.param_groups[0].lr: 0.0075 vs 0.015"),
                                       "scheduler": _failed("scheduler._last_lr[0]: 0.0075 vs 0.015")}, 6)
    assert "the learning-rate scheduler" in line
    # A generator, by name; an earlier step wins over the order.
    (line,) = diagnose_path("resume", {"rng_next_draws": _failed("rng_next_draws[0].numpy: 0.1 vs 0.2", 7),
                                       "sample_ids": _failed("sample_ids.sample_ids: 3 vs 4", 6)}, 6)
    assert "the data position" in line and "at step 6" in line
    (line,) = diagnose_path("resume", {"rng_states": _failed("rng_states[0].python.internal: 1 of 625 values differ")},
                            6)
    assert "a random generator (python)" in line
    # Only the trajectory differs, and nothing of the task's own differs: the first difference, then the trainer.
    first, guess = diagnose_path("resume", {"losses": _failed("losses[5]: 0.1 vs 0.2")}, 6)
    assert "check resume.losses" in first and "the trainer's resume" in guess
    assert "state not captured" not in guess and "not in the task" in guess
    # The same, with the live comparison's evidence on the task object: the task is blamed, the evidence named.
    first, guess = diagnose_path("resume", {"losses": _failed("losses[5]: 0.1 vs 0.2")}, 6,
                                 "task_attributes.private differs at step 5")
    assert "state not captured by the checkpoint" in guess and "task_attributes.private differs" in guess


def _crashed(error: str, *, code: int = 1, resumed_at: int | None = 5, steps: tuple[int, ...] = ()) -> PathResult:
    events = [*([] if resumed_at is None else [{"event": "resume", "step": resumed_at, "rng_restored": True}]),
              *({"event": "step", "step": s} for s in steps)]
    return PathResult(name="resume", url="x", argv=[], code=code, seconds=1.0, error=error, events=events)


def test_a_crash_after_the_restore_is_a_resume_failure_and_other_failures_leave_it_incomplete():
    """Exit 1 naming the check and the component when the resumed process crashed while restoring, or restored as
    intended and then crashed; an incomplete verification (exit 2) for a resume from another step, a timeout, a
    signal, or the trainer's own one-line error (the store, the data, the options)."""
    into: dict = {"resume": {}}
    crash = _crashed("╰──────╯\nRuntimeError: data pipeline out of step: built (5, 0, 0) for the step's (6, 0, 0)")
    assert resume_checks([crash], {"resume": 5}, into) == set()
    finished = into["resume"]["finished"]
    assert not finished.within and finished.first_step == 6 and "╰" not in finished.detail
    assert "data pipeline out of step" in finished.detail and "resumed from step 5" in finished.detail
    first, cause = diagnose_path("resume", into["resume"], 6)
    assert "check resume.finished" in first and "the data pipeline (named by the crash)" in first
    assert "the trainer's resume code, not the task or the store" in cause
    late = _crashed("ValueError: Tried to step 11 times. The specified number of total steps is 10", steps=(6, 7))
    assert crash_after_resume(late, 5) is not None and crash_after_resume(late, 5)[0] == 8
    assert "the learning-rate scheduler" in crashed_component(crash_after_resume(late, 5)[1])
    restoring = _crashed("SabotageCrash: failing the restore", resumed_at=None)
    into = {"resume": {}}
    assert resume_checks([restoring], {"resume": 5}, into) == set()
    assert into["resume"]["finished"].first_step == 6 and "while restoring step 5" in into["resume"]["finished"].detail
    for incomplete in (_crashed("RuntimeError: x", resumed_at=4),  # resumed from another step than its cut
                       _crashed("trainproof: error: the store is unreachable"),  # the trainer's own line
                       _crashed("RuntimeError: x", code=None), _crashed("RuntimeError: x", code=-9),
                       _crashed("trainproof: error: bad option", code=2)):
        assert crash_after_resume(incomplete, 5) is None
        with pytest.raises(VerificationIncomplete):
            resume_checks([incomplete], {"resume": 5}, {"resume": {}})
