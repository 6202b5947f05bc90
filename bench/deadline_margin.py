"""How early (or late) a ``--deadline`` run ends, quiet and with busy loops beside it.

A deadline run must commit, export and reload-check the export, then *end* before its deadline: the reserve it
keeps is measured save time, the reload check's fresh-process start-up (this process's own, measured) and this
process's own end (trainproof.lifecycle.finish.Finisher). This script runs the suite's scenario (the regression
fixture, 20 ms steps, ``--deadline 30s``) ``--reps`` times per load level and prints, per level, the median and
worst margin (seconds before the deadline the process was gone; negative: late), the reserve the run announced,
and how many exits were 0. Load levels are busy loops started beside the run (``--loads 0,3``: quiet, then three
loops on this machine's cores).

    .venv/bin/python bench/deadline_margin.py --reps 3 --loads 0,3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_run(deadline_s: int) -> dict:
    with tempfile.TemporaryDirectory(prefix="tp-deadline-") as tmp:
        store = Path(tmp) / "run"
        env = {**os.environ, "PYTHONPATH": str(ROOT), "TPHOOK_STEP_DELAY": "0.02"}
        done = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", str(store), "--task",
                               "regression", "--max-steps", "1000000", "--deadline", f"{deadline_s}s",
                               "--log-format", "json"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=deadline_s * 10)
        ended = datetime.now(timezone.utc)
        at = datetime.fromisoformat(json.loads((store / "deadline.json").read_text())["at"])
        events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
        start = next((e for e in events if e.get("event") == "start"), {})
        return {"code": done.returncode, "margin_s": (at - ended).total_seconds(),
                "reserve_s": start.get("deadline_reserve_s")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--loads", default="0,3", help="busy loops beside the run, per level (comma-separated)")
    parser.add_argument("--deadline", type=int, default=30, help="seconds")
    args = parser.parse_args()
    for loops in (int(x) for x in args.loads.split(",")):
        busy = [subprocess.Popen(["bash", "-c", "while :; do :; done"]) for _ in range(loops)]
        try:
            runs = [one_run(args.deadline) for _ in range(args.reps)]
        finally:
            for proc in busy:
                proc.kill()
        margins = [r["margin_s"] for r in runs]
        print(json.dumps({"busy_loops": loops, "cores": os.cpu_count(), "load_1min": round(os.getloadavg()[0], 1),
                          "median_margin_s": round(statistics.median(margins), 2),
                          "worst_margin_s": round(min(margins), 2),
                          "reserve_s": [r["reserve_s"] for r in runs], "exit_0": sum(r["code"] == 0 for r in runs),
                          "runs": len(runs)}))


if __name__ == "__main__":
    main()
