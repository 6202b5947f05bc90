"""The life of verification data: what a verdict keeps, and ``gc --keep-verifications``.

A verification writes, under ``<run>/verification/<id>/``, one run per path (``continuous/``, ``cut/``,
``resume/``, ``resume_without_rng/``, an audit's ``replay/``, ``world_equivalence/*/``), each with its ``step-*``
generations: the evidence the comparison read. Once a verdict is in, ``verification.json``, the plot, the paths'
``plan.json``/``summary.json`` and the export (``resume/exports/``) say everything a reader needs, and the
generations are the bulk of the bytes. So after a *passed* verdict they are removed unless ``--keep-evidence``;
a failed or incomplete verification keeps everything (that is when someone will want to look).

``gc --keep-verifications N`` keeps the N newest verifications with a report and removes older ones entirely;
``gc --abandoned-hours H`` removes those without a report that nothing was written to for H hours. It only ever
touches ``<run>/verification/``: never the run's own generations, exports or quarantine.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass

from trainproof.storage import GenerationStore
from trainproof.storage.errors import not_a_file
from trainproof.storage.limits import UntrustedJSONError, loads_untrusted, safe
from trainproof.storage.manifest import SHARED_DIR

log = logging.getLogger("trainproof.verify")
VERIFICATION_DIR, REPORT_FILE = "verification", "verification.json"
_GENERATION = re.compile(r"step-\d{8}")
_NEVER = {"exports", "quarantine"}  # folders whose contents outlive a verdict
_MAX_REPORT_BYTES = 16 * 2**20  # a verification.json is kilobytes to a few MiB; a planted huge one is not read whole
_MAX_DEPTH = 3  # <id>/world_equivalence/<path>/step-*: deeper is not a path of ours


def prune_evidence(root: GenerationStore) -> list[str]:
    """Remove the ``step-*`` generations (and ``shared/`` objects) of every path under one verification folder
    ``root``.

    Returns the removed generations (relative to ``root``). Exports, quarantine and run-level files stay.
    """
    removed: list[str] = []

    def walk(rel: str, depth: int) -> None:
        for entry in sorted(root.list_dir(rel), key=lambda e: e.name):
            if not entry.is_dir or entry.name in _NEVER:
                continue
            child = f"{rel}/{entry.name}" if rel else entry.name
            # A path's generation, not a folder named like one at the top; and its shared objects (its frozen model
            # entries), which only its own generations reference.
            if (_GENERATION.fullmatch(entry.name) or entry.name == SHARED_DIR) and rel:
                root.delete_tree(child)
                removed.append(child)
            elif depth < _MAX_DEPTH:
                walk(child, depth + 1)

    walk("", 0)
    return removed


@dataclass(frozen=True)
class Verification:
    """One ``<run>/verification/<id>/`` folder."""

    vid: str
    created_at: str | None
    """From its verification.json (shown only); None when it has no readable one (still running, died before its
    report, or what is there is not a report)."""
    verdict: str | None = None
    """Its report's verdict (PASSED, FAILED, INCOMPLETE), as stored: shown, never trusted for a decision."""
    reported_at: float = 0.0
    """When the store says its verification.json was written (the listing's time, at most now): what orders
    verifications. The report's own ``created_at`` is what anyone who can write there says, so it orders nothing."""


def list_verifications(run: GenerationStore) -> list[Verification]:
    """Every verification of the run, oldest first (by when the store says each report was written, then id).
    Each report is read capped and parsed defensively; one that does not parse counts as no report."""
    base = run.child(VERIFICATION_DIR)
    found = []
    for entry in base.list_dir():
        if not entry.is_dir or entry.is_special:
            continue
        folder = base.child(entry.name)
        listed = [e for e in folder.list_dir() if e.name == REPORT_FILE and not e.is_dir and not e.is_special]
        created = verdict = None
        if listed:
            try:
                report = loads_untrusted(folder.read_file(REPORT_FILE, max_bytes=_MAX_REPORT_BYTES), what=REPORT_FILE,
                                         max_bytes=_MAX_REPORT_BYTES)
                if isinstance(report, dict):  # anything else is not a report: counted as none
                    created, verdict = report.get("created_at"), report.get("verdict")
                    created = safe(created, 64) if isinstance(created, str) else "(no created_at)"
            except (FileNotFoundError, UntrustedJSONError) as exc:
                log.warning("verification/%s: %s is not a readable report (%s); counted as none", safe(entry.name),
                            REPORT_FILE, safe(exc))
            except OSError as exc:
                if not not_a_file(exc):
                    raise
        at = min(listed[0].mtime or 0.0, time.time()) if listed and created is not None else 0.0
        found.append(Verification(entry.name, created, safe(verdict, 32) if isinstance(verdict, str) else None, at))
    return sorted(found, key=lambda v: (v.reported_at, v.vid))


def plan_verification_gc(run: GenerationStore, keep: int | None, *, abandoned_after_s: float | None = None,
                         now: float | None = None) -> tuple[list[Verification], list[Verification]]:
    """(kept, doomed): the ``keep`` newest verifications with a report stay (all, when None). One without a report
    may be running right now: it is removed only when ``abandoned_after_s`` is given and nothing under it was
    written for that long (a running verification commits generations all along)."""
    found = list_verifications(run)
    reported = [v for v in found if v.created_at]
    doomed = [] if keep is None else reported[:-keep] if keep > 0 else reported
    if abandoned_after_s is not None:
        cutoff = (time.time() if now is None else now) - abandoned_after_s
        doomed += [v for v in found if not v.created_at and _last_written(run, v.vid) < cutoff]
    kept = [v for v in found if v not in doomed]
    return kept, doomed


def _last_written(run: GenerationStore, vid: str) -> float:
    """When anything under ``<run>/verification/<vid>/`` was last written (0 when nothing says: an empty folder);
    a bounded walk, like ``prune_evidence``'s. A time in the future (a clock or a planted object) counts as now."""
    root, newest = run.child(VERIFICATION_DIR).child(vid), 0.0

    def walk(rel: str, depth: int) -> None:
        nonlocal newest
        for entry in root.list_dir(rel):
            if entry.is_dir and depth < _MAX_DEPTH + 1:
                walk(f"{rel}/{entry.name}" if rel else entry.name, depth + 1)
            elif not entry.is_dir and entry.mtime is not None:
                newest = max(newest, min(entry.mtime, time.time()))

    walk("", 0)
    return newest


def remove_verification(run: GenerationStore, vid: str) -> None:
    """Delete ``<run>/verification/<vid>/`` entirely (its report, plot, paths and export)."""
    run.child(VERIFICATION_DIR).delete_tree(vid)
