"""Crash consistency at scale: SIGKILL a committing writer N times on a local folder and on S3 (the throw-away Ceph
RADOS Gateway of ``scripts/rgw.sh``, with files of several 5 MiB multipart parts, whose keys the store claims before
uploading there), checking after every kill that discovery returns the last committed generation and that every
committed generation verifies; then two writers racing for the same steps on RGW (multipart files), counting
winners. Prints a table and writes bench/out/crash.json.

    .venv/bin/python bench/crash_consistency.py --kills 1000 --backends local
    .venv/bin/python bench/crash_consistency.py --kills 200 --backends s3 --races 50
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support import rgw  # noqa: E402
from tests.support.crashloop import run  # noqa: E402
from tests.support.s3server import dummy_aws_env  # noqa: E402


def races(url: str, steps: int, env: dict, work: str) -> dict:
    """Two writer processes commit each step at the same moment (12.5 MB files in 5 MiB parts): exactly one must
    win, the other get a conflict, and every won generation must load with the winner's bytes afterwards."""
    from tests.test_storage_concurrency import race
    from trainproof.storage import open_store

    repeat, winners, bad = 2_500_000, {}, []
    for step in range(1, steps + 1):
        results = race(url, step, os.path.join(work, f"go-{step}"), env, repeat)
        won = [w for w, r in results.items() if r == "won"]
        lost = [w for w, r in results.items() if r.startswith("conflict:")]
        if len(won) != 1 or len(lost) != 1:
            bad.append(f"step {step}: {results}")
        else:
            winners[step] = won[0]
    store = open_store(url)
    for step, who in winners.items():
        loaded = store.load(step)
        if loaded.files["training_state.pt"] != who.encode() * repeat or loaded.files["meta.json"] != who.encode():
            bad.append(f"step {step}: the committed generation does not hold its winner's bytes")
    return {"steps": steps, "one_winner": len(winners), "failures": bad}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--backends", default="local,s3")
    ap.add_argument("--races", type=int, default=0, help="two-writer races on RGW (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.update(dummy_aws_env())
    rows, race_row = [], None
    state = rgw.prepare_session() if "s3" in args.backends or args.races else None
    try:
        for backend in args.backends.split(","):
            t0 = time.time()

            def progress(i, rep, backend=backend):
                if i % 50 == 0 or i == args.kills:
                    print(f"  {backend}: {i}/{args.kills} kills, {rep.commits_seen} commits, {rep.partials_seen} "
                          f"mid-commit, {rep.claims_seen} mid-upload, {len(rep.failures)} failures", flush=True)

            if backend == "s3":
                srv = rgw.session_server()
                os.environ["AWS_ENDPOINT_URL"] = srv.endpoint
                with tempfile.TemporaryDirectory() as spools:  # what a killed writer's serialising thread left
                    env = {**os.environ, "TRAINPROOF_PART_SIZE_MB": "5", "TRAINPROOF_SPOOL_DIR": spools}
                    rep = run(f"s3://{srv.create_bucket()}/crash/run", args.kills, seed=args.seed, max_delay=0.8,
                              size_scale=60, after_commits=2, aim_claims=True, env=env,
                              progress=progress)
            else:
                with tempfile.TemporaryDirectory() as tmp:
                    rep = run(os.path.join(tmp, "run"), args.kills, seed=args.seed, progress=progress)
            rows.append({"backend": backend, "kills": rep.kills, "commits": rep.commits_seen,
                         "kills_mid_commit": rep.partials_seen, "kills_mid_upload": rep.claims_seen,
                         "generations_verified": rep.checks, "failures": rep.failures,
                         "seconds": round(time.time() - t0, 1)})
        if args.races:
            t0 = time.time()
            srv = rgw.session_server()
            os.environ["AWS_ENDPOINT_URL"] = srv.endpoint
            with tempfile.TemporaryDirectory() as tmp:
                race_row = races(f"s3://{srv.create_bucket()}/race/run", args.races,
                                 {**os.environ, "TRAINPROOF_PART_SIZE_MB": "5"}, tmp)
            race_row["seconds"] = round(time.time() - t0, 1)
    finally:
        if state:
            rgw.end_session(state)
    print(f"\n{'backend':8} {'kills':>6} {'commits':>8} {'mid-commit':>10} {'mid-upload':>10} {'verified':>9} "
          f"{'failures':>8} {'s':>7}")
    for r in rows:
        print(f"{r['backend']:8} {r['kills']:>6} {r['commits']:>8} {r['kills_mid_commit']:>10} "
              f"{r['kills_mid_upload']:>10} {r['generations_verified']:>9} {len(r['failures']):>8} {r['seconds']:>7}")
    if race_row:
        print(f"races: {race_row['steps']} steps, {race_row['one_winner']} with exactly one winner, "
              f"{len(race_row['failures'])} failures, {race_row['seconds']} s")
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "out", "crash.json"), "w") as fh:
        json.dump({"kills": rows, "races": race_row}, fh, indent=2)
    sys.exit(1 if any(r["failures"] for r in rows) or (race_row and race_row["failures"]) else 0)


if __name__ == "__main__":
    main()
