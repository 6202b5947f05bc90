"""The S3 data path against a real server (Ceph RADOS Gateway on loopback, ``scripts/rgw.sh``), side by side with the
raw tools and the peers, at each ``--sizes`` MiB of state; every measurement is a fresh child process.

- **commit**: the store's commit of a serialised state (write -> read-back verify -> weights-only content check ->
  COMPLETE.json) from its spool file, against boto3 ``upload_fileobj`` of the same file, and the same upload through
  s3fs ``put_file``, obstore ``put`` and boto3 with the store's part size and concurrency; the store's commit and
  ``upload_fileobj`` are each done twice per child, and the second of each is reported too (``seconds_second``: a
  trainer commits many times per process, and pays the first one's set-up once);
- **save** (serialise + upload, what the peers' writers do): ``torch.save`` into a spool + the store's commit (on S3,
  as the trainer does: the upload runs beside the serialisation, ``encode_live``), against
  DCP's ``FsspecWriter`` (``torch.distributed.checkpoint.save``) and ``s3torchconnector``'s ``S3Checkpoint`` writer
  (when they import);
- **resume**: process start -> state loaded and every tensor read once, through the store (discovery, parallel ranged
  download into a spool hashed as it arrives, weights-only ``torch.load(mmap=True)``), against raw reads into a local
  file + ``torch.load(mmap=True)``: one streamed GET (boto3, obstore), parallel ranged GETs (boto3 threads),
  ``download_file``, s3fs ``get_file``, and ``s3torchconnector``'s reader + ``torch.load``; ``resume_ahead`` is the
  store's resume as ``train`` runs it: the store opened and its newest generation fetched ahead before torch is
  imported (``GenerationStore.fetch_ahead``);
- **memory**: each child's peak RSS above its RSS just before the measured operation (sampled every 10 ms), and of
  that the anonymous part (a mapped file's pages are page cache, reclaimable; the anonymous ones are not);
- **CPU**: each child's CPU seconds (user + system, every thread, native clients' included) over the measured
  operation (``cpu_seconds`` for the two-transfer modes ``commit_store`` and ``upload_boto3``, else ``cpu_s``; a
  resume: from just after the client library's import to ready), and the server's (Ceph's ``radosgw``, ``ceph-osd``
  and ``ceph-mon`` together, ``server_cpu_s``) over the whole child, halved for the two-transfer modes: on a
  machine whose cores the server shares, the two add up to the wall time. Per GiB in ``cpu_s_per_gib`` and
  ``server_cpu_s_per_gib``.

The peers are the raw floor (``save_floor``: ``torch.save`` into memory, then ``upload_fileobj``), a Lightning-style
save (``save_torch_s3fs``: ``torch.save`` into memory, written through an s3fs file), DCP's ``FsspecWriter``
(``save_dcp_fsspec``), s3torchconnector's ``S3Checkpoint`` writer (``save_s3tc``) and its DCP ``S3StorageWriter``
(``save_dcp_s3tc``; both on AWS's CRT client). obstore and s3torchconnector are not trainproof's dependencies: they are
installed into ``--peers`` (default ``bench/out/peers``, ``pip install --target``) on first use and put on the
children's path only; ``--peers none`` measures what imports without them.

    .venv/bin/python bench/bench_s3.py --sizes 1024,4096 --reps 3        # starts its own RGW (root: installs it)
    .venv/bin/python bench/bench_s3.py --sizes 1024 --modes commit_store,save_store,save_floor,save_s3tc
    .venv/bin/python bench/bench_s3.py --sizes 1024 --modes save_store,resume_store --before /tmp/older  # MODE@before
    AWS_ENDPOINT_URL=http://... .venv/bin/python bench/bench_s3.py --bucket B --sizes 1024   # an existing server

Medians per measurement, the ratios of the goals, the machine and versions go to stdout and ``--out``
(default ``bench/out/s3.json``). Objects are deleted after each measurement (a 4 GiB state is 4 GiB in RGW's
sparse file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MiB = 2**20
LIBRARIES = {"store": ("trainproof.storage.s3", "trainproof.format.state"), "boto3": ("boto3",), "s3fs": ("s3fs",),
             "obstore": ("obstore",), "s3tc": ("s3torchconnector",), "floor": ("boto3",), "torch": ("s3fs",),
             "dcp": ("torch.distributed.checkpoint", "s3fs")}
COMMIT = ["commit_store", "upload_boto3", "upload_boto3_parts", "upload_s3fs", "upload_obstore"]
SAVE = ["save_store", "save_floor", "save_torch_s3fs", "save_dcp_fsspec", "save_s3tc", "save_dcp_s3tc"]
PEERS = ("obstore==0.12.1", "s3torchconnector==1.5.0", "s3torchconnectorclient==1.5.0")
"""Installed into ``--peers`` for the children only (``--no-deps``: torch is the project's own)."""
SERVER = ("radosgw", "ceph-osd", "ceph-mon")
RESUME = ["resume_store", "resume_ahead", "read_boto3_stream", "read_boto3_ranged", "read_boto3_download", "read_s3fs",
          "read_obstore", "read_s3tc"]


# -- child side: one measurement in a fresh process ---------------------------------------------------------------
class Memory(threading.Thread):
    """Peak VmRSS and RssAnon (bytes) of this process above a baseline taken by :meth:`mark`."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.base = self.peak = (0, 0)
        self.running = True
        self.start()

    @staticmethod
    def now() -> tuple[int, int]:
        fields = {}
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(("VmRSS:", "RssAnon:")):
                    name, value = line.split(":")
                    fields[name] = int(value.split()[0]) * 1024
        return fields["VmRSS"], fields["RssAnon"]

    def mark(self) -> None:
        self.base = self.peak = self.now()
        self.cpu0 = time.process_time()

    def run(self) -> None:
        while self.running:
            rss, anon = self.now()
            self.peak = (max(self.peak[0], rss), max(self.peak[1], anon))
            time.sleep(0.01)

    def extra(self) -> dict:
        self.running = False
        rss, anon = self.now()
        peak = (max(self.peak[0], rss), max(self.peak[1], anon))
        return {"extra_rss": peak[0] - self.base[0], "extra_anon": peak[1] - self.base[1],
                "cpu_s": time.process_time() - self.cpu0}


def _boto3(args):
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=args["endpoint"], region_name="us-east-1", config=Config(
        s3={"addressing_style": "path"}, request_checksum_calculation="when_required",
        response_checksum_validation="when_required", max_pool_connections=32))


def _obstore(args):
    from obstore.store import S3Store

    return S3Store(args["bucket"], endpoint=args["endpoint"], region="us-east-1", virtual_hosted_style_request=False,
                   access_key_id=os.environ["AWS_ACCESS_KEY_ID"], secret_access_key=os.environ["AWS_SECRET_ACCESS_KEY"],
                   client_options={"allow_http": True})


def _s3tc(args):
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    return S3Checkpoint(region="us-east-1", endpoint=args["endpoint"], s3client_config=S3ClientConfig(
        force_path_style=True, part_size=args["part"]))


def _store(args):
    from trainproof.storage import StoreOptions, open_store

    return open_store(f"s3://{args['bucket']}/{args['run']}", StoreOptions.from_env(endpoint_url=args["endpoint"]))


def _fetch_ahead(args):
    """The store with its newest generation being fetched (``GenerationStore.fetch_ahead``), as `train` starts it."""
    store = _store(args)
    store.fetch_ahead(lambda: "bench", spool_dir=args["work"], spool_from=0)
    return store


def _touch(state) -> None:
    """Read every tensor once, as loading it into a model would."""
    for value in state.values():
        if hasattr(value, "sum"):
            value.sum()


def _load_file(path: str):
    import torch

    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    _touch(state)
    return state


def child(mode: str, args: dict) -> dict:
    import importlib

    # resume_ahead: as `train` does, the store is opened and the newest generation fetched before torch is imported
    ahead = _fetch_ahead(args) if mode == "resume_ahead" else None
    import torch  # noqa: F401  - every child pays the import, as a trainer does

    # The client library first: "extra memory" is what the transfer adds, not the library's code (its import time
    # still counts in a resume's start -> ready).
    for name in LIBRARIES.get(mode.split("_")[1], ()):
        importlib.import_module(name)
    mem = Memory()
    key, path, size = args["key"], args["file"], args["size"]
    out: dict = {}
    mem.mark()  # modes with set-up of their own mark again after it
    if mode == "commit_store":
        from trainproof.format.state import load_weights_only
        from trainproof.storage.digest import of_parts
        from trainproof.storage.spool import Spool

        store = _store(args)
        store.write_file("plan.json", b"{}")  # the store's one-time probe and sweep, as a trainer's start does
        # The data path's client is made on first use (~0.3 s of CPU here): a trainer pays it at its first commit,
        # not at every one, and the raw side makes its client before its clock too.
        store.read_range("plan.json", 0, 1)
        sha = of_parts(args["sha"]["parts"], args["sha"]["part_bytes"])  # the digest encode_spool computed
        mem.mark()
        for step, field in ((1, "seconds"), (2, "seconds_second")):  # a process's first commit, then a later one
            t0, c0 = time.perf_counter(), time.process_time()
            store.commit(step, {"training_state.pt": Spool(path=path, size=size, sha256=sha)},
                         contract="bench", world=1, code_version="bench", check=lambda _n, d: load_weights_only(d))
            out[field], out[f"cpu_{field}"] = time.perf_counter() - t0, time.process_time() - c0
    elif mode == "upload_boto3":
        client = _boto3(args)
        for suffix, field in (("", "seconds"), (".2", "seconds_second")):  # as commit_store: a first, then another
            t0, c0 = time.perf_counter(), time.process_time()
            with open(path, "rb") as fh:
                client.upload_fileobj(fh, args["bucket"], key + suffix)
            out[field], out[f"cpu_{field}"] = time.perf_counter() - t0, time.process_time() - c0
    elif mode == "upload_boto3_parts":
        from boto3.s3.transfer import TransferConfig

        client = _boto3(args)
        config = TransferConfig(multipart_chunksize=args["part"], max_concurrency=args["concurrency"])
        t0 = time.perf_counter()
        client.upload_file(path, args["bucket"], key, Config=config)
        out["seconds"] = time.perf_counter() - t0
    elif mode == "upload_s3fs":
        from tests.support.s3server import make_s3fs

        fs = make_s3fs(args["endpoint"], key=os.environ["AWS_ACCESS_KEY_ID"],
                       secret=os.environ["AWS_SECRET_ACCESS_KEY"], read_timeout=300)
        t0 = time.perf_counter()
        fs.put_file(path, f"{args['bucket']}/{key}")
        out["seconds"] = time.perf_counter() - t0
    elif mode == "upload_obstore":
        from pathlib import Path

        import obstore

        store = _obstore(args)
        t0 = time.perf_counter()
        obstore.put(store, key, Path(path), chunk_size=args["part"], max_concurrency=args["concurrency"])
        out["seconds"] = time.perf_counter() - t0
    elif mode.startswith("save"):
        import torch

        state = torch.load(path, map_location="cpu", weights_only=True, mmap=False)  # the trainer's snapshot
        if mode == "save_store":
            from trainproof.format.state import load_weights_only
            from trainproof.storage.spool import SpoolWriter

            store = _store(args)
            store.write_file("plan.json", b"{}")
            mem.mark()
            t0 = time.perf_counter()
            if getattr(store, "uploads_while_written", False):  # as the trainer's Checkpointer.encode does on S3
                from trainproof.format.state import encode_live

                spool = encode_live(state, args["work"])

                def serialised() -> None:  # when torch.save ended, while the upload goes on
                    spool.join()
                    out["encode_seconds"] = time.perf_counter() - t0

                timer = threading.Thread(target=serialised)
                timer.start()
            else:
                timer = None
                with SpoolWriter(args["work"]) as w:
                    torch.save(state, w)
                spool = w.finish()
                out["encode_seconds"] = time.perf_counter() - t0
            store.commit(1, {"training_state.pt": spool}, contract="bench", world=1, code_version="bench",
                         check=lambda _n, d: load_weights_only(d))
            spool.unlink()
            if timer is not None:
                timer.join()
        elif mode == "save_dcp_fsspec":
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

            mem.mark()
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=FsspecWriter(f"s3://{args['bucket']}/{key}", thread_count=1))
        elif mode == "save_s3tc":
            checkpoint = _s3tc(args)
            mem.mark()
            t0 = time.perf_counter()
            with checkpoint.writer(f"s3://{args['bucket']}/{key}") as w:
                torch.save(state, w)
        elif mode == "save_floor":  # the floor: serialise into memory, one upload_fileobj (durable, unverified)
            import io

            client = _boto3(args)
            mem.mark()
            t0 = time.perf_counter()
            buffer = io.BytesIO()
            torch.save(state, buffer)
            buffer.seek(0)
            client.upload_fileobj(buffer, args["bucket"], key)
        elif mode == "save_torch_s3fs":  # Lightning's _atomic_save through fsspec: into memory, then one fs write
            import io

            from tests.support.s3server import make_s3fs

            fs = make_s3fs(args["endpoint"], key=os.environ["AWS_ACCESS_KEY_ID"],
                           secret=os.environ["AWS_SECRET_ACCESS_KEY"], read_timeout=300)
            mem.mark()
            t0 = time.perf_counter()
            buffer = io.BytesIO()
            torch.save(state, buffer)
            with fs.open(f"{args['bucket']}/{key}", "wb") as fh:
                fh.write(buffer.getvalue())
        elif mode == "save_dcp_s3tc":
            import torch.distributed.checkpoint as dcp
            from s3torchconnector import S3ClientConfig
            from s3torchconnector._s3client import S3Client
            from s3torchconnector.dcp import S3StorageWriter
            from s3torchconnector.dcp.s3_file_system import S3FileSystem

            url = f"s3://{args['bucket']}/{key}"
            writer = S3StorageWriter("us-east-1", url)
            # Its constructor has no endpoint: the same writer over a client that has one (path-style, the part size).
            config = S3ClientConfig(force_path_style=True, part_size=args["part"])
            writer.fs = S3FileSystem("us-east-1", s3_client=S3Client("us-east-1", endpoint=args["endpoint"],
                                                                       s3client_config=config))
            writer.path = writer.fs.init_path(url)
            mem.mark()
            t0 = time.perf_counter()
            dcp.save(state, storage_writer=writer)
        out["seconds"] = time.perf_counter() - t0
    else:  # resume and reads: timed from the parent's Popen (process start, imports included)
        if mode in ("resume_store", "resume_ahead"):
            from trainproof.format.state import load_weights_only

            store = ahead or _store(args)
            decoded = {}
            loaded = store.load_latest(contract="bench", world=1, spool_dir=args["work"], spool_from=0,
                                       check=lambda _n, d: decoded.update(state=load_weights_only(d)))
            assert loaded is not None and loaded.info.step == 2, loaded  # commit_store committed steps 1 and 2
            assert (store.fetched_ahead == loaded.info.name) == (mode == "resume_ahead"), store.fetched_ahead
            _touch(decoded["state"])
            loaded.close()
        elif mode == "read_s3tc":
            import torch

            with _s3tc(args).reader(f"s3://{args['bucket']}/{key}") as r:
                _touch(torch.load(r, map_location="cpu", weights_only=True))
        else:
            local = os.path.join(args["work"], "read.pt")
            _read_raw(mode, args, key, local)
            _load_file(local)
            os.unlink(local)
        out["ready_at"] = time.time()
    out.update(mem.extra())
    return out


def _read_raw(mode: str, args: dict, key: str, local: str) -> None:
    bucket, part = args["bucket"], args["part"]
    if mode == "read_boto3_stream":
        body = _boto3(args).get_object(Bucket=bucket, Key=key)["Body"]
        with open(local, "wb") as fh:
            while chunk := body.read(part):
                fh.write(chunk)
    elif mode == "read_boto3_ranged":
        from concurrent.futures import ThreadPoolExecutor

        client, size = _boto3(args), args["size"]
        fd = os.open(local, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

        def fetch(start: int) -> None:
            end = min(start + part, size) - 1
            data = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end}")["Body"].read()
            os.pwrite(fd, data, start)

        with ThreadPoolExecutor(args["concurrency"]) as pool:
            list(pool.map(fetch, range(0, size, part)))
        os.close(fd)
    elif mode == "read_boto3_download":
        _boto3(args).download_file(bucket, key, local)
    elif mode == "read_s3fs":
        from tests.support.s3server import make_s3fs

        make_s3fs(args["endpoint"], key=os.environ["AWS_ACCESS_KEY_ID"], secret=os.environ["AWS_SECRET_ACCESS_KEY"],
                  read_timeout=300).get_file(f"{bucket}/{key}", local)
    elif mode == "read_obstore":
        import obstore

        with open(local, "wb") as fh:
            for chunk in obstore.get(_obstore(args), key).stream(min_chunk_size=part):
                fh.write(chunk)
    else:
        raise ValueError(mode)


# -- parent side ---------------------------------------------------------------------------------------------------
def available(mode: str) -> str | None:
    """Why ``mode`` cannot run here (a module it needs does not import), else None."""
    needs = {"upload_obstore": "obstore", "read_obstore": "obstore", "save_s3tc": "s3torchconnector",
             "read_s3tc": "s3torchconnector", "save_dcp_s3tc": "s3torchconnector"}.get(mode)
    if needs is None:
        return None
    proc = subprocess.run([sys.executable, "-c", f"import {needs}"], env=child_env(), capture_output=True, text=True)
    if proc.returncode:  # any failure means: not measured, say why
        return f"{needs} does not import: {(proc.stderr.strip().splitlines() or ['?'])[-1]}"
    return None


def server_cpu_s() -> float:
    """CPU seconds the S3 server's processes (:data:`SERVER`) have used so far (0 when none runs here)."""
    total = 0
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
        if name in SERVER:
            total += int(rest[11]) + int(rest[12])  # utime, stime (fields 14 and 15)
    return total / os.sysconf("SC_CLK_TCK")


def child_env(root: str = ROOT) -> dict:
    """The children's environment: the peers' folder after the checkout on the path."""
    paths = [root] + ([PEERS_DIR[0]] if PEERS_DIR[0] else [])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)}


PEERS_DIR: list[str | None] = [None]
BEFORE: list[str | None] = [None]
"""``--before``: another checkout, whose own bench/bench_s3.py runs the ``MODE@before`` children."""
COMPARED = ("commit_store", "save_store", "resume_store")
"""The store's modes ``--before`` also runs from the other checkout."""


def install_peers(folder: str) -> None:
    """The peers' libraries into ``folder`` (once), for the children only."""
    if all(os.path.isdir(os.path.join(folder, p.split("==")[0])) for p in PEERS):
        return
    print(f"installing {', '.join(PEERS)} into {folder} (the benchmark's children only)", flush=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", folder, *PEERS],
                   check=True)


def run_child(mode: str, args: dict) -> dict:
    t0, server0 = time.time(), server_cpu_s()
    mode, _, side = mode.partition("@")
    root = BEFORE[0] if side == "before" and BEFORE[0] else ROOT
    proc = subprocess.run([sys.executable, os.path.join(root, "bench", "bench_s3.py"), "child", mode,
                           json.dumps(args)], cwd=root, env=child_env(root), capture_output=True, text=True,
                          timeout=3600)
    if proc.returncode != 0:  # recorded, not fatal: a peer's client may not work with this server
        lines = proc.stderr.strip().splitlines() or ["no output"]
        return {"error": lines[-1][:300]}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["server_cpu_s"] = server_cpu_s() - server0
    if "ready_at" in result:
        result["seconds"] = result.pop("ready_at") - t0
    return result


def make_state(path: str, mib: int) -> None:
    """A state of ``mib`` MiB: float32 tensors of 64 MiB (random, so nothing compresses), saved with torch.save."""
    import torch

    gen = torch.Generator().manual_seed(0)
    state = {f"layer{i}.weight": torch.rand(min(64, mib - 64 * i) * MiB // 4, generator=gen)
             for i in range(-(-mib // 64))}
    torch.save(state, path)


def clean(client, bucket: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            client.delete_object(Bucket=bucket, Key=obj["Key"])


def measure(size_mib: int, reps: int, modes: list[str], endpoint: str, client, work: str, part: int,
            concurrency: int) -> dict:
    from trainproof.storage.digest import FileHasher

    path = os.path.join(work, "state.pt")
    make_state(path, size_mib)
    sha = FileHasher()
    with open(path, "rb") as fh:
        while block := fh.read(8 * MiB):
            sha.update(block)
    digest = sha.hexdigest()
    base = {"endpoint": endpoint, "file": path, "size": os.path.getsize(path),
            "sha": {"parts": list(digest.parts) or [str(digest)], "part_bytes": digest.part_bytes},
            "work": work, "part": part, "concurrency": concurrency}
    results: dict[str, list] = {m: [] for m in modes}
    for rep in range(reps):
        order = modes if rep % 2 == 0 else list(reversed(modes))
        # The reads need the object first: the store's generation (resume_store) and a plain object (the rest).
        bucket = f"bench-s3-{size_mib}-{rep}-{os.getpid()}"
        client.create_bucket(Bucket=bucket)
        args = {**base, "bucket": bucket, "run": "run", "key": "obj/state.pt"}
        for mode in [m for m in order if m.split("@")[0] in COMMIT + SAVE]:
            results[mode].append(run_child(mode, args))
            clean(client, bucket)
            print(f"  {size_mib} MiB rep {rep} {mode}: {results[mode][-1]}", flush=True)
        reads = [m for m in order if m.split("@")[0] in RESUME]
        if reads:
            run_child("commit_store", args)
            with open(path, "rb") as fh:
                client.upload_fileobj(fh, bucket, args["key"])
            for mode in reads:
                results[mode].append(run_child(mode, args))
                print(f"  {size_mib} MiB rep {rep} {mode}: {results[mode][-1]}", flush=True)
        clean(client, bucket)
        client.delete_bucket(Bucket=bucket)
    os.unlink(path)
    return {"bytes": base["size"], "runs": results}


def summary(size: int, runs: dict[str, list]) -> dict:
    ok = {m: [r for r in rs if "error" not in r] for m, rs in runs.items()}
    med = {m: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for m, rs in ok.items() if rs}
    out = {"medians": med, "errors": {m: rs[0]["error"] for m, rs in runs.items() if rs and "error" in rs[0]}}
    if "commit_store" in med and "upload_boto3" in med:
        out["commit_vs_upload_fileobj"] = med["commit_store"]["seconds"] / med["upload_boto3"]["seconds"]
        if "seconds_second" in med["commit_store"] and "seconds_second" in med["upload_boto3"]:
            # A trainer commits many times per process: its second commit against a second upload, same process.
            out["second_commit_vs_second_upload"] = (med["commit_store"]["seconds_second"]
                                                     / med["upload_boto3"]["seconds_second"])
    raw = {m: v["seconds"] for m, v in med.items() if m.startswith("read_")}
    if "resume_store" in med and raw:
        best = min(raw, key=raw.get)
        out["resume_vs_best_raw"] = med["resume_store"]["seconds"] / raw[best]
        out["best_raw"] = best
    gib = size / 2**30
    # Per transfer: the two-transfer modes (a first commit, then a second) have their first one's CPU apart; the
    # server's, read around the whole child, is halved for them.
    out["cpu_s_per_gib"] = {m: round(v.get("cpu_seconds", v.get("cpu_s", 0.0)) / gib, 3) for m, v in med.items()}
    out["server_cpu_s_per_gib"] = {m: round(v["server_cpu_s"] / (2 if "seconds_second" in v else 1) / gib, 3)
                                   for m, v in med.items()}
    peers = {m: v for m, v in med.items() if m in SAVE and m not in ("save_store", "save_floor")}
    if "save_store" in med and peers:  # the goals: a verified save against the fastest peer's unverified one
        fastest = min(peers, key=lambda m: peers[m]["seconds"])
        mine = med["save_store"]
        out["save_vs_fastest_peer"] = {"peer": fastest, "seconds": mine["seconds"] / peers[fastest]["seconds"],
                                       "cpu": mine["cpu_s"] / peers[fastest]["cpu_s"],
                                       "cpu_with_server": (mine["cpu_s"] + mine["server_cpu_s"])
                                       / (peers[fastest]["cpu_s"] + peers[fastest]["server_cpu_s"])}
        if "save_floor" in med:
            out["save_vs_floor"] = mine["seconds"] / med["save_floor"]["seconds"]
    for m in ("commit_store", "resume_store", "save_store"):
        if m in med:
            out[f"{m}_extra_rss_x_state"] = med[m]["extra_rss"] / size
            out[f"{m}_extra_anon_x_state"] = med[m]["extra_anon"] / size
    return out


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": platform.python_version(), "machine": platform.machine(), "cores": os.cpu_count(),
           "kernel": platform.release()}
    for name in ("torch", "boto3", "botocore", "s3fs", "aiobotocore", "obstore", "s3torchconnector"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    try:
        out["radosgw"] = subprocess.run(["radosgw", "--version"], capture_output=True, text=True).stdout.strip()
    except OSError:
        out["radosgw"] = None
    out["load_before"] = os.getloadavg()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="1024,4096", help="state sizes in MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default=",".join(COMMIT + SAVE + RESUME))
    ap.add_argument("--part-mib", type=int, default=8, help="part size of the raw tuned clients")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--work", default=None, help="local folder for the state file and spools (default: temp)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "s3.json"))
    ap.add_argument("--peers", default=os.path.join(ROOT, "bench", "out", "peers"),
                    help="folder the peers' libraries are installed into for the children (none: use what imports)")
    ap.add_argument("--before", default=None, help="another checkout (e.g. git archive of an older commit): its "
                    f"store runs {', '.join(COMPARED)} too, as MODE@before, beside this one's")
    args = ap.parse_args()
    BEFORE[0] = os.path.abspath(args.before) if args.before else None
    if args.peers != "none":
        install_peers(args.peers)
        PEERS_DIR[0] = args.peers
        sys.path.append(args.peers)  # for versions() only: the parent imports none of them
    from tests.support import rgw
    from tests.support.s3server import dummy_aws_env

    own = None
    if os.environ.get("AWS_ENDPOINT_URL"):
        endpoint = os.environ["AWS_ENDPOINT_URL"]
    else:
        os.environ.update(dummy_aws_env())
        own = rgw.prepare_session()
        endpoint = rgw.session_server().endpoint
        os.environ["AWS_ENDPOINT_URL"] = endpoint
    import boto3
    from botocore.config import Config

    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                          config=Config(s3={"addressing_style": "path"}, request_checksum_calculation="when_required"))
    modes = []
    skipped = {}
    wanted = args.modes.split(",")
    wanted += [f"{m}@before" for m in wanted if BEFORE[0] and m in COMPARED]
    for m in wanted:
        why = available(m.split("@")[0])
        if why:
            skipped[m] = why
        else:
            modes.append(m)
    work = args.work or tempfile.mkdtemp(prefix="trainproof-bench-s3-")
    report = {"versions": versions(), "skipped": skipped, "sizes": {}, "command": " ".join(sys.argv)}
    try:
        for mib in (int(s) for s in args.sizes.split(",")):
            measured = measure(mib, args.reps, modes, endpoint, client, work, args.part_mib * MiB, args.concurrency)
            report["sizes"][mib] = {**measured, **summary(measured["bytes"], measured["runs"])}
            print(json.dumps({k: v for k, v in report["sizes"][mib].items() if k != "runs"}, indent=1), flush=True)
    finally:
        report["versions"]["load_after"] = os.getloadavg()
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
        if own:
            rgw.end_session(own)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as fh:
        json.dump(report, fh, indent=1)
    print(f"skipped: {skipped}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        print(json.dumps(child(sys.argv[2], json.loads(sys.argv[3]))), flush=True)
    else:
        main()
