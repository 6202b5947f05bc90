"""The tail every ``trainproof verify`` shares, the protocol's and the audit's: run, report, plot, prune, outcome.

Why one tail: whatever the verification (the four-path protocol, or ``--audit`` of a real run), the person reading
its log and the CronJob reading its exit code are owed the same things. A report is *always* attempted, a partial one
with the error when the verification could not complete (a crashed path still leaves its commands and what was
compared before it). The plot goes with a complete report only. A passed verdict is what allows the evidence (the
paths' generations) to be removed; a failed or incomplete one keeps everything, since that is when someone will want
to look. The outcome is one of three (:class:`Outcome`), which the command line maps to its exit codes.

A runner implements :class:`VerificationRunner` explicitly (:class:`trainproof.proof.protocol.Protocol`,
:class:`trainproof.proof.audit.Audit`), so the tail asks it, rather than probing it, what it does after a pass, whether
it has a plot, and whether its evidence may be pruned.
"""

from __future__ import annotations

import enum
import logging
import sys
from typing import Any, Protocol

from trainproof.errors import TrainError
from trainproof.proof.evidence import prune_evidence
from trainproof.proof.paths import VerificationIncomplete
from trainproof.proof.report import print_summary, upload
from trainproof.storage import GenerationStore, StoreError

log = logging.getLogger("trainproof.verify")


class Outcome(enum.Enum):
    """How a verification ended (``trainproof verify`` exits 0, 1 or 2)."""

    PASSED = "passed"
    """Every check passed."""
    FAILED = "failed"
    """It completed and a comparison failed."""
    INCOMPLETE = "incomplete"
    """It could not complete (a path crashed, the store failed, a result is missing) or its report was not stored."""


class VerificationRunner(Protocol):
    """What the tail needs of one verification."""

    root: GenerationStore
    """The verification's own folder (``<store>/verification/<id>/`` or under ``--workdir``): the report goes there."""
    prunes_evidence: bool
    """Whether a passed verdict removes the paths' generations (an audit's credentials may not delete: it never
    does; ``gc --keep-verifications`` removes old audits)."""

    def run(self) -> None:
        """Run the verification to its verdict. Raises VerificationIncomplete (or TrainError, StoreError, OSError)
        when it cannot complete; a failed comparison is a verdict, not an exception."""

    def verdicts(self) -> dict[str, Any]:
        """The verdicts so far, ``all_checks_passed`` among them."""

    def after_pass(self) -> None:
        """What a passed verdict triggers before the report is built (the audit records its span, which releases the
        restore point the trainer protects). Never raises for a store that refuses: it says so in the report."""

    def report(self, error: str | None = None) -> dict[str, Any]:
        """verification.json (partial, with ``error`` and every verdict false, when it could not complete)."""

    def plot(self) -> bytes | None:
        """verification.png, or None (no matplotlib, nothing to draw, or a verification without a plot)."""


def run_verification(runner: VerificationRunner, *, keep_evidence: bool = False) -> Outcome:
    """Run, then always try to upload a report (a partial one, with the error, when it could not complete); print
    the summary; after a passed verdict prune the evidence unless ``keep_evidence`` (or the runner never prunes)."""
    error, hint = _run(runner)
    report = runner.report(error)
    if error is not None:
        report["what_to_try"] = hint or GENERIC_HINT
    try:
        upload(runner.root, report, runner.plot() if error is None else None)
    except (StoreError, OSError) as exc:
        error = error or f"could not upload the report: {exc}"
        print(f"trainproof: error: could not upload {runner.root.url}/verification.json: {exc}", file=sys.stderr)
    if error is None and report["all_checks_passed"] and not keep_evidence and runner.prunes_evidence:
        _prune(runner.root, report)
    print_summary(report)
    if error is not None:
        print(f"trainproof: error: verification incomplete: {' '.join(error.split())}", file=sys.stderr)
        return Outcome.INCOMPLETE
    return Outcome.PASSED if report["all_checks_passed"] else Outcome.FAILED


GENERIC_HINT = ("read the error above; the commands of every path that ran are in verification.json (paths): run the "
                "failing one to see its whole output, fix what it names, then run verify again")


def _run(runner: VerificationRunner) -> tuple[str | None, str | None]:
    """The runner's run and, when it passed, its after-pass step; the error that stopped it and what to try, or
    (None, None)."""
    try:
        runner.run()
        if runner.verdicts()["all_checks_passed"]:
            runner.after_pass()
    except VerificationIncomplete as exc:
        return f"{type(exc).__name__}: {exc}", exc.hint
    except (TrainError, StoreError, OSError) as exc:
        return f"{type(exc).__name__}: {exc}", None
    except Exception as exc:  # a bug must still end as "could not complete", with its traceback logged
        log.exception("verification failed unexpectedly")
        return f"{type(exc).__name__}: {exc}", None
    return None, None


def _prune(root: GenerationStore, report: dict[str, Any]) -> None:
    """After a passed verdict: remove the paths' generations, then say so in verification.json (re-uploaded).
    A failure to remove is a warning, never a changed verdict."""
    try:
        removed = prune_evidence(root)
        report["evidence"] = {"removed_generations": removed, "kept": "verification.json, plot, each path's "
                              "plan.json and summary.json, the export; --keep-evidence keeps the generations"}
        upload(root, report, None)
    except (StoreError, OSError) as exc:
        log.warning("could not remove the verification's generations under %s (%s); they stay: "
                    "`trainproof gc --keep-verifications N` removes old verifications", root.url, exc)
