"""The life of verification data: what a verdict keeps, and ``gc --keep-verifications``.

A verification writes, under ``<run>/verification/<id>/``, one run per path (``continuous/``, ``cut/``,
``resume/``, ``resume_without_rng/``, an audit's ``replay/``, ``world_equivalence/*/``), each with its ``step-*``
generations: the evidence the comparison read. Once a verdict is in, ``verification.json``, the plot, the paths'
``plan.json``/``summary.json`` and the export (``resume/exports/``) say everything a reader needs, and the
generations are the bulk of the bytes. So after a *passed* verdict they are removed unless ``--keep-evidence``;
a failed or incomplete verification keeps everything (that is when someone will want to look).

``gc --keep-verifications N`` keeps the N newest verifications with a report and removes older ones entirely.
It only ever touches ``<run>/verification/``: never the run's own generations, exports or quarantine.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass

from trainproof.storage import GenerationStore

log = logging.getLogger("trainproof.verify")
VERIFICATION_DIR, REPORT_FILE = "verification", "verification.json"
_GENERATION = re.compile(r"step-\d{8}")
_NEVER = {"exports", "quarantine"}  # folders whose contents outlive a verdict
_MAX_DEPTH = 3  # <id>/world_equivalence/<path>/step-*: deeper is not a path of ours


def prune_evidence(root: GenerationStore) -> list[str]:
    """Remove the ``step-*`` generations of every path under one verification folder ``root``.

    Returns the removed generations (relative to ``root``). Exports, quarantine and run-level files stay.
    """
    removed: list[str] = []

    def walk(rel: str, depth: int) -> None:
        for entry in sorted(root.list_dir(rel), key=lambda e: e.name):
            if not entry.is_dir or entry.name in _NEVER:
                continue
            child = f"{rel}/{entry.name}" if rel else entry.name
            if _GENERATION.fullmatch(entry.name) and rel:  # a path's generation, not a folder named like one at the top
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
    """From its verification.json; None when it has none (still running, or it died before its report)."""


def list_verifications(run: GenerationStore) -> list[Verification]:
    """Every verification of the run, oldest first (by the report's ``created_at``, then id)."""
    base = run.child(VERIFICATION_DIR)
    found = []
    for entry in base.list_dir():
        if not entry.is_dir:
            continue
        try:
            created = json.loads(base.child(entry.name).read_file(REPORT_FILE)).get("created_at")
        except (FileNotFoundError, ValueError, AttributeError):
            created = None
        found.append(Verification(entry.name, created))
    return sorted(found, key=lambda v: (v.created_at or "", v.vid))


def plan_verification_gc(run: GenerationStore, keep: int) -> tuple[list[Verification], list[Verification]]:
    """(kept, doomed): the ``keep`` newest verifications with a report stay; one without a report is never
    removed (it may be running right now)."""
    reported = [v for v in list_verifications(run) if v.created_at]
    doomed = reported[:-keep] if keep > 0 else reported
    kept = [v for v in list_verifications(run) if v not in doomed]
    return kept, doomed


def remove_verification(run: GenerationStore, vid: str) -> None:
    """Delete ``<run>/verification/<vid>/`` entirely (its report, plot, paths and export)."""
    run.child(VERIFICATION_DIR).delete_tree(vid)
