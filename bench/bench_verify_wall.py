"""Wall time of the default ``verify`` (export and objective check included) of a task, for one or two checkouts.

    .venv/bin/python bench/bench_verify_wall.py --task regression --task tinylm [--before /tmp/before] [--repeats 2]

Runs ``python -m trainproof verify --store <tmp> --task T --id w`` with this interpreter in each checkout's root (the
verifier puts its own package on its paths' PYTHONPATH, so each checkout runs its own code), alternating before/after
per repetition, and prints one JSON line per run and the medians. ``--before`` is another checkout, e.g. made with
``mkdir /tmp/before && git archive 5e236fa | tar -x -C /tmp/before``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(checkout: Path, task: str) -> tuple[float, int]:
    with tempfile.TemporaryDirectory(prefix="bench-verify-") as tmp:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "trainproof", "verify", "--store", f"{tmp}/run", "--task", task,
                               "--id", "w"], cwd=checkout, capture_output=True, text=True)
        return time.monotonic() - t0, proc.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", action="append", default=None)
    parser.add_argument("--before", type=Path, default=None, help="another checkout to compare with")
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    sides = {"after": ROOT, **({"before": args.before} if args.before else {})}
    walls: dict[tuple[str, str], list[float]] = {}
    for task in args.task or ["regression"]:
        for r in range(args.repeats):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for side in order:
                wall, code = one(sides[side], task)
                walls.setdefault((task, side), []).append(wall)
                print(json.dumps({"task": task, "side": side, "wall_s": round(wall, 2), "exit": code}), flush=True)
    print(json.dumps({f"{task}/{side}": round(statistics.median(v), 2) for (task, side), v in walls.items()}))


if __name__ == "__main__":
    main()
