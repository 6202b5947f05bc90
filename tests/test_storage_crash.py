"""Crash consistency with real processes killed by SIGKILL at random moments (local folder and S3 over loopback).

After each kill: discovery returns the last committed generation (never a partial one) and every committed
generation's bytes verify and are that step's bytes.  bench/crash_consistency.py runs the same with ≥ 1000 kills.
"""

from __future__ import annotations

import os

import pytest

from tests.support.crashloop import run

KILLS = int(os.environ.get("TRAINPROOF_CRASH_KILLS", "50"))


def test_sigkill_during_commits_on_a_local_folder(tmp_path):
    report = run(str(tmp_path / "run"), KILLS, seed=1)
    assert report.failures == []
    assert report.kills == KILLS and report.checks > 0
    assert report.max_step > 5, "the writer should have committed between kills"
    assert report.partials_seen > 0, "no kill landed inside a commit"


@pytest.mark.slow  # the local-folder variant runs by default
def test_sigkill_during_commits_on_s3(s3_env):
    report = run(f"s3://{s3_env}/crash/run", KILLS, seed=2, max_delay=0.6, env=dict(os.environ))
    assert report.failures == []
    assert report.kills == KILLS and report.checks > 0
    assert report.max_step > 5
    assert report.partials_seen > 0, "no kill landed inside a commit"
