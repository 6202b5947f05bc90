"""``trainproof plan --measure``: time a few real steps, real commits and a real export against the store.

Why a scratch child run (``<store>/plan-measure/<id>``): the timings must come from the real store and task
(an S3 bucket across the world is not a local disk), but the run's own generations must never be touched,
so the measurement trains a fresh run of its own beside them. It uses the same commands a rental does
(``train`` in a child process, then ``export`` and the fresh-process reload check), so nothing is simulated.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from trainproof.proof.paths import child_env, job_argv

SCRATCH = "plan-measure"


def scratch_url(store: str) -> str:
    """A new child run under the store, unique per measurement."""
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{store.rstrip('/')}/{SCRATCH}/{stamp}-{secrets.token_hex(3)}"


def measure(store: str, task: str, *, steps: int = 5, config: Path | None = None,
            store_args: list[str] | None = None, timeout: float = 3600.0) -> dict[str, Any]:
    """Train ``steps`` steps committing each one, then export and reload-check; the measured seconds.

    ``checkpoint_s`` is the slowest commit seen (what the planner asks for), ``step_s`` the mean step
    without the commits, ``export_s`` the export plus its reload check in a fresh process.
    """
    url, args = scratch_url(store), list(store_args or [])
    argv = job_argv("train", "--store", url, "--task", task, "--max-steps", str(steps), "--checkpoint-every", "1",
                    "--checkpoint-every-seconds", "0", "--keep", "0", "--log-format", "json",
                    # Inline commits: each is timed whole, and the span less the commits is the steps' time
                    # (background commits would overlap the steps and the subtraction would mean nothing).
                    "--sync-checkpoint",
                    *(["--config", str(config)] if config else []), *args)
    t0 = time.perf_counter()
    proc = subprocess.run(argv, env=child_env(), capture_output=True, text=True, timeout=timeout)
    train_wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the measuring run failed (exit {proc.returncode}): {proc.stderr.strip()[-800:]}")
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    saves = [e["seconds"] for e in events if e.get("event") == "checkpoint"]
    return {"scratch": url, "steps": steps, "train_wall_s": round(train_wall, 3),
            "step_s": _step_seconds(events, saves, steps), "checkpoint_s": max(saves),
            "checkpoints": len(saves), "export_s": _export_seconds(url, task, args, timeout)}


def _step_seconds(events: list[dict[str, Any]], saves: list[float], steps: int) -> float:
    """Mean optimizer step: the time from the start event to the done event, less the commits."""
    times = {e["event"]: datetime.fromisoformat(e["time"]) for e in events if e.get("event") in ("start", "done")}
    span = (times["done"] - times["start"]).total_seconds()
    return max((span - sum(saves)) / steps, 1e-6)


def _export_seconds(url: str, task: str, store_args: list[str], timeout: float) -> float:
    """Export the scratch run's newest generation and reload-check it in a fresh process, timed."""
    from trainproof.proof.reload import export_and_check
    from trainproof.storage import StoreOptions, open_store

    t0 = time.perf_counter()
    # The record is not written: the scratch run is the measurement's own, nobody reads its bundle's check.
    checked = export_and_check(open_store(url, StoreOptions.from_env()), task=task, store_args=store_args,
                               timeout=timeout, keep_record=False)
    if not checked.passed:
        raise RuntimeError(f"the measuring export failed its reload check: {checked.bundle.url}")
    return time.perf_counter() - t0
