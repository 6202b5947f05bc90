"""Background checkpoints with world > 1: how long each rank's training is blocked, what it costs in throughput
and in memory, DDP or ``--fsdp``, against ``--sync-checkpoint`` and against no checkpoint at all.

``.venv/bin/python bench/bench_world_async.py [--mib 256] [--world 2] [--reps 3] [--fsdp] [--every 5] [--steps 30]``

Each repetition runs three real ``trainproof train --nproc-per-node W`` launches of ``bench.bigmodel:factory``
(Linear layers with Adam, ``--mib`` MiB of parameters + Adam moments in total) into fresh local folders, in an
order that alternates between repetitions:

- ``async``: the default, a checkpoint every ``--every`` steps, committed by each rank's save thread;
- ``sync``: the same with ``--sync-checkpoint``;
- ``none``: ``--checkpoint-every 0`` (only the final commit, after the timed window).

Reported (medians over the repetitions; rank 0's events):

- **blocked**: seconds training was blocked per periodic checkpoint (the trainer's ``blocked_s``), async vs sync;
  for async also split into the wait for the previous commit (``checkpoint_wait``: at most one save is in flight,
  so a commit slower than the checkpoint interval makes the next one wait) and the rest (capture + the copy to
  host memory);
- **throughput**: steps/s between the first and the last step event, async / none and sync / none;
- **memory**: each rank's peak resident set (sampled every 10 ms from ``/proc/<pid>/statm``) while training, from
  the first to the last step event (the final commit comes after it), minus the same rank's peak over the same
  window of the ``none`` run, per state byte that rank checkpoints (rank 0 of a DDP run: the whole state; a sharded
  run: each rank its shard, ``--mib / W``).

Not run by CI; figures in bench/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * PAGE
    except (OSError, ValueError, IndexError):
        return 0


def launch(store: Path, args: argparse.Namespace, mode: str) -> dict:
    """One ``train`` launch; its rank 0 events and each rank's peak RSS."""
    config = store.parent / "bigmodel.json"
    config.write_text(json.dumps({"state_mib": args.mib}))
    cmd = [sys.executable, "-m", "trainproof", "train", "--nproc-per-node", str(args.world), "--store", str(store),
           "--task", "bench.bigmodel:factory", "--config", str(config), "--max-steps", str(args.steps), "--keep", "2",
           "--log-format", "json", "--checkpoint-every", "0" if mode == "none" else str(args.every),
           *(["--sync-checkpoint"] if mode == "sync" else []), *(["--fsdp"] if args.fsdp else [])]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    events, samples, pids = [], [], []
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.01):
            now = time.time()
            samples.extend((now, rank, _rss(pid)) for rank, pid in enumerate(pids))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for line in proc.stdout:
        if line.startswith("{"):
            event = json.loads(line)
            events.append(event)
            if event.get("event") == "launch":
                pids.extend(r["pid"] for r in event["ranks"])
    stderr = proc.stderr.read()
    proc.wait()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run exited {proc.returncode}: {stderr[-2000:]}")
    steps = [datetime.fromisoformat(e["time"]).timestamp() for e in events if e.get("event") == "step"]
    peaks: dict[int, int] = {}
    for t, rank, rss in samples:
        if steps[0] <= t <= steps[-1]:
            peaks[rank] = max(peaks.get(rank, 0), rss)
    return {"events": events, "peaks": peaks}


def _throughput(events: list[dict]) -> float:
    steps = [(e["step"], datetime.fromisoformat(e["time"]).timestamp()) for e in events if e.get("event") == "step"]
    (s0, t0), (s1, t1) = steps[0], steps[-1]
    return (s1 - s0) / (t1 - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=256.0, help="parameters + Adam moments in total, MiB (default 256)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--fsdp", action="store_true", help="shard with FSDP2 instead of DDP")
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-world-async-"))
    rows = []
    try:
        for rep in range(args.reps):
            modes = ["async", "sync", "none"]
            if rep % 2:
                modes.reverse()
            row = {}
            for mode in modes:
                store = base / f"{mode}-{rep}"
                t0 = time.perf_counter()
                result = launch(store, args, mode)
                row[mode] = {"wall_s": time.perf_counter() - t0, "throughput": _throughput(result["events"]),
                             "peaks": result["peaks"],
                             "blocked": [e["blocked_s"] for e in result["events"]
                                         if e.get("event") == "checkpoint" and e["step"] < args.steps],
                             "seconds": [e["seconds"] for e in result["events"]
                                         if e.get("event") == "checkpoint" and e["step"] < args.steps],
                             "waited": [sum(w["seconds"] for w in result["events"]
                                            if w.get("event") == "checkpoint_wait" and w["step"] == e["step"])
                                        for e in result["events"]
                                        if e.get("event") == "checkpoint" and e["step"] < args.steps]}
                shutil.rmtree(store, ignore_errors=True)
            rows.append(row)
            print(f"rep {rep}: " + ", ".join(f"{m} {row[m]['throughput']:.2f} steps/s, blocked "
                                             f"{statistics.median(row[m]['blocked'] or [0]):.3f} s" for m in modes),
                  flush=True)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    med = statistics.median
    kind = "fsdp" if args.fsdp else "ddp"
    print(f"\n{kind}, world {args.world}, {args.mib:g} MiB of model + Adam state, a checkpoint every {args.every} of "
          f"{args.steps} steps, {args.reps} repetitions (medians)")
    for mode in ("async", "sync"):
        blocked = med(med(r[mode]["blocked"]) for r in rows)
        commit = med(med(r[mode]["seconds"]) for r in rows)
        ratio = med(r[mode]["throughput"] / r["none"]["throughput"] for r in rows)
        waited = med(med(r[mode]["waited"]) for r in rows)
        print(f"  {mode:5}: blocked {blocked:.3f} s per checkpoint (of which waiting for the previous commit "
              f"{waited:.3f} s), commit {commit:.3f} s, throughput {ratio:.2f}x of no checkpoint")
    per_rank = args.mib * 2**20 / args.world if args.fsdp else None
    for rank in range(args.world):
        own = per_rank if per_rank else (args.mib * 2**20 if rank == 0 else 0)
        cells = []
        for mode in ("async", "sync"):
            extra = med(r[mode]["peaks"].get(rank, 0) - r["none"]["peaks"].get(rank, 0) for r in rows)
            cells.append(f"{mode} {extra / 2**20:+.0f} MiB" + (f" ({extra / own:.2f}x its state)" if own else ""))
        print(f"  rank {rank} peak RSS while training, above the no-checkpoint run's: " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
