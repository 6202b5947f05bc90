"""The one duration syntax of every setting that takes one: ``90s``, ``10m``, ``6h``, ``7d``, ``1h30m``, ``500ms``.

Here, at the bottom of the parts, because retention's ``--keep-every 6h`` reads it and ``trainproof.storage`` imports
no other part; ``--deadline``, ``plan`` and the lifecycle's other settings read the same one
(trainproof.lifecycle.signals, trainproof.lifecycle.planner).
"""

from __future__ import annotations

import re

_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def duration_seconds(text: str) -> float | None:
    """The seconds of ``text`` when it is a duration with units (case and surrounding space ignored), else None. A
    plain number is not one here (a caller decides what a bare number means: seconds, or a step count)."""
    spec = str(text).strip().lower()
    parts = _PART.findall(spec)
    if not parts or "".join(n + u for n, u in parts) != spec:
        return None
    return sum(float(n) * UNIT_SECONDS[u] for n, u in parts)
