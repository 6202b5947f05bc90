"""``trainproof export`` of a sharded run: time and peak memory against the same files written the plain way.

``.venv/bin/python bench/bench_export.py [--mib 3072] [--reps 3] [--dir DIR]`` trains ``bench.bigmodel:factory``
with ``--mib`` MiB of state (weights a third of it: ``--mib 3072`` is 1 GiB of float32 weights) for one step with
``train --fsdp --nproc-per-node 2`` into a local folder, then per repetition, each in a fresh process and in
alternating order:

- ours: ``trainproof.export.bundle.export`` of that generation into a fresh folder: the model gathered from the verified
  shards (``full_state``, model only), the weight files written tensor by tensor into spool files, the bf16 weights
  evaluated and saved from a map of the bf16 file, every file committed (written, read back, sha256, content check,
  COMPLETE.json). Then, in another fresh process (*reload*), the reload check that ``trainproof export`` runs next
  in a process of its own (``trainproof.proof.reload.reload_check``: the bundle read back and verified, weight files
  spooled and mapped, the metrics re-evaluated).
- plain: the same weights gathered the same way, then what a script does with the libraries: a bf16 copy,
  ``safetensors.torch.save`` of both, ``torch.save`` of the bf16 copy, both evaluated, the ``torch.export`` program
  traced and saved (this task has no ``model.py``, so the bundle has one), the three weight files written with
  ``open().write`` and fsync. No verification, no commit, no small files (config, metrics, plot, README).

Memory is the process's anonymous resident memory (page cache of mapped files excluded: the kernel can drop it)
sampled every 2 ms, above the level before the call, as a multiple of the weights' bytes. Medians of ``--reps``.
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
TASK = "bench.bigmodel:factory"


def child(mode: str, run: str, out: str) -> dict:
    """One measured export in this (fresh) process."""
    import io

    import torch
    from safetensors.torch import save

    from bench.bench_sharded import PeakRSS
    from trainproof.export.bundle import _bf16, evaluate_weights, export
    from trainproof.export.standalone import export_program
    from trainproof.format.contract import read_run_plan
    from trainproof.format.state import STATE_FILE, decode
    from trainproof.storage import open_store
    from trainproof.tasks import load_task
    from trainproof.train.fsdp import full_state

    store = open_store(run)
    step = max(g.step for g in store.scan() if g.status == "complete")
    with PeakRSS(anon=True) as mem:
        start = time.perf_counter()
        if mode == "ours":
            export(store, step=step, dest=open_store(out), task=TASK)
        else:
            plan = read_run_plan(store)
            state = decode(store.load(step, skip=lambda n: n != STATE_FILE).files[STATE_FILE])
            state = full_state(store, step, state, contract=plan["contract"], sections=("model",))
            weights = {k: v.contiguous() for k, v in state["model"].items()}
            bf16 = {k: _bf16(v) for k, v in weights.items()}
            task = load_task(TASK, plan["task_config"])
            evaluate_weights(task, weights)
            evaluate_weights(task, bf16)
            program, _, _ = export_program(task, weights)
            buf = io.BytesIO()
            torch.save(bf16, buf)
            files = {"model.safetensors": save(weights), "model_bf16.safetensors": save(bf16),
                     "model_bf16.pt": buf.getvalue()}
            os.makedirs(out, exist_ok=True)
            if program is not None:
                torch.export.save(program, os.path.join(out, "model.pt2"))
            for name, data in files.items():
                with open(os.path.join(out, name), "wb") as fh:
                    fh.write(data)
                    fh.flush()
                    os.fsync(fh.fileno())
        seconds = time.perf_counter() - start
    folder = Path(out, f"step-{step:08d}") if mode == "ours" else Path(out)
    weights_bytes = (folder / "model.safetensors").stat().st_size
    return {"mode": mode, "seconds": seconds, "peak_anon": mem.extra, "weights_bytes": weights_bytes}


def reload_child(out: str, step: int) -> dict:
    """The reload check ``trainproof export`` runs after committing, in a fresh process as there."""
    from bench.bench_sharded import PeakRSS
    from trainproof.proof.reload import reload_check
    from trainproof.storage import open_store

    with PeakRSS(anon=True) as mem:
        start = time.perf_counter()
        record = reload_check(open_store(out), step, task=TASK)
        seconds = time.perf_counter() - start
    assert record["passed"], record
    return {"mode": "reload", "seconds": seconds, "peak_anon": mem.extra}


def train_sharded_run(run: Path, mib: float, env: dict) -> bool:
    """A 2-rank ``train --fsdp`` run of ``bench.bigmodel:factory`` with ``mib`` MiB of model + Adam state, one
    step, into folder ``run`` (left as it is when it already holds one). False (its stderr printed) if it failed."""
    if run.exists():
        return True
    config = run.parent / "bigmodel.json"
    config.write_text(json.dumps({"state_mib": mib}))
    trained = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", str(run), "--task", TASK,
                              "--config", str(config), "--fsdp", "--nproc-per-node", "2", "--max-steps", "1"],
                             cwd=ROOT, env=env, capture_output=True, text=True)
    if trained.returncode != 0:
        print(trained.stderr[-3000:], file=sys.stderr)
    return trained.returncode == 0


def child_row(script: str, args: list[str], env: dict) -> dict | None:
    """One measurement: ``script --child ARGS`` in a fresh process, its last stdout line as JSON (None on failure,
    its stderr printed)."""
    done = subprocess.run([sys.executable, script, "--child", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if done.returncode != 0:
        print(done.stderr[-3000:], file=sys.stderr)
        return None
    return json.loads(done.stdout.strip().splitlines()[-1])


def print_medians(rows: dict[str, list[dict]], unit: int, what: str) -> None:
    """Median time and peak anonymous memory of each mode, the memory also as a multiple of ``unit`` bytes."""
    for mode, got in rows.items():
        secs = statistics.median(r["seconds"] for r in got)
        peak = statistics.median(r["peak_anon"] for r in got)
        print(f"{mode:8s}: {secs:7.2f} s   peak anonymous memory {peak / 2**20:7.0f} MiB ({peak / unit:.2f}x {what})")


def print_ratio(label: str, mine: list[dict], baseline: list[dict]) -> None:
    """The median of the per-repetition time ratios ``mine / baseline`` (measured side by side), and each."""
    ratio = [a["seconds"] / b["seconds"] for a, b in zip(mine, baseline)]
    print(f"{label}: {statistics.median(ratio):.2f} (per repetition {', '.join(f'{r:.2f}' for r in ratio)})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=3072, help="state size of the run (weights: a third of it)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default=None, help="work folder (default: a temporary one, deleted after)")
    p.add_argument("--child", nargs=3, metavar=("MODE", "RUN", "OUT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        mode, run_url, out = args.child
        print(json.dumps(reload_child(out, int(run_url)) if mode == "reload" else child(mode, run_url, out)))
        return 0
    work = Path(args.dir or tempfile.mkdtemp(prefix="bench-export-"))
    work.mkdir(parents=True, exist_ok=True)
    run = work / "run"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    try:
        if not train_sharded_run(run, args.mib, env):
            return 1
        rows: dict[str, list[dict]] = {"ours": [], "plain": [], "reload": []}
        for rep in range(args.reps):
            for mode in (("ours", "plain") if rep % 2 == 0 else ("plain", "ours")):
                out = work / f"{mode}-{rep}"
                row = child_row(__file__, [mode, str(run), str(out)], env)
                if row is None:
                    return 1
                rows[mode].append(row)
                print(f"rep {rep} {mode}: {row}", flush=True)
                if mode == "ours":
                    step = max(int(p.name.split("-")[1]) for p in out.glob("step-*") if p.is_dir())
                    row = child_row(__file__, ["reload", str(step), str(out)], env)
                    if row is None:
                        return 1
                    rows["reload"].append(row)
                    print(f"rep {rep} reload: {row}", flush=True)
                shutil.rmtree(out, ignore_errors=True)
        weights = rows["ours"][0]["weights_bytes"]
        print(f"weights: {weights / 2**20:.0f} MiB (float32), {args.reps} repetitions, medians")
        print_medians(rows, weights, "the weights")
        print_ratio("export time ours/plain", rows["ours"], rows["plain"])
    finally:
        if not args.dir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
