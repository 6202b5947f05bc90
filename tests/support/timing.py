"""Wall-clock limits that hold on a loaded machine.

A test that says "this gives up at once, well within 15 s" means 15 s on a quiet machine. With both cores busy
(a CI neighbour, another suite) the same work takes several times longer, and a fixed limit turns into a false
failure. ``budget(15)`` is that limit scaled by how loaded the machine is when the limit is needed (the 1-minute
load average per core, at least 1), so the limit keeps its meaning on a quiet machine and holds on a busy one.
Only for limits about *waiting* (a timeout, "not hung"); what a test counts (retries, steps, bytes) is never
scaled.
"""

from __future__ import annotations

import os


def slowdown() -> float:
    """How many times slower than quiet this machine runs now: runnable processes per core, at least 1."""
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # no load average on this platform
        return 1.0
    return max(1.0, load / (os.cpu_count() or 1))


def budget(seconds: float) -> float:
    """``seconds`` on a quiet machine, as a limit for this machine now."""
    return seconds * slowdown()
