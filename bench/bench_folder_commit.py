"""A verified commit to a folder store against ``torch.save`` + fsync of the same state, for one or two checkouts.

    .venv/bin/python bench/bench_folder_commit.py [--mib 1024] [--reps 3] [--before /tmp/before] [--dir DIR]

Each measurement is a fresh process (``PYTHONPATH`` = the checkout) holding ``--mib`` MiB of float32 tensors:

- ``floor``: ``torch.save`` of the tensors into a file of the folder, then ``fsync`` (durable, unverified);
- ``dcp``: ``torch.distributed.checkpoint.save`` with its ``FileSystemWriter`` (the default: one file per rank,
  fsynced; durable, unverified), the peer issue 42 measures against;
- ``device``: the disk's share of a verified commit, the least any can cost: the tensors' bytes written as they
  are, each 32 MiB range read back from the device by a second thread once it is there (``sync_file_range``, its
  pages dropped), then ``fsync``; no serialisation, hashing or comparison. ``device`` over ``dcp`` is then the least
  a commit that reads its bytes back from the disk can cost against a save that does not;
- ``commit``: what the trainer's checkpointer does on a folder store: ``torch.save`` into a spool while hashing it
  (``trainproof.format.state.save_archive`` where the checkout has it: torch.save without its crc32s)
  (``SpoolWriter``, in ``GenerationStore.spool_folder()`` when the checkout has it, else the temp folder), then
  ``GenerationStore.commit``: written (linked or copied), read back and hashed, ``COMPLETE.json`` create-only.
  Where the store has ``verifies_while_written`` (a folder), as the checkpointer does: serialised on a thread of its
  own into a spool written behind, which the commit reads back from the device part by part meanwhile (comparing
  each part with the copy the writer kept, where the checkout keeps them: ``keep_parts``).

The modes alternate order per repetition; printed: one JSON line per run (wall and CPU seconds: user + system, every
thread; the peak resident memory the save added, over the state's size, sampled every 5 ms), then the medians (the
largest peak), ratios to the floor and to DCP
(``before``/``after`` with ``--before``, e.g. ``mkdir /tmp/before && git archive HEAD | tar -x -C /tmp/before``)
and the load average.
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def child(mode: str, folder: str, mib: float) -> dict:
    import torch

    count = max(1, int(mib // 64))
    tensors = {f"t{i}": torch.randn(int(mib * 2**20 / 4 / count)) for i in range(count)}
    os.makedirs(folder, exist_ok=True)
    # Every library imported before the clock starts: a trainer has them loaded when it saves.
    import torch.distributed.checkpoint as dcp

    from trainproof.storage import open_store
    from trainproof.storage.spool import SpoolWriter

    peak = _PeakRss()
    t0, c0 = time.perf_counter(), time.process_time()
    if mode == "dcp":
        dcp.save(tensors, storage_writer=dcp.FileSystemWriter(os.path.join(folder, "dcp")))
    elif mode == "device":
        _write_then_read_back(tensors.values(), os.path.join(folder, "raw"))
    elif mode == "floor":
        with open(os.path.join(folder, "state.pt"), "wb") as fh:
            torch.save(tensors, fh)
            fh.flush()
            os.fsync(fh.fileno())
    else:
        try:  # how the checkout's checkpointer serialises a state (torch.save before it had its own)
            from trainproof.format.state import save_archive as save
        except ImportError:
            save = torch.save
        store = open_store(os.path.join(folder, "run"))
        spools = store.spool_folder() if hasattr(store, "spool_folder") else None
        if spools is not None and getattr(store, "verifies_while_written", False):
            # As the checkpointer does (Checkpointer.encode): serialised on a thread of its own, written behind, and
            # read back from the device by the commit meanwhile.
            import inspect

            from trainproof.format.state import encode_live

            keep = {"keep_parts": True} if "keep_parts" in inspect.signature(encode_live).parameters else {}
            spool = encode_live(tensors, spools, write_behind=True, **keep)
        else:  # checkouts before it: serialised first (written behind where the checkout can), then committed
            try:
                out = SpoolWriter(spools, write_behind=spools is not None)
            except TypeError:
                out = SpoolWriter(spools)
            with out:
                save(tensors, out)
            spool = out.finish()
        store.commit(1, {"training_state.pt": spool}, contract="bench", world=1, code_version="bench")
        spool.unlink()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    return {"seconds": seconds, "cpu_s": cpu, "peak_extra": peak.stop() / (mib * 2**20)}


def _write_then_read_back(tensors, path: str) -> None:
    """The device's share of a verified commit and nothing else: the tensors' bytes written as they are (no
    serialisation, no hashing) in 32 MiB ranges, each sent to the device as it is written and read back from the
    device by a second thread once it is there and dropped from the page cache (into one reused buffer, compared
    with nothing), then ``fsync``. The commit overlaps its read-back with its write the same way."""
    import queue
    import threading

    from trainproof.storage import writeback

    chunk = 32 * 2**20
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    written: queue.Queue = queue.Queue()

    def read_back() -> None:
        buf = bytearray(chunk)
        while (item := written.get()) is not None:
            offset, length = item
            writeback.wait(fd, offset, length)
            writeback.drop(fd, offset, length)
            os.preadv(fd, [memoryview(buf)[:length]], offset)

    reader = threading.Thread(target=read_back)
    reader.start()
    offset = 0
    try:
        for tensor in tensors:
            view = memoryview(tensor.numpy()).cast("B")
            while view:
                piece = view[:chunk]
                length = 0
                while length < piece.nbytes:
                    length += os.pwrite(fd, piece[length:], offset + length)
                writeback.start(fd, offset, length)
                written.put((offset, length))
                offset, view = offset + length, view[length:]
    finally:
        written.put(None)
        reader.join()
    os.fsync(fd)
    os.close(fd)


class _PeakRss:
    """The process's resident memory sampled every 5 ms on a thread; :meth:`stop` returns its peak above the first
    sample, in bytes (the state's tensors are made before: what the save adds on top of them)."""

    def __init__(self) -> None:
        import threading

        self._page = os.sysconf("SC_PAGE_SIZE")
        self._base = self._peak = self._rss()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self._page

    def _run(self) -> None:
        while not self._done.wait(0.005):
            self._peak = max(self._peak, self._rss())

    def stop(self) -> int:
        self._done.set()
        self._thread.join()
        return max(self._peak, self._rss()) - self._base


def one(checkout: Path, mode: str, mib: float, work: Path) -> dict:
    folder = work / f"{mode}-{time.monotonic_ns()}"
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "bench_folder_commit.py"), "--child", mode,
                          str(folder), str(mib)], env=env, cwd=checkout, capture_output=True, text=True, check=True)
    shutil.rmtree(folder, ignore_errors=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=1024)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--before", type=Path, default=None, help="another checkout to compare with")
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one on the temp folder's disk)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "FOLDER", "MIB"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], float(args.child[2]))))
        return
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-folder-commit-"))
    work.mkdir(parents=True, exist_ok=True)
    sides = [("floor", "after", ROOT), ("dcp", "after", ROOT), ("device", "after", ROOT), ("commit", "after", ROOT)]
    if args.before:
        sides.append(("commit", "before", args.before))
    times: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    peaks: dict[str, list[float]] = {}
    loads = []
    try:
        for rep in range(args.reps):
            for mode, side, checkout in (sides if rep % 2 == 0 else list(reversed(sides))):
                loads.append(os.getloadavg()[0])
                result = one(checkout, mode, args.mib, work)
                key = mode if mode != "commit" else f"commit/{side}"
                times.setdefault(key, []).append(result["seconds"])
                cpus.setdefault(key, []).append(result["cpu_s"])
                peaks.setdefault(key, []).append(result["peak_extra"])
                print(json.dumps({"mode": key, "seconds": round(result["seconds"], 3),
                                  "cpu_s": round(result["cpu_s"], 3), "peak_extra": round(result["peak_extra"], 3),
                                  "load": round(loads[-1], 2)}), flush=True)
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    medians = {k: round(statistics.median(v), 3) for k, v in times.items()}
    print(json.dumps({"mib": args.mib, "medians_s": medians,
                      "cpu_medians_s": {k: round(statistics.median(v), 3) for k, v in cpus.items()},
                      "peak_extra_rss_over_state": {k: round(max(v), 3) for k, v in peaks.items()},
                      "ratio_to_floor": {k: round(v / medians["floor"], 2) for k, v in medians.items()},
                      "ratio_to_dcp": {k: round(v / medians["dcp"], 2) for k, v in medians.items()},
                      "load_median": round(statistics.median(loads), 2)}))


if __name__ == "__main__":
    main()
