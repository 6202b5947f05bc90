"""``--checkpoint-every auto`` against a sweep of fixed intervals, over many seeds and long rentals: a simulation of
the run's commit cycle under a seeded Poisson process of interruptions, driven by the real policy
(:class:`trainproof.lifecycle.autointerval.AutoInterval`, fed step by step and commit by commit as the trainer feeds
it, on the simulation's clock) and by the costs ``bench/bench_goodput.py`` measured on the real run.

``bench/bench_goodput.py`` measures the real thing, but a cell of one seed is decided by where its few kills fall in
the commit cycle, and hours of cells at each rate would be needed to rank intervals a point apart. This script runs
the same model thousands of times: what it leaves out is listed below, and ``--replay`` checks it against the
benchmark's own cells (the same interruption times, the truth the harness measured).

The model (all durations in seconds; defaults from the 1 GiB cells of ``bench/RESULTS.md``):

- a machine starts ``--restart`` after the previous one ended, spends ``--startup`` starting and ``--restore``
  loading the newest generation (none before the first commit), then trains steps of ``--step`` each;
- a checkpoint is due when ``every`` seconds have passed since the previous one began and the step is past the newest
  committed or in flight (:func:`trainproof.train.saver.save_due`); it waits for the commit in flight, blocks training
  ``--blocked`` (the first of each process: ``--blocked-first``, a full copy), then lands ``D`` later (uniform in
  ``--land``), in the background; the steps that end while it is in flight are slowed so that together they lose
  ``--interference``; its step is committed at the first step boundary after it lands;
- interruptions come at the times of a seeded Poisson process of mean ``--mtbi`` on the wall clock (the harness's
  :func:`bench.bench_goodput.schedule`), a share ``--kill-share`` of them SIGKILLs (the steps past the newest landed
  commit are redone), the rest SIGTERMs with ``--notice`` seconds: the step in flight ends, the commit in flight lands,
  the final step is committed (``--final`` seconds) when 1.25 x the longest commit of the process + 1 s fits in what
  is left of the notice (:func:`trainproof.train.saver.final_commit_skip`), else its steps are redone; the process
  exits ``--exit`` later; still running at the end of the notice it is killed. The end of the wall time is a SIGTERM
  like the others;
- ``auto`` is a fresh :class:`AutoInterval` per process, built from the previous attempts as
  :meth:`AutoInterval.from_report` builds it from their records (exposure from start to the last record: its end,
  or where its record was last refreshed when it was killed; stops that lost work and stops that did not; the
  newest attempt's C and how long its commits took to land).

Goodput = the steps committed at the end x ``--step`` / the wall time, as the harness's truth prices kept
steps. Left out: step time noise, interference that varies with the interval, disk and server state, and a commit that
fails.

    python bench/sim_interval.py                       # 3 rates x 200 seeds x 8 h: auto against the sweep
    python bench/sim_interval.py --mtbi 180 --seeds 50 --wall 3600
    python bench/sim_interval.py --replay bench/goodput-1gib-cells.json   # the model against measured cells

Prints a table per rate (mean goodput over the seeds, its standard error, auto minus the best fixed interval with a
paired standard error: every policy of a seed sees the same interruptions and commit times) and writes
``--out`` (default bench/out/sim_interval.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.bench_goodput import schedule  # noqa: E402 - the harness's schedules: same seed, same times
from trainproof.lifecycle.autointerval import CLEAR_WINDOW, WINDOW, AutoInterval  # noqa: E402
from trainproof.train.attempts import REFRESH_S  # noqa: E402
from trainproof.train.saver import final_commit_skip, save_due  # noqa: E402

SWEEP = (10, 15, 20, 30, 45, 60, 90, 120, 180, 300, 600)
HELP = {"step": "seconds of a step clear of any commit", "startup": "process start to the run agreed",
        "restore": "seconds to load the newest generation", "restart": "an interrupted machine's end to the next start",
        "blocked": "seconds a background commit blocks training", "blocked_first": "the first of each process (a "
        "full copy)", "interference": "seconds a commit slows the steps beside it, together",
        "final": "the final commit at a SIGTERM (it runs alone)", "exit": "a stopped process's end after its last "
        "commit", "notice": "seconds between a SIGTERM and the SIGKILL"}


@dataclass(frozen=True)
class Costs:
    step: float = 0.58
    startup: float = 3.5
    restore: float = 8.7
    restart: float = 5.0
    blocked: float = 0.3
    blocked_first: float = 2.4
    land: tuple[float, float] = (8.0, 18.0)
    interference: float = 3.4
    final: float = 8.0
    exit: float = 2.0
    notice: float = 30.0


@dataclass
class Attempt:
    """What an attempt record gives the next process (trainproof.lifecycle.goodput.Attempt, reduced)."""

    started: float
    stop: float
    lost: bool
    stopped: bool
    commits: int = 0
    cost_s: float = 0.0
    """Blocked + interference seconds of its commits."""
    landed: list[float] = field(default_factory=list)
    """Seconds each commit took from its start to committed."""


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Run:
    """One policy over one schedule of interruptions."""

    costs: Costs
    every: float | None
    """Fixed interval; None: auto."""
    events: list[tuple[float, str]]
    wall: float
    rng: random.Random
    committed: int = 0
    attempts: list[Attempt] = field(default_factory=list)
    intervals: list[float] = field(default_factory=list)
    end: float = 0.0

    def policy(self, clock: Clock) -> AutoInterval | None:
        if self.every is not None:
            return None
        done = self.attempts
        with_commits = [a for a in done if a.commits]
        past_c = with_commits[-1].cost_s / with_commits[-1].commits if with_commits else None
        landed = [a.landed for a in done if a.landed]
        return AutoInterval(past_commit_s=statistics.median(landed[-1][-WINDOW:]) if landed else None,
                            past_exposure_s=sum(max(0.0, a.stop - a.started) for a in done),
                            interruptions=sum(a.lost for a in done),
                            cheap_stops=sum(a.stopped and not a.lost for a in done),
                            past_checkpoint_s=past_c, clock=clock)

    def simulate(self) -> float:
        c, t = self.costs, 0.0
        pending = [e for e in self.events if e[0] < self.wall] + [(self.wall, "end")]
        while pending:
            t, how = self.attempt(t, pending)
            if how == "end" or not pending:
                break
            t += c.restart
            # the harness starts no machine that the end of the wall time would stop at once
            while pending and pending[0][0] < t:
                if pending[0][1] == "end":
                    pending.clear()
                    break
                pending.pop(0)
            if not pending:
                break
        self.end = t
        return self.committed * c.step / t

    def attempt(self, t0: float, pending: list[tuple[float, str]]) -> tuple[float, str]:  # noqa: C901 - one process
        c = self.costs
        clock = Clock(t0)
        auto = self.policy(clock)
        record = Attempt(started=t0, stop=t0, lost=False, stopped=False)
        self.attempts.append(record)
        ready = t0 + c.startup + (c.restore if self.committed else 0.0)
        if pending[0][0] <= ready:  # interrupted while starting: nothing trained, nothing lost
            at, how = pending.pop(0)
            record.stop, record.stopped = at, how != "sigkill"
            record.lost = how == "sigkill"
            return (at + c.exit if how != "sigkill" else at), how
        t = clock.now = ready
        step = self.committed
        mark = t
        inflight: tuple[int, float, float, float] | None = None  # step, lands at, blocked, seconds
        measured: list[float] = []
        first = True
        touched = False
        rho = 0.0
        every = self.every if auto is None else auto.interval_s
        if auto is not None:
            self.intervals.append(every)

        def collect(now: float) -> None:
            nonlocal inflight, touched, every
            s, _, blocked, seconds = inflight
            self.committed = s
            record.commits += 1
            record.cost_s += blocked + c.interference
            record.stop = now
            measured.append(seconds)
            record.landed.append(seconds)
            inflight, touched = None, True
            if auto is not None:
                auto.observe_commit(blocked, seconds)
                every = auto.interval_s
                self.intervals.append(every)

        def begin(now: float) -> float:
            nonlocal inflight, first, mark, rho
            waited = 0.0
            if inflight is not None:
                waited = inflight[1] - now
                now = inflight[1]
                clock.now = now
                collect(now)
            blocked = c.blocked_first if first else c.blocked
            first = False
            land = self.rng.uniform(*c.land)
            rho = c.interference / max(land - c.interference, 1e-3)
            inflight = (step, now + blocked + land, waited + blocked, blocked + land)
            now += blocked
            mark = now
            return now

        while True:
            # a step boundary at t
            clock.now = t
            if inflight is not None and inflight[1] <= t:
                collect(t)
            saved_through = max(self.committed, inflight[0] if inflight else 0)
            if save_due(step, saved_through=saved_through, every_steps=0, every_seconds=every, elapsed_s=t - mark):
                t = begin(t)
            # how many steps run before the next event (a commit landing, a checkpoint due, an interruption)
            dur = c.step * (1.0 + rho) if inflight is not None else c.step
            horizon = pending[0][0]
            if inflight is None:
                due_at = mark + every
                n = max(1, math.ceil((min(due_at, horizon) - t) / dur))
            else:
                n = max(1, math.ceil((min(inflight[1], horizon) - t) / dur))
            end_at = t + n * dur
            if horizon < end_at:  # the interruption lands inside the n-th step or earlier
                k = int((horizon - t) // dur)  # whole steps before it
                self._feed(auto, k, dur, inflight is not None, touched)
                touched = touched and k == 0
                step += k
                t += k * dur
                return self.stop(t, dur, pending.pop(0), step, inflight, measured, record, ready, collect)
            self._feed(auto, n, dur, inflight is not None, touched)
            if touched and auto is not None:  # the step after a landing re-plans; the trainer's clock follows
                every = auto.interval_s
            touched = False
            step += n
            t = end_at

    @staticmethod
    def _feed(auto: AutoInterval | None, n: int, dur: float, beside: bool, touched: bool) -> None:
        """``n`` steps of ``dur`` to the policy (clear ones: at most its window's worth, all alike)."""
        if auto is None or n <= 0:
            return
        auto.observe_step(dur, beside_commit=beside, after_commit=touched)
        rest = n - 1 if beside else min(n - 1, CLEAR_WINDOW)
        for _ in range(rest):
            auto.observe_step(dur, beside_commit=beside)

    def stop(self, t: float, dur: float, event: tuple[float, str], step: int, inflight, measured, record: Attempt,
             ready: float, collect) -> tuple[float, str]:
        c = self.costs
        at, how = event
        if how == "sigkill":
            if inflight is not None and inflight[1] <= at:
                collect(inflight[1])
            record.lost = True  # its record says where it got to REFRESH_S ago at worst
            record.stop = max(record.stop, ready + REFRESH_S * math.floor((at - ready) / REFRESH_S))
            return at, how
        deadline = at + c.notice
        t += dur  # the step in flight ends
        if inflight is not None:
            t = max(t, inflight[1])
            if t > deadline:
                record.lost = True
                return deadline, how
            collect(t)
        record.stopped = True
        if step > self.committed:
            why_not = final_commit_skip(reason="signal", committed=self.committed, measured_s=measured,
                                        stopped_for_s=t - at, grace_s=c.notice)
            if why_not is None:
                t += c.blocked + c.final
                if t > deadline:
                    record.lost = True
                    return deadline, how
                self.committed = step
                record.commits += 1
                record.cost_s += c.blocked
                record.landed.append(c.blocked + c.final)
            else:
                record.lost = True  # stopped with steps the next attempt redoes
        record.stop = t
        return min(t + c.exit, deadline), how


def one(costs: Costs, every: float | None, events, wall: float, seed: int) -> tuple[float, list[float]]:
    run = Run(costs, every, events, wall, random.Random(seed * 7919 + 1))
    return run.simulate(), run.intervals


def sweep(args: argparse.Namespace, costs: Costs) -> list[dict]:
    out = []
    for mtbi in args.mtbi:
        goodput: dict[str, list[float]] = {}
        planned: list[float] = []
        for seed in range(1, args.seeds + 1):
            events = schedule(mtbi, args.wall, args.kill_share, seed)
            for every in [None, *args.every]:
                g, intervals = one(costs, every, events, args.wall, seed)
                goodput.setdefault("auto" if every is None else f"{every:g}", []).append(g)
                if every is None:
                    planned.extend(intervals)
        out.append(summarise(mtbi, goodput, planned))
        print_rate(out[-1], args)
    return out


def summarise(mtbi: float, goodput: dict[str, list[float]], planned: list[float]) -> dict:
    means = {k: statistics.fmean(v) for k, v in goodput.items()}
    fixed = {k: m for k, m in means.items() if k != "auto"}
    best = max(fixed, key=fixed.get)
    diffs = [a - b for a, b in zip(goodput["auto"], goodput[best])]
    return {"mtbi": mtbi, "seeds": len(goodput["auto"]), "mean": means,
            "sem": {k: statistics.stdev(v) / math.sqrt(len(v)) if len(v) > 1 else 0.0 for k, v in goodput.items()},
            "best_fixed": best, "auto_minus_best": statistics.fmean(diffs),
            "auto_minus_best_sem": statistics.stdev(diffs) / math.sqrt(len(diffs)) if len(diffs) > 1 else 0.0,
            "auto_interval_median": statistics.median(planned) if planned else None}


def print_rate(r: dict, args: argparse.Namespace) -> None:
    print(f"\nmtbi {r['mtbi']:g} s, kill share {args.kill_share:g}, notice {args.notice:g} s, wall {args.wall:g} s, "
          f"{r['seeds']} seeds")
    for k, m in r["mean"].items():
        flag = "  <- best fixed" if k == r["best_fixed"] else ""
        print(f"  every {k:>5}: goodput {m:.4f} ± {r['sem'][k]:.4f}{flag}")
    print(f"  auto - best fixed: {100 * r['auto_minus_best']:+.2f} pt ± {100 * r['auto_minus_best_sem']:.2f} "
          f"(paired); auto's median interval {r['auto_interval_median']:.0f} s", flush=True)


def replay(paths: list[str], costs: Costs) -> list[dict]:
    """Each measured cell's interruption times through the model: the model's goodput beside the truth."""
    rows = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            result = json.load(f)
        wall = float(result["args"]["wall"])
        run_costs = Costs(**{**costs.__dict__, "notice": float(result["args"]["notice"]),
                             "restart": float(result["args"]["restart"])})
        for cell in result["cells"]:
            every = None if cell["every"] == "auto" else float(cell["every"])
            events = [(float(t), how) for t, how in cell["events"]]
            sims = [one(run_costs, every, events, wall, seed)[0] for seed in range(1, 51)]
            rows.append({"file": os.path.basename(path), "mtbi": cell["mtbi"], "every": cell["every"],
                         "truth": cell["truth"], "model": statistics.fmean(sims),
                         "model_range": [min(sims), max(sims)]})
            r = rows[-1]
            print(f"  {r['file']} mtbi {r['mtbi']:g} every {r['every']:>4}: truth {r['truth']:.3f}  model "
                  f"{r['model']:.3f} (commit times drawn 50 ways: {min(sims):.3f}-{max(sims):.3f})  "
                  f"{100 * (r['model'] - r['truth']):+.1f} pt", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mtbi", type=float, action="append", help="mean seconds between interruptions (repeatable; "
                    "default 180, 600, 1800)")
    ap.add_argument("--every", type=float, action="append", help=f"fixed intervals of the sweep (default {SWEEP})")
    ap.add_argument("--seeds", type=int, default=200, help="schedules of interruptions per rate (default 200)")
    ap.add_argument("--wall", type=float, default=8 * 3600.0, help="seconds of the rental (default 8 h)")
    ap.add_argument("--kill-share", type=float, default=0.5, help="share of interruptions that are SIGKILLs")
    for name, value in Costs().__dict__.items():
        if name != "land":
            ap.add_argument(f"--{name.replace('_', '-')}", type=float, default=value,
                            help=f"{HELP[name]} (default {value:g})")
    ap.add_argument("--land", type=float, nargs=2, default=Costs.land, metavar=("MIN", "MAX"),
                    help="a background commit lands uniformly this many seconds after it began (default 8 18)")
    ap.add_argument("--replay", nargs="+", help="bench_goodput result files (or bench/goodput-1gib-cells.json): the "
                    "model against their cells")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "sim_interval.json"))
    args = ap.parse_args()
    args.mtbi = args.mtbi or [180.0, 600.0, 1800.0]
    args.every = args.every or list(map(float, SWEEP))
    costs = Costs(**{k: (tuple(getattr(args, k)) if k == "land" else getattr(args, k)) for k in Costs().__dict__})
    started = time.perf_counter()
    load = os.getloadavg()[0]
    result: dict = {"args": vars(args), "costs": costs.__dict__, "machine": platform.platform(), "load_before": load}
    if args.replay:
        result["replay"] = replay(args.replay, costs)
    else:
        result["rates"] = sweep(args, costs)
    result["seconds"] = time.perf_counter() - started
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"\nwrote {args.out} ({result['seconds']:.0f} s)")


if __name__ == "__main__":
    main()
