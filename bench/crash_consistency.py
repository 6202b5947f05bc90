"""Crash consistency at scale: SIGKILL a committing writer N times (default 1000) on a local folder and on S3
over loopback (moto server mode), checking after every kill that discovery returns the last committed
generation and that every committed generation verifies.  Prints a table and writes bench/out/crash.json.

    .venv/bin/python bench/crash_consistency.py --kills 1000 [--backends local,s3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.support.crashloop import run  # noqa: E402
from tests.support.s3server import S3Server, dummy_aws_env  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=1000)
    ap.add_argument("--backends", default="local,s3")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.update(dummy_aws_env())
    rows = []
    for backend in args.backends.split(","):
        t0 = time.time()

        def progress(i, rep, backend=backend):
            if i % 50 == 0 or i == args.kills:
                print(f"  {backend}: {i}/{args.kills} kills, {rep.commits_seen} commits, "
                      f"{rep.partials_seen} mid-commit, {len(rep.failures)} failures", flush=True)

        if backend == "s3":
            with S3Server() as srv:
                os.environ["AWS_ENDPOINT_URL"] = srv.endpoint
                rep = run(f"s3://{srv.create_bucket()}/crash/run", args.kills, seed=args.seed, max_delay=0.6,
                          env=dict(os.environ), progress=progress)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                rep = run(os.path.join(tmp, "run"), args.kills, seed=args.seed, progress=progress)
        rows.append({"backend": backend, "kills": rep.kills, "commits": rep.commits_seen,
                     "kills_mid_commit": rep.partials_seen, "generations_verified": rep.checks,
                     "failures": rep.failures, "seconds": round(time.time() - t0, 1)})
    print(f"\n{'backend':8} {'kills':>6} {'commits':>8} {'mid-commit':>10} {'verified':>9} {'failures':>8} {'s':>7}")
    for r in rows:
        print(f"{r['backend']:8} {r['kills']:>6} {r['commits']:>8} {r['kills_mid_commit']:>10} "
              f"{r['generations_verified']:>9} {len(r['failures']):>8} {r['seconds']:>7}")
    os.makedirs(os.path.join(os.path.dirname(__file__), "out"), exist_ok=True)
    with open(os.path.join(os.path.dirname(__file__), "out", "crash.json"), "w") as fh:
        json.dump(rows, fh, indent=2)
    sys.exit(1 if any(r["failures"] for r in rows) else 0)


if __name__ == "__main__":
    main()
