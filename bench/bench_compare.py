"""The verifier's comparison of sharded states: read a group of entries at a time vs read whole.

``.venv/bin/python bench/bench_compare.py [--mib 3072] [--reps 3] [--others 1] [--dir DIR]`` trains
``bench.bigmodel:factory`` with ``--mib`` MiB of model + Adam state (``--mib 3072``: 1 GiB of float32 weights, 3 GiB
of state) for one step with ``train --fsdp --nproc-per-node 2`` into a local folder, then per repetition, each in a
fresh process and in alternating order, compares that generation with itself read through ``--others``
further readers (what the verifier does when a resumed path equals the continuous one: every byte of both sides
read back from the store, verified, and compared):

- grouped: ``trainproof.proof.paths.RunReader(...).state(step)`` (the shards opened, nothing read) and
  ``trainproof.proof.compare.compare_all``: each group of ``TRAINPROOF_COMPARE_GROUP_MIB`` (default 256) MiB of the
  reference read once, the same entries of each other side read after it, compared a slice at a time.
- whole: what ``verify --fsdp`` did before: every side read whole (``state(step, whole=True)``: the sharded model
  and optimizer gathered in this process, ``trainproof.train.fsdp.full_state``), then every check and the parameter
  distance per other side, as ``compare_states`` and ``parameter_distance`` did. Only run with ``--others 1``
  unless memory allows it (it holds ``1 + others`` states).

Memory is the process's anonymous resident memory sampled every 2 ms, above the level before the call, also as a
multiple of the state's bytes. Medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = "bench.bigmodel:factory"


def child(mode: str, run: str, others: int) -> dict:
    """One measured comparison in this (fresh) process."""
    from bench.bench_sharded import PeakRSS
    from trainproof.format.contract import read_run_plan
    from trainproof.proof.compare import Tolerance, compare_all
    from trainproof.proof.paths import RunReader
    from trainproof.proof.protocol import parameter_names
    from trainproof.storage import open_store
    from trainproof.tasks import load_task

    store = open_store(run)
    names, _ = parameter_names(load_task(TASK, read_run_plan(store)["task_config"]))
    step = max(g.step for g in store.scan() if g.status == "complete")
    with PeakRSS(anon=True) as mem:
        start = time.perf_counter()
        whole = mode == "whole"
        ref = RunReader("ref", run, open_store).state(step, whole=whole)
        sides = {f"o{i}": RunReader(f"o{i}", run, open_store).state(step, whole=whole) for i in range(others)}
        results = compare_all(ref, sides, Tolerance(), names)  # whole states: every check, then the distance
        seconds = time.perf_counter() - start
    assert all(d.within for diffs, _ in results.values() for d in diffs.values()), results
    assert all(distance == 0.0 for _, distance in results.values())
    state_bytes = sum(meta["bytes"] for name, meta in store.generation(step).manifest["files"].items()
                      if name.startswith("shard-"))
    return {"mode": mode, "seconds": seconds, "peak_anon": mem.extra, "state_bytes": state_bytes}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=3072, help="state size of the run (weights: a third of it)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--others", type=int, default=1, help="states compared with the reference (the protocol: up to 4)")
    p.add_argument("--modes", default="grouped,whole", help="comma-separated: grouped, whole")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, deleted after)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "RUN", "OTHERS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, run_url, others = args.child
        print(json.dumps(child(mode, run_url, int(others))))
        return 0
    sys.path.insert(0, str(ROOT))
    from bench.bench_export import child_row, print_medians, print_ratio, train_sharded_run

    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-compare-"))
    work.mkdir(parents=True, exist_ok=True)
    run = work / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    modes = args.modes.split(",")
    try:
        if not train_sharded_run(run, args.mib, env):
            return 1
        rows: dict[str, list[dict]] = {m: [] for m in modes}
        for rep in range(args.reps):
            for mode in (modes if rep % 2 == 0 else modes[::-1]):
                row = child_row(__file__, [mode, str(run), str(args.others)], env)
                if row is None:
                    return 1
                rows[mode].append(row)
                print(f"rep {rep} {mode}: {row}", flush=True)
        state = rows[modes[0]][0]["state_bytes"]
        print(f"state: {state / 2**20:.0f} MiB of shards, compared with {args.others} other side(s), "
              f"{args.reps} repetitions, medians")
        print_medians(rows, state, "the state")
        if len(modes) == 2:
            print_ratio(f"time {modes[0]}/{modes[1]}", rows[modes[0]], rows[modes[1]])
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
