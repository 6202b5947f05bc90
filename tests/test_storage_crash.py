"""Crash consistency with real processes killed by SIGKILL at random moments (a local folder, and the session's
Ceph RADOS Gateway with files of several multipart parts, whose keys the store claims before uploading there, each
part uploaded while the writer's thread still writes the file).

After each kill: discovery returns the last committed generation (never a partial one) and every committed
generation's bytes verify and are that step's bytes.  bench/crash_consistency.py runs the same with ≥ 1000 kills
(local) and ≥ 200 (RGW).
"""

from __future__ import annotations

import os

from tests.support.crashloop import run

KILLS = int(os.environ.get("TRAINPROOF_CRASH_KILLS", "50"))
S3_KILLS = int(os.environ.get("TRAINPROOF_CRASH_KILLS_S3", "12"))  # a writer's life costs ~4 s on RGW


def test_sigkill_during_commits_on_a_local_folder(tmp_path):
    report = run(str(tmp_path / "run"), KILLS, seed=1)
    assert report.failures == []
    assert report.kills == KILLS and report.checks > 0
    assert report.max_step > 5, "the writer should have committed between kills"
    assert report.partials_seen > 0, "no kill landed inside a commit"


def test_sigkill_during_multipart_commits_on_rgw(s3_env, tmp_path):
    # 5 MiB parts and files of 3-27 MB: most go up in several parts, each key claimed by an empty PUT first, each
    # part as soon as the writer's serialising thread has written it (a LiveSpool, as the trainer's S3 commits).
    # Kills are aimed at commits (after_commits): a writer's first commit also pays the create-only probe.
    env = {**os.environ, "TRAINPROOF_PART_SIZE_MB": "5", "TRAINPROOF_SPOOL_DIR": str(tmp_path)}
    report = run(f"s3://{s3_env}/crash/run", S3_KILLS, seed=3, max_delay=0.8, size_scale=60, env=env,
                 after_commits=2, aim_claims=True)
    assert report.failures == []
    assert report.kills == S3_KILLS and report.checks > 0
    assert report.max_step > 3, "the writer should have committed between kills"
    assert report.partials_seen > 0, "no kill landed inside a commit"
    assert report.claims_seen > 0, "no kill landed between a claim and its multipart completion"
