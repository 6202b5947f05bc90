"""Store commit throughput vs raw boto3, side by side against one moto server on loopback.

One generation of ``--mib`` MiB (one file of random bytes, generated once) is committed with the store
(write -> verify read-back -> COMPLETE.json), timing the phases separately by wrapping ``store.backend.write``,
``store.backend.read`` and ``storage.commit._verify`` (wrapped, nothing in storage/ changes); the same bytes go
through boto3 ``upload_fileobj`` / ``download_fileobj`` with the default TransferConfig (multipart threshold and
part size 8 MiB, ``max_concurrency=10`` threads).  Store and boto3 runs are interleaved (store, boto3, store,
boto3, ...), ``--reps`` times each; medians, spread and ratios go to a table and ``bench/out/throughput.json``.

With ``--alternatives`` (default on) each repetition also times reference readers/writers, to explain the gap:
a single-stream ``get_object`` (boto3) and ``cat_file(max_concurrency=1)`` (s3fs), and two prototype writers for
``S3Backend.write`` (hashing in a thread while uploading; and that plus a sliding window of part uploads).

    .venv/bin/python bench/bench_storage_throughput.py [--mib 256] [--reps 5] [--server subprocess|inproc]

The moto server runs in a child process by default (``--server subprocess``), so that its request threads do not
compete with the client for one GIL; ``--server inproc`` runs it in this process (as the tests do).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import hashlib
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from tests.support.s3server import S3Server, dummy_aws_env, make_boto3_client, unique_bucket_name  # noqa: E402

MiB = 2**20
SERVER_CODE = """
import sys
from tests.support.s3server import S3Server
with S3Server() as srv:
    print(srv.endpoint, flush=True)
    sys.stdin.read()
"""


# -- the server -----------------------------------------------------------------------------------------------
class Server:
    """One ThreadedMotoServer (tests/support/s3server.py), in a child process or in this one."""

    def __init__(self, mode: str) -> None:
        self.mode, self.proc, self.inproc, self.pid = mode, None, None, os.getpid()

    def __enter__(self) -> "Server":
        if self.mode == "subprocess":
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER_CODE], cwd=ROOT, env=dict(os.environ),
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            self.endpoint = self.proc.stdout.readline().strip()
            if not self.endpoint.startswith("http://"):
                raise RuntimeError("moto server did not start")
            self.pid = self.proc.pid
        else:
            self.inproc = S3Server().start()
            self.endpoint = self.inproc.endpoint
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        if self.inproc is not None:
            self.inproc.stop()

    def cpu(self) -> float:
        """CPU seconds the server process has used (the whole process when in-process)."""
        if self.mode != "subprocess":
            return float("nan")
        with open(f"/proc/{self.pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def client_cpu() -> float:
    t = os.times()
    return t.user + t.system


class Phase:
    """Wall and CPU time of one timed block."""

    def __init__(self, server: Server) -> None:
        self.server = server

    def __enter__(self) -> "Phase":
        self.c0, self.s0, self.t0 = client_cpu(), self.server.cpu(), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall = time.perf_counter() - self.t0
        self.client_cpu = client_cpu() - self.c0
        self.server_cpu = self.server.cpu() - self.s0


# -- the store, with its phases timed by wrapping ------------------------------------------------------------------
def timed_store(url: str, server: "Server"):
    import storage.commit
    from storage import StoreOptions, open_store

    store = open_store(url, StoreOptions.from_env(endpoint_url=server.endpoint))
    store.write_file("plan.json", b"{}")  # the one-time create-only probe and multipart sweep, outside the timing
    log: list[tuple[str, str, float, float, float]] = []  # (kind, path, wall, client cpu, server cpu)
    backend = store.backend

    def wrap(name, fn):
        def timed(path, *a, **kw):
            c0, s0, t0 = client_cpu(), server.cpu(), time.perf_counter()
            try:
                return fn(path, *a, **kw)
            finally:
                log.append((name, path, time.perf_counter() - t0, client_cpu() - c0, server.cpu() - s0))
        return timed

    backend.write = wrap("write", backend.write)  # instance attributes shadow the methods; the class is untouched
    backend.read = wrap("read", backend.read)
    if not getattr(storage.commit._verify, "_bench_wrapped", False):
        real_verify = storage.commit._verify

        def verify(ctx, name, written, check):
            t0 = time.perf_counter()
            try:
                return real_verify(ctx, name, written, check)
            finally:
                timed_store.verify_log.append(time.perf_counter() - t0)
        verify._bench_wrapped = True
        storage.commit._verify = verify
    return store, log


timed_store.verify_log = []


def store_rep(server: Server, store, log, step: int, data: bytes) -> dict:
    log.clear()
    timed_store.verify_log.clear()
    cpu = {}
    c0, s0 = client_cpu(), server.cpu()
    t0 = time.perf_counter()
    store.commit(step, {"training_state.pt": data}, contract="bench", world=1, code_version="bench")
    total = time.perf_counter() - t0
    cpu["client"], cpu["server"] = client_cpu() - c0, server.cpu() - s0
    def phase(kind, i):
        return sum(e[i] for e in log if e[0] == kind and e[1].endswith("/training_state.pt"))

    verify = sum(timed_store.verify_log)
    store.backend.delete_tree(f"{store.root}/step-{step:08d}")  # keep moto's footprint flat
    return {"store_write": phase("write", 2), "store_read": phase("read", 2), "store_verify": verify,
            "store_commit": total, "store_commit_other": total - phase("write", 2) - verify,
            "cpu_client_store_write": phase("write", 3), "cpu_server_store_write": phase("write", 4),
            "cpu_client_store_read": phase("read", 3), "cpu_server_store_read": phase("read", 4),
            "cpu_client_store_commit": cpu["client"], "cpu_server_store_commit": cpu["server"]}


# -- raw boto3 -------------------------------------------------------------------------------------------------------
def boto3_rep(server: Server, client, bucket: str, key: str, data: bytes, digest: str) -> dict:
    with Phase(server) as up:
        client.upload_fileobj(io.BytesIO(data), bucket, key)  # default TransferConfig
    buf = io.BytesIO()
    with Phase(server) as down:
        client.download_fileobj(bucket, key, buf)
    assert hashlib.sha256(buf.getbuffer()).hexdigest() == digest, "boto3 download differs"
    del buf
    client.delete_object(Bucket=bucket, Key=key)
    return {"boto3_upload": up.wall, "boto3_download": down.wall,
            "cpu_client_boto3_upload": up.client_cpu, "cpu_server_boto3_upload": up.server_cpu,
            "cpu_client_boto3_download": down.client_cpu, "cpu_server_boto3_download": down.server_cpu}


# -- references and prototypes (not the store's code path) ----------------------------------------------------------
def proto_write_overlap(fs, path: str, data: bytes, part: int = 16 * MiB, concurrency: int = 8) -> tuple[int, str]:
    """S3Backend.write as it is (pipe_file, create-only), but sha256 runs in a thread during the upload instead of
    before it (hashlib releases the GIL on big buffers); optionally other part size / concurrency."""
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        sha = pool.submit(hashlib.sha256, data)
        fs.pipe_file(path, data, mode="create", chunksize=part, max_concurrency=concurrency)
        return len(data), sha.result().hexdigest()


def proto_write_window(fs, path: str, data: bytes, part: int = 8 * MiB, concurrency: int = 10) -> tuple[int, str]:
    """Own multipart upload: a sliding window of ``concurrency`` UploadPart calls (s3fs's pipe_file waits for each
    batch of ``concurrency`` parts to finish before starting the next), sha256 in a thread meanwhile, and
    CompleteMultipartUpload with If-None-Match.  (Each part is also where a per-part retry would go.)"""
    from fsspec.asyn import sync

    async def run():
        bucket, key, _ = fs.split_path(path)
        sha = asyncio.get_running_loop().run_in_executor(None, hashlib.sha256, data)
        mpu = await fs._call_s3("create_multipart_upload", Bucket=bucket, Key=key)
        gate = asyncio.Semaphore(concurrency)

        async def put(number: int, offset: int) -> dict:
            async with gate:
                out = await fs._call_s3("upload_part", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                                        PartNumber=number, Body=data[offset:offset + part])
            return {"PartNumber": number, "ETag": out["ETag"]}

        try:
            parts = await asyncio.gather(*[put(i + 1, off) for i, off in enumerate(range(0, len(data), part))])
            await fs._call_s3("complete_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"],
                              MultipartUpload={"Parts": parts}, IfNoneMatch="*")
        except BaseException:
            await fs._call_s3("abort_multipart_upload", Bucket=bucket, Key=key, UploadId=mpu["UploadId"])
            raise
        return len(data), (await sha).hexdigest()

    return sync(fs.loop, run)


def alternatives_rep(server: Server, store, client, bucket: str, rep: int, data: bytes, digest: str) -> dict:
    fs = store.backend.fs
    out = {}
    base = f"{store.root}/alt-{rep}"
    writers = (
        ("proto_write_overlap16", lambda p: proto_write_overlap(fs, p, data)),
        ("proto_write_overlap8", lambda p: proto_write_overlap(fs, p, data, part=8 * MiB, concurrency=10)),
        ("proto_write_window", lambda p: proto_write_window(fs, p, data)),
    )
    for name, writer in writers:
        path = f"{base}/{name}"
        with Phase(server) as ph:
            size, sha = writer(path)
        assert (size, sha) == (len(data), digest)
        out[name] = ph.wall
        out[f"cpu_client_{name}"], out[f"cpu_server_{name}"] = ph.client_cpu, ph.server_cpu
    path = f"{base}/proto_write_window"  # read references, on an object the store wrote
    with Phase(server) as ph:
        got = fs.cat_file(path, max_concurrency=1)
    assert len(got) == len(data)
    del got
    out["s3fs_read_single_stream"] = ph.wall
    key = path.split("/", 1)[1]
    with Phase(server) as ph:
        got = client.get_object(Bucket=bucket, Key=key)["Body"].read()
    assert len(got) == len(data)
    del got
    out["boto3_get_single_stream"] = ph.wall
    store.backend.delete_tree(base)
    return out


# -- report ------------------------------------------------------------------------------------------------------------
ROWS = [
    # key, label, kind (write/read/other)
    ("store_write", "store: write (own MPU 16 MiB x 8, sha256 in parallel)", "w"),
    ("boto3_upload", "boto3 upload_fileobj (8 MiB x 10 threads)", "w"),
    ("store_read", "store: verify read (s3fs cat_file)", "r"),
    ("store_verify", "store: verify total (read + sha256)", "r"),
    ("boto3_download", "boto3 download_fileobj (8 MiB x 10 threads)", "r"),
    ("store_commit", "store: whole commit", "o"),
    ("store_commit_other", "store: commit minus write and verify", "o"),
    ("proto_write_overlap16", "proto: pipe_file 16 MiB x 8, sha256 in a thread", "w"),
    ("proto_write_overlap8", "proto: pipe_file 8 MiB x 10, sha256 in a thread", "w"),
    ("proto_write_window", "proto: own MPU, window 8 MiB x 10, sha256 thread", "w"),
    ("s3fs_read_single_stream", "ref: s3fs cat_file single GET", "r"),
    ("boto3_get_single_stream", "ref: boto3 get_object single GET", "r"),
]


def summarise(samples: dict[str, list[float]], mib: float) -> dict:
    out = {}
    for key, values in samples.items():
        med = statistics.median(values)
        q = statistics.quantiles(values, n=4) if len(values) >= 2 else [med, med, med]
        out[key] = {"median_s": med, "min_s": min(values), "max_s": max(values), "iqr_s": q[2] - q[0],
                    "spread_pct": 100.0 * (max(values) - min(values)) / med if med else 0.0,
                    "median_mib_s": mib / med if med else float("inf"), "samples_s": values}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=256, help="generation size (one file), MiB")
    ap.add_argument("--reps", type=int, default=5, help="repetitions of each (interleaved)")
    ap.add_argument("--server", choices=("subprocess", "inproc"), default="subprocess")
    ap.add_argument("--alternatives", action=argparse.BooleanOptionalAction, default=True,
                    help="also time reference readers and prototype writers")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "throughput.json"))
    args = ap.parse_args()
    os.environ.update(dummy_aws_env())

    print(f"generating {args.mib} MiB of random bytes ...", flush=True)
    data = os.urandom(args.mib * MiB)
    digest = hashlib.sha256(data).hexdigest()
    load_before = os.getloadavg()
    samples: dict[str, list[float]] = {}
    with Server(args.server) as server:
        client = make_boto3_client(server.endpoint)  # checksums when_required, 1 attempt: like the store's client
        bucket = unique_bucket_name("bench")
        client.create_bucket(Bucket=bucket)
        store, log = timed_store(f"s3://{bucket}/bench/run", server)
        # warm-up (connections, models, moto's first-request costs), not counted
        store_rep(server, store, log, 99_999_999, data[: 33 * MiB])
        boto3_rep(server, client, bucket, "warmup", data[: 33 * MiB], hashlib.sha256(data[: 33 * MiB]).hexdigest())
        for rep in range(args.reps):
            results = store_rep(server, store, log, rep + 1, data)
            results.update(boto3_rep(server, client, bucket, f"raw/{rep}", data, digest))
            if args.alternatives:
                results.update(alternatives_rep(server, store, client, bucket, rep, data, digest))
            for k, v in results.items():
                samples.setdefault(k, []).append(v)
            print(f"rep {rep + 1}/{args.reps}: store write {results['store_write']:.2f}s verify-read "
                  f"{results['store_read']:.2f}s | boto3 upload {results['boto3_upload']:.2f}s download "
                  f"{results['boto3_download']:.2f}s | load {os.getloadavg()[0]:.1f}", flush=True)
    load_after = os.getloadavg()

    summary = summarise({k: v for k, v in samples.items() if not k.startswith("cpu_")}, args.mib)
    cpu_summary = {k: statistics.median(v) for k, v in samples.items() if k.startswith("cpu_")}
    ratio_write = summary["boto3_upload"]["median_s"] / summary["store_write"]["median_s"]
    ratio_read = summary["boto3_download"]["median_s"] / summary["store_read"]["median_s"]
    ratio_verify = summary["boto3_download"]["median_s"] / summary["store_verify"]["median_s"]
    # per-repetition ratios (paired, same interleaved slot): a noise-robust view of the same thing
    paired_w = [b / s for s, b in zip(samples["store_write"], samples["boto3_upload"])]
    paired_r = [b / s for s, b in zip(samples["store_read"], samples["boto3_download"])]

    print(f"\n{args.mib} MiB, {args.reps} interleaved reps, moto server {args.server}, {os.cpu_count()} CPUs, "
          f"load avg {load_before[0]:.1f} -> {load_after[0]:.1f}")
    print(f"{'':55} {'median s':>9} {'MiB/s':>7} {'min s':>7} {'max s':>7} {'spread':>7}")
    for key, label, _ in ROWS:
        if key not in summary:
            continue
        s = summary[key]
        print(f"{label:55} {s['median_s']:9.2f} {s['median_mib_s']:7.0f} {s['min_s']:7.2f} {s['max_s']:7.2f} "
              f"{s['spread_pct']:6.0f}%")
    print("\nthroughput ratio store/boto3 (goal >= 0.90):")
    print(f"  write        {ratio_write:.2f}   (per rep, paired: {', '.join(f'{r:.2f}' for r in paired_w)}; "
          f"median {statistics.median(paired_w):.2f})")
    print(f"  verify read  {ratio_read:.2f}   (per rep, paired: {', '.join(f'{r:.2f}' for r in paired_r)}; "
          f"median {statistics.median(paired_r):.2f})")
    print(f"  verify total {ratio_verify:.2f}   (read + sha256 vs download alone)")
    if args.server == "subprocess":
        print("\nmedian CPU seconds per phase (client = this process, server = the moto process):")
        for key, label, _ in ROWS:
            if f"cpu_client_{key}" in samples:
                print(f"  {label:55} client {statistics.median(samples[f'cpu_client_{key}']):5.2f}  "
                      f"server {statistics.median(samples[f'cpu_server_{key}']):5.2f}")

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump({
            "config": {"mib": args.mib, "reps": args.reps, "server": args.server, "alternatives": args.alternatives,
                       "store": {"part_mib": 16, "write_concurrency": 8, "read_block_mib": 50, "read_concurrency": 8,
                                 "checksum": "when_required (custom endpoint)"},
                       "boto3": {"TransferConfig": "default", "multipart_threshold_mib": 8,
                                 "multipart_chunksize_mib": 8,
                                 "max_concurrency": 10, "checksum": "when_required", "max_attempts": 1}},
            "environment": {"cpus": os.cpu_count(), "python": platform.python_version(),
                            "loadavg_before": load_before, "loadavg_after": load_after,
                            "versions": _versions()},
            "results": summary,
            "cpu_seconds_median": cpu_summary,
            "ratios": {"write": ratio_write, "verify_read": ratio_read, "verify_total": ratio_verify,
                       "write_paired": paired_w, "verify_read_paired": paired_r,
                       "write_paired_median": statistics.median(paired_w),
                       "verify_read_paired_median": statistics.median(paired_r), "goal": 0.9},
        }, fh, indent=2)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")


def _versions() -> dict:
    from importlib.metadata import version
    return {p: version(p) for p in ("boto3", "botocore", "s3fs", "aiobotocore", "aiohttp", "moto", "fsspec")}


if __name__ == "__main__":
    main()
