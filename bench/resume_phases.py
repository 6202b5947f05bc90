"""Where a store resume's time goes, phase by phase, in fresh processes (issue 42).

One generation of ``--mib`` MiB (default 1024) is committed to a Ceph RGW of its own (``scripts/rgw.sh``; or the
endpoint in ``AWS_ENDPOINT_URL``), then ``--runs`` fresh processes (default 3) one after the other each time: importing
torch, importing the S3 store, ``open_store``, the scan, ``load_latest`` (scan, ranged download into a hashed spool,
weights-only check) and reading every tensor once; wall and user/system CPU seconds per phase, and the whole process
from ``Popen`` to exit.

    .venv/bin/python bench/resume_phases.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
BUCKET = "resume-phases"


class Phases:
    """Prints each phase's wall, user and system seconds since the previous one."""

    def __init__(self) -> None:
        self.t, self.c = time.perf_counter(), os.times()

    def mark(self, name: str) -> None:
        t, c = time.perf_counter(), os.times()
        print(f"  {name:36s} {t - self.t:6.2f} s  user {c.user - self.c.user:5.2f}  sys "
              f"{c.system - self.c.system:5.2f}", flush=True)
        self.t, self.c = t, c


def child(endpoint: str, work: str) -> None:
    phases = Phases()
    import torch  # noqa: F401 - timed: every resume pays it

    phases.mark("import torch")
    import trainproof.storage.s3  # noqa: F401 - timed
    from trainproof.format.state import load_weights_only
    from trainproof.storage import StoreOptions, open_store

    phases.mark("import the S3 store")
    store = open_store(f"s3://{BUCKET}/run", StoreOptions.from_env(endpoint_url=endpoint))
    phases.mark("open_store")
    store.scan(contract="bench", world=1)
    phases.mark("scan")
    decoded: dict = {}
    loaded = store.load_latest(contract="bench", world=1, spool_dir=work, spool_from=0,
                               check=lambda _n, d: decoded.update(state=load_weights_only(d)))
    assert loaded is not None
    phases.mark("load_latest (scan, download, check)")
    for value in decoded["state"].values():
        value.sum()
    phases.mark("every tensor read once")
    loaded.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=1024)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--child", nargs=2, metavar=("ENDPOINT", "WORK"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    import torch

    from tests.support.rgw import bench_bucket
    from trainproof.format.state import load_weights_only
    from trainproof.storage import StoreOptions, open_store
    from trainproof.storage.spool import SpoolWriter

    with bench_bucket(BUCKET) as endpoint, tempfile.TemporaryDirectory() as work:
        store = open_store(f"s3://{BUCKET}/run", StoreOptions.from_env(endpoint_url=endpoint))
        state = {f"t{i}": torch.rand(16 * 2**20) for i in range(max(1, args.mib // 64))}
        with SpoolWriter(work) as writer:
            torch.save(state, writer)
        spool = writer.finish()
        store.commit(1, {"training_state.pt": spool}, contract="bench", world=1, code_version="bench",
                     check=lambda _n, d: load_weights_only(d))
        spool.unlink()
        del state
        print(f"load average {os.getloadavg()[0]:.2f}; {args.mib} MiB committed; fresh processes:")
        for run in range(args.runs):
            started = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--child", endpoint, work], check=True)
            print(f"run {run + 1}: Popen to exit {time.perf_counter() - started:.2f} s", flush=True)


if __name__ == "__main__":
    main()
