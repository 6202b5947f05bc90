"""What an incomplete or failed verification says, without processes: the failing path's last error lines (not its
whole traceback), and the diagnosis naming the state component that differs first before guessing a cause.

The end-to-end versions run real paths: tests/test_verify.py (a crashing resume: INCOMPLETE; each sabotage's first
component), tests/test_verify_cuts.py (hidden task state: the first difference, then the guess).
"""

from __future__ import annotations

from trainproof.proof.compare import Diff
from trainproof.proof.diagnose import diagnose_path
from trainproof.proof.paths import error_lines

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
    # Only the trajectory differs: the first difference, then the hidden-state guess.
    first, guess = diagnose_path("resume", {"losses": _failed("losses[5]: 0.1 vs 0.2")}, 6)
    assert "check resume.losses" in first and "state not captured by the checkpoint" in guess
