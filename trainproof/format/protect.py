"""Which generations retention must keep for the audit: those around every restore point no audit has passed.

``verify --audit`` proves a resume by replaying across it: from the newest generation *before* a restore point to
one after it (trainproof.proof.audit). If retention deleted those (``--keep 3`` with a checkpoint every step does so
within three steps), no replay could start before the resume any more, and a broken resume could no longer be shown.

So at each retention the trainer keeps, besides the K newest generations, for every restore point ``r`` that no
passed audit has spanned yet: ``r`` itself and the newest generation before ``r``. The restore points are this
process's own (where it resumed) and those recorded by the K newest generations (``extra.resumed_from`` in their
COMPLETE.json: where the processes that wrote them resumed). Taking them from the newest generations only keeps the
cost bounded (at most two protected generations per process among the K newest: it does not grow with the run's
length or its number of restarts), and a newest generation that someone else planted can only make retention keep
more, never less: a forged generation that a run without a signing key resumed from is a restore point, so the
genuine generation before it stays until an audit has passed across it, which a forgery does not.

A passed audit records its span in ``<run>/verification/audited.json`` (trainproof.proof.audit), which this module
reads; it releases the restore points inside its span. An audit written elsewhere (``--workdir``) releases nothing: it
only costs storage. The record releases protection, so it is evidence and is authenticated before it counts
(:func:`read_audited`): with a signing key it must carry a valid signature; without one it must name a verification
whose own report (``verification/<id>/verification.json``) is a passed audit of the same span, and its span must end
at or before the run's newest generation (:func:`within_run`). A record that fails counts as none: nothing released.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Callable, Iterable

from trainproof.storage.limits import UntrustedJSONError, loads_untrusted

AUDITED_FILE = "audited.json"
"""Under ``<run>/verification/``: the span ``{from, to, passed}`` of the newest passed audit."""
_MAX_AUDITED_BYTES = 64 * 1024
_MAX_REPORT_BYTES = 16 * 2**20
_VID = re.compile(r"[A-Za-z0-9._-]{1,128}")
"""A verification id as a name under ``verification/`` (no separators, no parent)."""
log = logging.getLogger("trainproof.retention")


def audited_past(record: Any, step: int) -> bool:
    """Whether an audit record shows a passed replay that started at or before ``step`` and ended after it."""
    if not isinstance(record, dict) or record.get("passed") is not True:
        return False
    start, end = record.get("from"), record.get("to")
    return _step(start) is not None and _step(end) is not None and start <= step < end


def _step(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def recorded_restore(manifest: Any) -> int | None:
    """The step the process that wrote this generation resumed from (its COMPLETE.json ``extra.resumed_from``), or
    None (a fresh start, or anything that is not a step: stored content is read defensively)."""
    extra = manifest.get("extra") if isinstance(manifest, dict) else None
    value = _step(extra.get("resumed_from")) if isinstance(extra, dict) else None
    return value or None


def steps_to_keep(steps: list[int], restore_points: Iterable[int], record: Any) -> frozenset[int]:
    """For each restore point no passed audit spans (``record``): the point and the newest of ``steps`` before it."""
    ordered = sorted(steps)
    keep: set[int] = set()
    for r in set(restore_points):
        if not r or audited_past(record, r):
            continue
        keep.add(r)
        before = [s for s in ordered if s < r]
        if before:
            keep.add(before[-1])
    return frozenset(keep & set(ordered))


def read_audited(store: Any) -> Any:
    """The run's audit record when it is authenticated (see the module docstring), else None: then nothing is
    released. Never raises: the store failing here must not fail a commit (the generations are kept)."""
    try:
        verification = store.child("verification")
        record = _small_json(verification, AUDITED_FILE, _MAX_AUDITED_BYTES)
        if not isinstance(record, dict):
            return None
        keys = getattr(getattr(store, "options", None), "signing", None)
        if keys is not None:
            problem = keys.problem(record)
            if problem is not None:
                log.warning("verification/%s is not this run's (%s): it releases no restore point", AUDITED_FILE,
                            problem)
                return None
            return record
        vid = record.get("id")
        if not isinstance(vid, str) or not _VID.fullmatch(vid):
            return None
        report = _small_json(verification.child(vid), "verification.json", _MAX_REPORT_BYTES)
        settings = report.get("settings") if isinstance(report, dict) else None
        if not (isinstance(settings, dict) and report.get("kind") == "audit" and report.get("verdict") == "PASSED"
                and settings.get("from") == record.get("from") and settings.get("to") == record.get("to")):
            log.warning("verification/%s names no passed audit of its span (verification/%s): it releases no "
                        "restore point", AUDITED_FILE, vid)
            return None
        return record
    except Exception:  # noqa: BLE001 - the store failing here must not fail a commit: keep the generations
        return None


def within_run(record: Any, newest: int) -> Any:
    """``record`` when its span ends at or before the run's newest generation ``newest``, else None: an audit can
    only have replayed generations that existed (a record claiming every step is not an audit of this run)."""
    end = _step(record.get("to")) if isinstance(record, dict) else None
    return record if end is not None and end <= newest else None


def _small_json(store: Any, name: str, cap: int) -> Any:
    """A small record read capped and parsed defensively; None when absent or not strict JSON."""
    try:
        return loads_untrusted(store.read_file(name, max_bytes=cap), what=name, max_bytes=cap)
    except (FileNotFoundError, UntrustedJSONError):
        return None


def restore_protection(store: Any, resumed_from: int | None, keep: int) -> Callable[[list[Any]], frozenset[int]]:
    """The retention rule (``storage.RetentionPolicy.protect_rule``): given the run's complete generations (oldest
    first, each with its ``step`` and ``manifest``), the steps to keep for the audit besides the ``keep`` newest."""

    def rule(generations: list[Any]) -> frozenset[int]:
        # A generation can only have been written after the step its process resumed from: anything else recorded
        # there is not a restore point of this run.
        recorded = ((recorded_restore(g.manifest), g.step) for g in generations[-keep:])
        points = {r for r, step in recorded if r and r < step} | ({resumed_from} if resumed_from else set())
        if not points:
            return frozenset()
        return steps_to_keep([g.step for g in generations], points,
                             within_run(read_audited(store), generations[-1].step) if generations else None)

    return rule
