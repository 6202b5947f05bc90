"""How often to checkpoint and when to stop, for a rental of known length: a pure calculation.

Inputs are a few durations (the rental, the mean time between interruptions, what one checkpoint,
a restart, the final export and the verification take); outputs are the checkpoint interval, what it
costs, the reserve to keep for the final export, and the ``train`` flags that follow. Nothing here
touches a store, a clock or the command line: ``trainproof/cmd_plan.py`` fills in :class:`PlanInputs` and
prints the :class:`Plan`; a future ``--measure`` mode fills it in from measured timings through
:func:`plan_from_measurements`.

The interval (J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart
dumps", Future Generation Computer Systems 22(3), 2006), with C the checkpoint time and M the mean
time between interruptions::

    T = sqrt(2 C M) * [1 + 1/3 sqrt(C / 2M) + 1/9 (C / 2M)] - C     when C < 2M
    T = M                                                           when C >= 2M

It refines Young's first-order ``T = sqrt(2 C M)`` (CACM 1974), which it approaches when C << M.
Note: both assume interruptions that lose the work since the last commit (exponential arrivals). A
preemption whose notice leaves time for the emergency save loses only the step in flight, so M is
the mean time between interruptions that *lose work*: crashes, hard kills, notices too short to save.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta, timezone

from trainproof.storage.durations import duration_seconds


def parse_duration(text: str) -> float:
    """Seconds in ``90s``, ``10m``, ``6h``, ``7d``, ``1h30m`` or plain seconds (``45``, ``0.8``).

    Raises ValueError with a message fit for the command line.
    """
    spec = str(text).strip().lower()
    try:
        seconds = float(spec)
    except ValueError:
        parsed = duration_seconds(spec)
        if parsed is None:
            raise ValueError(f"{text!r} is not a duration (use 90s, 10m, 6h, 7d, 1h30m or plain seconds)") from None
        seconds = parsed
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{text!r} is not a duration (it must be finite and >= 0)")
    return seconds


def format_duration(seconds: float) -> str:
    """Compact duration that ``train --deadline`` parses back: ``6d23h31m``, ``26m10s``, ``45s``.

    Rounds *down* to whole seconds, so a deadline written this way is never later than computed.
    """
    left = max(0, int(math.floor(seconds)))
    out = []
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        count, left = divmod(left, size)
        if count:
            out.append(f"{count}{unit}")
    return "".join(out) or "0s"


def young_interval(checkpoint_s: float, mtbi_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints: ``sqrt(2 C M)``."""
    return math.sqrt(2.0 * checkpoint_s * mtbi_s)


def daly_interval(checkpoint_s: float, mtbi_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints (see the module docstring).

    ``checkpoint_s`` is C (the time one checkpoint takes), ``mtbi_s`` is M. Both must be > 0.
    """
    if checkpoint_s <= 0 or mtbi_s <= 0:
        raise ValueError("the checkpoint time and the mean time between interruptions must be > 0")
    if checkpoint_s >= 2.0 * mtbi_s:
        return mtbi_s  # checkpoints cost more than they save: checkpoint about once per interruption
    x = checkpoint_s / (2.0 * mtbi_s)
    return young_interval(checkpoint_s, mtbi_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - checkpoint_s


@dataclass(kw_only=True, frozen=True)
class PlanInputs:
    """What the plan is computed from. All durations in seconds; validation raises ValueError."""

    rental_s: float
    """Length of the rental: from the start of training to the moment the machine is taken back."""
    mtbi_s: float = 6 * 3600.0
    """M: mean time between interruptions that lose work (crash, hard kill, a notice too short for the
    emergency save). The default is deliberately pessimistic for spot capacity; use what you observe."""
    checkpoint_s: float = 60.0
    """C: one commit, end to end: serialise, upload, read back and check, write COMPLETE.json."""
    restart_s: float = 180.0
    """R: from an interruption to training again: reschedule, image pull, start, discovery, load."""
    export_s: float = 300.0
    """E: writing, verifying and reloading the final export bundle (``trainproof export``)."""
    verify_s: float = 600.0
    """V: the four-path equivalence verification (``trainproof verify``)."""
    step_s: float | None = None
    """Duration of one optimizer step, when known: gives the interval in steps and sizes the grace."""
    safety: float = 1.5
    """Multiplier on the finishing work (final save, export, verification) and on the emergency save."""
    rollback_s: float = 2 * 3600.0
    """How far back the kept generations must reach (a corrupt newest one, a loss spike found late)."""
    start: datetime | None = None
    """When the rental started (aware); gives an absolute deadline. None: only the relative one."""

    def __post_init__(self) -> None:
        for name in ("rental_s", "mtbi_s", "checkpoint_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{_flag(name)} must be > 0 (got {getattr(self, name)})")
        for name in ("restart_s", "export_s", "verify_s", "rollback_s"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{_flag(name)} must be >= 0 (got {getattr(self, name)})")
        if self.step_s is not None and not self.step_s > 0:
            raise ValueError(f"--step-seconds must be > 0 (got {self.step_s})")
        if not self.safety >= 1.0:
            raise ValueError(f"--safety must be >= 1 (got {self.safety})")
        if self.start is not None and self.start.tzinfo is None:
            raise ValueError("the rental start must carry a time zone (e.g. 2026-12-01T09:00:00Z)")


@dataclass(kw_only=True, frozen=True)
class Plan:
    """The recommendation. Seconds unless the name says otherwise."""

    inputs: PlanInputs
    """What it was computed from."""
    interval_s: int
    """Compute time between checkpoints (Daly), whole seconds: ``--checkpoint-every-seconds``."""
    young_s: float
    """Young's first-order interval, for comparison."""
    interval_steps: int | None
    """The interval in optimizer steps (``--checkpoint-every``) when the step time is known."""
    overhead_fraction: float
    """Expected share of the run lost to checkpoints, rework and restarts (first-order)."""
    checkpoint_fraction: float
    """The part of ``overhead_fraction`` spent writing checkpoints: ``C / (T + C)``."""
    lost_per_interruption_s: float
    """Expected work redone plus downtime per interruption: ``(T + C) / 2 + R``."""
    expected_interruptions: float
    """Rental length over M."""
    keep: int
    """Generations to keep so the kept ones reach back ``rollback_s`` (never fewer than 2)."""
    reserve_s: int
    """Time kept free at the end: ``safety × (step + C + R + E + V)``, rounded up to a minute."""
    deadline_after_start_s: int
    """``--deadline`` relative to the start of the rental: rental minus reserve."""
    deadline: str
    """The same as a duration ``train --deadline`` accepts (``6d23h31m``)."""
    deadline_at: datetime | None
    """The absolute deadline when the rental start is known."""
    grace_s: int
    """Stop grace for the emergency save (terminationGracePeriodSeconds, TimeoutStopSec):
    ``step + safety × C + 30 s``, rounded up to 10 s."""
    drill_s: float
    """Cost of the first save → stop → resume drill (one checkpoint plus one restart): do it early."""
    warnings: tuple[str, ...] = field(default=())
    """Conditions the operator should know about (one line each)."""

    def env(self) -> dict[str, str]:
        """The ``train`` settings as the TRAINPROOF_* variables it reads."""
        return {
            "TRAINPROOF_CHECKPOINT_EVERY_SECONDS": str(self.interval_s),
            "TRAINPROOF_KEEP": str(self.keep),
            "TRAINPROOF_DEADLINE": self.deadline,
        }


def make_plan(inputs: PlanInputs) -> Plan:
    """Compute the recommendation for ``inputs`` (raises ValueError when the rental cannot fit it)."""
    c, m, r = inputs.checkpoint_s, inputs.mtbi_s, inputs.restart_s
    interval = max(1, round(daly_interval(c, m)))
    cycle = interval + c
    lost = cycle / 2.0 + r
    checkpoint_fraction = c / cycle
    step = inputs.step_s or 0.0
    reserve = _round_up(inputs.safety * (step + c + r + inputs.export_s + inputs.verify_s), 60)
    deadline_s = int(inputs.rental_s) - reserve
    if deadline_s <= 0:
        raise ValueError(
            f"the rental ({format_duration(inputs.rental_s)}) is shorter than the reserve for the final save, "
            f"export and verification ({format_duration(reserve)})")
    return Plan(
        inputs=inputs,
        interval_s=interval,
        young_s=young_interval(c, m),
        interval_steps=None if inputs.step_s is None else max(1, int(interval // inputs.step_s)),
        overhead_fraction=min(1.0, checkpoint_fraction + lost / m),
        checkpoint_fraction=checkpoint_fraction,
        lost_per_interruption_s=lost,
        expected_interruptions=inputs.rental_s / m,
        keep=max(2, math.ceil(inputs.rollback_s / cycle) + 1),
        reserve_s=reserve,
        deadline_after_start_s=deadline_s,
        deadline=format_duration(deadline_s),
        deadline_at=None if inputs.start is None else inputs.start + timedelta(seconds=deadline_s),
        grace_s=_round_up(step + inputs.safety * c + 30.0, 10),
        drill_s=c + r,
        warnings=tuple(_warnings(inputs, interval)),
    )


def plan_from_measurements(
    inputs: PlanInputs, *, checkpoint_s: float, export_s: float | None = None, step_s: float | None = None,
) -> Plan:
    """The plan with measured timings in place of the assumed ones (the hook for ``plan --measure``).

    The measuring side (a few timed commits, an export and steps against the real store and task)
    passes the slowest commit it saw as ``checkpoint_s``; None keeps the assumed value.
    """
    measured = {"checkpoint_s": checkpoint_s, "export_s": export_s, "step_s": step_s}
    return make_plan(replace(inputs, **{k: v for k, v in measured.items() if v is not None}))


def plan_document(plan: Plan) -> dict:
    """The plan as a JSON-ready mapping (``plan --json``)."""
    i = plan.inputs
    return {
        "inputs": {
            "rental_s": i.rental_s, "mtbi_s": i.mtbi_s, "checkpoint_s": i.checkpoint_s, "restart_s": i.restart_s,
            "export_s": i.export_s, "verify_s": i.verify_s, "step_s": i.step_s, "safety": i.safety,
            "rollback_s": i.rollback_s, "start": None if i.start is None else _iso(i.start),
        },
        "interval_s": plan.interval_s, "young_s": plan.young_s, "interval_steps": plan.interval_steps,
        "overhead_fraction": plan.overhead_fraction, "checkpoint_fraction": plan.checkpoint_fraction,
        "lost_per_interruption_s": plan.lost_per_interruption_s,
        "expected_interruptions": plan.expected_interruptions, "keep": plan.keep,
        "reserve_s": plan.reserve_s, "deadline_after_start_s": plan.deadline_after_start_s,
        "deadline": plan.deadline, "deadline_at": None if plan.deadline_at is None else _iso(plan.deadline_at),
        "grace_s": plan.grace_s, "drill_s": plan.drill_s, "env": plan.env(), "warnings": list(plan.warnings),
    }


def _warnings(inputs: PlanInputs, interval: int) -> list[str]:
    out = []
    if inputs.checkpoint_s >= 2 * inputs.mtbi_s:
        out.append("a checkpoint takes longer than twice the mean time between interruptions: "
                   "the interval falls back to M and little progress will stick; make the save faster")
    if inputs.step_s is not None and inputs.step_s > interval:
        out.append("one step is longer than the interval: checkpoint after every step")
    if inputs.rental_s < 2 * (inputs.checkpoint_s + inputs.restart_s) + 3600:
        out.append("the rental barely fits a save → stop → resume drill; test resumption before renting")
    return out


def _round_up(seconds: float, quantum: int) -> int:
    return int(math.ceil(seconds / quantum) * quantum)


def _iso(at: datetime) -> str:
    # "+00:00" rather than "Z": datetime.fromisoformat() (what `train --deadline` uses) reads "Z" only from 3.11.
    return at.astimezone(timezone.utc).isoformat()


def _flag(name: str) -> str:
    return {"rental_s": "--rental", "mtbi_s": "--mtbi", "rollback_s": "--rollback"}.get(
        name, "--" + name.removesuffix("_s").replace("_", "-") + "-seconds")
