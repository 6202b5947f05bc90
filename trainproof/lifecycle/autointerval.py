"""``train --checkpoint-every auto``: the interval between commits, re-planned from what this run measures.

The interval is Daly's optimum (:func:`trainproof.lifecycle.planner.daly_interval`, what ``trainproof plan``
recommends) of two figures the run keeps up to date instead of figures an operator typed:

- **C**, what one checkpoint costs training: the median over the newest commits of the seconds each blocked training
  (a background commit blocks only while the state is copied to host memory, and while the previous commit is still
  landing; an inline one for the whole commit) plus the seconds it slowed the steps that ran beside it (serialising,
  hashing and uploading share the machine's cores, memory bandwidth and PCIe with training: the steps that ended
  while it was in flight, less as many steps at the mean of those that ran clear of any commit). Before this process
  has committed, the previous attempt's blocked and interference seconds per commit (its attempt record); before
  any, the planner's default (60 s).
- **M**, the mean time between interruptions that *lose work*, from the run's attempt records
  (trainproof.train.attempts): an attempt killed without an end (SIGKILL, a crash, a lost machine), or stopped
  with steps after its last commit that the next attempt redid. A stop whose notice was honoured (SIGTERM or a
  spot notice, the final step committed) costs a restart but loses no work, yet it says how often the machine is
  interrupted. So M is the exposure (the attempts' time from start to end or last record, plus this process's own
  time so far) over all stops, divided by the share of stops that lose work, estimated as (lost + 1) / (stops + 2):
  one SIGTERM after a minute is evidence of a spot market that interrupts often, and three honoured stops make the
  next kill less likely than three kills do. With no stop yet, the larger of that exposure and the planner's default
  (6 h): a run that has not been interrupted in 40 h does not expect one every 6 h.

Until a commit has measured C (this process's or one in the records), the first commit comes at most :data:`FIRST_S`
after training began (rank 0's clock, which reads the records, decides it for all ranks): on the planner's default C
a fresh run would wait 26 minutes, unprotected, for its first generation. The interval is bounded: at least
:data:`MIN_S` and at least the median time a background commit takes to land (a shorter interval would only queue
commits behind each other; before this process has landed one, the newest attempt record's), at most :data:`MAX_S`
(a long, quiet run still leaves a generation every hour). It is
re-planned after every commit; a change of more than :data:`CHANGE` is logged (event ``checkpoint_interval``), and
so is the first plan. Each rank plans from its own commits; rank 0, which reads the attempt records, has the whole
picture, and a checkpoint is due when any rank's clock says so.

Attempt records are only ever read (size-capped, validated, signed when the run has a key, by
trainproof.lifecycle.goodput); a record that is not usable is ignored, so a planted record can at worst move the
interval within its bounds, never stop or end the run.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from typing import Any

from trainproof.lifecycle.goodput import Report, read_report
from trainproof.lifecycle.planner import PlanInputs, daly_interval
from trainproof.storage import GenerationStore
from trainproof.storage.limits import safe

FIRST_S = 60.0
"""Longest a run waits for its first commit while nothing has measured what one costs (no commit of this process,
none in the attempt records): the planner's default C (60 s) is a guess, one commit measures it."""
MIN_S = 5.0
MAX_S = 3600.0
CHANGE = 0.1
"""Relative change of the interval that is logged."""
WINDOW = 5
"""Newest commits whose cost is C's median."""
CLEAR_WINDOW = 200
"""Newest steps clear of any commit whose mean is a step's undisturbed duration."""
_DEFAULTS = PlanInputs(rental_s=1.0)


class AutoInterval:
    """The seconds between commits of ``--checkpoint-every auto`` (the trainer's ``IntervalPolicy``)."""

    def __init__(self, *, past_exposure_s: float = 0.0, interruptions: int = 0, cheap_stops: int = 0,
                 past_checkpoint_s: float | None = None, past_commit_s: float | None = None,
                 reads_records: bool = True, clock: Any = time.monotonic) -> None:
        self.past_exposure_s, self.interruptions, self.cheap_stops = past_exposure_s, interruptions, cheap_stops
        self.past_checkpoint_s = past_checkpoint_s
        self.past_commit_s = past_commit_s
        """The median seconds a commit of the previous attempt took to land: the floor until this process's own."""
        self.reads_records = reads_records
        """False on ranks other than 0: they read no records, so an unmeasured C says nothing; rank 0's clock (which
        has the records) brings the first commit forward when the run has none."""
        self._clock = clock
        self._t0 = clock()
        self._cost: list[float] = []
        self._commits: list[float] = []
        self._clear: deque[float] = deque(maxlen=CLEAR_WINDOW)
        self._beside = [0, 0.0]
        """Steps that ended while the commit now in flight was, and their seconds."""
        self.interval_s = self._plan()
        self._logged: float | None = None

    @classmethod
    def from_report(cls, report: Report, **kwargs: Any) -> AutoInterval:
        """From the run's attempt records (every attempt before this process)."""
        attempts, redone = report.attempts, report.redone()
        lost = [a for a, r in zip(attempts, redone) if a.end is None or (a.end == "stopped" and r > 0)]
        cheap = [a for a, r in zip(attempts, redone) if a.end == "stopped" and r == 0]
        exposure = sum(max(0.0, a.stop - a.started) for a in attempts)
        past_c = next(((a.blocked_s + i) / a.commits for a, i in zip(reversed(attempts),
                                                                     reversed(report.interference())) if a.commits),
                      None)  # the newest attempt with commits, per commit
        landed = [a.commit_seconds for a in attempts if a.commit_seconds]
        return cls(past_exposure_s=exposure, interruptions=len(lost), cheap_stops=len(cheap),
                   past_checkpoint_s=past_c,
                   past_commit_s=statistics.median(landed[-1][-WINDOW:]) if landed else None, **kwargs)

    @classmethod
    def from_store(cls, store: GenerationStore | None) -> AutoInterval:
        """From the records in ``store`` (None: this rank reads none, the planner's defaults stand in). Records that
        cannot be read at all (the folder is not one, the store fails) are a warning: the defaults stand in."""
        if store is None:
            return cls(reads_records=False)
        try:
            return cls.from_report(read_report(store))
        except Exception as exc:  # noqa: BLE001 - what the bucket holds never stops a run; the interval is bounded
            logging.getLogger("trainproof.train").warning(
                "--checkpoint-every auto: the attempt records were not read (%s); planning from the defaults until "
                "this run's own commits are measured", safe(" ".join(str(exc).split()), 300))
            return cls()

    # -- the figures -----------------------------------------------------------------------------------------
    @property
    def checkpoint_s(self) -> float:
        """C: seconds one checkpoint costs training (blocked, and the steps beside it slowed)."""
        if self._cost:
            return max(statistics.median(self._cost[-WINDOW:]), 1e-3)
        if self.past_checkpoint_s is not None:
            return max(self.past_checkpoint_s, 1e-3)
        return _DEFAULTS.checkpoint_s

    @property
    def mtbi_s(self) -> float:
        """M: mean seconds between interruptions that lose work: every stop, honoured or not, says how often this
        machine is interrupted; the share of them that lose work is estimated with one imagined stop of each kind
        added (Laplace's rule), so a run whose stops were all honoured so far still expects some not to be, and one
        with only kills expects them all to be. No stop yet: the larger of the exposure and the planner's default."""
        exposure = self.past_exposure_s + (self._clock() - self._t0)
        stops = self.interruptions + self.cheap_stops
        if stops:
            lossy_share = (self.interruptions + 1) / (stops + 2)
            return max(exposure / stops / lossy_share, 1.0)
        return max(_DEFAULTS.mtbi_s, exposure)

    def bounds(self) -> tuple[float, float]:
        """The interval's floor (MIN_S, or longer: the time a commit takes to land) and ceiling (MAX_S; FIRST_S
        while nothing has measured C)."""
        landing = statistics.median(self._commits[-WINDOW:]) if self._commits else self.past_commit_s
        measured = self._cost or self.past_checkpoint_s is not None or not self.reads_records
        return max(MIN_S, landing or 0.0), MAX_S if measured else FIRST_S

    def _plan(self) -> float:
        floor, ceiling = self.bounds()
        return min(ceiling, max(floor, daly_interval(self.checkpoint_s, self.mtbi_s)))

    # -- the trainer's side ----------------------------------------------------------------------------------
    def observe_step(self, seconds: float, *, beside_commit: bool, after_commit: bool = False) -> None:
        """A step took ``seconds`` (one a checkpoint began before is timed from the end of its blocked time, counted
        apart), ending while a commit was in flight, right after one landed (``after_commit``: what follows a
        commit, freeing its snapshot, the server finishing its writes, is still its cost: added to the commit that
        landed), or clear of any."""
        if after_commit and not beside_commit and self._cost:
            if self._clear:
                self._cost[-1] += max(0.0, seconds - statistics.fmean(self._clear))
                self.interval_s = self._plan()
            return
        if beside_commit:
            self._beside[0] += 1
            self._beside[1] += max(0.0, seconds)
        else:
            self._clear.append(max(0.0, seconds))

    def interference_s(self) -> float:
        """What the commit in flight has slowed the steps beside it so far (none before a step ran clear of one)."""
        n, seconds = self._beside
        if not n or not self._clear:
            return 0.0
        return max(0.0, seconds - n * statistics.fmean(self._clear))

    def observe_commit(self, blocked_s: float, commit_s: float) -> None:
        """A commit landed: it blocked training ``blocked_s``, took ``commit_s`` from start to committed; the steps
        observed beside it since the previous one landed were its interference."""
        self._cost.append(max(0.0, blocked_s) + self.interference_s())
        self._beside = [0, 0.0]
        self._commits.append(max(0.0, commit_s))
        self._cost, self._commits = self._cost[-WINDOW:], self._commits[-WINDOW:]
        self.interval_s = self._plan()

    def change(self) -> dict[str, Any] | None:
        """What to log (event ``checkpoint_interval``) when the interval is new or moved by more than CHANGE."""
        if self._logged is not None and abs(self.interval_s - self._logged) <= CHANGE * self._logged:
            return None
        previous, self._logged = self._logged, self.interval_s
        return {"interval_s": round(self.interval_s, 1), "previous_s": None if previous is None else round(previous, 1),
                "checkpoint_s": round(self.checkpoint_s, 3), "mtbi_s": round(self.mtbi_s, 1),
                "interruptions": self.interruptions, "cheap_stops": self.cheap_stops,
                "bounds_s": [round(b, 1) for b in self.bounds()]}
