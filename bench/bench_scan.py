"""What a scan of the run costs as it keeps more generations, on Ceph RGW (issue 42: the restore).

Every resume and every retention scans the run: one listing of the generations, one of their files, and each
complete generation's ``COMPLETE.json``. A run that keeps milestones (``--keep-every``) holds more generations the
longer it runs. This commits ``--generations`` small generations (default 1,10,40) to a Ceph RGW of its own
(``scripts/rgw.sh``; or the endpoint in ``AWS_ENDPOINT_URL``) and times, in fresh processes of this checkout and
of ``--before`` (another checkout, e.g. ``git archive`` of an older commit) one after the other, the median of
``--reps`` scans and one ``load_latest`` (the scan, then the newest generation read and verified).

    .venv/bin/python bench/bench_scan.py
    mkdir /tmp/before && git archive HEAD~1 | tar -x -C /tmp/before
    .venv/bin/python bench/bench_scan.py --before /tmp/before
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "bench-scan"


def child(root: str, endpoint: str, url: str, reps: int) -> None:
    sys.path.insert(0, root)
    from trainproof.storage import StoreOptions, open_store

    store = open_store(url, StoreOptions.from_env(endpoint_url=endpoint))
    store.scan(contract="bench", world=1)  # the client's first connections are not the scan's cost
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        found = store.scan(contract="bench", world=1)
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    loaded = store.load_latest(contract="bench", world=1)
    load = time.perf_counter() - t0
    assert loaded is not None and loaded.info.step == len(found), (loaded, len(found))
    print(json.dumps({"scan": statistics.median(times), "load_latest": load, "generations": len(found)}))


def run_child(root: str, endpoint: str, url: str, reps: int) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", root, endpoint, url, str(reps)],
                         check=True, capture_output=True, text=True, cwd=root)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--generations", default="1,10,40", help="how many generations the run keeps, ascending")
    ap.add_argument("--reps", type=int, default=5, help="scans per process (their median is reported)")
    ap.add_argument("--before", default=None, help="another checkout to time beside this one")
    ap.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        root, endpoint, url, reps = args.child
        child(root, endpoint, url, int(reps))
        return
    sys.path.insert(0, ROOT)
    from tests.support.rgw import bench_bucket
    from trainproof.storage import StoreOptions, open_store

    roots = {"this": ROOT, **({"before": os.path.abspath(args.before)} if args.before else {})}
    with bench_bucket(BUCKET) as endpoint:
        url = f"s3://{BUCKET}/run-{os.getpid()}-{int(time.time())}"
        store = open_store(url, StoreOptions.from_env(endpoint_url=endpoint))
        print(f"load average before: {os.getloadavg()[0]:.2f}; {args.reps} scans per process")
        committed = 0
        for target in sorted(int(n) for n in args.generations.split(",")):
            while committed < target:
                committed += 1
                store.commit(committed, {"training_state.pt": os.urandom(4096)}, contract="bench", world=1,
                             code_version="bench")
            row = {name: run_child(root, endpoint, url, args.reps) for name, root in roots.items()}
            line = "  ".join(f"{name}: scan {r['scan']:.3f} s, load_latest {r['load_latest']:.3f} s"
                             for name, r in row.items())
            if "before" in row:
                line += f"  (scan this/before {row['this']['scan'] / row['before']['scan']:.2f})"
            print(f"{target:4d} generations  {line}", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
