"""How long training is blocked by an asynchronous checkpoint, what it costs in throughput and in memory.

Every run is a fresh child process that trains ``bench.bigmodel:factory`` (k x Linear(1024, 1024) with Adam, the
state sized by ``--sizes``) through the real trainer (``trainproof.train.loop.train``) into a fresh store, with one of:

- ``async``: the default, a checkpoint every ``--every`` steps, committed in the background;
- ``sync``: the same with ``--sync-checkpoint`` (for comparison);
- ``none``: no periodic checkpoint (only the final commit, after the timed window).

Reported per size, medians over ``--repeats`` runs of each mode:

- **stall** = training time blocked per checkpoint (the trainer's own ``blocked_s``: waiting for the previous save,
  capture and the copy to host memory) / time to copy the state to host memory (``tensor.clone()`` of every tensor
  of the model and optimizer state, measured in the same child after training, median of 5). Goal <= 1.5.
- **throughput** = steps/s with a checkpoint every ``--every`` steps / steps/s without (between the first and the
  last step, so the final commit is outside the window). Goal >= 0.9 (reported, the machine decides).
- **memory** = (peak RSS from a checkpoint's start until its commit is collected - RSS at its start) / state bytes,
  for the first checkpoint of each run (RSS sampled every 5 ms from /proc/self/statm). Goal <= 1.2.
- **commit** = the checkpoint's write + read-back verify + commit (the trainer's ``seconds``: spool upload,
  ranged read-back hash, weights-only check, COMPLETE.json) / the baseline write of the same bytes in the same
  child after training, median of 5: boto3 ``upload_fileobj`` to the same server for S3, a copy + fsync into the
  same folder for a local store. Goal <= 2.2.
- **resume** = (process start -> ready to take the first step, i.e. the ``start`` event after the restore, of a
  fresh ``trainproof`` process resuming the run) / (process start -> state loaded, of a fresh process doing one GET
  (or open) + ``torch.load``). Goal <= 1.2. The time until the first step is *done* is shown beside it.

Writes ``bench/out/async_stall.json`` and ``bench/out/async_stall.md``. Not run by CI.

    .venv/bin/python bench/bench_async_stall.py                               # 64 and 256 MiB, local folder, 5 runs
    .venv/bin/python bench/bench_async_stall.py --sizes 64,256,1024 --modes async,none
    .venv/bin/python bench/bench_async_stall.py --store-root s3://bucket/bench  # AWS_ENDPOINT_URL for MinIO/RGW
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOALS = {"stall": "≤ 1.5", "throughput": "≥ 0.98", "memory": "≤ 1.2", "commit": "≤ 2.2", "resume": "≤ 1.2"}


class _RssSampler(threading.Thread):
    """(time, RSS bytes) every ``period`` seconds from /proc/self/statm."""

    def __init__(self, period: float = 0.005) -> None:
        super().__init__(daemon=True)
        self.period, self.samples, self._halt = period, [], threading.Event()
        self._page = os.sysconf("SC_PAGE_SIZE")

    def rss(self) -> int:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * self._page

    def run(self) -> None:
        while not self._halt.is_set():
            self.samples.append((time.perf_counter(), self.rss()))
            time.sleep(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One training run in this process; returns its measurements."""
    import torch

    from trainproof.tasks import load_task
    from trainproof.train.config import TrainConfig
    from trainproof.train.loop import train
    from trainproof.train.progress import Reporter
    from trainproof.train.run import build_run, train_step

    sampler = _RssSampler()

    class Probe(Reporter):
        def __init__(self) -> None:
            super().__init__()
            self.step_times: list[float] = []
            self.events: list[tuple[float, int, str, dict]] = []

        def step(self, record, *, target):
            super().step(record, target=target)
            self.step_times.append(time.perf_counter())

        def event(self, name, **fields):
            self.events.append((time.perf_counter(), sampler.rss(), name, fields))

    probe = Probe()
    cfg = TrainConfig(store=f"{spec['root'].rstrip('/')}/run-{uuid.uuid4().hex[:10]}", task="bench.bigmodel:factory",
                      task_config={"state_mib": spec["mib"]}, max_steps=spec["steps"],
                      checkpoint_every=spec["every"] if spec["mode"] != "none" else 0, checkpoint_every_seconds=0,
                      keep=2, sync_checkpoint=spec["mode"] == "sync", log_format="json")
    sampler.start()
    outcome = train(cfg, reporter=probe)
    sampler.stop()
    assert outcome.exit_code == 0, outcome
    t = probe.step_times
    steps_per_s = (len(t) - 1) / (t[-1] - t[0])
    records = [f for _, _, n, f in probe.events if n == "checkpoint"]
    periodic = [r for r in records if r["step"] < spec["steps"]]
    memory = None
    begins = [(ts, rss) for ts, rss, n, f in probe.events if n == "checkpoint_begin"]
    ends = [ts for ts, _, n, f in probe.events if n == "checkpoint"]
    if spec["mode"] != "none" and begins and ends:
        (t0, rss0), t1 = begins[0], ends[0]
        peak = max(rss for ts, rss in sampler.samples if t0 <= ts <= t1)
        memory = (peak - rss0) / records[0]["bytes"]
    # Baseline: copy the same state (model + optimizer tensors) to host memory, in this process.
    task = load_task("bench.bigmodel:factory", {"state_mib": spec["mib"]})
    run = build_run(task, torch.device("cpu"), 1234)
    train_step(run)
    tensors = [*run.model.state_dict().values(),
               *(v for s in run.optimizer.state_dict()["state"].values() for v in s.values() if torch.is_tensor(v))]
    copies = []
    for _ in range(5):
        c0 = time.perf_counter()
        out = [x.clone() for x in tensors]
        copies.append(time.perf_counter() - c0)
        del out
    base_commit = _baseline_writes(cfg.store, records[-1]["generation"]) if records else []
    return {"mode": spec["mode"], "mib": spec["mib"], "steps_per_s": steps_per_s, "store": cfg.store,
            "base_commit_s": base_commit, "step": records[-1]["step"] if records else None,
            "blocked_s": [r["blocked_s"] for r in periodic], "save_s": [r["seconds"] for r in periodic],
            "bytes": records[0]["bytes"] if records else None, "memory_ratio": memory,
            "copy_s": statistics.median(copies),
            "waits": sum(1 for _, _, n, _ in probe.events if n == "checkpoint_wait")}


def _baseline_writes(url: str, generation: str, repeats: int = 5) -> list[float]:
    """Seconds to write the committed state's bytes again the plain way: boto3 ``upload_fileobj`` (S3) or a copy
    + fsync (folder), from a local file, ``repeats`` times."""
    import shutil

    from trainproof.storage import open_store
    from trainproof.storage.backend import join

    store = open_store(url)
    src = join(store.root, generation, "training_state.pt")
    with tempfile.TemporaryDirectory(prefix="tp-bench-base-") as tmp:
        local = os.path.join(tmp, "state.pt")
        with open(local, "wb") as fh:
            for chunk in store.backend.iter_read(src):
                fh.write(chunk)
        out = []
        client = None
        if url.startswith("s3://"):
            import boto3

            client = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL"))
        for i in range(repeats):
            if client is not None:
                bucket, _, key = src.partition("/")
                t0 = time.perf_counter()
                with open(local, "rb") as fh:
                    client.upload_fileobj(fh, bucket, f"{key}.baseline-{i}")
                out.append(time.perf_counter() - t0)
                client.delete_object(Bucket=bucket, Key=f"{key}.baseline-{i}")  # keep the server's disk flat
            else:
                dst = os.path.join(os.path.dirname(src), f".baseline-{i}")
                t0 = time.perf_counter()
                with open(local, "rb") as a, open(dst, "wb") as b:
                    shutil.copyfileobj(a, b, 8 * 2**20)
                    b.flush()
                    os.fsync(b.fileno())
                out.append(time.perf_counter() - t0)
                os.unlink(dst)
    return out


def resume_child(spec: dict[str, Any]) -> dict[str, Any]:
    """A fresh process resuming ``spec['store']`` for one step; the wall time of its first optimizer step."""
    from trainproof.train.config import TrainConfig
    from trainproof.train.loop import train
    from trainproof.train.progress import Reporter

    first: list[float] = []
    ready: list[float] = []

    class Probe(Reporter):
        def step(self, record, *, target):
            first.append(time.time()) if not first else None

        def event(self, name, **fields):
            if name == "start":  # state restored, about to take the first step
                ready.append(time.time())

    cfg = TrainConfig(store=spec["store"], task="bench.bigmodel:factory", task_config={"state_mib": spec["mib"]},
                      max_steps=spec["step"] + 1, checkpoint_every=spec["every"], checkpoint_every_seconds=0,
                      keep=2, log_format="json")
    outcome = train(cfg, reporter=Probe())
    assert outcome.exit_code == 0, outcome
    return {"first_step_wall": first[0], "ready_wall": ready[0]}


def load_child(spec: dict[str, Any]) -> dict[str, Any]:
    """The baseline of resume: a fresh process fetching the state file with one GET (or one open) + torch.load."""
    import io

    import torch

    from trainproof.storage import open_store
    from trainproof.storage.backend import join

    store = open_store(spec["store"])
    src = join(store.root, f"step-{spec['step']:08d}", "training_state.pt")
    if spec["store"].startswith("s3://"):
        import boto3

        bucket, _, key = src.partition("/")
        body = boto3.client("s3", endpoint_url=os.environ.get("AWS_ENDPOINT_URL")).get_object(Bucket=bucket, Key=key)
        state = torch.load(io.BytesIO(body["Body"].read()), map_location="cpu", weights_only=True)
    else:
        state = torch.load(src, map_location="cpu", weights_only=True)
    assert state["progress"]["step"] == spec["step"]
    return {"loaded_wall": time.time()}


def _spawn(kind: str, spec: dict[str, Any], env: dict[str, str]) -> tuple[float, dict[str, Any]]:
    """(wall time at spawn, the child's JSON result)."""
    t0 = time.time()
    out = subprocess.run([sys.executable, __file__, f"--{kind}", json.dumps(spec)], cwd=ROOT, capture_output=True,
                         text=True, env=env)
    if out.returncode:
        sys.exit(f"{kind} child failed ({spec}):\n{out.stderr[-3000:]}")
    return t0, json.loads(out.stdout.strip().splitlines()[-1])


def _drop(url: str) -> None:
    from trainproof.storage import open_store

    store = open_store(url)
    store.backend.delete_tree(store.root)


def versions() -> dict[str, str]:
    import torch

    import trainproof

    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                         text=True).stdout.strip()
    return {"python": platform.python_version(), "torch": torch.__version__, "trainproof": trainproof.__version__,
            "git": rev, "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM, {platform.platform()}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,256", help="state sizes in MiB")
    ap.add_argument("--modes", default="async,sync,none")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--every", type=int, default=20, help="checkpoint every N steps")
    ap.add_argument("--checkpoints", type=int, default=4, help="checkpoints per run (steps = every x this)")
    ap.add_argument("--store-root", default=None, help="folder or s3:// prefix (default: a temporary folder)")
    ap.add_argument("--s3", action="store_true",
                    help="train against a throw-away Ceph RADOS Gateway on loopback (scripts/rgw.sh; stopped at exit)")
    ap.add_argument("--resume", action="store_true", help="also measure resume: a fresh process resuming each async "
                    "run vs a fresh process doing one GET + torch.load")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--resume-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--load-child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--summarise", default=None, metavar="JSON", help="only re-print the table of an earlier run")
    ap.add_argument("--out-dir", default=str(ROOT / "bench" / "out"), help="where async_stall.json/.md go")
    args = ap.parse_args()
    if args.summarise:
        print(summarise(json.loads(Path(args.summarise).read_text())["runs"], args))
        return
    for kind, fn in (("child", child), ("resume_child", resume_child), ("load_child", load_child)):
        if getattr(args, kind):
            print(json.dumps(fn(json.loads(getattr(args, kind)))), flush=True)
            return
    tmp = tempfile.TemporaryDirectory(prefix="tp-async-bench-") if args.store_root is None else None
    root = args.store_root or tmp.name
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    if args.s3:  # a throw-away Ceph RADOS Gateway (scripts/rgw.sh), stopped when this process exits
        from tests.support import rgw
        from tests.support.s3server import dummy_aws_env

        os.environ.update(dummy_aws_env())
        rgw.prepare_session()
        server = rgw.session_server()
        env.update(dummy_aws_env(), AWS_ENDPOINT_URL=server.endpoint)
        os.environ.update(AWS_ENDPOINT_URL=server.endpoint)
        root = f"s3://{server.create_bucket()}/bench"
    results: list[dict[str, Any]] = []
    for mib in [float(s) for s in args.sizes.split(",")]:
        for rep in range(args.repeats):
            for mode in args.modes.split(","):  # interleaved, so load changes hit every mode alike
                spec = {"mode": mode, "mib": mib, "root": root, "every": args.every,
                        "steps": args.every * args.checkpoints}
                out = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT,
                                     capture_output=True, text=True, env=env)
                if out.returncode:
                    sys.exit(f"child failed ({spec}):\n{out.stderr[-3000:]}")
                res = json.loads(out.stdout.strip().splitlines()[-1])
                results.append(res)
                if args.resume and mode == "async" and res["step"]:
                    resumed = {"store": res["store"], "mib": mib, "step": res["step"], "every": args.every}
                    t_a, a = _spawn("load-child", resumed, env)
                    t_b, b = _spawn("resume-child", resumed, env)
                    res["resume_s"], res["base_load_s"] = b["ready_wall"] - t_b, a["loaded_wall"] - t_a
                    res["first_step_s"] = b["first_step_wall"] - t_b
                    print(f"  resume {res['resume_s']:.2f} s (first step done {res['first_step_s']:.2f} s) vs "
                          f"GET + torch.load {res['base_load_s']:.2f} s",
                          file=sys.stderr, flush=True)
                _drop(res.pop("store"))  # keep the disk (or the gateway's sparse file) flat
                print(f"{mib:g} MiB {mode} #{rep}: {res['steps_per_s']:.2f} step/s, blocked "
                      f"{[round(b, 3) for b in res['blocked_s']]}, copy {res['copy_s']:.3f} s, "
                      f"memory {res['memory_ratio']}", file=sys.stderr, flush=True)
    table = summarise(results, args)
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {"command": " ".join(["python", "bench/bench_async_stall.py", *sys.argv[1:]]),
            "store": "S3 (Ceph RADOS Gateway on loopback)" if args.s3 else args.store_root or "local folder (tmp)",
            **versions()}
    (out_dir / "async_stall.json").write_text(json.dumps({"meta": meta, "runs": results}, indent=2))
    (out_dir / "async_stall.md").write_text(table)
    print(json.dumps(meta, indent=2))
    print(table)


def summarise(results: list[dict[str, Any]], args: argparse.Namespace) -> str:
    med = statistics.median
    lines = ["| state | mode | ratio | value | goal | detail |", "|---|---|---|---:|---|---|"]
    for mib in sorted({r["mib"] for r in results}):
        runs = {m: [r for r in results if r["mib"] == mib and r["mode"] == m] for m in args.modes.split(",")}
        size = next((r["bytes"] for r in results if r["mib"] == mib and r["bytes"]), None)
        copy = med([r["copy_s"] for r in results if r["mib"] == mib])
        base = med([r["steps_per_s"] for r in runs.get("none", [])]) if runs.get("none") else None
        label = f"{size / 2**20:.0f} MiB" if size else f"{mib:g} MiB"
        for mode in ("async", "sync"):
            if not runs.get(mode):
                continue
            blocked = med([med(r["blocked_s"]) for r in runs[mode] if r["blocked_s"]])
            steady = [b for r in runs[mode] for b in r["blocked_s"][1:]]  # buffers already allocated
            save = med([med(r["save_s"]) for r in runs[mode] if r["save_s"]])
            waits = sum(r["waits"] for r in runs[mode])
            lines.append(f"| {label} | {mode} | stall | {blocked / copy:.2f} "
                         f"| {GOALS['stall']} | blocked {blocked:.3f} s "
                         f"per checkpoint vs copy to host {copy:.3f} s"
                         + (f" (after the first checkpoint: {med(steady):.3f} s, stall {med(steady) / copy:.2f})"
                            if steady and mode == "async" else "")
                         + f"; commit {save:.2f} s; {waits} waits |")
            if base:
                tput = med([r["steps_per_s"] for r in runs[mode]])
                # Paired by repetition (the runs of one repetition ran back to back): load drifts between them less.
                paired = med([a["steps_per_s"] / b["steps_per_s"] for a, b in zip(runs[mode], runs["none"])])
                lines.append(f"| {label} | {mode} | throughput | {paired:.2f} "
                             f"| {GOALS['throughput']} | median of paired "
                             f"ratios; medians {tput:.2f} vs {base:.2f} "
                             f"steps/s, a checkpoint every {args.every} steps |")
            pairs = [(med(r["save_s"]), med(r["base_commit_s"])) for r in runs[mode]
                     if r["save_s"] and r.get("base_commit_s")]
            if pairs:
                s3 = args.s3 or str(args.store_root or "").startswith("s3://")
                base_name = "boto3 upload_fileobj" if s3 else "copy + fsync"
                lines.append(f"| {label} | {mode} | commit | "
                             f"{med([a / b for a, b in pairs]):.2f} | {GOALS['commit']} | "
                             f"write + read-back verify + commit {med([a for a, _ in pairs]):.2f} s vs {base_name} of "
                             f"the same bytes {med([b for _, b in pairs]):.2f} s (median of paired ratios) |")
            resumes = [(r["resume_s"], r["base_load_s"], r.get("first_step_s", 0.0)) for r in runs[mode]
                       if r.get("resume_s")]
            if resumes:
                lines.append(f"| {label} | {mode} | resume | "
                             f"{med([a / b for a, b, _ in resumes]):.2f} | {GOALS['resume']} | "
                             f"process start → ready {med([a for a, _, _ in resumes]):.2f} s (first step done "
                             f"{med([c for _, _, c in resumes]):.2f} s) vs fresh process GET + torch.load "
                             f"{med([b for _, b, _ in resumes]):.2f} s |")
            mem = [r["memory_ratio"] for r in runs[mode] if r["memory_ratio"] is not None]
            if mem:
                lines.append(f"| {label} | {mode} | memory | {med(mem):.2f} | {GOALS['memory']} | peak RSS during the "
                             f"first checkpoint - RSS before, / state bytes (max {max(mem):.2f}) |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
