"""Saving, beside the training loop: :class:`Saving` owns the clock, the checkpointer (trainproof.train.checkpoint) and
a way of saving (:class:`Saver`); its decisions are pure functions of plain values (:func:`save_due`,
:func:`final_commit_skip`). :class:`SyncSaver` commits inline (``--sync-checkpoint``), nothing is ever in flight;
:class:`trainproof.train.async_save.BackgroundSaver` snapshots the capture to host memory and commits on a thread. Both
call ``on_committed(step)`` then ``on_saved(seconds)`` on the training thread after a commit landed, never after a
failed one (a failed save never loses a history row).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Protocol

from trainproof.errors import ConfigError
from trainproof.format.identity import code_version
from trainproof.storage import GenerationStore
from trainproof.train.async_save import BackgroundSaver
from trainproof.train.checkpoint import Capture, Checkpointer
from trainproof.train.config import TrainConfig
from trainproof.train.dist import Collectives, PeerError
from trainproof.train.progress import Reporter
from trainproof.train.stops import IntervalPolicy, StopFlags


def save_due(step: int, *, saved_through: int, every_steps: int, every_seconds: float, elapsed_s: float) -> bool:
    """Whether a periodic checkpoint is due right after optimizer step ``step``: a step past ``saved_through`` (the
    newest step committed or being committed), on the ``every_steps`` cadence or ``every_seconds`` after the last
    checkpoint (``elapsed_s`` ago); 0 turns either cadence off."""
    if step <= saved_through:
        return False
    if every_steps and step % every_steps == 0:
        return True
    return bool(every_seconds) and elapsed_s >= every_seconds


def final_commit_skip(*, reason: str, committed: int, measured_s: list[float], stopped_for_s: float,
                      grace_s: float) -> str | None:
    """Why the final commit is skipped (None: commit it): only after a stop request (``reason``) in a run with a commit
    (``committed`` > 0) and one measured, when the longest (x 1.25, + 1 s) does not fit in what is left of
    ``--stop-grace`` ``stopped_for_s`` after the first request: one cut off by SIGKILL costs the one in flight too."""
    if reason not in ("signal", "spot-notice") or not committed or not measured_s:
        return None
    need = 1.25 * max(measured_s) + 1.0
    left = grace_s - stopped_for_s
    if need <= left:
        return None
    return f"a commit takes ~{max(measured_s):.1f} s, {max(left, 0.0):.1f} s of the {grace_s:g} s --stop-grace are left"


class SaveClock:
    """Step and/or wall-clock cadence of periodic checkpoints (:func:`save_due` on this process's clock)."""

    def __init__(self, every_steps: int = 0, every_seconds: float = 0.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_steps, self.every_seconds, self._clock = every_steps, every_seconds, clock
        self._last_time = clock()

    def due(self, step: int, *, saved_through: int = 0) -> bool:
        """True when a periodic checkpoint is due right after optimizer step ``step``."""
        return save_due(step, saved_through=saved_through, every_steps=self.every_steps,
                        every_seconds=self.every_seconds, elapsed_s=self._clock() - self._last_time)

    def mark(self) -> None:
        """A checkpoint was just committed: restart the wall-clock interval."""
        self._last_time = self._clock()


class Saver(Protocol):
    """What the trainer asks of a way of saving."""

    mode: str
    """``async`` or ``sync``: recorded in the ``start`` event."""
    measured_s: list[float]
    """Measured time of every commit of this process that may be estimated from at a stop (empty inline: the
    final commit is then always tried)."""

    @property
    def in_flight(self) -> int | None:
        """Step of a save not yet collected, or None."""

    def poll(self) -> None:
        """At a step boundary: collect a finished save; raise if it failed."""

    def poll_failed(self) -> bool:
        """True when the save in flight finished and failed (left to :meth:`wait` to raise)."""

    def wait(self) -> float:
        """Block until no save is in flight; the seconds waited. Raises a failed save's error."""

    def save(self, capture: Capture, *, blocked_since: float) -> None:
        """Commit ``capture``; training is blocked from ``blocked_since`` (``time.perf_counter()``) until this
        returns (inline: the whole commit; in the background: the host snapshot)."""


class SyncSaver:
    """Commits inline on the training thread (``--sync-checkpoint``): never a save in flight."""

    mode = "sync"
    in_flight = None

    def __init__(self, checkpointer: Checkpointer, on_saved: Callable[[float], None],
                 on_committed: Callable[[int], None]) -> None:
        self.checkpointer, self.on_saved, self.on_committed = checkpointer, on_saved, on_committed
        self.measured_s: list[float] = []

    def poll(self) -> None:
        """Nothing runs in the background."""

    def poll_failed(self) -> bool:
        return False

    def wait(self) -> float:
        return 0.0

    def save(self, capture: Capture, *, blocked_since: float) -> None:
        self.checkpointer.commit(replace(capture, blocked_since=blocked_since))
        self.on_committed(capture.step)
        self.on_saved(time.perf_counter() - blocked_since)


class Saving:
    """One process's checkpoints of a run (one rank's, when world > 1): the clock, the checkpointer and the saver."""

    def __init__(self, cfg: TrainConfig, store: GenerationStore, *, contract: str, sync: Collectives,
                 reporter: Reporter, on_saved: Callable[[float], None], on_committed: Callable[[int], None],
                 interval: IntervalPolicy | None = None) -> None:
        self.reporter, self.sync, self.grace_s = reporter, sync, cfg.stop_grace_s
        if cfg.auto_interval and interval is None:
            raise ConfigError("--checkpoint-every auto needs its interval policy: trainproof train builds it "
                              "(trainproof.lifecycle.autointerval); an in-process caller passes interval=")
        self.interval = interval if cfg.auto_interval else None
        self.clock = SaveClock(cfg.every_steps, cfg.checkpoint_every_seconds if self.interval is None else
                               self.interval.interval_s)
        self._on_saved = on_saved
        self._blocked: float | None = None
        """The blocked seconds of the newest save, once its submission returned."""
        self._step_at: float | None = None
        self._skip_step = False
        self._touched = False
        """A commit was collected at this boundary: the next step counts as beside it (what follows a commit still
        slows it), as in the attempt record (trainproof.train.attempts)."""
        on_saved = self._saved
        self._log_interval()
        # Commits run their collectives over the checkpoint group (trainproof.train.dist), from whichever thread saves.
        self.checkpointer = Checkpointer(store, contract=contract, world=sync.world, keep=cfg.keep,
                                         code_version=code_version(), reporter=reporter, sync=sync.saves,
                                         spool_dir=store.spool_folder() if sync.rank == 0 else None)
        # In the background (trainproof.train.async_save) unless --sync-checkpoint: one process or many, DDP or sharded.
        self.saver: Saver = (SyncSaver(self.checkpointer, on_saved, on_committed) if cfg.sync_checkpoint else
                             BackgroundSaver(self.checkpointer, reporter, on_saved, on_committed))

    def _saved(self, seconds: float) -> None:
        """A commit landed (``seconds`` from its start): tell the deadline, re-plan an auto interval."""
        self._on_saved(seconds)
        self._touched = True
        if self.interval is not None:
            self.interval.observe_commit(seconds if self._blocked is None else self._blocked, seconds)
            self._replanned()

    def _replanned(self) -> None:
        """The auto interval may have moved: the clock follows it at once, and a change worth it is logged."""
        if self.interval is not None:
            self.clock.every_seconds = self.interval.interval_s
        self._log_interval()

    def _log_interval(self) -> None:
        change = self.interval.change() if self.interval is not None else None
        if change is not None:
            self.reporter.event("checkpoint_interval", **change)

    def failed(self) -> bool:
        """World > 1, at a step boundary: whether this rank's save failed (the ranks agree on it, then :meth:`fail`)."""
        return self.sync.world > 1 and self.saver.poll_failed()

    def fail(self, ranks: int) -> None:
        """``ranks`` ranks saw their background save fail: raise that failure here (a commit fails on every rank
        together, so this rank's save thread ends with it too), or a PeerError should it have succeeded here."""
        step = self.saver.in_flight
        self.saver.wait()  # raises this rank's own failure of the same commit
        raise PeerError(f"the background checkpoint of step {step} failed on {ranks} other rank(s) "
                        "(see their log lines); stopping this rank too")

    def due(self, step: int) -> bool:
        """At a step boundary: whether this rank's clock asks for a checkpoint after ``step`` (the trainer agrees on it
        across ranks). One process collects a finished save first: one that failed fails the run here, naming it."""
        if self.interval is not None:
            self._time_step()
        if self.sync.world == 1:
            self.saver.poll()
        return self.clock.due(step, saved_through=max(self.checkpointer.last_step, self.saver.in_flight or 0))

    def _time_step(self) -> None:
        """At a step boundary, for an auto interval: the step that just ended, beside a commit in flight (one not yet
        collected) or clear of any; not the first (warm-up); one a checkpoint began before is timed from the end of
        that checkpoint's blocked time (counted apart)."""
        assert self.interval is not None
        now, first = time.perf_counter(), self._step_at is None
        if self._step_at is not None and not self._skip_step:
            self.interval.observe_step(now - self._step_at, beside_commit=self.saver.in_flight is not None,
                                       after_commit=self._touched)
            if self._touched:  # the step after a landing added to that commit's cost: the interval is re-planned
                self._replanned()
        self._step_at, self._skip_step, self._touched = now, first, False  # after the first: the warm-up step

    def save(self, step: int, capture: Callable[[], Capture]) -> None:
        """Commit this step on every rank, once the previous save landed: ``capture()`` (a host-memory snapshot of it
        in the background, trainproof.train.async_save; inline with ``--sync-checkpoint``)."""
        t0 = time.perf_counter()
        previous = self.saver.in_flight
        waited = self.saver.wait()  # at most one save in flight; raises if the previous one failed
        if previous is not None and waited >= 0.001:
            self.reporter.event("checkpoint_wait", step=step, waiting_for=previous, seconds=waited)
        self.reporter.event("checkpoint_begin", step=step)
        self._blocked = None  # inline, the commit reports its own time while still blocking: that is the blocked time
        self.saver.save(capture(), blocked_since=t0)
        self._blocked = time.perf_counter() - t0
        self._step_at = time.perf_counter()  # the next step is timed from here: its blocked time is counted apart
        self.reporter.event("checkpoint_snapshot", step=step, blocked_s=round(self._blocked, 4))  # the record too
        self.clock.mark()

    def finish(self, step: int, reason: str, *, stop: StopFlags, stop_seen_at: float | None,
               capture: Callable[[], Capture]) -> int:
        """After the loop: land the save in flight, then commit the final step when it is new and fits on every rank
        (:func:`final_commit_skip` from the first stop request: ``stop``'s, else ``stop_seen_at``); the step of the
        last commit (without the final one, the run exits 75 from the one that landed)."""
        self.saver.wait()
        last = self.checkpointer.last_step
        if step > last:
            since = getattr(stop, "first_at", None) or stop_seen_at or time.monotonic()
            why_not = final_commit_skip(reason=reason, committed=last, measured_s=self.saver.measured_s,
                                        stopped_for_s=time.monotonic() - since, grace_s=self.grace_s)
            skip, = self.sync.sum_ints([int(why_not is not None)], f"agree whether to commit step {step}")
            if skip and why_not is None:  # every rank commits, or none: another rank's estimate says it won't fit
                why_not = f"{skip} other rank(s) estimate the final commit does not fit in --stop-grace"
            if why_not:
                self.reporter.warn(f"stopped at step {step}; the last commit is step {last}; {step - last} "
                                   f"step(s) will be redone ({why_not})")
                self.reporter.event("checkpoint_skipped", step=step, committed_step=last, why=why_not)
                return last
            self.save(step, capture)
            self.saver.wait()
        return self.checkpointer.last_step

    def abandon(self) -> None:
        """On a failure of the training thread: let the commit in flight land (its work is good), then go on failing."""
        if self.saver.in_flight is not None:
            try:
                self.saver.wait()
            except Exception as exc:  # noqa: BLE001 - the original failure is the one reported
                self.reporter.warn(str(exc))
