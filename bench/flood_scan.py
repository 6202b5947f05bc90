"""What a flood of small ``step-*`` folders planted in a shared bucket costs every scan of the run (each resume and
each retention), on Ceph RADOS Gateway: the scan's one listing of the tree (``ListsTrees``) against the
folder-by-folder look it replaced (a request per folder), in the same process, same store, medians.

    .venv/bin/python bench/flood_scan.py --folders 3000 --reps 3     # starts its own RGW (root: installs it)

Prints a JSON line with the medians, the ratio and the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--folders", type=int, default=3000, help="empty step-* folders planted (default 3000)")
    parser.add_argument("--reps", type=int, default=3, help="scans timed per way (default 3)")
    args = parser.parse_args()

    from tests.support.rgw import bench_endpoint
    from tests.support.s3server import make_boto3_client

    with bench_endpoint() as endpoint:
        print(json.dumps(measure(endpoint, args.folders, args.reps, make_boto3_client)))


def measure(endpoint: str, folders: int, reps: int, make_client) -> dict:
    from trainproof.storage import generations, open_store

    client = make_client(endpoint)
    bucket = f"flood-{uuid.uuid4().hex[:10]}"
    client.create_bucket(Bucket=bucket)
    store = open_store(f"s3://{bucket}/run")
    store.commit(1, {"state.pt": b"x" * 1000}, contract="c", world=1, code_version="v")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda i: client.put_object(Bucket=bucket, Key=f"run/step-{90000000 + i:08d}/x", Body=b""),
                      range(folders)))
    plant_s = time.perf_counter() - t0

    def timed() -> float:
        t = time.perf_counter()
        assert len(store.scan(contract="c", world=1)) == folders + 1
        return time.perf_counter() - t

    tree = [timed() for _ in range(reps)]
    real = generations._listed_trees
    generations._listed_trees = lambda *a, **k: None  # the folder-by-folder look: a listing request per folder
    try:
        alone = [timed() for _ in range(reps)]
    finally:
        generations._listed_trees = real
    return {"folders": folders, "plant_s": round(plant_s, 2), "scan_tree_s": round(statistics.median(tree), 3),
            "scan_per_folder_s": round(statistics.median(alone), 3),
            "ratio_tree_over_per_folder": round(statistics.median(tree) / statistics.median(alone), 4),
            "load": [round(x, 2) for x in os.getloadavg()], "cores": os.cpu_count()}


if __name__ == "__main__":
    main()
