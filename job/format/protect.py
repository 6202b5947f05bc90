"""Which generation retention must keep for the audit: the one the newest restore started from.

``verify --audit`` proves a resume by replaying across it: from a generation at or before the restore point
to one after it. If retention deleted the restore point (``--keep 3`` with a checkpoint every step does so
within three steps), no generation would be left to start such a replay from, and a broken resume could no
longer be shown. So the trainer keeps that generation until an audit has passed across it; a passed audit
records its span in ``<run>/verification/audited.json`` (job.proof.audit), which this module reads.
An audit written elsewhere (``--workdir``) does not release the protection: it only costs storage.
"""

from __future__ import annotations

import json
from typing import Any, Callable

AUDITED_FILE = "audited.json"
"""Under ``<run>/verification/``: the span ``{from, to, passed}`` of the newest passed audit."""


def audited_past(record: Any, step: int) -> bool:
    """Whether an audit record shows a passed replay that started at or before ``step`` and ended after it."""
    if not isinstance(record, dict) or record.get("passed") is not True:
        return False
    start, end = record.get("from"), record.get("to")
    return isinstance(start, int) and isinstance(end, int) and start <= step < end


def protected_steps(store: Any, resumed_from: int | None) -> Callable[[], frozenset[int]]:
    """A callable (asked at each retention) returning ``{resumed_from}`` until an audit passed across it."""
    if not resumed_from:
        return frozenset

    def protect() -> frozenset[int]:
        try:
            record = json.loads(store.child("verification").read_file(AUDITED_FILE))
        except (FileNotFoundError, ValueError, UnicodeDecodeError):
            record = None
        except Exception:  # noqa: BLE001 - the store failing here must not fail a commit: keep the generation
            record = None
        return frozenset() if audited_past(record, resumed_from) else frozenset({resumed_from})

    return protect
