"""What a restart costs on S3: the wall time of a trainer process that resumes a run and trains a few steps.

Against a Ceph RGW of its own (``scripts/rgw.sh``; or the endpoint in ``AWS_ENDPOINT_URL``), each checkout (this one,
and ``--before``: another, e.g. ``git archive`` of an older commit) trains a run of its own of the ``regression``
task to ``--steps``, then ``--reps`` more processes each resume it and train ``--steps`` more, the checkouts
interleaved. Reported: the median wall time of the resuming processes (``Popen`` to exit), and its ``restore_s``
(the trainer's own ``resume`` event: finding, verifying and restoring the generation).

    .venv/bin/python bench/bench_restart.py
    mkdir /tmp/before && git archive HEAD~1 | tar -x -C /tmp/before
    .venv/bin/python bench/bench_restart.py --before /tmp/before
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
BUCKET = "bench-restart"


def attempt(root: str, url: str, steps: int) -> dict:
    """One trainer process of checkout ``root`` training ``url`` to ``steps`` in all: its wall time and restore_s."""
    env = dict(os.environ, PYTHONPATH=root)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", url, "--task", "regression",
                           "--max-steps", str(steps), "--log-format", "json"], cwd=root, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{root}: trainer exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    restore = None
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("{") and '"resume"' in line:
            with_restore = json.loads(line)
            restore = with_restore.get("restore_s", restore)
    return {"wall": wall, "restore_s": restore}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=6, help="resuming processes per checkout")
    ap.add_argument("--steps", type=int, default=10, help="steps each process trains")
    ap.add_argument("--before", default=None, help="another checkout to time beside this one")
    args = ap.parse_args()
    sys.path.insert(0, ROOT)
    from tests.support.rgw import bench_bucket

    roots = {"this": ROOT, **({"before": os.path.abspath(args.before)} if args.before else {})}
    with bench_bucket(BUCKET):  # the trainers find it in AWS_ENDPOINT_URL
        stamp = f"{os.getpid()}-{int(time.time())}"
        urls = {name: f"s3://{BUCKET}/{name}-{stamp}" for name in roots}
        for name, root in roots.items():  # the first process of each run starts it: not a restart
            attempt(root, urls[name], args.steps)
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        runs: dict[str, list[dict]] = {name: [] for name in roots}
        for rep in range(args.reps):
            for name, root in roots.items():
                runs[name].append(attempt(root, urls[name], args.steps * (rep + 2)))
                r = runs[name][-1]
                print(f"  {name:6s} restart {rep + 1}: {r['wall']:.2f} s (restore_s {r['restore_s']})", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        medians = {name: statistics.median(r["wall"] for r in rs) for name, rs in runs.items()}
        for name, rs in runs.items():
            restores = [r["restore_s"] for r in rs if r["restore_s"] is not None]
            print(f"{name}: restart median {medians[name]:.2f} s, restore_s median "
                  f"{statistics.median(restores) if restores else float('nan'):.3f} s")
        if "before" in medians:
            print(f"this / before: {medians['this'] / medians['before']:.3f}")


if __name__ == "__main__":
    main()
