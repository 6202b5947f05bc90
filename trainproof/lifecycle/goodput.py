"""What a rental bought: goodput and badput of a run, from its attempt records (trainproof.train.attempts).

Each process of the run left a record: when it started, when it had restored (``startup_s``, ``restore_s``), from
which step it resumed, the steps it trained and how long they took (``train_s``, checkpoint stalls excluded), each
commit's blocked time, and how it ended. From those, in the buckets of Google's ml-goodput-measurement:

- **productive**: training time of the steps the run kept;
- **startup** (interpreter, torch, building the model and the data) and **restore** (finding, verifying and loading
  the generation);
- **checkpoint stall**: the time commits blocked training;
- **checkpoint interference**: what a commit in the background cost the steps that ran beside it (serialising,
  hashing and uploading share the machine with training): the steps that ended while a commit was in flight, times
  how much longer they took on average than the attempt's steps clear of one (a mean of each, so steps whose length
  varies anyway, e.g. with the batch's sequence lengths, are not counted as slowed);
- **redone steps**: training time of steps an attempt trained beyond the point the next attempt resumed from (a
  SIGKILL between commits), priced at that attempt's own step time; for the newest attempt, when it stopped (exit 75)
  with steps after its last commit (the final commit did not fit in the stop's grace), those steps: the next attempt
  resumes from that commit. An attempt still running (no end) has its uncommitted steps counted as trained until it
  ends;
- **gaps**: from an attempt's end (or, killed, its last record) to the next attempt's start (rescheduling, a new VM);
- **finish**: after the last step (the final commit, an export, the reload check);
- **unaccounted**: the rest of the wall time (a killed attempt's time after its last record).

goodput = productive / wall, wall = from the first attempt's start to the last one's end (or last record).

With a price (``price_per_hour``: what an hour of this machine cost) each bucket's cost, and the total (wall time at
that price). With an on-demand price too, what the run saved against on-demand: the on-demand cost is the
*productive* time at the on-demand price (what an uninterrupted on-demand machine would have needed to train the
same kept steps, with no start-up, restore, stall or finish: a lower bound, so the saving is never overstated), and
``saved`` = on-demand cost - total (negative when the badput ate the discount).

Records are read from a shared bucket: each is size-capped, parsed strictly, type-checked field by field, and (with a
signing key) must be signed; one that is not is skipped and counted, never trusted, never a crash.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from trainproof.lifecycle.finish import aware_time
from trainproof.storage import GenerationStore
from trainproof.storage.limits import UntrustedJSONError, loads_untrusted
from trainproof.train.attempts import ATTEMPTS_DIR, MAX_COMMITS, SCHEMA

MAX_RECORD_BYTES = 64 * 1024
MAX_RECORDS = 10_000
BUCKETS = ("productive", "startup", "restore", "checkpoint_stall", "checkpoint_interference", "redone_steps", "gaps",
           "finish", "unaccounted")
MIN_STEPS = 3
"""Steps needed on each side (beside a background commit, and clear of one) before their difference is counted."""


@dataclass
class Attempt:
    """One process, as its record says (validated)."""

    name: str
    started: float
    updated: float
    ended: float | None
    end: str | None
    reason: str | None
    resumed_from: int
    """0 when the record names none (``restored`` False: killed before it had restored or begun)."""
    last_step: int | None
    startup_s: float
    restore_s: float
    train_s: float
    blocked_s: float
    commits: int
    committed_step: int | None
    finish_s: float
    restored: bool = True
    """Whether the record names the step it resumed from (it had restored, or started fresh, and begun)."""
    commit_steps: list[int] = field(default_factory=list)
    """Steps of its newest commits (the record lists at most its last 200)."""
    commit_seconds: list[float] = field(default_factory=list)
    """Seconds its newest commits took from their start to committed: the valid durations among them (not aligned
    with :attr:`commit_steps`: each list drops what is not one of its kind)."""
    step_times: tuple[int, float, int, float] = (0, 0.0, 0, 0.0)
    """Steps that ended clear of a background commit (count, seconds), and beside one (count, seconds)."""

    def interference(self, run_clear_mean: float | None = None) -> float:
        """What background commits cost the steps that ran beside them: their count times how much longer they took
        on average than the steps clear of one, at most the training time; 0 with fewer than MIN_STEPS beside one.
        With fewer than MIN_STEPS clear of one (commits back to back), measured against ``run_clear_mean``, the
        mean clear step of the run's attempts, when given (else 0)."""
        clear_n, clear_s, commit_n, commit_s = self.step_times
        clear_mean = clear_s / clear_n if clear_n >= MIN_STEPS else run_clear_mean
        if clear_mean is None or commit_n < MIN_STEPS:
            return 0.0
        return min(self.train_s, max(0.0, commit_s - commit_n * clear_mean))

    @property
    def stop(self) -> float:
        """When it ended, or (killed) its last record."""
        return self.ended if self.ended is not None else self.updated

    @property
    def steps(self) -> int:
        return max(0, (self.last_step or self.resumed_from) - self.resumed_from)


@dataclass
class Report:
    attempts: list[Attempt] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)

    def to_json(self, price_per_hour: float | None = None, on_demand_price: float | None = None) -> dict[str, Any]:
        return {"attempts": [_attempt_json(a, r, i) for a, r, i in zip(self.attempts, self.redone(),
                                                                         self.interference())],
                "skipped": self.skipped, **summary(self, price_per_hour, on_demand_price)}

    def interference(self) -> list[float]:
        """Per attempt, :meth:`Attempt.interference`, one without enough steps clear of a commit measured against the
        mean clear step of all the run's attempts (the same machine type, as a rule)."""
        clear_n = sum(a.step_times[0] for a in self.attempts)
        pooled = sum(a.step_times[1] for a in self.attempts) / clear_n if clear_n >= MIN_STEPS else None
        return [a.interference(pooled) for a in self.attempts]

    def redone(self) -> list[int]:
        """Per attempt, the steps it trained beyond where the next attempt that restored resumed (an attempt killed
        before it restored says nothing about where the run continued from). With no such next attempt, where the
        next one will resume: a stopped attempt's last commit; none known for one without an end (still running, or
        killed after its last record: counted when the next attempt shows where it resumed)."""
        out, after = [], None
        for a in reversed(self.attempts):
            resumes_at = after if after is not None else (a.committed_step if a.end == "stopped" else None)
            out.append(0 if resumes_at is None else
                       max(0, (a.last_step or a.resumed_from) - max(resumes_at, a.resumed_from)))
            after = a.resumed_from if a.restored else after
        return out[::-1]


def read_report(store: GenerationStore) -> Report:
    """Every attempt record of the run at ``store``, validated, oldest first; the unusable ones named in
    ``skipped``."""
    report = Report()
    if any(not e.is_dir or e.is_special for e in store.entries(ATTEMPTS_DIR)):
        report.skipped.append(f"{ATTEMPTS_DIR}: not a folder (a file, a link or a FIFO): not read")
        return report
    folder = store.child(ATTEMPTS_DIR)
    names = sorted(e.name for e in folder.list_dir(limit=MAX_RECORDS) if not e.is_dir and e.name.endswith(".json"))
    if len(names) > MAX_RECORDS:
        report.skipped.append(f"{len(names) - MAX_RECORDS} record(s) beyond the first {MAX_RECORDS}")
        names = names[:MAX_RECORDS]
    keys = store.options.signing
    for name in names:
        try:
            doc = loads_untrusted(folder.read_file(name, max_bytes=MAX_RECORD_BYTES), what=name,
                                  max_bytes=MAX_RECORD_BYTES)
            if keys is not None:
                problem = keys.problem(doc) if isinstance(doc, dict) else "not an object"
                if problem is not None:
                    raise ValueError(f"not this run's ({problem})")
            report.attempts.append(_attempt(name, doc))
        except (OSError, UntrustedJSONError, ValueError, TypeError, KeyError) as exc:
            report.skipped.append(f"{name}: {' '.join(str(exc).split())[:200]}")
    report.attempts.sort(key=lambda a: a.started)
    return report


def _attempt(name: str, doc: Any) -> Attempt:
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} record")
    started, updated = _time(doc["started_at"]), _time(doc["updated_at"])
    ended = None if doc.get("ended_at") is None else _time(doc["ended_at"])
    if updated < started or (ended is not None and ended < started):
        raise ValueError("its times go backwards")
    end = doc.get("end")
    if end not in (None, "done", "stopped"):
        raise ValueError(f"end {end!r}")
    resumed = _count(doc.get("resumed_from"), "resumed_from", default=0)
    last = None if doc.get("last_step") is None else _count(doc["last_step"], "last_step")
    if last is not None and last < resumed:
        raise ValueError("last_step is before resumed_from")
    reason = doc.get("reason")
    return Attempt(name=name, started=started, updated=updated, ended=ended, end=end,
                   reason=reason[:40] if isinstance(reason, str) else None, resumed_from=resumed, last_step=last,
                   startup_s=_secs(doc.get("startup_s")), restore_s=_secs(doc.get("restore_s")),
                   train_s=_secs(doc.get("train_s")), blocked_s=_secs(doc.get("blocked_s")),
                   commits=_count(doc.get("commits"), "commits", default=0),
                   committed_step=None if doc.get("committed_step") is None else _count(doc["committed_step"],
                                                                                      "committed_step"),
                   finish_s=_secs(doc.get("finish_s")), restored=doc.get("resumed_from") is not None,
                   commit_steps=_commit_steps(doc.get("recent_commits")),
                   commit_seconds=_commit_seconds(doc.get("recent_commits")),
                   step_times=_step_times(doc.get("step_times")))


def _step_times(value: Any) -> tuple[int, float, int, float]:
    """A record's ``step_times`` (absent in records written before it: none counted)."""
    if value is None:
        return (0, 0.0, 0, 0.0)
    if not isinstance(value, dict):
        raise ValueError("step_times is not an object")
    return (_count(value.get("clear_n"), "step_times.clear_n", default=0), _secs(value.get("clear_s")),
            _count(value.get("commit_n"), "step_times.commit_n", default=0), _secs(value.get("commit_s")))


def _commit_steps(value: Any) -> list[int]:
    """The steps of a record's ``recent_commits`` (a list of {"step": n, ...}); what is not one is left out."""
    if not isinstance(value, list):
        return []
    return [c["step"] for c in value[-MAX_COMMITS:] if isinstance(c, dict) and isinstance(c.get("step"), int)
            and not isinstance(c["step"], bool) and 0 <= c["step"] < 2**62]


def _commit_seconds(value: Any) -> list[float]:
    """The seconds of a record's ``recent_commits`` (``{"seconds": s, ...}``); what is not a duration is left out."""
    if not isinstance(value, list):
        return []
    out = []
    for c in value[-MAX_COMMITS:]:
        try:
            out.append(_secs(c.get("seconds")) if isinstance(c, dict) and c.get("seconds") is not None else None)
        except ValueError:
            out.append(None)
    return [s for s in out if s is not None]


def _time(value: Any) -> float:
    return aware_time(value).timestamp()


def _secs(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 \
            or value > 10 * 365 * 86400:
        raise ValueError(f"a duration that is not one: {str(value)[:40]}")
    return float(value)


def _count(value: Any, what: str, default: int | None = None) -> int:
    if value is None and default is not None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**62:
        raise ValueError(f"{what} is not a step count")
    return value


def _attempt_json(a: Attempt, redone: int, interference: float) -> dict[str, Any]:
    return {"record": a.name, "started": _iso(a.started), "ended": _iso(a.ended) if a.ended is not None else None,
            "end": a.end or "killed (no end recorded)", "reason": a.reason,
            "resumed_from": a.resumed_from if a.restored else None,
            "last_step": a.last_step, "steps": a.steps, "redone_steps": redone, "commits": a.commits,
            "committed_step": a.committed_step, "startup_s": a.startup_s, "restore_s": a.restore_s,
            "train_s": a.train_s, "checkpoint_stall_s": a.blocked_s,
            "checkpoint_interference_s": round(interference, 3)}


def _iso(t: float) -> str:
    from datetime import timezone

    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def summary(report: Report, price_per_hour: float | None = None,
            on_demand_price: float | None = None) -> dict[str, Any]:
    """Wall time, the buckets (seconds and share of wall), goodput; with a price the cost of each bucket, and with an
    on-demand price too what the run saved against on-demand (see the module)."""
    attempts = report.attempts
    if not attempts:
        return {"wall_s": 0.0, "buckets": {}, "goodput": None}
    redone = report.redone()
    buckets = dict.fromkeys(BUCKETS, 0.0)
    for a, r, interference in zip(attempts, redone, report.interference()):
        per_step = (a.train_s - interference) / a.steps if a.steps else 0.0
        wasted = min(a.train_s - interference, r * per_step)
        buckets["productive"] += a.train_s - interference - wasted
        buckets["checkpoint_interference"] += interference
        buckets["redone_steps"] += wasted
        buckets["startup"] += a.startup_s
        buckets["restore"] += a.restore_s
        buckets["checkpoint_stall"] += a.blocked_s
        buckets["finish"] += a.finish_s
    for a, b in zip(attempts, attempts[1:]):
        buckets["gaps"] += max(0.0, b.started - a.stop)
    wall = max(a.stop for a in attempts) - attempts[0].started
    buckets["unaccounted"] = max(0.0, wall - sum(v for k, v in buckets.items() if k != "unaccounted"))
    out: dict[str, Any] = {
        "wall_s": round(wall, 3), "goodput": round(buckets["productive"] / wall, 4) if wall > 0 else None,
        "buckets": {k: {"seconds": round(v, 3), "share": round(v / wall, 4) if wall > 0 else None}
                    for k, v in buckets.items()},
        "steps_kept": _steps_kept(attempts, redone),
        "redone_steps": sum(redone), "interruptions": sum(1 for a in attempts[:-1] if a.end != "done")}
    if price_per_hour is not None:
        out.update(_costs(out, price_per_hour, on_demand_price))
    return out


def _steps_kept(attempts: list[Attempt], redone: list[int]) -> int:
    """From the first attempt's start to where the last attempt that restored got (one killed before it restored
    trained nothing), less what it trained after its last commit when it stopped (redone by the next attempt)."""
    i = next((i for i in range(len(attempts) - 1, -1, -1) if attempts[i].restored), len(attempts) - 1)
    last = attempts[i]
    return (last.last_step or last.resumed_from) - redone[i] - attempts[0].resumed_from


def _costs(out: dict[str, Any], price: float, on_demand_price: float | None) -> dict[str, Any]:
    """Costs from the figures the report shows (its rounded seconds), so that they can be checked from them."""
    seconds = {k: b["seconds"] for k, b in out["buckets"].items()}
    total = out["wall_s"] / 3600 * price
    costs: dict[str, Any] = {"cost": {**{k: round(v / 3600 * price, 2) for k, v in seconds.items()},
                                      "total": round(total, 2)}}
    if on_demand_price is not None:
        on_demand = seconds["productive"] / 3600 * on_demand_price
        costs["on_demand"] = {
            "price_per_hour": on_demand_price, "price_per_hour_paid": price,
            "basis": "the productive seconds at the on-demand price (an uninterrupted machine training the same "
                     "kept steps; a lower bound)",
            "cost": round(on_demand, 2), "paid": round(total, 2), "saved": round(on_demand - total, 2),
            "saved_share": round((on_demand - total) / on_demand, 4) if on_demand > 0 else None}
    return costs
