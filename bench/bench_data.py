"""Batches built by DataLoader workers, and datasets read from a bucket: ratios against baselines run side by side.

Four measurements, each a ratio of medians over interleaved repetitions in this one script:

``workers``  steps/s of the real trainer (``python -m trainproof train``, a tiny model so the data is the bottleneck)
with a
             per-sample transform of ~5 ms of CPU, 2 workers vs 0 (goal >= 1.7 with 2 cores' worth of workers);
``loader``   micro-batches/s of trainproof's loader (trainproof.train.pipeline: the lookahead, DataLoader, per-sample
             generators, the step check) vs a plain ``torch.utils.data.DataLoader`` over the same dataset, transform,
             batches, workers and prefetch (goal >= 0.95);
``s3``       MiB/s reading a packed dataset from S3 through the store layer (``ShardedDataset``: parallel ranged reads,
             every part verified, written to the local cache; cold cache each time) vs raw parallel ranged GETs of the
             same parts with boto3 (same part size and concurrency; goal >= 0.9). Needs a real S3 server: the AWS_*
             variables, or ``--rgw`` to start ``scripts/rgw.sh`` for the run (never moto);
``memory``   the peak memory each data worker adds while a run reads the bucket dataset (VmHWM over its RSS once
             its S3 client is made, at its first batch), against docs/tasks.md's bound
             ``(2 x TRAINPROOF_IO_CONCURRENCY + 1) x part size`` plus the micro-batch being built (and 8 MiB for the
             interpreter); the client's own size (a fixed cost per reading process) is reported apart.

``--link-mbit N`` shapes what the S3 server sends to N Mbit/s (tc on loopback, root): client and server share this
machine's cores, so unshaped the s3 comparison is a CPU race; shaped, the link is the bottleneck, as on a real node.

    .venv/bin/python bench/bench_data.py workers loader --reps 5
    .venv/bin/python bench/bench_data.py s3 memory --rgw --reps 5
    .venv/bin/python bench/bench_data.py s3 --rgw --reps 5 --link-mbit 1600
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.parse
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainproof.tasks import BatchRequest, DatasetTask, TaskContext  # noqa: E402

SAMPLES, FEATURES, BATCH = 2048, 64, 16
TRANSFORM_S = 0.005


def cpu_spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time (a decode or an augmentation), whatever the machine's load."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


class Features:
    """``SAMPLES`` rows of ``FEATURES`` floats and a target; every read costs ``TRANSFORM_S`` of CPU."""

    def __init__(self) -> None:
        gen = np.random.default_rng(0)
        self.x = gen.standard_normal((SAMPLES, FEATURES)).astype(np.float32)
        self.y = self.x @ gen.standard_normal(FEATURES).astype(np.float32)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> tuple[np.ndarray, np.float32]:
        cpu_spin(TRANSFORM_S)
        return self.x[i], self.y[i]


def _loss(model: torch.nn.Module, batch: Any) -> torch.Tensor:
    x, y = batch
    return (model(x).squeeze(1) - y) ** 2


def factory(config: dict[str, Any]) -> DatasetTask:
    """``--task bench.bench_data:factory``: a linear model on :class:`Features` (the step is nearly free)."""
    return DatasetTask(dataset=Features(), build_model=lambda: torch.nn.Linear(FEATURES, 1), per_sample_loss=_loss,
                       config=dict(config), batch_size=BATCH, optimizer="sgd", lr=0.01,
                       data_identity="0" * 64, default_steps=60)


# -- workers: the trainer's steps/s ---------------------------------------------------------------------------------
def steps_per_second(workers: int, steps: int) -> float:
    """Steps/s of a real training process over its steps after the fifth (start-up and worker start left out)."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")},
               "PYTHONPATH": str(ROOT), "TRAINPROOF_LOG_FORMAT": "json"}
        out = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", f"{tmp}/run", "--task",
                              "bench.bench_data:factory", "--max-steps", str(steps), "--data-workers", str(workers),
                              "--checkpoint-every-seconds", "0"], cwd=ROOT, env=env, text=True, capture_output=True,
                             check=True).stdout
    seconds = [e["step_seconds"] for e in map(json.loads, (x for x in out.splitlines() if x.startswith("{")))
               if e.get("event") == "step" and e["step"] > 5]
    return len(seconds) / sum(seconds)


def bench_workers(reps: int) -> dict[str, Any]:
    runs: dict[int, list[float]] = {0: [], 2: []}
    for _ in range(reps):
        for workers in (0, 2):  # interleaved: both sides see the same load over time
            runs[workers].append(steps_per_second(workers, 60))
    zero, two = statistics.median(runs[0]), statistics.median(runs[2])
    return {"steps_per_s_0_workers": zero, "steps_per_s_2_workers": two, "ratio": two / zero, "runs": runs}


# -- loader: trainproof's pipeline vs a plain DataLoader --------------------------------------------------------------
def _requests(batches: int) -> list[BatchRequest]:
    from trainproof.train.data import EpochSampler
    from trainproof.train.pipeline import Lookahead
    from trainproof.train.rng import data_generator

    ahead = Lookahead(EpochSampler(SAMPLES, data_generator(1)), seed=1, first=1, global_batch=BATCH, world=1, rank=0,
                      micro=BATCH)
    it = iter(ahead)
    return [next(it) for _ in range(batches)]


def _cpu() -> float:
    """CPU seconds of this process and of its children that have ended (the DataLoader workers, once joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def ours(workers: int, batches: int, prefetch: int = 2) -> tuple[float, float]:
    """(batches/s, CPU s/batch) of trainproof.train.pipeline, consumed the way train_step consumes it."""
    from trainproof.train.data import EpochSampler
    from trainproof.train.pipeline import open_batches
    from trainproof.train.rng import data_generator

    task, ctx = factory({}), TaskContext(np_rng=np.random.default_rng(0), device=torch.device("cpu"))
    wanted = _requests(batches)
    t0, c0 = time.perf_counter(), _cpu()
    source = open_batches(task, EpochSampler(SAMPLES, data_generator(1)), seed=1, first=1, world=1, rank=0,
                          workers=workers, prefetch=prefetch, pin_memory=False)
    for request in wanted:
        source.batch(request, ctx)
    wall = time.perf_counter() - t0
    source.close()  # joins the workers: their CPU time is counted (the batches they built past the end too)
    return batches / wall, (_cpu() - c0) / batches


def plain(workers: int, batches: int, prefetch: int = 2) -> tuple[float, float]:
    """(batches/s, CPU s/batch) of a plain DataLoader over the same samples, batches, workers and prefetch."""
    from torch.utils.data import DataLoader

    chunks = [list(r.sample_ids) for r in _requests(batches)]
    t0, c0 = time.perf_counter(), _cpu()
    loader = DataLoader(Features(), batch_sampler=chunks, num_workers=workers,
                        prefetch_factor=prefetch if workers else None,
                        multiprocessing_context="fork" if workers else None)
    it = iter(loader)
    for _ in it:
        pass
    wall = time.perf_counter() - t0
    del it  # shuts its workers down and joins them
    return batches / wall, (_cpu() - c0) / batches


def bench_loader(reps: int, workers: int = 2, batches: int = 120) -> dict[str, Any]:
    runs: dict[str, list[tuple[float, float]]] = {"trainproof": [], "plain": []}
    for rep in range(reps):
        sides = ("trainproof", "plain") if rep % 2 == 0 else ("plain", "trainproof")  # alternate who goes first
        for side in sides:
            runs[side].append((ours if side == "trainproof" else plain)(workers, batches))
    rate = {side: statistics.median(r for r, _ in values) for side, values in runs.items()}
    cpu = {side: statistics.median(c for _, c in values) for side, values in runs.items()}
    return {"batches_per_s_trainproof": rate["trainproof"], "batches_per_s_plain": rate["plain"],
            "ratio": rate["trainproof"] / rate["plain"], "cpu_s_per_batch_trainproof": cpu["trainproof"],
            "cpu_s_per_batch_plain": cpu["plain"], "cpu_ratio": cpu["plain"] / cpu["trainproof"], "workers": workers,
            "batches": batches, "runs": runs}


# -- s3: the store layer's verified reads vs raw ranged GETs ----------------------------------------------------------
def _boto3_client() -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"], config=Config(
        retries={"total_max_attempts": 1}, request_checksum_calculation="when_required",
        response_checksum_validation="when_required", max_pool_connections=32, s3={"addressing_style": "path"}))


def pack_bench_dataset(bucket: str, mib: int, part_kib: int) -> str:
    from examples.tokenlm import stdlib_tokens
    from trainproof.data import pack_records, token_windows

    url = f"s3://{bucket}/datasets/bench-{mib}mib-{part_kib}k"
    try:
        from trainproof.data import ShardedDataset

        with tempfile.TemporaryDirectory() as nothing_cached:
            ShardedDataset(url, cache_dir=nothing_cached)
        return url  # packed by an earlier run
    except Exception:  # noqa: BLE001 - not there yet
        pass
    pack_records(url, token_windows(stdlib_tokens(mib * 2**20 + 68), 16), shard_bytes=4 * 2**20,
                 part_bytes=part_kib * 1024)
    return url


def read_store(url: str, cache: str) -> tuple[float, int]:
    from trainproof.data import ShardedDataset

    shutil.rmtree(cache, ignore_errors=True)
    data = ShardedDataset(url, cache_dir=cache, cache_mib=1 << 20)
    _warm(data)
    t0 = time.perf_counter()
    read = data.verify()
    return time.perf_counter() - t0, read


def _warm(data: Any) -> None:
    """One 1-byte read through the dataset's store before the clock starts: its S3 client is made on first use
    (~0.3 s of CPU here), which the raw side pays before its clock too. A worker pays it once, not per read."""
    shard = data.manifest.shards[0]
    data._store.read_range(shard.entry.name, 0, 1)


def read_raw(url: str, concurrency: int) -> tuple[float, int]:
    from trainproof.data import ShardedDataset

    with tempfile.TemporaryDirectory() as nothing_cached:  # only the manifest is read
        data = ShardedDataset(url, cache_dir=nothing_cached)
    bucket, prefix = url[len("s3://"):].split("/", 1)
    client = _boto3_client()
    spans = [(f"{prefix}/{s.entry.name}", *s.entry.span(i)) for s in data.manifest.shards
             for i in range(len(s.entry.parts))]

    def get(span: tuple[str, int, int]) -> int:
        key, start, end = span
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}")["Body"]
        return len(body.read())

    get((spans[0][0], 0, 1))  # as _warm: the client made and one connection open before the clock starts
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        read = sum(pool.map(get, spans))
    return time.perf_counter() - t0, read


def read_ranges(url: str, concurrency: int) -> tuple[float, int]:
    """The same parts through the store's own ranged reads (its S3 client, retried), in ``concurrency`` threads:
    no verification, no cache. The difference to :func:`read_store` is what trainproof.data and
    trainproof.storage.objects add."""
    from trainproof.data import ShardedDataset

    with tempfile.TemporaryDirectory() as nothing_cached:  # only the manifest is read
        data = ShardedDataset(url, cache_dir=nothing_cached)
    store = data._store
    spans = [(s.entry.name, *s.entry.span(i)) for s in data.manifest.shards for i in range(len(s.entry.parts))]
    _warm(data)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        read = sum(pool.map(lambda span: len(store.read_range(*span)), spans))
    return time.perf_counter() - t0, read


def bench_s3(reps: int, mib: int = 256, part_kib: int = 1024) -> dict[str, Any]:
    from trainproof.storage import StoreOptions

    bucket = _bucket()
    url = pack_bench_dataset(bucket, mib, part_kib)
    concurrency = StoreOptions.from_env().concurrency
    cache = tempfile.mkdtemp(prefix="bench-data-cache-")
    read_raw(url, concurrency)  # warm-up: connections, the server's first reads
    sides = {"verified": lambda: read_store(url, cache), "store_ranges": lambda: read_ranges(url, concurrency),
             "boto3": lambda: read_raw(url, concurrency)}
    runs: dict[str, list[float]] = {side: [] for side in sides}
    cpu: dict[str, list[float]] = {side: [] for side in sides}
    for rep in range(reps):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))  # alternate who goes first
        for side in order:
            c0 = _cpu()
            seconds, read = sides[side]()
            assert read >= mib * 2**20 - 68, (side, read)
            runs[side].append(read / 2**20 / seconds)
            cpu[side].append((_cpu() - c0) * 1000 / (read / 2**20))  # every side runs in this process's threads
    shutil.rmtree(cache, ignore_errors=True)
    rate = {side: statistics.median(values) for side, values in runs.items()}
    return {"dataset": url, "mib": mib, "part_kib": part_kib, "concurrency": concurrency, "sha256_mib_per_s": _sha(),
            **{f"mib_per_s_{side}": value for side, value in rate.items()},
            **{f"cpu_ms_per_mib_{side}": statistics.median(values) for side, values in cpu.items()},
            "ratio": rate["verified"] / rate["boto3"], "ratio_to_store_ranges": rate["verified"] / rate["store_ranges"],
            "runs": runs}


def _sha() -> float:
    """sha256 MiB/s on one core now (the verification's own cost: ~1.5 GB/s on an idle core with SHA extensions)."""
    import hashlib

    data = os.urandom(64 * 2**20)
    t0 = time.perf_counter()
    hashlib.sha256(data).digest()
    return 64 / (time.perf_counter() - t0)


def _bucket() -> str:
    import boto3  # noqa: F401

    client, name = _boto3_client(), os.environ.get("BENCH_BUCKET", "trainproof-bench")
    try:
        client.create_bucket(Bucket=name)
    except client.exceptions.BucketAlreadyOwnedByYou:
        pass
    return name


# -- memory: what a data worker adds ------------------------------------------------------------------------------
def bench_memory(reps: int, part_kib: int = 4096) -> dict[str, Any]:
    """Two workers read a 64 MiB bucket dataset (4 MiB parts) in micro-batches of 4096 windows through a real run;
    each worker reports its peak RSS over its RSS at its first batch (bench.bench_data:MemoryProbe)."""
    from trainproof.storage import StoreOptions

    url = pack_bench_dataset(_bucket(), 64, part_kib)
    concurrency = StoreOptions.from_env().concurrency
    # docs/tasks.md's bound: (2 x concurrency + 1) parts (the S3 client holds a part's body about twice while it
    # arrives), the micro-batch being built (4096 windows as uint16 samples, then int64 tensors, counted 4 times),
    # and 8 MiB for the interpreter's own growth (thread stacks of the fetching threads, allocator arenas).
    bound = (2 * concurrency + 1) * part_kib * 1024 + 4096 * 17 * 8 * 4 + 8 * 2**20
    peaks: list[float] = []
    clients: list[float] = []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as tmp:
            env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}, "PYTHONPATH": str(ROOT),
                   "TRAINPROOF_DATA_CACHE": f"{tmp}/cache", "BENCH_MEMORY_DIR": tmp}
            Path(f"{tmp}/lm.json").write_text(json.dumps({"dataset": url, "batch_size": 4096, "micro_batch_size": 4096,
                                                          "context": 16, "d_model": 8, "n_heads": 1, "n_layers": 1,
                                                          "d_ff": 8, "eval_windows": 8}))
            subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", f"{tmp}/run", "--task",
                            "bench.bench_data:memory_factory", "--config", f"{tmp}/lm.json", "--max-steps", "30",
                            "--data-workers", "2", "--checkpoint-every-seconds", "0"], cwd=ROOT, env=env, check=True,
                           capture_output=True)
            records = [json.loads(p.read_text()) for p in Path(tmp).glob("worker-*.json")]
            peaks += [r["added_bytes"] for r in records]
            clients += [r["client_bytes"] for r in records]
    return {"dataset": url, "part_kib": part_kib, "concurrency": concurrency, "bound_bytes": bound,
            "peak_added_bytes_median": statistics.median(peaks), "peak_added_bytes_max": max(peaks),
            "within_bound": max(peaks) <= bound, "workers_measured": len(peaks),
            "client_bytes_median": statistics.median(clients), "client_bytes_max": max(clients)}


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def memory_factory(config: dict[str, Any]) -> DatasetTask:
    """examples.tokenlm's task whose builds record the worker's peak RSS over its RSS at its first build."""
    from examples.tokenlm import factory as lm

    task = lm(config)
    build = task.build_batch
    seen: dict[str, int] = {}

    def probed(request: BatchRequest) -> Any:
        if "base" not in seen:
            # The worker's own S3 client is made on its first read: a fixed cost of every reading process, measured
            # apart from what the reads hold (the bound covers parts in flight, not the client).
            before = _status("VmRSS:")
            data = task.dataset.dataset
            data._reader_here()  # this worker's own store and reader (a forked worker opens them on first use)
            _warm(data)
            seen["base"] = _status("VmRSS:")
            seen["client"] = seen["base"] - before
        batch = build(request)
        added = _status("VmHWM:") - seen["base"]
        record = Path(os.environ["BENCH_MEMORY_DIR"], f"worker-{os.getpid()}.json")
        record.write_text(json.dumps({"added_bytes": added, "client_bytes": seen["client"]}))
        return batch

    task.build_batch = probed  # an instance attribute: the trainer still sees DatasetTask's build_batch override
    return task


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", nargs="+", choices=("workers", "loader", "s3", "memory"))
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--rgw", action="store_true", help="start scripts/rgw.sh for the s3 and memory benchmarks")
    parser.add_argument("--link-mbit", type=int, default=0, metavar="MBIT",
                        help="shape what the S3 server sends on loopback to MBIT Mbit/s with tc (root; the server's "
                             "port only, so its own traffic to the OSD is not slowed): the link as the bottleneck, as "
                             "on a real node, instead of the two cores that client and server share here")
    args = parser.parse_args()
    results: dict[str, Any] = {"cpus": os.cpu_count(), "load_average": os.getloadavg(), "link_mbit": args.link_mbit}
    rgw = _start_rgw() if args.rgw and {"s3", "memory"} & set(args.what) else None
    try:
        if args.link_mbit:
            _shape(args.link_mbit)
        for what in args.what:
            results[what] = globals()[f"bench_{what}"](args.reps)
            print(json.dumps({what: {k: v for k, v in results[what].items() if k != "runs"}}), flush=True)
    finally:
        if args.link_mbit:
            subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], check=False)
        if rgw is not None:
            subprocess.run(["bash", str(ROOT / "scripts" / "rgw.sh"), "stop"], env=rgw, check=False)
    results["load_average_after"] = os.getloadavg()
    print(json.dumps(results, indent=1))
    return 0


def _shape(mbit: int) -> None:
    """Limit the bytes the server at AWS_ENDPOINT_URL sends on loopback to ``mbit`` Mbit/s (an htb class matched on
    its source port; every other loopback flow, RGW's own traffic to its OSD included, goes unshaped)."""
    port = urllib.parse.urlsplit(os.environ["AWS_ENDPOINT_URL"]).port
    for cmd in (["qdisc", "add", "dev", "lo", "root", "handle", "1:", "htb", "default", "10", "r2q", "1000"],
                ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:10", "htb", "rate", "100gbit"],
                ["class", "add", "dev", "lo", "parent", "1:", "classid", "1:20", "htb", "rate", f"{mbit}mbit",
                 "ceil", f"{mbit}mbit"],
                ["filter", "add", "dev", "lo", "protocol", "ip", "parent", "1:", "prio", "1", "u32", "match", "ip",
                 "sport", str(port), "0xffff", "flowid", "1:20"]):
        subprocess.run(["tc", *cmd], check=True, capture_output=True)


def _start_rgw() -> dict[str, str]:
    env = {**os.environ, "RGW_DIR": os.environ.get("RGW_DIR", tempfile.mkdtemp(prefix="bench-rgw-"))}
    out = subprocess.run(["bash", str(ROOT / "scripts" / "rgw.sh"), "start"], env=env, text=True, capture_output=True,
                         check=True).stdout
    values = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    os.environ.update(AWS_ENDPOINT_URL=values["RGW_ENDPOINT"], AWS_ACCESS_KEY_ID=values["RGW_ACCESS_KEY"],
                      AWS_SECRET_ACCESS_KEY=values["RGW_SECRET_KEY"], AWS_DEFAULT_REGION=values["RGW_REGION"])
    return env


if __name__ == "__main__":
    sys.exit(main())
