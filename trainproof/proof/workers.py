"""What a run must not depend on, varied: the resumed paths build their batches with other DataLoader worker counts.

A task's worker count never changes a result (trainproof.train.pipeline: every build draws from generators derived
from its request, whatever worker builds it), so it is not part of the run contract and a real run may resume with
another ``--data-workers``. A verification that ran every path with the task's own count would never see a task (or a
trainer) that draws from something tied to the worker: a generator seeded from the DataLoader worker id instead of the
micro-batch passes with 2 workers (each step's micro-batch i is built by worker i) and differs with 0 or 3.

So for a task that builds its batches through the pipeline (``build_batch``; ``DatasetTask`` does), the continuous
and cut paths run with the task's own count and every resumed path (each resumed process's ``train`` command line,
``--resume auto``) with another one, in turn: 0 and the task's count + 1 (capped at :data:`CAP`; the count - 1 above
it), or 1 and 2 for a task without workers. The negative control keeps the task's count: it tests the RNG restore
alone. Every resumed path is compared with the continuous one as before, so another count that changes a result fails
that path's checks (bitwise on the CPU). ``verification.json``'s ``data_workers`` block records the counts each
process ran with (its ``start`` event).

:class:`WorkerCounts` is a :class:`trainproof.proof.check.Check` with no runs and no verdict of its own: the protocol
hands it every phase's jobs (:meth:`WorkerCounts.vary`) before they start.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainproof.proof.check import Check, Job, Results
from trainproof.proof.paths import PathResult

CAP = 4
"""Most workers a varied count adds (a task with more is varied downwards)."""
OPTION = "--data-workers"


def varied_counts(task_workers: int) -> list[int]:
    """The worker counts the resumed paths take in turn: two counts other than the task's, one of them >= 2 (with
    0 or 1 worker every micro-batch is built by the same worker, id 0)."""
    if task_workers == 0:
        return [1, 2]
    return [0, task_workers + 1 if task_workers < CAP else task_workers - 1]


def _resumed(argv: list[str]) -> bool:
    """A ``train`` command line that resumes (``--resume auto``) with the RNG restore (not the negative control)."""
    return ("--resume", "auto") in list(zip(argv, argv[1:])) and "--omit-rng-restore" not in argv and OPTION not in argv


class WorkerCounts(Check):
    """Gives each resumed path another worker count than the continuous path's (none for a task that builds its
    batches in the training process), and reports the counts every process ran with."""

    def __init__(self, *, builds_batches: bool, task_workers: int) -> None:
        self.task_workers = task_workers
        self.varied = varied_counts(task_workers) if builds_batches else []
        self.why = "" if builds_batches else ("the task builds its batches in the training process (make_batch): it "
                                              "has no data workers to vary")
        self.given: dict[str, int] = {}
        """The count given to each varied path, by name."""
        self.ran: dict[str, int] = {}
        """The count each process reported in its ``start`` event (every path that builds batches)."""

    def vary(self, jobs: list[Job]) -> list[Job]:
        """``jobs`` with ``--data-workers N`` on each resumed path's command line, N taken in turn from
        :attr:`varied`."""
        if not self.varied:
            return jobs
        out = []
        for name, url, argv in jobs:
            if _resumed(argv):
                self.given[name] = self.varied[len(self.given) % len(self.varied)]
                argv = [*argv, OPTION, str(self.given[name])]
            out.append((name, url, argv))
        return out

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        return []

    def record(self, phase: str, results: list[PathResult]) -> None:
        """Nothing of its own: :meth:`compare` reads every run's ``start`` event."""

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """The worker count every process that ran so far reported (``start`` event's ``data_workers``)."""
        for name, run in done.runs.items():
            start = run.event("start")
            if start is not None and isinstance(start.get("data_workers"), int):
                self.ran[name] = start["data_workers"]

    @property
    def passed(self) -> bool:
        """Nothing of its own to fail: the varied paths are compared (and fail) as the paths they are."""
        return True

    def failing(self) -> list[str]:
        return []

    def verdicts(self) -> dict[str, bool]:
        return {}

    def sections(self) -> dict[str, Any]:
        """The ``data_workers`` block: the task's count, the varied ones, what each path ran with."""
        if not self.varied:
            return {"data_workers": {"varied": [], "why": self.why}}
        return {"data_workers": {
            "task": self.task_workers, "varied": self.varied, "given": dict(self.given),
            "by_path": dict(sorted(self.ran.items())), "exercised": sorted(set(self.ran.values())),
            "why": ("the continuous and cut paths build with the task's own worker count, each resumed path with "
                    "another: a result must not depend on it")}}
