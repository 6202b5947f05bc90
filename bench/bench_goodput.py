"""What a spot rental keeps: goodput under a seeded Poisson process of interruptions, ground truth vs the run's report.

A real training run (``bench.bigmodel``, a state of ``--state-mib``, default 1 GiB) on Ceph RGW (the endpoint in
``AWS_ENDPOINT_URL``, else a gateway of its own) is kept going by the project's own restart path,
``infra/spot/supervise.sh``, for ``--wall`` seconds of the harness's clock. Interruptions arrive as a Poisson process
of mean ``--mtbi`` (seeded): a share ``--kill-share`` are SIGKILLs of the whole machine (supervisor and trainer, no
notice); the rest are SIGTERMs with a notice of ``--notice`` seconds (the supervisor forwards it, the trainer
commits and exits 75; still alive at the end of the notice: SIGKILL). The next machine starts ``--restart`` seconds
later. At the end of the wall time the run gets a SIGTERM and its notice like any other.

Ground truth, from the harness alone: wall = first start to the last process's end (harness clock); useful work =
each step the store holds committed at the end, at the step time the harness itself saw on the machine that trained
it last (the mean gap between the step lines it read, stamped with its own clock, over the steps clear of any
commit: no checkpoint in flight, beginning or landing between the two lines; the same load as the run; the median of
all gaps gives ``truth_median``, printed beside it); truth goodput = useful / wall. An interruption so late that the
next machine would start at the end of the wall time ends the cell there (no machine started only to be stopped).
Beside it: ``trainproof report``'s goodput (from the attempt records), and the planner's prediction (1 - overhead,
``trainproof plan`` with the measured C, the harness's M of interruptions that lose work, and the measured restart).

Each configuration is a ``--mtbi`` and an ``--every`` (``auto`` or a fixed ``--checkpoint-every-seconds``); all
configurations of one invocation see the same interruption times (same seed). ``--check-final`` trains an
uninterrupted run to each configuration's final step and compares the states bitwise (CPU).

    python bench/bench_goodput.py --mtbi 90 --mtbi 300 --every auto --every 20 --every 120 --wall 360

Prints a table and writes bench/out/goodput-<time>.json. Medians are not taken: each cell is one run of a random
process; the seed is printed so a cell can be run again.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.support.rgw import bench_endpoint  # noqa: E402
from trainproof.lifecycle.planner import PlanInputs, make_plan  # noqa: E402

BUCKET = "trainproof-bench"


@dataclass
class Cell:
    mtbi: float
    every: str
    seed: int
    events: list[tuple[float, str]] = field(default_factory=list)
    """(seconds after the start, sigterm|sigkill) of each interruption the harness delivered."""
    lost_work_interruptions: int = 0
    wall_s: float = 0.0
    steps: int = 0
    truth: float = 0.0
    """Useful / wall, each kept step at the mean of its machine's step gaps clear of commits."""
    truth_median: float = 0.0
    """The same at the median of all its machine's step gaps."""
    report: dict = field(default_factory=dict)
    predicted: float | None = None
    final_equal: bool | None = None
    url: str = ""


def env_for(args: argparse.Namespace, every: str, state_dir: str, grace: float) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}
    env.update({
        "PYTHONPATH": f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", "TRAINPROOF_LOG_FORMAT": "json",
        "TRAINPROOF_TASK": "bench.bigmodel:factory", "TRAINPROOF_KEEP": "2", "TRAINPROOF_STOP_GRACE": str(grace),
        "TRAINPROOF_TENSORBOARD": "off", "SUPERVISE_STATE_DIR": state_dir, "SUPERVISE_BACKOFF_SECONDS": "1",
        "TRAINPROOF_BIN": str(_bin(state_dir)),
    })
    if every == "auto":
        env["TRAINPROOF_CHECKPOINT_EVERY"] = "auto"
    else:
        env.update(TRAINPROOF_CHECKPOINT_EVERY="0", TRAINPROOF_CHECKPOINT_EVERY_SECONDS=every)
    return env


def _bin(folder: str) -> Path:
    path = Path(folder) / "trainproof"
    if not path.exists():
        path.write_text(f"#!/bin/sh\nexec {sys.executable} -m trainproof \"$@\"\n")
        path.chmod(0o755)
    return path


def config_json(args: argparse.Namespace) -> str:
    return json.dumps({"state_mib": args.state_mib, "samples": 256, "batch_size": args.batch})


def _config_file(args: argparse.Namespace, work: Path) -> Path:
    path = work / "bigmodel.json"
    path.write_text(config_json(args))
    return path


def schedule(mtbi: float, wall: float, kill_share: float, seed: int) -> list[tuple[float, str]]:
    rng = random.Random(seed)
    out, t = [], 0.0
    while True:
        t += rng.expovariate(1.0 / mtbi)
        if t >= wall:
            return out
        out.append((t, "sigkill" if rng.random() < kill_share else "sigterm"))


MIN_CLEAR = 5
"""Fewer clear gaps than this on a machine (its commits ran back to back): its steps are priced at the cell's."""


class Machine:
    """One rented machine: the supervisor (and the trainers it starts) in a process group of its own, its output
    read line by line by the harness, which stamps each step line with its own clock."""

    def __init__(self, args: argparse.Namespace, url: str, env: dict[str, str], work: Path, log) -> None:
        cmd = ["bash", str(ROOT / "infra/spot/supervise.sh"), "--store", url, "--config",
               str(_config_file(args, work)), "--max-steps", "100000000"]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, text=True,
                                     start_new_session=True)
        self.steps: list[tuple[float, int]] = []
        """(harness clock, step) of every step line, as it arrived."""
        self.events: list[tuple[float, dict]] = []
        """(harness clock, event) of every step and checkpoint line, as it arrived."""
        self._reader = threading.Thread(target=self._read, args=(log,), daemon=True)
        self._reader.start()

    def _read(self, log) -> None:
        for line in self.proc.stdout:
            now = time.monotonic()
            log.write(line)
            if line.startswith(('{"event": "step"', '{"event": "checkpoint')):
                event = json.loads(line)
                self.events.append((now, event))
                if event["event"] == "step":
                    self.steps.append((now, event["step"]))

    def step_s(self) -> float | None:
        """Median seconds between consecutive step lines (stalls and start-up excluded by the median)."""
        gaps = [b[0] - a[0] for a, b in zip(self.steps, self.steps[1:]) if b[1] == a[1] + 1]
        return statistics.median(gaps) if gaps else None

    def clear_step_s(self) -> float | None:
        """Mean seconds between consecutive step lines with no checkpoint in flight, beginning or landing between
        them (:func:`clear_gaps`): a step's undisturbed duration, its natural spread included."""
        gaps = clear_gaps(self.events)
        return statistics.fmean(gaps) if len(gaps) >= MIN_CLEAR else None

    def close(self) -> None:
        self._reader.join(timeout=10)


def clear_gaps(events: list[tuple[float, dict]]) -> list[float]:
    """Seconds between consecutive step lines during which no commit was in flight, began or landed (the first
    step's excluded: warm-up), from ``events`` (clock, step or checkpoint event) in order."""
    in_flight, touched, previous, gaps = 0, True, None, []
    for at, event in events:
        kind = event.get("event")
        if kind == "checkpoint_begin":
            in_flight, touched = in_flight + 1, True
        elif kind in ("checkpoint", "checkpoint_failed"):
            in_flight, touched = max(0, in_flight - 1), True
        elif kind == "step":
            if previous is not None and not touched and not in_flight and event["step"] == previous[1] + 1:
                gaps.append(at - previous[0])
            previous, touched = (at, event["step"]), bool(in_flight)
    return gaps


def interrupt(machine: Machine, how: str, notice: float) -> None:
    """Deliver ``how`` to the machine; it is gone when this returns."""
    proc = machine.proc
    if how == "sigterm":
        proc.send_signal(signal.SIGTERM)  # the supervisor forwards it; the trainer commits and exits 75
        try:
            proc.wait(timeout=notice)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the machine goes: whatever is left of it
    except ProcessLookupError:
        pass
    proc.wait()
    machine.close()


def run_cell(args: argparse.Namespace, cell: Cell, work: Path) -> Cell:
    cell.url = f"s3://{BUCKET}/goodput/{uuid.uuid4().hex[:8]}/run"
    state_dir = tempfile.mkdtemp(dir=work)
    env = env_for(args, cell.every, state_dir, grace=args.notice)
    plan = schedule(cell.mtbi, args.wall, args.kill_share, cell.seed)
    log = open(work / f"cell-{cell.mtbi:g}-{cell.every}.log", "w")
    t0 = time.monotonic()
    machines = [Machine(args, cell.url, env, work, log)]
    for at, how in plan + [(args.wall, "sigterm")]:
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        if machines[-1].proc.poll() is not None:  # it ended by itself (exit 2: a bug of the harness): say so
            raise SystemExit(f"the supervisor exited {machines[-1].proc.returncode} by itself; see {log.name}")
        interrupt(machines[-1], how, args.notice)
        if at >= args.wall:
            break
        cell.events.append((round(at, 1), how))
        if time.monotonic() - t0 + args.restart >= args.wall:
            break  # the next machine would start at the end of the measurement: the cell ends with this one
        time.sleep(args.restart)
        machines.append(Machine(args, cell.url, env, work, log))
    cell.wall_s = time.monotonic() - t0
    log.close()
    cell.steps = committed_step(cell.url)
    cell.truth = useful_s(machines, cell.steps, Machine.clear_step_s) / cell.wall_s
    cell.truth_median = useful_s(machines, cell.steps, Machine.step_s) / cell.wall_s
    cell.report = report_json(cell.url)
    return cell


def useful_s(machines: list[Machine], final: int, price=None) -> float:
    """The harness's ground truth of useful training time: each step the run kept (up to ``final``, the last commit),
    at the step time the harness saw on the machine that trained it last: ``price(machine)``, by default the mean gap
    between step lines clear of any commit (:meth:`Machine.clear_step_s`; :meth:`Machine.step_s`, the median of
    all, is the other figure)."""
    kept: dict[int, float] = {}
    pooled = [g for m in machines for g in clear_gaps(m.events)]
    fallback = statistics.fmean(pooled) if len(pooled) >= MIN_CLEAR else None
    for m in machines:
        per_step = (price or Machine.clear_step_s)(m)
        per_step = fallback if per_step is None and price is None else per_step
        for _, step in m.steps:
            if step <= final and per_step is not None:
                kept[step] = per_step  # a later machine that trained the step again replaces the earlier one
    return sum(kept.values())


def committed_step(url: str) -> int:
    from trainproof.storage import open_store

    infos = [g for g in open_store(url).scan() if g.status == "complete"]
    return max((g.step for g in infos), default=0)


def report_json(url: str) -> dict:
    out = subprocess.run([sys.executable, "-m", "trainproof", "report", "--store", url, "--json"], cwd=ROOT,
                         capture_output=True, text=True)
    return json.loads(out.stdout) if out.returncode == 0 else {"error": out.stderr.strip()[-300:]}


def predicted(cell: Cell, args: argparse.Namespace) -> float | None:
    """1 - the planner's overhead (trainproof.lifecycle.planner) for this cell: C = its measured blocked and
    interference seconds per commit, T = its interval (auto: the planner's optimum), M = the harness's mean time
    between interruptions that lost work, R = its median start-up + restore + the harness's restart gap, paid at
    every interruption: ``C/(T+C) + ((T+C)/2)/M + R x interruptions/wall``."""
    attempts = cell.report.get("attempts") or []
    commits = sum(a["commits"] for a in attempts)
    if not commits or len(attempts) < 1:
        return None
    c = max(sum(a["checkpoint_stall_s"] + a.get("checkpoint_interference_s", 0.0) for a in attempts) / commits, 1e-3)
    lost = sum(1 for a in attempts[:-1] if a["end"].startswith("killed") or a["redone_steps"] > 0)
    m = cell.wall_s / lost if lost else float("inf")
    r = statistics.median(a["startup_s"] + a["restore_s"] for a in attempts) + args.restart
    t = (make_plan(PlanInputs(rental_s=10 * 86400.0, mtbi_s=min(m, 1e9), checkpoint_s=c)).interval_s
         if cell.every == "auto" else float(cell.every))
    overhead = c / (t + c) + ((t + c) / 2) / m + r * len(cell.events) / cell.wall_s
    return round(max(0.0, 1.0 - overhead), 4)


def check_final(cell: Cell, args: argparse.Namespace, work: Path) -> bool:
    from tests.test_train_helpers import kept_differences, load_state

    folder = work / f"straight-{cell.mtbi:g}-{cell.every}"
    subprocess.run([sys.executable, "-m", "trainproof", "train", "--store", str(folder), "--task",
                    "bench.bigmodel:factory", "--config", str(_config_file(args, work)), "--max-steps",
                    str(cell.steps), "--checkpoint-every", "0", "--checkpoint-every-seconds", "0", "--log-format",
                    "json", "--tensorboard", "off"], cwd=ROOT, capture_output=True, check=True)
    # Retention kept the newest generations only: the histories are compared from the later first step on, the
    # rows before it through their sha256 chain (tests.test_train_helpers.kept_differences); the rest exactly.
    kept = {"history": "kept"}
    return not kept_differences(load_state(folder, cell.steps, **kept), load_state(cell.url, cell.steps, **kept))


def reanalyse(result: Path, logs: Path, records: Path) -> list[dict]:
    """Each cell of an earlier run (its JSON ``result``) with the current figures: the truth from its log
    (``logs/cell-<mtbi>-<every>.log``: what the harness read, in order; the trainer's own time stamps, ms, stand in for
    the harness's arrival stamps) and ``trainproof report`` from a copy of its attempt records
    (``records/<run id>/attempts/``). ``wall_trimmed_s``: the wall less a last machine that trained no step (one a
    harness without that fix started at the end of the wall time), at the supervisor's one-second resolution."""
    from datetime import datetime

    def stamp(text: str) -> float:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()

    out = []
    for cell in json.loads(result.read_text())["cells"]:
        supervise: list[tuple[float, str]] = []
        events: list[tuple[float, dict]] = []
        run_id = None
        # The supervisors' lines (stderr) reached the log at once, the trainers' (stdout) through the harness's
        # buffered writes: events are placed by their time stamp, on the machine started last before it.
        for line in (logs / f"cell-{cell['mtbi']:g}-{cell['every']}.log").read_text().splitlines():
            if line.startswith("[supervise "):
                supervise.append((stamp(line[11:31]), line[33:]))
                if line[33:].startswith("starting:"):
                    run_id = run_id or line.split("/goodput/")[1].split("/")[0]
            elif line.startswith(('{"event": "step"', '{"event": "checkpoint')):
                event = json.loads(line)
                events.append((stamp(event["time"]), event))
        starts = [t for t, text in supervise if text.startswith("starting:")]
        machines: list[list[tuple[float, dict]]] = [[] for _ in starts]
        for at, event in sorted(events, key=lambda e: e[0]):
            machines[max(0, sum(1 for t in starts if t <= at) - 1)].append((at, event))
        kept: dict[int, float] = {}
        pooled = [g for events in machines for g in clear_gaps(events)]
        for events in machines:
            gaps = clear_gaps(events)
            gaps = gaps if len(gaps) >= MIN_CLEAR else pooled
            for _, event in events:
                if event["event"] == "step" and event["step"] <= cell["steps"] and gaps:
                    kept[event["step"]] = statistics.fmean(gaps)
        wall = cell["wall_s"]
        trimmed = wall
        if machines and not any(e["event"] == "step" for _, e in machines[-1]):
            ends = [t for t, text in supervise if t < starts[-1] and not text.startswith("starting:")]
            trimmed = wall - (supervise[-1][0] - ends[-1]) if ends else wall
        report = report_json(str(records / run_id)) if run_id else {}
        useful = sum(kept.values())
        out.append({"mtbi": cell["mtbi"], "every": cell["every"], "steps": cell["steps"], "wall_s": round(wall, 1),
                    "wall_trimmed_s": round(trimmed, 1), "truth": round(useful / wall, 4),
                    "truth_trimmed": round(useful / trimmed, 4), "truth_median_before": cell["truth"],
                    "report": report.get("goodput"), "report_before": cell["report"].get("goodput"),
                    "report_steps_kept": report.get("steps_kept"), "interruptions": len(cell["events"]),
                    "kills": sum(1 for _, how in cell["events"] if how == "sigkill"),
                    "final_equal": cell["final_equal"], "predicted": cell["predicted"]})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mtbi", type=float, action="append", help="mean seconds between interruptions (repeatable)")
    ap.add_argument("--every", action="append", help="auto or fixed seconds between commits (repeatable)")
    ap.add_argument("--wall", type=float, default=360.0, help="seconds each configuration runs (harness clock)")
    ap.add_argument("--kill-share", type=float, default=0.5, help="share of interruptions that are SIGKILLs")
    ap.add_argument("--notice", type=float, default=20.0, help="seconds between a SIGTERM and the SIGKILL")
    ap.add_argument("--restart", type=float, default=5.0, help="seconds from an interruption to the next machine")
    ap.add_argument("--state-mib", type=float, default=1024.0)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--check-final", nargs="?", const="all", choices=("all", "auto"),
                    help="compare each final state (or only the auto cells': --check-final auto) with an "
                         "uninterrupted run to the same step")
    ap.add_argument("--reanalyse", nargs=3, type=Path, metavar=("RESULT", "LOGS", "RECORDS"),
                    help="recompute an earlier run's figures (see reanalyse()) instead of running one")
    args = ap.parse_args()
    if args.reanalyse:
        reanalyse(*args.reanalyse)
        return
    mtbis, everies = args.mtbi or [90.0], args.every or ["auto"]
    with ExitStack() as stack:
        stack.enter_context(bench_endpoint())
        _bucket()
        work = Path(tempfile.mkdtemp(prefix="goodput-"))
        load = os.getloadavg()[0]
        print(f"state {args.state_mib:g} MiB, load {load:.1f}, seed {args.seed}")
        cells = []
        for mtbi in mtbis:
            for every in everies:
                cell = run_cell(args, Cell(mtbi=mtbi, every=every, seed=args.seed), work)
                cell.predicted = predicted(cell, args)
                if args.check_final in ("all", every) and cell.steps:
                    cell.final_equal = check_final(cell, args, work)
                cells.append(cell)
                print(row(cell), flush=True)
        out = ROOT / "bench/out" / f"goodput-{time.strftime('%Y%m%dT%H%M%S')}.json"
        out.parent.mkdir(exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "load_before": load,
                                   "load_after": os.getloadavg()[0], "cells": [c.__dict__ for c in cells]}, indent=1))
        print(f"written {out.relative_to(ROOT)}; load after {os.getloadavg()[0]:.1f}")


def row(c: Cell) -> str:
    rep = c.report.get("goodput")
    kills = sum(1 for _, h in c.events if h == "sigkill")
    diff = f"{(rep - c.truth) * 100:+.1f} pt" if isinstance(rep, float) else c.report.get("error", "?")
    return (f"mtbi {c.mtbi:>5g}s every {c.every:>5}: {len(c.events)} interruptions ({kills} kills), wall "
            f"{c.wall_s:.0f}s, {c.steps} steps kept; goodput truth {c.truth:.3f} (median-priced "
            f"{c.truth_median:.3f}), report {rep} ({diff}), "
            f"planner {c.predicted}, final state equal: {c.final_equal}")


def _bucket() -> None:
    import boto3

    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    try:
        s3.create_bucket(Bucket=BUCKET)
    except s3.exceptions.BucketAlreadyOwnedByYou:
        pass
    except Exception as exc:  # noqa: BLE001 - already there under another owner's name on some servers
        if "BucketAlreadyExists" not in str(exc):
            raise


if __name__ == "__main__":
    main()
