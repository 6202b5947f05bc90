"""The load-scaled wall-clock limits of tests/support/timing.py."""

from __future__ import annotations

import os

from tests.support import timing


def test_a_limit_scales_with_load_per_core_and_never_shrinks(monkeypatch):
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    monkeypatch.setattr(os, "getloadavg", lambda: (8.0, 0.0, 0.0))
    assert timing.budget(15) == 60.0
    monkeypatch.setattr(os, "getloadavg", lambda: (0.5, 0.0, 0.0))
    assert timing.budget(15) == 15.0  # a quiet machine keeps the limit as written


def test_no_load_average_means_no_scaling(monkeypatch):
    def missing():
        raise OSError("no load average")

    monkeypatch.setattr(os, "getloadavg", missing)
    assert timing.budget(7) == 7.0
