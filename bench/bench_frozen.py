"""Bytes and time per commit of a run with a large frozen base (a LoRA fine-tune's shape), against the same run
storing its whole model in every generation.

    .venv/bin/python bench/bench_frozen.py --before /tmp/before [--frozen-mib 1024] [--state-mib 48] [--reps 3]

Each repetition trains ``bench.bigmodel:factory`` with a frozen base of ``--frozen-mib`` MiB (float32 weights that
require no gradient) in front of trained layers of ``--state-mib`` MiB (weights and Adam moments), ``--steps`` steps
with a commit every ``--every``, into a fresh local folder, in this checkout ("after": the base stored once under
``shared/``, each generation referencing it) and in ``--before`` (a checkout from before frozen entries were split
out: every generation holds the base; this script's ``bench/bigmodel.py`` is copied into it). Printed per side, the
medians over the repetitions of: bytes per generation (the checkpoint events' ``bytes``: what the generation holds
itself), the store's commit seconds (written -> read back -> COMPLETE.json), the seconds from a checkpoint's start
to its landing (``landed_s``: the snapshot, serialising, the store's commit) and the seconds training was blocked, the
first commit apart (``first_*``: the one that stores the base); and the ratios to the trainable state's bytes. The
machine's load is printed beside them.
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
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one(checkout: Path, args: argparse.Namespace, work: Path) -> dict:
    store = work / f"run-{os.urandom(3).hex()}"
    config = work / "config.json"
    config.write_text(json.dumps({"state_mib": args.state_mib, "frozen_mib": args.frozen_mib, "width": 1024}))
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", str(store), "--task",
                           "bench.bigmodel:factory", "--config", str(config), "--max-steps", str(args.steps),
                           "--checkpoint-every", str(args.every), "--keep", "2", "--log-format", "json"],
                          cwd=checkout, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(done.stderr[-3000:])
    events = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    commits = [e for e in events if e.get("event") == "checkpoint"]
    begun = {e["step"]: e["time"] for e in events if e.get("event") == "checkpoint_begin"}
    landed = [(datetime.fromisoformat(e["time"]) - datetime.fromisoformat(begun[e["step"]])).total_seconds()
              for e in commits]
    shared = sum(p.stat().st_size for p in (store / "shared").iterdir()) if (store / "shared").is_dir() else 0
    shutil.rmtree(store, ignore_errors=True)
    later = commits[1:]
    return {"bytes": statistics.median(e["bytes"] for e in later),
            "seconds": statistics.median(e["seconds"] for e in later),
            "blocked_s": statistics.median(e["blocked_s"] for e in later),
            "landed_s": statistics.median(landed[1:]), "first_landed_s": landed[0],
            "first_seconds": commits[0]["seconds"], "shared_bytes": shared, "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="a checkout from before the frozen split")
    p.add_argument("--frozen-mib", type=float, default=1024)
    p.add_argument("--state-mib", type=float, default=48, help="trained layers: weights and Adam moments")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    shutil.copy(ROOT / "bench" / "bigmodel.py", args.before / "bench" / "bigmodel.py")
    work = Path(tempfile.mkdtemp(prefix="bench-frozen-"))
    runs: dict[str, list[dict]] = {"after": [], "before": []}
    try:
        for rep in range(args.reps):
            for side in (["after", "before"] if rep % 2 == 0 else ["before", "after"]):
                result = one(ROOT if side == "after" else args.before, args, work)
                runs[side].append(result)
                print(json.dumps({"side": side, **result}), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    trainable = args.state_mib * 2**20
    out = {}
    for side, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        out[side] = {**{k: round(v, 3) for k, v in med.items()}, "bytes_per_trainable": round(med["bytes"] / trainable,
                                                                                               3)}
    out["ratio_after_before"] = {k: round(out["after"][k] / out["before"][k], 3)
                                 for k in ("bytes", "seconds", "blocked_s", "landed_s", "first_landed_s")}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
