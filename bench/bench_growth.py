"""Does a checkpoint grow with the run's length? ``growth`` = bytes of the newest checkpoint after N steps of the
built-in ``regression`` task ÷ after 10 steps, with the same checkpoint interval. Goal ≤ 1.01.

Each run is a real ``trainproof train`` process on a local folder (``--checkpoint-every K --keep 2``); the bytes
are those of the newest generation's ``training_state.pt`` as listed in its ``COMPLETE.json``, split into the
model + optimizer tensors and everything else (bookkeeping: meta, progress, history since the previous generation,
data position, generator states). Prints a Markdown table and writes ``bench/out/growth.json``. Not run by CI.

    .venv/bin/python bench/bench_growth.py                      # 10 and 100 000 steps, a checkpoint every 10
    .venv/bin/python bench/bench_growth.py --steps 10,10000 --every 10
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

GOAL = "≤ 1.01"


def measure(steps: int, every: int, folder: Path) -> dict:
    """Train ``steps`` steps into a fresh folder; sizes of the newest checkpoint."""
    import torch

    from trainproof.format.state import STATE_FILE, decode
    from trainproof.storage import open_store

    store_url = str(folder / f"run-{steps}")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", store_url, "--task", "regression",
                          "--max-steps", str(steps), "--checkpoint-every", str(every), "--keep", "2",
                          "--log-format", "json"], cwd=ROOT, capture_output=True, text=True)
    seconds = time.perf_counter() - t0
    if out.returncode:
        sys.exit(f"training {steps} steps failed:\n{out.stderr[-3000:]}")
    loaded = open_store(store_url).load_latest()
    data = loaded.files[STATE_FILE]
    state = decode(data)
    tensors = [t for part in (state["model"], state["optimizer"]["state"]) for t in _tensors(part)]
    weights = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    return {"steps": steps, "every": every, "step": loaded.info.step, "bytes": len(data), "weights_bytes": weights,
            "bookkeeping_bytes": len(data) - weights, "seconds": seconds}


def _tensors(obj):
    if isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)
    else:
        yield obj


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", default="10,100000", help="run lengths, the first is the reference")
    ap.add_argument("--every", type=int, default=10, help="checkpoint interval in steps (the same for every run)")
    args = ap.parse_args()
    lengths = [int(s) for s in args.steps.split(",")]
    with tempfile.TemporaryDirectory(prefix="tp-growth-") as tmp:
        results = []
        for n in lengths:
            res = measure(n, args.every, Path(tmp))
            results.append(res)
            print(f"{n} steps: {res['bytes']:,} bytes ({res['bookkeeping_bytes']:,} beyond the weights), "
                  f"{res['seconds']:.0f} s", file=sys.stderr, flush=True)
    ref = results[0]
    lines = ["| steps | checkpoint bytes | beyond model + optimizer | ratio | goal |", "|---:|---:|---:|---|---|"]
    for r in results:
        lines.append(f"| {r['steps']:,} | {r['bytes']:,} | {r['bookkeeping_bytes']:,} | growth "
                     f"{r['bytes'] / ref['bytes']:.4f} | {GOAL} |")
    table = "\n".join(lines) + "\n"
    out_dir = ROOT / "bench" / "out"
    out_dir.mkdir(parents=True, exist_ok=True)
    command = " ".join(["python", "bench/bench_growth.py", *sys.argv[1:]])
    (out_dir / "growth.json").write_text(json.dumps({"command": command,
                                                     "runs": results}, indent=2))
    print(table)


if __name__ == "__main__":
    main()
