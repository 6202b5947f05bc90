"""Finishing a rental: the run-level deadline, and the export made after the deadline's final commit.

Why a run-level ``deadline.json``: a relative ``--deadline 90m`` read against each process's own start would
move later at every restart (a run restarted after 80 minutes would get another 90). So the first start
writes the absolute time, create-only, and every restart with the same value reads it back. A *changed*
value wins (the person or the orchestrator meant it), with a warning, and replaces the file.

Exit codes of a deadline stop (see README): 0 when the final checkpoint is committed *and* the export bundle
is committed and passed its reload check in a fresh process; 75 when the export could not be made in time
or failed (the checkpoint is committed: run again, or ``trainproof export`` later). A signal stays 75.
"""

from __future__ import annotations

import json
import logging
import time
from datetime import datetime, timezone
from typing import Any

from job.errors import ConfigError, TrainError
from job.lifecycle.signals import is_duration, parse_deadline
from storage import GenerationStore
from storage.errors import StoreError

log = logging.getLogger("trainproof.finish")
DEADLINE_FILE = "deadline.json"
DEADLINE_SCHEMA = "trainproof.deadline/1"


def resolve_run_deadline(store: GenerationStore, spec: str, *, absolute_only: bool = False) -> datetime:
    """The run's absolute deadline for ``--deadline spec``, recorded in (or read from) ``deadline.json``."""
    if absolute_only and is_duration(spec):
        raise ConfigError(f"--rental-ends {spec!r} must be an absolute ISO time (2026-12-01T18:00:00Z); "
                          "use --deadline for a duration")
    now = datetime.now(timezone.utc)
    record = {"schema": DEADLINE_SCHEMA, "spec": spec, "first_start": now.isoformat(),
              "at": parse_deadline(spec, now).isoformat()}
    try:
        store.write_file(DEADLINE_FILE, _json(record), create_only=True)
        return datetime.fromisoformat(record["at"])
    except FileExistsError:
        pass
    try:
        saved = store.read_json(DEADLINE_FILE, max_bytes=MAX_RECORD_BYTES)
        saved_at = _aware(saved["at"])
        first = _aware(saved.get("first_start", record["first_start"]))
    except (ValueError, TypeError, KeyError, RecursionError, AttributeError) as exc:
        # Damaged (or planted) record: counting from now is the safe reading; the old value is unknowable.
        log.warning("%s is unreadable (%s): recording the deadline afresh from now", DEADLINE_FILE,
                    type(exc).__name__)
        store.write_file(DEADLINE_FILE, _json(record))
        return datetime.fromisoformat(record["at"])
    if saved.get("spec") == spec:
        return saved_at
    # A changed value: a relative one still counts from the run's first start, not from this restart.
    at = parse_deadline(spec, first)
    log.warning("--deadline changed from %r (%s) to %r (%s) since the run's first start: the new value wins",
                saved.get("spec"), saved.get("at"), spec, at.isoformat())
    store.write_file(DEADLINE_FILE, _json({**record, "first_start": first.isoformat(), "at": at.isoformat()}))
    return at


MAX_RECORD_BYTES = 64 * 1024
"""deadline.json is a few hundred bytes; anything longer is not ours."""


def _aware(text: object) -> datetime:
    """An ISO time with a zone, from a stored record (ValueError/TypeError otherwise)."""
    if not isinstance(text, str) or len(text) > 64:
        raise ValueError("not an ISO time")
    at = datetime.fromisoformat(text)
    if at.tzinfo is None:
        raise ValueError("no time zone")
    return at


class Finisher:
    """Estimates and performs the export + fresh-process reload check after a deadline's final commit."""

    def __init__(self, startup_s: float, task: str) -> None:
        self.startup_s = startup_s
        self.task = task
        """The run's task as this process was told it (the export compares plan.json with it)."""
        """How long this process took to import torch and open the run: the reload check is such a process."""

    def estimate_s(self, save_s: float) -> float:
        """Seconds the export and its reload check may take.

        The export reads the generation back, evaluates twice and commits about as many bytes as a save, so
        twice the save; the reload check is a fresh ``python -m job`` process, so this process's own start-up
        (measured), plus a second for the evaluations.
        """
        return 2.0 * save_s + self.startup_s + 1.0

    def export_and_check(self, store: GenerationStore, seconds_left: float | None, save_s: float) -> dict[str, Any]:
        """Export the newest generation and reload-check it; ``{"ok": bool, ...}``, never raises."""
        need = self.estimate_s(save_s)
        if seconds_left is not None and seconds_left < need:
            return {"ok": False, "why": f"{seconds_left:.1f}s left before the deadline, the export needs ~{need:.1f}s"}
        from job.proof.paths import VerificationIncomplete
        from job.proof.reload import export_and_check

        t0 = time.perf_counter()
        # The reload check gets what is left of the deadline once the export is committed (3600 s without one).
        ends_at = None if seconds_left is None else time.monotonic() + seconds_left
        try:
            checked = export_and_check(store, task=self.task, store_args=[], timeout=3600.0, ends_at=ends_at)
        except (TrainError, VerificationIncomplete, StoreError, OSError) as exc:
            return {"ok": False, "why": " ".join(f"{type(exc).__name__}: {exc}".split())[:500]}
        record = checked.record
        return {"ok": checked.passed, "bundle": checked.bundle.url, "reload_check": checked.location,
                "seconds": round(time.perf_counter() - t0, 3), "metric": record["metric"],
                "recorded": record["recorded"], "reloaded_bf16": record["reloaded_bf16"],
                **({} if checked.passed else {"why": "the reload check failed"})}


def _json(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()
