"""Checkpointing overhead of ``trainproof train`` on tinylm: the same loop with and without checkpoints.

Both sides run the real trainer (``trainproof.train.loop.train``) in this process, alternating, each into a fresh
store: side A commits only the final generation (``--checkpoint-every 0``), side B also commits every N
steps. Reported (medians over ``--repeats`` runs):

- throughput of both sides (optimizer steps/s, tokens/s) and the relative slowdown;
- overhead per checkpoint: (time B - time A) / number of periodic checkpoints in B;
- blocking time of one save (capture + serialise + write + read back + verify + commit), as measured by
  the trainer itself, and the size of one state.

Writes ``bench/out/train_overhead.json`` and ``bench/out/train_overhead.md``. Not run by CI.

    python bench/bench_train_overhead.py                          # CPU-sized defaults, local folder store
    python bench/bench_train_overhead.py --store-root s3://bucket/bench --steps 200 --every 20
    python bench/bench_train_overhead.py --model '{"d_model": 256, "n_layers": 6}' --device cuda
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rich.console import Console
from rich.table import Table

from trainproof.train.config import TrainConfig
from trainproof.train.loop import train
from trainproof.train.progress import Reporter

DEFAULT_MODEL = {"d_model": 128, "n_heads": 4, "n_layers": 4, "d_ff": 512, "max_len": 64, "min_len": 16,
                 "n_sequences": 512, "batch_size": 16, "micro_batch_size": 8, "vocab_size": 256}


def one_run(root: str, *, steps: int, every: int, model: dict, device: str) -> dict:
    """Train ``steps`` steps into a fresh store; return wall time and the trainer's own save records."""
    url = f"{root.rstrip('/')}/run-{uuid.uuid4().hex[:10]}"
    cfg = TrainConfig(store=url, task="tinylm", task_config=model, max_steps=steps, checkpoint_every=every,
                      checkpoint_every_seconds=0, keep=2, device=device, log_format="json")
    reporter = Reporter()  # silent: no terminal or log output inside the timed region
    t0 = time.perf_counter()
    outcome = train(cfg, reporter=reporter)
    wall = time.perf_counter() - t0
    assert outcome.exit_code == 0, outcome
    from trainproof.storage import open_store

    summary = json.loads(open_store(url).read_file("summary.json"))
    return {"wall": wall, "saves": summary["checkpoints"], "throughput": summary["throughput"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per run")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps on side B")
    ap.add_argument("--repeats", type=int, default=5, help="runs per side (medians are reported)")
    ap.add_argument("--store-root", default=None, help="where the runs go (default: a temporary folder)")
    ap.add_argument("--model", default="{}", help="JSON overrides of the tinylm settings")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent / "out"))
    args = ap.parse_args()
    model = {**DEFAULT_MODEL, **json.loads(args.model)}
    root = args.store_root or tempfile.mkdtemp(prefix="tp-bench-")
    run = lambda every: one_run(root, steps=args.steps, every=every, model=model, device=args.device)  # noqa: E731

    run(0)  # warm-up: imports, allocator, page cache
    plain, ckpt = [], []
    for _ in range(args.repeats):  # alternate so drift (thermal, neighbours) hits both sides alike
        plain.append(run(0))
        ckpt.append(run(args.every))
    report(args, model, root, plain, ckpt)


def report(args: argparse.Namespace, model: dict, root: str, plain: list[dict], ckpt: list[dict]) -> None:
    """Print the side-by-side table and write JSON + Markdown results."""
    med = statistics.median
    periodic = [s for r in ckpt for s in r["saves"] if s["step"] != args.steps]
    n_periodic = len(periodic) // len(ckpt)
    wall_a, wall_b = med(r["wall"] for r in plain), med(r["wall"] for r in ckpt)
    result = {
        "steps": args.steps, "every": args.every, "repeats": args.repeats, "model": model, "store_root": root,
        "plain": {"wall_s": wall_a, "steps_per_s": med(r["throughput"]["steps_per_s"] for r in plain),
                  "tokens_per_s": med(r["throughput"]["targets_per_s"] for r in plain)},
        "checkpointing": {"wall_s": wall_b, "steps_per_s": med(r["throughput"]["steps_per_s"] for r in ckpt),
                          "tokens_per_s": med(r["throughput"]["targets_per_s"] for r in ckpt),
                          "periodic_checkpoints": n_periodic},
        "overhead_per_checkpoint_s": (wall_b - wall_a) / max(n_periodic, 1),
        "save_blocking_s_median": med(s["seconds"] for s in periodic) if periodic else None,
        "state_bytes": periodic[0]["bytes"] if periodic else None,
    }
    result["slowdown_pct"] = 100.0 * (wall_b - wall_a) / wall_a
    table = Table(title=f"tinylm: {args.steps} steps, checkpoint every {args.every} (medians of {args.repeats})")
    for col in ("side", "wall s", "steps/s", "tokens/s", "checkpoints"):
        table.add_column(col, justify="right")
    table.add_row("no checkpoints", f"{wall_a:.2f}", f"{result['plain']['steps_per_s']:.1f}",
                  f"{result['plain']['tokens_per_s']:.0f}", "final only")
    table.add_row(f"every {args.every}", f"{wall_b:.2f}", f"{result['checkpointing']['steps_per_s']:.1f}",
                  f"{result['checkpointing']['tokens_per_s']:.0f}", f"{n_periodic} + final")
    console = Console()
    console.print(table)
    lines = [
        f"slowdown: {result['slowdown_pct']:.1f} %",
        f"overhead per checkpoint: {result['overhead_per_checkpoint_s'] * 1000:.1f} ms",
        f"blocking time of one save (median): {(result['save_blocking_s_median'] or 0) * 1000:.1f} ms"
        f" for a {result['state_bytes'] or 0:,}-byte state",
    ]
    for line in lines:
        console.print(line)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_overhead.json").write_text(json.dumps(result, indent=2) + "\n")
    md = ["| side | wall s | steps/s | tokens/s |", "|---|---|---|---|",
          f"| no checkpoints | {wall_a:.2f} | {result['plain']['steps_per_s']:.1f} | "
          f"{result['plain']['tokens_per_s']:.0f} |",
          f"| every {args.every} | {wall_b:.2f} | {result['checkpointing']['steps_per_s']:.1f} | "
          f"{result['checkpointing']['tokens_per_s']:.0f} |", "", *[f"- {line}" for line in lines]]
    (out / "train_overhead.md").write_text("\n".join(md) + "\n")
    console.print(f"wrote {out / 'train_overhead.json'} and {out / 'train_overhead.md'}")


if __name__ == "__main__":
    main()
