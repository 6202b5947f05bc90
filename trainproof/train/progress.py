"""Progress a person can follow: a rich progress bar on a terminal, JSON lines everywhere else.

Kubernetes (and any log collector) gets one JSON object per line on stdout: every logged step and every
event (start, resume, checkpoint, stop, done). Warnings and errors go to stderr as plain lines.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import datetime, timezone
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from trainproof.storage.limits import safe


class Reporter:
    """Base reporter: keeps throughput; subclasses decide how a step or an event is shown."""

    def __init__(self, *, log_every: int = 1) -> None:
        self.log_every = max(1, log_every)
        self._t0 = time.perf_counter()
        self._steps = self._samples = self._targets = 0

    def __enter__(self) -> Reporter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def begin(self, *, step: int, target: int) -> None:
        """Training is about to run from ``step`` towards ``target``."""
        self._t0 = time.perf_counter()

    def step(self, record: dict[str, Any], *, target: int) -> None:
        """One optimizer step finished; ``record`` has step, epoch, loss, lr, samples, targets."""
        self._steps += 1
        self._samples += record["samples"]
        self._targets += record["targets"]

    def throughput(self) -> dict[str, float]:
        """Steps, samples and targets (rows/tokens) per second since :meth:`begin`."""
        dt = max(time.perf_counter() - self._t0, 1e-9)
        return {"steps_per_s": self._steps / dt, "samples_per_s": self._samples / dt,
                "targets_per_s": self._targets / dt}

    def event(self, name: str, **fields: Any) -> None:
        """Something a person should see: resume, checkpoint, stop, done."""

    def warn(self, message: str) -> None:
        """A warning line on stderr (never fatal)."""
        print(f"warning: {safe(' '.join(str(message).splitlines()), 4000)}", file=sys.stderr, flush=True)

    def close(self) -> None:
        """Release the terminal."""


class JsonReporter(Reporter):
    """One JSON object per line on stdout (flushed: log collectors and tests read it live)."""

    def step(self, record: dict[str, Any], *, target: int) -> None:
        super().step(record, target=target)
        if record["step"] % self.log_every == 0 or record["step"] >= target:
            self._emit({"event": "step", **record, "target": target, **self.throughput()})

    def event(self, name: str, **fields: Any) -> None:
        self._emit({"event": name, **fields})

    def _emit(self, obj: dict[str, Any]) -> None:
        obj["time"] = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
        sys.stdout.write(json.dumps(obj, default=str) + "\n")
        sys.stdout.flush()


class RichReporter(Reporter):
    """A live progress bar (step, loss, lr, throughput) with events printed above it."""

    def __init__(self, *, log_every: int = 1) -> None:
        super().__init__(log_every=log_every)
        self.console = Console(stderr=False)
        self._bar = Progress(
            TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}  lr {task.fields[lr]}  {task.fields[rate]}"),
            TimeElapsedColumn(), console=self.console, transient=False,
        )
        self._task_id: Any = None

    def begin(self, *, step: int, target: int) -> None:
        super().begin(step=step, target=target)
        self._bar.start()
        self._task_id = self._bar.add_task("train", total=target, completed=step, loss="-", lr="-", rate="")

    def step(self, record: dict[str, Any], *, target: int) -> None:
        super().step(record, target=target)
        rate = self.throughput()
        self._bar.update(
            self._task_id, completed=record["step"], loss=f"{record['loss']:.4g}", lr=f"{record['lr']:.3g}",
            rate=f"{rate['steps_per_s']:.1f} step/s {rate['targets_per_s']:.0f} tgt/s",
        )

    def event(self, name: str, **fields: Any) -> None:
        if name in ("checkpoint_begin", "checkpoint_snapshot"):
            return  # JSON logs keep them (the save's start, the end of its blocked time); on a terminal, noise
        if name == "start":
            self.console.print(start_line({k: escape(safe(v, 500)) if isinstance(v, str) else v
                                           for k, v in fields.items()}), highlight=False)
            return
        details = "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={safe(v, 500)}"
                            for k, v in fields.items())
        self.console.print(f"[cyan]{name}[/cyan] {escape(details)}", highlight=False)

    def close(self) -> None:
        if self._task_id is not None:
            self._bar.stop()
            self._task_id = None


def start_line(f: dict[str, Any]) -> str:
    """The start event for a person: task, steps and where the target comes from, short contract, key settings."""
    plan = f.get("epoch_plan") or {}
    epoch = (f"  epoch {plan['steps']} steps of {plan['global_batch']} samples"
             if plan.get("steps") and plan.get("global_batch") else "")
    deadline = f"  deadline {f['deadline']}" if f.get("deadline") else ""
    world = f"  world {f['world']}" if f.get("world", 1) != 1 else ""
    return (f"[cyan]start[/cyan] {f.get('task')}: step {f.get('step')} -> {f.get('target')} "
            f"({f.get('target_from', '--max-steps')})  seed {f.get('seed')}  on {f.get('device')}{world}"
            f"{epoch}  contract {str(f.get('contract', ''))[:12]}  store {f.get('store')}{deadline}")


def make_reporter(fmt: str = "auto", *, log_every: int = 1) -> Reporter:
    """``rich`` on a terminal, ``json`` otherwise (``auto``), or the format asked for."""
    if fmt == "auto":
        fmt = "rich" if sys.stdout.isatty() else "json"
    return RichReporter(log_every=log_every) if fmt == "rich" else JsonReporter(log_every=log_every)
