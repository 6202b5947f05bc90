"""The verifier's checks: what each one declares, so that the protocol runs, judges and reports every check alike.

:class:`trainproof.proof.protocol.Protocol` runs the phases (:data:`PHASES`) and folds over its list of checks
``Protocol.checks``, handing each the results so far (:class:`Results`); from the list it derives the runs of each phase
(started together), the resumed paths compared, the verdicts, ``failing_checks``, the ``diagnosis`` and the report:

- :class:`trainproof.proof.four_paths.FourPaths` (first): the four paths of docs/protocol.md (continuous, cut, resume,
  and the resume without RNG restore), the comparison of every resumed path with the continuous one, the export;
- :class:`trainproof.proof.cuts.CutsCheck`: resumes at more cuts (every epoch boundary, the middle of later epochs, a
  seeded random step) and a resume of a resume;
- :class:`trainproof.proof.clipping.ClipCheck`: for a task with ``grad_clip`` its resumed paths never reached, a resume
  on runs where clipping bites;
- :class:`trainproof.proof.world.WorldEquivalence` (``--world W``): W ranks train the same model as one rank;
- :class:`trainproof.proof.objective.ObjectiveCheck`: the objective does not depend on how a step is split;
- :class:`Skipped`: a check that does not run this time still says so in its report section;
- :class:`NotApplicable`: a check that cannot apply to this task (a model that normalises over the batch, for the
  objective check), with the reason, and the findings a reader is owed about it (:meth:`Check.findings`).

Adding a check is: write a subclass of :class:`Check`, and add it to ``Protocol._checks``; a trainer mode it needs is
a field of :class:`trainproof.train.variant.Variant` (``Variant(...).argv()`` on its runs' command lines). Nothing else
in the protocol, the report or the command line names a particular check.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainproof.proof.compare import Diff
from trainproof.proof.paths import PathResult

REFERENCE, RESUMED, AGAIN, COMPARE, AFTER, EXPORT = "reference", "resumed", "again", "compare", "after", "export"
"""When a check's runs start: ``reference`` with the continuous and cut paths; ``resumed`` with the resumed paths,
once the cut's generations exist (a check may seed its own resumed runs from them); ``again`` once the resumed paths
committed their generations (a resume of a resume is seeded from one); ``compare`` (no runs): every resumed path is
compared with the continuous one; ``after``: runs that need nothing of the four paths, started last so they do not
compete with them; ``export`` (no runs): the resumed result, when every check passed."""
PHASES = (REFERENCE, RESUMED, AGAIN, COMPARE, AFTER, EXPORT)

Job = tuple[str, str, list[str]]
"""``(name, url, argv)``: one process for :func:`trainproof.proof.paths.run_processes`; names unique within a phase."""


@dataclass(frozen=True)
class Resumed:
    """A path a check resumed from a cut, for the protocol to compare with the continuous path after the cut."""

    name: str
    """The path's name in ``checks`` and ``failing_checks`` (e.g. ``resume_at_6``)."""
    url: str
    """Where its run is, read back through a fresh store."""
    at: int
    """The step it resumed from: every state it committed after it is compared with the continuous path's."""
    diffs: dict[str, Diff]
    """The check's own record for this path: the comparison merges each compared step's differences into it."""
    negative: bool = False
    """A negative control: compared, but what it exercised proves nothing (trainproof.proof.exercised)."""


@dataclass
class Results:
    """The results so far, handed to every check in every phase, updated after each (no callback into the protocol)."""

    runs: dict[str, PathResult] = field(default_factory=dict)
    """Every process that ran, by name (the four paths' and every check's): what each exercised."""
    resumed: list[Resumed] = field(default_factory=list)
    """Every check's resumed paths (:meth:`Check.resumed`), which the ``compare`` phase compares."""
    passed: bool = False
    """Whether every check passed so far (:meth:`Check.ok`)."""
    task_evidence: dict[str, str] = field(default_factory=dict)
    """Per resumed path, the task's own state that the live comparison (trainproof.proof.live) found differing: the
    evidence that lets a diagnosis blame the task (trainproof.proof.diagnose), set in the ``compare`` phase."""


class Check(abc.ABC):
    """One thing the verifier proves: its runs, its comparison, its verdicts, its report.

    A check never starts processes itself: it lists them (:meth:`jobs`); the protocol starts every check's runs of a
    phase together (``--sequential``, ``--timeout``), then hands each its results (:meth:`record`, :meth:`compare`).
    """

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """The runs to start in ``phase`` (one of :data:`PHASES`); none by default.

        Called once per phase, in order, after the previous phase's runs were compared (``done``: the results so far):
        a check may prepare here what its runs need (seed a resumed run's store from a generation an earlier phase
        committed). ``scratch``: a local folder that lives until the phase's runs ended, for files they name."""
        return []

    def record(self, phase: str, results: list[PathResult]) -> None:
        """Keep the entries of the runs :meth:`jobs` listed for ``phase`` (all of them, in that order) for the report:
        command lines, exit codes. Called for every check before any run of the phase is judged, so that a report
        stopped by another run's crash still lists every run that ran. Never raises."""

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Take the same results (called even when it listed none; ``done``: the results so far, these among them):
        check that they ran as intended, read them back from the store, compare.

        Raises :class:`trainproof.proof.paths.VerificationIncomplete` when a run crashed or a result is missing (the
        verification could not complete, exit 2); a difference is a failed check, recorded, never raised."""

    def resumed(self) -> list[Resumed]:
        """The check's resumed paths that the ``compare`` phase compares with the continuous path, state by state,
        reading each continuous state once for every path (a large state is read a group of entries at a time, see
        :mod:`trainproof.proof.compare`). Asked after every phase (:attr:`Results.resumed`); none by default."""
        return []

    @property
    @abc.abstractmethod
    def passed(self) -> bool:
        """The positive part: every comparison the check made is within its tolerance (False before it compared)."""

    @property
    def negative_detected(self) -> bool | None:
        """Its negative control (a deliberately wrong run) was told apart; None (default): the check has none."""
        return None

    def ok(self) -> bool:
        """What ``all_checks_passed`` asks of the check: passed, and its negative control (if any) detected."""
        return self.passed and self.negative_detected is not False

    @abc.abstractmethod
    def failing(self) -> list[str]:
        """The names of its failed checks for ``failing_checks`` (``<path or check>.<what>``; stable: people and
        tests read them)."""

    def diagnosis(self) -> list[str]:
        """Likely causes of its failures, in words a task's author can act on (``diagnosis``); none by default."""
        return []

    @abc.abstractmethod
    def verdicts(self) -> dict[str, bool]:
        """The verdict keys it adds to verification.json (top level, beside ``all_checks_passed``), with their
        values. A report that could not complete sets every one to false. Named ``<check>_passed`` and
        ``<check>_negative_detected``: the printed summary shows every such key."""

    @abc.abstractmethod
    def sections(self) -> dict[str, Any]:
        """The blocks it adds to verification.json, by top-level key (its measurements, tolerance, runs)."""

    def covers(self) -> dict[str, str]:
        """What the resumed paths did not exercise that this check made active on runs of its own (a ``what`` of
        trainproof.proof.exercised's ``not_exercised`` -> how), for the report; nothing by default."""
        return {}

    def checks(self) -> dict[str, dict[str, Diff]]:
        """Rows it adds to verification.json's ``checks`` (and the summary table): per path, each compared part's
        difference, as the four paths have them; none by default."""
        return {}

    def findings(self) -> list[dict[str, Any]]:
        """What the reader should know about the task that is neither a pass nor a failure (``findings`` in
        verification.json, printed under the verdict): ``{"what", "check", "finding"}`` each; none by default."""
        return []


class Skipped(Check):
    """A check that does not run in this verification: no runs and no verdict, only its block saying why.

    The block keeps its place in verification.json (a reader finds ``{"skipped": why}``, not a missing key), and the
    summary says the verdict covers nothing of what the check would have proved."""

    def __init__(self, key: str, why: str) -> None:
        self.key, self.why = key, why

    @property
    def passed(self) -> bool:
        """Nothing ran that could fail."""
        return True

    def failing(self) -> list[str]:
        """Nothing ran that could fail."""
        return []

    def verdicts(self) -> dict[str, bool]:
        """No verdict keys: a skipped check's keys are absent from verification.json."""
        return {}

    def sections(self) -> dict[str, Any]:
        """``{key: {"skipped": why}}``."""
        return {self.key: {"skipped": self.why}}


class NotApplicable(Skipped):
    """A check that cannot apply to this task: no runs and no verdict keys, its block saying why
    (``{"not_applicable": why, ...}``), and the findings it makes instead (:meth:`Check.findings`). Not a failure:
    a correct task it does not fit passes the verification without it, and the summary says so."""

    def __init__(self, key: str, why: str, *, details: dict[str, Any] | None = None,
                 findings: list[dict[str, Any]] | None = None) -> None:
        super().__init__(key, why)
        self.details, self._findings = dict(details or {}), list(findings or [])

    def sections(self) -> dict[str, Any]:
        """``{key: {"not_applicable": why, **details}}``."""
        return {self.key: {"not_applicable": self.why, **self.details}}

    def findings(self) -> list[dict[str, Any]]:
        """What the task does that the check would have judged (e.g. BatchNorm over accumulated micro-batches)."""
        return list(self._findings)
