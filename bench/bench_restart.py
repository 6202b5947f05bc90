"""What a restart costs on S3: the wall time of a trainer process that resumes a run and trains a few steps.

Against a Ceph RGW of its own (``scripts/rgw.sh``; or the endpoint in ``AWS_ENDPOINT_URL``), each checkout (this one,
and ``--before``: another, e.g. ``git archive`` of an older commit) trains a run of its own of ``--task`` (default the
``regression`` task; ``--config``: its settings as JSON) to ``--steps``, then ``--reps`` more processes each resume it
and train ``--steps`` more, the checkouts interleaved. Reported: the median wall time of the resuming processes
(``Popen`` to exit), the time from ``Popen`` to the trainer's ``resume`` event (started, restored, about to train), and
its ``restore_s`` (the trainer's own measure: finding, verifying and restoring the generation), and each
process's peak RSS.

    .venv/bin/python bench/bench_restart.py
    mkdir /tmp/before && git archive HEAD~1 | tar -x -C /tmp/before
    .venv/bin/python bench/bench_restart.py --before /tmp/before
    .venv/bin/python bench/bench_restart.py --before /tmp/before --task bench.bigmodel:factory \
        --config '{"state_mib": 1024}' --steps 2 --reps 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from datetime import datetime

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUCKET = "bench-restart"


def attempt(root: str, url: str, steps: int, task: list[str]) -> dict:
    """One trainer process of checkout ``root`` training ``url`` to ``steps`` in all: its wall time, the time from
    ``Popen`` to its ``resume`` event, and that event's restore_s."""
    env = dict(os.environ, PYTHONPATH=root)
    started, t0 = time.time(), time.perf_counter()
    # Through a wrapper whose only child is the trainer: its RUSAGE_CHILDREN peak RSS is the trainer's own.
    proc = subprocess.run([sys.executable, "-c", PEAK, sys.executable, "-m", "trainproof", "train", "--store", url,
                           *task, "--max-steps", str(steps), "--log-format", "json"], cwd=root, env=env,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise SystemExit(f"{root}: trainer exited {proc.returncode}: {proc.stderr.strip()[-2000:]}")
    restore = resumed = None
    for line in (proc.stdout + proc.stderr).splitlines():
        if line.startswith("{") and '"resume"' in line:
            event = json.loads(line)
            restore = event.get("restore_s", restore)
            resumed = datetime.fromisoformat(event["time"]).timestamp() - started
    peak = [line for line in proc.stderr.splitlines() if line.startswith("peak_rss_kib ")]
    return {"wall": wall, "restore_s": restore, "resumed": resumed,
            "peak_mib": int(peak[-1].split()[1]) / 1024 if peak else None}


PEAK = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
        "print('peak_rss_kib', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); "
        "sys.exit(code)")


def _median(values: list) -> float:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=6, help="resuming processes per checkout")
    ap.add_argument("--steps", type=int, default=10, help="steps each process trains")
    ap.add_argument("--before", default=None, help="another checkout to time beside this one")
    ap.add_argument("--task", default="regression", help="the task the runs train")
    ap.add_argument("--config", default=None, help="the task's settings, a JSON object")
    args = ap.parse_args()
    task = ["--task", args.task]
    if args.config:
        path = os.path.join(os.path.abspath(os.path.dirname(__file__)), "out", f"restart-{os.getpid()}.json")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as fh:
            fh.write(args.config)
        task += ["--config", path]
    sys.path.insert(0, ROOT)
    from tests.support.rgw import bench_bucket

    roots = {"this": ROOT, **({"before": os.path.abspath(args.before)} if args.before else {})}
    with bench_bucket(BUCKET):  # the trainers find it in AWS_ENDPOINT_URL
        stamp = f"{os.getpid()}-{int(time.time())}"
        urls = {name: f"s3://{BUCKET}/{name}-{stamp}" for name in roots}
        for name, root in roots.items():  # the first process of each run starts it: not a restart
            attempt(root, urls[name], args.steps, task)
        print(f"load average before: {os.getloadavg()[0]:.2f}")
        runs: dict[str, list[dict]] = {name: [] for name in roots}
        for rep in range(args.reps):
            for name, root in roots.items():
                runs[name].append(attempt(root, urls[name], args.steps * (rep + 2), task))
                r = runs[name][-1]
                print(f"  {name:6s} restart {rep + 1}: {r['wall']:.2f} s, resumed at {r['resumed']:.2f} s "
                      f"(restore_s {r['restore_s']}), peak RSS {r['peak_mib']:.0f} MiB", flush=True)
        print(f"load average after: {os.getloadavg()[0]:.2f}")
        medians = {name: statistics.median(r["wall"] for r in rs) for name, rs in runs.items()}
        resumed = {name: _median([r["resumed"] for r in rs]) for name, rs in runs.items()}
        for name, rs in runs.items():
            print(f"{name}: restart median {medians[name]:.2f} s, resumed at {resumed[name]:.2f} s, restore_s median "
                  f"{_median([r['restore_s'] for r in rs]):.3f} s, peak RSS median "
                  f"{_median([r['peak_mib'] for r in rs]):.0f} MiB")
        if "before" in medians:
            peaks = {name: _median([r["peak_mib"] for r in rs]) for name, rs in runs.items()}
            print(f"this / before: restart {medians['this'] / medians['before']:.3f}, resumed "
                  f"{resumed['this'] / resumed['before']:.3f}, peak RSS {peaks['this'] / peaks['before']:.3f}")


if __name__ == "__main__":
    main()
