"""Where the store's S3 commit spends its time, in one process, against a real server (Ceph RGW on loopback).

``bench_s3.py`` times whole operations in fresh processes. This one takes the commit apart, with the raw tools side
by side in the same process and the same warm clients, interleaved over ``--reps`` repetitions (medians):

- ``upload_fileobj``: boto3's managed upload of the state file (the commit goal's baseline);
- ``store_write``: the store's create-only multipart write of the same file, nothing else;
- ``store_commit``: the store's whole commit (write -> read-back verify -> mark usable);
- ``readback_parts`` / ``readback_in_order``: the commit's read-back alone (ranged GETs of the stored object,
  hashed on the fetching threads, or in order by one consumer);
- ``download_fileobj``: boto3's managed download of the same object into /dev/null (the read-back's baseline);
- ``store_download`` / ``download_file``: the resume's download alone (the stored object into a local spool file,
  verified as it arrives) against boto3's managed download of the same object into a local file.

    .venv/bin/python bench/bench_s3_split.py --mib 1024 --reps 5     # starts its own RGW (root: installs it)

Figures go to stdout and ``--out`` (default ``bench/out/s3-split.json``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
MiB = 2**20
BUCKET = "bench-s3-split"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="state size in MiB")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "s3-split.json"))
    args = ap.parse_args()
    from tests.support.rgw import bench_endpoint

    with bench_endpoint() as endpoint, tempfile.TemporaryDirectory(prefix="trainproof-bench-split-") as work:
        report = measure(endpoint, args.mib, args.reps, work)
    report["command"] = " ".join(sys.argv)
    report["load_after"] = os.getloadavg()
    print(json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=1))
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)


def measure(endpoint: str, mib: int, reps: int, work: str) -> dict:
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config

    from trainproof.storage import StoreOptions, open_store
    from trainproof.storage.digest import FileHasher
    from trainproof.storage.spool import Spool, download, hashed_parts, hashed_ranges

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", config=Config(
        s3={"addressing_style": "path"}, request_checksum_calculation="when_required", max_pool_connections=32))
    client.create_bucket(Bucket=BUCKET)
    path = os.path.join(work, "state.bin")
    sha = FileHasher()
    with open(path, "wb") as fh:  # random bytes: nothing compresses
        for _ in range(mib // 8):
            block = os.urandom(8 * MiB)
            sha.update(block)
            fh.write(block)
    size, digest = os.path.getsize(path), sha.hexdigest()
    store = open_store(f"s3://{BUCKET}/run", StoreOptions.from_env(endpoint_url=endpoint))
    store.write_file("plan.json", b"{}")  # the one-time probe and sweep
    store.read_range("plan.json", 0, 1)  # the data path's client, made on first use
    ctx = store._ctx  # the store's own read-back, without the rest of the commit  # noqa: SLF001
    transfer = TransferConfig(multipart_chunksize=8 * MiB, max_concurrency=8)
    runs: dict[str, list[float]] = {m: [] for m in ("upload_fileobj", "store_write", "store_commit", "readback_parts",
                                                   "readback_in_order", "download_fileobj", "store_download",
                                                   "download_file")}
    for rep in range(reps):
        step = rep + 1
        obj = ctx.path(f"step-{step:08d}", "training_state.pt")
        key = f"run/{obj.rsplit('/run/', 1)[1]}"  # the same object, for the raw client
        read = lambda a, b, obj=obj: ctx.backend.read_range(obj, a, b)  # noqa: E731

        def upload_fileobj() -> None:
            with open(path, "rb") as fh:
                client.upload_fileobj(fh, BUCKET, f"raw/{rep}", Config=transfer)

        def store_write() -> None:
            ctx.backend.write(ctx.path(f"write-{rep}", "obj"), Spool(path=path, size=size, sha256=digest),
                              create_only=True)

        def store_commit() -> None:
            store.commit(step, {"training_state.pt": Spool(path=path, size=size, sha256=digest)}, contract="bench",
                         world=1, code_version="bench")

        def readback_parts() -> None:
            assert hashed_parts(read, size, FileHasher(), **ctx.transfer()) == (size, digest)

        def readback_in_order() -> None:
            assert hashed_ranges(read, size, hasher=FileHasher(), **ctx.transfer()) == (size, digest)

        def download_fileobj() -> None:
            client.download_fileobj(BUCKET, key, io.FileIO(os.devnull, "w"),
                                    Config=transfer)

        def store_download() -> None:
            spool, seen, got = download(read, size, work, hasher=FileHasher(), **ctx.transfer())
            os.unlink(spool.path)
            assert (seen, got) == (size, digest)

        def download_file() -> None:
            client.download_file(BUCKET, key, os.path.join(work, "raw.bin"), Config=transfer)
            os.unlink(os.path.join(work, "raw.bin"))

        ops = [upload_fileobj, store_write, store_commit, readback_parts, readback_in_order, download_fileobj,
               store_download, download_file]
        if rep % 2:  # the commit before the reads of its object; the two writes and the reads swap places
            ops = [store_write, upload_fileobj, store_commit, readback_in_order, readback_parts, download_fileobj,
                   download_file, store_download]
        for op in ops:
            t0 = time.perf_counter()
            op()
            runs[op.__name__].append(time.perf_counter() - t0)
            print(f"  rep {rep} {op.__name__}: {runs[op.__name__][-1]:.2f} s", flush=True)
    med = {m: statistics.median(v) for m, v in runs.items()}
    return {"bytes": size, "runs": runs, "medians": med,
            "commit_vs_upload_fileobj": med["store_commit"] / med["upload_fileobj"],
            "write_vs_upload_fileobj": med["store_write"] / med["upload_fileobj"],
            "readback_vs_download_fileobj": med["readback_parts"] / med["download_fileobj"],
            "store_download_vs_download_file": med["store_download"] / med["download_file"]}


if __name__ == "__main__":
    main()
