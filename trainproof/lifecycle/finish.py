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
import os
import time
from datetime import datetime, timedelta, timezone
from typing import Any

from trainproof.errors import ConfigError, TrainError
from trainproof.lifecycle.signals import is_duration, parse_deadline
from trainproof.storage import GenerationStore
from trainproof.storage.errors import StoreError, not_a_file
from trainproof.storage.limits import safe

log = logging.getLogger("trainproof.finish")
DEADLINE_FILE = "deadline.json"
DEADLINE_SCHEMA = "trainproof.deadline/1"


def resolve_run_deadline(store: GenerationStore, spec: str, *, absolute_only: bool = False) -> datetime:
    """The run's absolute deadline for ``--deadline spec``; a relative one counts from the run's first start,
    recorded in (or read from) ``deadline.json``.

    The deadline always comes from the operator: an absolute ``spec`` is the deadline whatever the record says
    (a recorded time that disagrees is reported as tampering), and of a record only ``first_start`` is used, never
    its ``at``. ``first_start`` is believed only when the record is signed by an accepted key (with a signing key
    configured) and, key or not, when it lies between plan.json's ``created_at`` (less the start-up slack: the
    record is written before the plan) and now; otherwise it is reported as tampering (one warning line) and the
    run counts from plan.json's ``created_at`` (or from now, before there is a plan)."""
    if absolute_only and is_duration(spec):
        raise ConfigError(f"--rental-ends {spec!r} must be an absolute ISO time (2026-12-01T18:00:00Z); "
                          "use --deadline for a duration")
    now = datetime.now(timezone.utc)
    record = {"schema": DEADLINE_SCHEMA, "spec": spec, "first_start": now.isoformat(),
              "at": parse_deadline(spec, now).isoformat()}
    keys = store.options.signing
    try:
        store.write_file(DEADLINE_FILE, _signed(record, keys), create_only=True)
        return datetime.fromisoformat(record["at"])
    except FileExistsError:
        pass
    created = _plan_created(store, now)
    try:
        saved = store.read_json(DEADLINE_FILE, max_bytes=MAX_RECORD_BYTES)
        if not isinstance(saved, dict):
            raise TypeError("not an object")
        first = aware_time(saved.get("first_start"))
    except OSError as exc:
        if not not_a_file(exc):
            raise  # the store failing, not what it holds
        log.warning("%s is not a file (a folder, a link or a FIFO): counting the deadline from %s", DEADLINE_FILE,
                    "the run's plan.json" if created else "now")
        return _record_afresh(store, record, spec, created or now, keys)
    except (ValueError, TypeError, KeyError, RecursionError, AttributeError) as exc:
        # Damaged (or planted) record: the old value is unknowable; count from the plan's creation (or now).
        log.warning("%s is unreadable (%s): counting the deadline from %s", DEADLINE_FILE, type(exc).__name__,
                    "the run's plan.json" if created else "now")
        return _record_afresh(store, record, spec, created or now, keys)
    problem = _tampered(saved, first, created, now, keys)
    if problem is None and not is_duration(spec) and saved.get("spec") == spec and saved.get("at") != record["at"]:
        problem = f"it records {safe(saved.get('at'))} for --deadline {safe(spec)}, which means {record['at']}"
    if problem is not None:
        log.warning("%s looks tampered with (%s): ignored; the deadline is --deadline %s, counted from %s",
                    DEADLINE_FILE, problem, safe(spec), "the run's plan.json" if created else "now")
        return _record_afresh(store, record, spec, created or now, keys)
    at = parse_deadline(spec, first)
    if saved.get("spec") != spec:
        # A changed value wins: a relative one still counts from the run's first start, not from this restart.
        log.warning("--deadline changed from %s to %r (%s) since the run's first start: the new value wins",
                    safe(saved.get("spec")), spec, at.isoformat())
        store.write_file(DEADLINE_FILE, _signed({**record, "first_start": first.isoformat(), "at": at.isoformat()},
                                                keys))
    return at


START_SLACK = timedelta(minutes=10)
"""How long before plan.json's ``created_at`` a genuine first start may lie: deadline.json is written as the
process starts, plan.json once torch is imported, the task loaded and the ranks met."""


def _tampered(saved: dict[str, Any], first: datetime, created: datetime | None, now: datetime,
              keys: Any) -> str | None:
    """Why a readable record cannot be the run's own (None when it can)."""
    if keys is not None:
        problem = keys.problem(saved)
        if problem is not None:
            return problem
    if first > now + timedelta(minutes=1):
        return f"its first start {first.isoformat()} is in the future"
    if created is not None and first < created - START_SLACK:
        return f"its first start {first.isoformat()} is before the run's plan.json was written ({created.isoformat()})"
    return None


def _plan_created(store: GenerationStore, now: datetime) -> datetime | None:
    """plan.json's ``created_at`` when there is a readable one that is not in the future, else None."""
    try:
        plan = store.read_json("plan.json")
        created = aware_time(plan.get("created_at")) if isinstance(plan, dict) else None
    except (OSError, StoreError, ValueError, TypeError, RecursionError):
        return None
    return created if created is not None and created <= now + timedelta(minutes=1) else None


def _record_afresh(store: GenerationStore, record: dict[str, Any], spec: str, first: datetime, keys: Any) -> datetime:
    at = parse_deadline(spec, first)
    data = _signed({**record, "first_start": first.isoformat(), "at": at.isoformat()}, keys)
    try:
        store.write_file(DEADLINE_FILE, data)
    except OSError as exc:
        if not not_a_file(exc):
            raise
        # A folder at the name (a file, link or FIFO is replaced by the write itself): moved aside, then written.
        store.move_aside(DEADLINE_FILE, f"occupied {DEADLINE_FILE}, which the run writes: not a file")
        store.write_file(DEADLINE_FILE, data)
    return at


def _signed(record: dict[str, Any], keys: Any) -> bytes:
    return _json(keys.sign(record) if keys is not None else record)


MAX_RECORD_BYTES = 64 * 1024
"""deadline.json is a few hundred bytes; anything longer is not ours."""


def aware_time(text: object) -> datetime:
    """An ISO time with a zone, from a stored record (ValueError/TypeError otherwise)."""
    if not isinstance(text, str) or len(text) > 64:
        raise ValueError("not an ISO time")
    at = datetime.fromisoformat(text)
    if at.tzinfo is None:
        raise ValueError("no time zone")
    return at


def process_age_s(fallback_since: float) -> float:
    """Seconds since this process started, interpreter start-up included (Linux: ``/proc/self/stat``); elsewhere
    since ``fallback_since`` (a ``time.monotonic()`` value taken as early as possible)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as stat, open("/proc/uptime", encoding="ascii") as uptime:
            # Field 22 (starttime, clock ticks after boot) follows the command name, which may hold spaces: split
            # after its closing parenthesis.
            started = int(stat.read().rpartition(")")[2].split()[19]) / os.sysconf("SC_CLK_TCK")
            age = float(uptime.read().split()[0]) - started
    except (OSError, ValueError, IndexError, AttributeError):
        age = -1.0
    return age if 0.0 <= age < 86400.0 else time.monotonic() - fallback_since


class Finisher:
    """Estimates and performs the export + fresh-process reload check after a deadline's final commit."""

    EXIT_SHARE = 0.5
    """This process's own end (interpreter finalization: torch's modules and objects torn down) as a share of its
    start-up. Measured on 2 cores: 0.45-0.9 s after the last event for a start-up of 2-3 s, and it grows with the
    machine's load as the start-up does."""

    def __init__(self, startup_s: float, task: str) -> None:
        self.startup_s = startup_s
        """How long this process took to start, import torch and open the run: the reload check is such a process."""
        self.task = task
        """The run's task as this process was told it (the export compares plan.json with it)."""

    def exit_s(self) -> float:
        """Seconds kept after the reload check for this process to write its summary and end."""
        return 0.5 + self.EXIT_SHARE * self.startup_s

    def estimate_s(self, save_s: float) -> float:
        """Seconds the export, its reload check and this process's end may take.

        The export reads the generation back, evaluates twice and commits about as many bytes as a save, so
        twice the save; the reload check is a fresh ``python -m trainproof`` process, so this process's own start-up
        (measured from the process's start), plus a second for the evaluations; then this process ends
        (:meth:`exit_s`).
        """
        return 2.0 * save_s + self.startup_s + 1.0 + self.exit_s()

    def export_and_check(self, store: GenerationStore, seconds_left: float | None, save_s: float,
                         step: int | None = None) -> dict[str, Any]:
        """Export generation ``step`` (the run's final commit; None: the newest usable) and reload-check it;
        ``{"ok": bool, ...}``, never raises. The step is named: a newer generation that is not this run's own
        (planted above its target) is never what a deadline exports."""
        need = self.estimate_s(save_s)
        if seconds_left is not None and seconds_left < need:
            return {"ok": False, "why": f"{seconds_left:.1f}s left before the deadline, the export needs ~{need:.1f}s"}
        from trainproof.proof.paths import VerificationIncomplete
        from trainproof.proof.reload import export_and_check

        t0 = time.perf_counter()
        # The reload check gets what is left of the deadline once the export is committed, less this process's end
        # (3600 s without a deadline): a check that runs later is stopped, so the run still ends by the deadline.
        ends_at = None if seconds_left is None else time.monotonic() + seconds_left - self.exit_s()
        try:
            checked = export_and_check(store, step=step, task=self.task, store_args=[], timeout=3600.0,
                                       ends_at=ends_at)
        except (TrainError, VerificationIncomplete, StoreError, OSError) as exc:
            return {"ok": False, "why": " ".join(f"{type(exc).__name__}: {exc}".split())[:500]}
        record = checked.record
        return {"ok": checked.passed, "bundle": checked.bundle.url, "reload_check": checked.location,
                "seconds": round(time.perf_counter() - t0, 3), "metric": record["metric"],
                "recorded": record["recorded"], "reloaded_bf16": record["reloaded_bf16"],
                "others": record.get("others", {}),
                **({} if checked.passed else {"why": "the reload check failed"})}


def _json(value: dict[str, Any]) -> bytes:
    return (json.dumps(value, indent=2) + "\n").encode()
