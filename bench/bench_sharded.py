"""Sharded save/load through the generation store vs DCP's own FileSystemWriter/Reader, same state, same disk.

``.venv/bin/python bench/bench_sharded.py [--mib 300] [--reps 6] [--world 2] [--dir DIR]`` starts ``--world``
ranks (gloo, CPU). Each wraps an MLP of ``--mib`` MiB of model + Adam state in total (parameters ~1/3, Adam's
two moments ~2/3) with FSDP2, takes one Adam step, then per repetition (order alternated):

- ours: ``trainproof.train.sharded.save_sharded`` into a run folder (create-only writes with fsync, read back, sha256,
  one COMPLETE.json) and ``load_sharded`` (manifest, verified metadata, verified shard files);
- DCP: ``dcp.save`` / ``dcp.load`` with ``FileSystemWriter``/``FileSystemReader`` (fsync on, its default) into a
  folder beside it.

With ``--async``, two more pairs: a background save as ``train`` makes one (``async_save.snapshot`` of the state,
then ``save_sharded`` of that snapshot, whose own memory the shard files are written from, on a thread, over a
gloo group of its own)
against DCP's ``dcp.async_save`` into a ``FileSystemWriter`` (its default stager, thread executor); ``blocked`` is
the time until the call returned (training could go on), ``total`` until the commit finished on every rank.

Times are rank 0's wall time from a barrier to a barrier; before each timed call every rank runs ``os.sync()``
(untimed), so no earlier call's dirty pages are flushed to the disk during it. Peak memory is each rank's resident
set sampled every 2 ms during the call, minus the resident set just before it, against that rank's shard (its local
tensor bytes); the largest over the repetitions is printed. ``--dir /dev/shm/x`` (tmpfs) takes the disk out: what
is left is the CPU cost of each side's protocol.
Prints the medians and the ratio lines ``sharded save`` / ``sharded load`` (goal <= 1.3), with the ratio of the
medians and the *balanced* ratio (the two orders weighted equally: use an even ``--reps``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss(anon: bool = False) -> int:
    """This process's resident set (``anon``: without the pages of mapped files, which the kernel can drop)."""
    with open("/proc/self/statm") as f:
        fields = f.read().split()
    return (int(fields[1]) - (int(fields[2]) if anon else 0)) * PAGE


class PeakRSS:
    """Resident-set high-water mark above the level at entry, sampled every 2 ms by a thread (``anon``: anonymous
    memory only, not the page cache of mapped files)."""

    def __init__(self, anon: bool = False) -> None:
        self.anon = anon

    def __enter__(self):
        self.base = self.peak = _rss(self.anon)
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._poll, daemon=True)
        self._t.start()
        return self

    def _poll(self):
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss(self.anon))

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, _rss(self.anon))
        self.extra = self.peak - self.base


def rank_main(args) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    sys.path.insert(0, str(ROOT))
    from tests.support.sharded_worker import build, shard, train_step
    from trainproof.storage import open_store
    from trainproof.train.async_save import snapshot
    from trainproof.train.sharded import load_sharded, save_sharded

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    # params P floats, Adam 2P more: 12 P bytes = mib MiB; hidden h with 4 layers of h*h
    layers = 4
    hidden = int((args.mib * 2**20 / 12 / layers) ** 0.5)
    model = shard(build(hidden, layers + 1, seed=0), world)  # build() makes layers - 1 of hidden x hidden
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    train_step(model, opt, 0)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd}
    shard_bytes = 0
    for v in [*msd.values(), *(x for s in osd["state"].values() for x in s.values())]:
        if isinstance(v, DTensor):
            shard_bytes += v.to_local().numel() * v.to_local().element_size()
    base = Path(args.dir)
    store = open_store(str(base / "run"))
    rows = []

    saves_group = dist.new_group(backend="gloo")

    def timed(fn):
        os.sync()  # untimed: no other writes' dirty pages left for the disk to flush during this call
        dist.barrier()
        with PeakRSS() as mem:
            t0 = time.perf_counter()
            fn()
            dist.barrier()
            seconds = time.perf_counter() - t0
        return seconds, mem.extra

    for rep in range(args.reps):
        step = rep + 1
        folder = base / "dcp" / f"rep{rep}"

        def ours_save():
            save_sharded(store, step, state, contract="b" * 64, world=world, code_version="bench")

        def dcp_save():
            dcp.save(state, storage_writer=dcp.FileSystemWriter(str(folder)))

        def ours_load():
            load_sharded(store, step, state, world=world)

        def dcp_load():
            dcp.load(state, storage_reader=dcp.FileSystemReader(str(folder)))

        order = [("ours", ours_save, ours_load), ("dcp", dcp_save, dcp_load)]
        if rep % 2:
            order.reverse()
        row = {"rep": rep}
        for name, save, load in order:
            row[f"{name}_save_s"], row[f"{name}_save_mem"] = timed(save)
            row[f"{name}_load_s"], row[f"{name}_load_mem"] = timed(load)
        if args.use_async:
            blocked = {}

            def ours_async():
                t0 = time.perf_counter()
                copied = snapshot(state)  # a fresh snapshot each time: its memory is counted every time
                blocked["ours"] = time.perf_counter() - t0
                worker = threading.Thread(target=save_sharded, args=(store, 1000 + step, copied), kwargs=dict(
                    contract="b" * 64, world=world, code_version="bench", process_group=saves_group))
                worker.start()
                worker.join()

            def dcp_async():
                t0 = time.perf_counter()
                fut = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(str(folder) + "-async"),
                                     process_group=saves_group)
                blocked["dcp"] = time.perf_counter() - t0
                (fut.upload_completion if hasattr(fut, "upload_completion") else fut).result()

            pairs = [("ours", ours_async), ("dcp", dcp_async)]
            for name, fn in (reversed(pairs) if rep % 2 else pairs):
                row[f"{name}_async_total_s"], row[f"{name}_async_mem"] = timed(fn)
                row[f"{name}_async_blocked_s"] = blocked[name]
        rows.append(row)
        dist.barrier()
        if rank == 0:  # keep the disk small: drop this repetition's copies
            shutil.rmtree(folder, ignore_errors=True)
            shutil.rmtree(str(folder) + "-async", ignore_errors=True)
            for s in (step, 1000 + step):
                shutil.rmtree(base / "run" / f"step-{s:08d}", ignore_errors=True)
        dist.barrier()
    with open(base / f"rank{rank}.json", "w") as f:
        json.dump({"rank": rank, "hidden": hidden, "shard_bytes": shard_bytes, "rows": rows}, f)
    dist.destroy_process_group()


def _balanced(rows: list[dict], ratios: list[float]) -> float:
    """The ratio with the order's effect cancelled: the geometric mean of the median ratio of the repetitions where
    ours ran first (even) and of those where DCP did (odd). On this machine whichever save runs second in a
    repetition is often the slower one (per repetition the ratio alternates, e.g. 0.7 / 1.7), so with an odd
    number of repetitions the plain median leans to the order that ran more often."""
    first = [x for r, x in zip(rows, ratios) if r["rep"] % 2 == 0]
    second = [x for r, x in zip(rows, ratios) if r["rep"] % 2 == 1]
    if not second:
        return statistics.median(first)
    return math.sqrt(statistics.median(first) * statistics.median(second))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=float, default=300.0, help="model + Adam state in total, MiB (default 300)")
    ap.add_argument("--reps", type=int, default=6, help="repetitions, order alternated (default 6; keep it even)")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--dir", default=None, help="folder for both sides (default: a temporary one)")
    ap.add_argument("--async", dest="use_async", action="store_true",
                    help="also time background saves: ours (snapshot, then its save) vs dcp.async_save")
    ap.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank_main:
        rank_main(args)
        return 0
    tmp = None
    if args.dir is None:
        tmp = tempfile.mkdtemp(prefix="bench-sharded-")
        args.dir = tmp
    try:
        port = str(_port())
        procs = []
        for rank in range(args.world):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(args.world), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": port, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1"}
            procs.append(subprocess.Popen([sys.executable, __file__, "--rank-main", "--mib", str(args.mib),
                                           "--reps", str(args.reps), "--dir", args.dir,
                                           *(["--async"] if args.use_async else [])], env=env, cwd=ROOT))
        codes = [p.wait() for p in procs]
        if any(codes):
            print(f"ranks exited {codes}", file=sys.stderr)
            return 1
        ranks = [json.loads((Path(args.dir) / f"rank{r}.json").read_text()) for r in range(args.world)]
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    rows = ranks[0]["rows"]
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if k.endswith("_s")}
    total = sum(r["shard_bytes"] for r in ranks)
    print(f"state: {total / 2**20:.0f} MiB of sharded tensors over {args.world} ranks (hidden {ranks[0]['hidden']}), "
          f"{len(rows)} repetitions, medians")
    print(f"{'':14}{'ours s':>9}{'DCP s':>9}{'ratio':>8}{'balanced':>10}  (goal <= 1.3)")
    for op in ("save", "load"):
        ratio = med[f"ours_{op}_s"] / med[f"dcp_{op}_s"]
        per_rep = [r[f"ours_{op}_s"] / r[f"dcp_{op}_s"] for r in rows]
        print(f"sharded {op:6}{med[f'ours_{op}_s']:9.3f}{med[f'dcp_{op}_s']:9.3f}{ratio:8.2f}"
              f"{_balanced(rows, per_rep):10.2f}  per repetition {', '.join(f'{x:.2f}' for x in per_rep)}")
    if args.use_async:
        for what in ("blocked", "total"):
            ours, theirs = med[f"ours_async_{what}_s"], med[f"dcp_async_{what}_s"]
            per_rep = [r[f"ours_async_{what}_s"] / r[f"dcp_async_{what}_s"] for r in rows]
            print(f"async {what:8}{ours:9.3f}{theirs:9.3f}{ours / theirs:8.2f}{_balanced(rows, per_rep):10.2f}  "
                  f"per repetition {', '.join(f'{x:.2f}' for x in per_rep)}")
    # The largest of the repetitions, not the median: memory the allocator kept from an earlier call (glibc's
    # heap keeps freed blocks below its moving mmap threshold) hides a later call's peak, never inflates it.
    print("peak resident memory above the level before the call, per rank, largest of the repetitions (x its shard):")
    for r in ranks:
        sb = r["shard_bytes"]
        cells = []
        for side in ("ours", "dcp"):
            for op in ("save", "load", *(("async",) if args.use_async else ())):
                extra = max(x[f"{side}_{op}_mem"] for x in r["rows"])
                cells.append(f"{side} {op} {extra / 2**20:.0f} MiB ({extra / sb:.2f}x)")
        print(f"  rank {r['rank']} (shard {sb / 2**20:.0f} MiB): " + "; ".join(cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
