"""``train --checkpoint-every auto``: the interval follows the run's own interruptions and checkpoint cost.

Real processes on a folder store: a run's attempt records (two SIGKILLs, one honoured SIGTERM) make the next
attempt's interval shorter; commits that block longer make it longer. The planner's calculation on records made
up here covers what the processes cannot reach cheaply (the bounds, the fallback to the defaults)."""

from __future__ import annotations

import signal
import statistics
import time
from dataclasses import replace

import pytest

from tests.support.timing import budget
from tests.test_dist_helpers import read_until
from tests.test_train_helpers import finish, start
from trainproof.errors import ConfigError
from trainproof.lifecycle.autointerval import FIRST_S, MAX_S, MIN_S, AutoInterval
from trainproof.lifecycle.goodput import Attempt, Report
from trainproof.lifecycle.goodput import _attempt as parse_attempt
from trainproof.train.attempts import SCHEMA
from trainproof.lifecycle.planner import PlanInputs, daly_interval
from trainproof.train.config import TrainConfig
from trainproof.train.loop import train as train_in_process

AUTO = ("--checkpoint-every", "auto", "--sync-checkpoint", "--log-format", "json")
CHEAP = {"TPHOOK_SAVE_DELAY": "0.2"}  # test-only: each (inline) commit blocks training this long at least
DEAR = {"TPHOOK_SAVE_DELAY": "4.0"}
SLOW_STEPS = {"TPHOOK_STEP_DELAY": "0.05", "TPHOOK_ATTEMPT_REFRESH": "0"}


def _records(store) -> int:
    folder = store / "attempts"
    return len(list(folder.glob("*.json"))) if folder.is_dir() else 0


def _interrupt(store, how: signal.Signals):
    """One attempt that trains until its record is in the store, then gets ``how``."""
    before = _records(store)
    proc = start(store, *AUTO, "--steps", "100000", env={**SLOW_STEPS, **CHEAP})
    read_until(proc, lambda e: e.get("event") == "step", [])
    deadline = time.monotonic() + budget(30)
    while _records(store) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(how)
    return finish(proc)


def test_auto_shortens_the_interval_after_kills_not_after_honoured_stops_and_lengthens_it_for_dear_commits(tmp_path):
    quiet, dear_run = tmp_path / "quiet", tmp_path / "dear"
    procs = start(quiet, *AUTO, "--steps", "3", env=CHEAP), start(dear_run, *AUTO, "--steps", "3", env=DEAR)
    first, dear = (finish(p) for p in procs)
    for r in (first, dear):
        assert r.code == 0, r.stderr
    calm, costly = first.last("checkpoint_interval"), dear.last("checkpoint_interval")
    # No interruption yet: M is the planner's 6 h; the commit that blocks ten times longer gets a longer interval.
    assert calm["interruptions"] == costly["interruptions"] == 0
    # (Both blocked times include what the machine's load adds; the difference is at least most of the 3.8 s.)
    assert costly["checkpoint_s"] - calm["checkpoint_s"] > 3.0
    assert costly["interval_s"] > 1.5 * calm["interval_s"]  # T grows as sqrt(C): sqrt(4.2 / 0.2) quiet

    killed = [_interrupt(quiet, signal.SIGKILL) for _ in range(2)]
    assert [k.code for k in killed] == [-9, -9]
    stopped = _interrupt(quiet, signal.SIGTERM)
    assert stopped.code == 75, stopped.stderr
    after = finish(start(quiet, *AUTO, "--steps", "3", env=CHEAP))
    assert after.code == 0, after.stderr
    planned = [e for e in after.events if e.get("event") == "checkpoint_interval"][0]  # before its own commit
    assert (planned["interruptions"], planned["cheap_stops"]) == (2, 1)  # the SIGTERM committed its last step
    assert planned["mtbi_s"] < 600 < calm["mtbi_s"]
    assert after.last("checkpoint_interval")["interval_s"] < calm["interval_s"] / 2


def _attempt(start: float, end: float, *, how: str | None, steps=(0, 10), commits: int = 1, blocked: float = 0.5):
    return Attempt(name=f"{start}.json", started=start, updated=end, ended=end if how else None, end=how,
                   reason="signal" if how == "stopped" else None, resumed_from=steps[0], last_step=steps[1],
                   startup_s=1.0, restore_s=0.0, train_s=end - start - 1.0, blocked_s=blocked * commits,
                   commits=commits, committed_step=steps[1] if how else steps[0], finish_s=0.0)


def test_the_planner_counts_only_interruptions_that_lost_work_and_keeps_its_bounds():
    clock = lambda: 0.0  # noqa: E731 - this process has been running no time at all
    # Killed at step 10 after committing 0, resumed from 0: lost work. Stopped at 20 committing 20: cheap.
    report = Report(attempts=[_attempt(0, 100, how=None, steps=(0, 10), commits=0),
                              _attempt(150, 250, how="stopped", steps=(0, 20)),
                              _attempt(300, 400, how="done", steps=(20, 30), blocked=0.8)])
    plan = AutoInterval.from_report(report, clock=clock)
    assert (plan.interruptions, plan.cheap_stops) == (1, 1)
    assert plan.mtbi_s == 300.0  # three attempts' exposure over one interruption
    assert plan.checkpoint_s == pytest.approx(0.8)  # the newest attempt with commits, per commit
    assert plan.interval_s == pytest.approx(max(MIN_S, daly_interval(0.8, 300.0)))
    # The newest attempt's interference counts too: 10 steps beside commits at 0.5 s, clear ones at 0.2 s.
    slowed = Report(attempts=[replace(_attempt(300, 400, how="done", steps=(20, 30), blocked=0.8, commits=2),
                                      step_times=(20, 4.0, 10, 5.0))])
    assert AutoInterval.from_report(slowed, clock=clock).checkpoint_s == pytest.approx((1.6 + 10 * 0.3) / 2)

    # Honoured stops lose no work but say how often the machine is interrupted: one SIGTERM 40 s in, and the share
    # of stops that lose work is still 1/3 (one imagined of each kind): M = 40 / 1 / (1/3); ten honoured, none lost:
    # the exposure / 10 / (1/12).
    early = Report(attempts=[_attempt(0, 40, how="stopped", steps=(0, 20))])
    assert AutoInterval.from_report(early, clock=clock).mtbi_s == pytest.approx(120.0)
    calm = Report(attempts=[_attempt(100 * i, 100 * i + 100, how="stopped", steps=(20 * i, 20 * i + 20))
                            for i in range(10)])
    assert AutoInterval.from_report(calm, clock=clock).mtbi_s == pytest.approx(1000 / 10 * 12)
    # A stop whose final commit was skipped lost the steps after its commit: the next attempt resumed before them.
    lossy = Report(attempts=[_attempt(0, 100, how="stopped", steps=(0, 20)), _attempt(150, 250, how="done",
                                                                                      steps=(15, 30))])
    assert AutoInterval.from_report(lossy, clock=clock).interruptions == 1

    fresh = AutoInterval(clock=clock)  # nothing measured: the planner's defaults, the first commit within FIRST_S
    defaults = PlanInputs(rental_s=1.0)
    assert fresh.interval_s == FIRST_S < daly_interval(defaults.checkpoint_s, defaults.mtbi_s)
    assert AutoInterval(past_checkpoint_s=defaults.checkpoint_s, clock=clock).interval_s == daly_interval(
        defaults.checkpoint_s, defaults.mtbi_s)  # the same C measured by an earlier attempt: the planner's interval
    assert fresh.change() is not None and fresh.change() is None  # logged once, then only when it moves

    fresh.observe_commit(blocked_s=0.001, commit_s=40.0)  # cheap to block, slow to land: never shorter than a commit
    assert fresh.interval_s == 40.0 and fresh.change()["previous_s"] is not None
    # Nor is a new process's first interval, before it has landed one of its own: the newest attempt's commits say
    # how long one takes to land (the median of its newest; a record that lists no durations says nothing).
    slow = Report(attempts=[replace(_attempt(0, 40, how="stopped", steps=(0, 20), commits=3, blocked=0.01),
                                    commit_seconds=[30.0, 50.0, 45.0]),
                            _attempt(50, 60, how="stopped", steps=(20, 20), commits=0)])
    assert daly_interval(0.01, 50 / 2 / (1 / 4)) < 45.0 == AutoInterval.from_report(slow, clock=clock).interval_s
    unlisted = Report(attempts=[_attempt(0, 40, how="stopped", steps=(0, 20), commits=3, blocked=0.01)])
    assert AutoInterval.from_report(unlisted, clock=clock).interval_s < 45.0
    record = {"schema": SCHEMA, "started_at": "2026-01-01T00:00:00+00:00", "updated_at": "2026-01-01T00:01:00+00:00",
              "recent_commits": [{"step": 5, "seconds": 12.5}, {"step": 6, "seconds": -1}, {"step": 7, "seconds": "x"},
                                 {"step": 8}, "junk", {"step": 9, "seconds": 1e300}, {"step": 10, "seconds": 7}]}
    assert parse_attempt("planted.json", record).commit_seconds == [12.5, 7.0]  # what is not a duration: left out

    # Steps slowed beside a commit are part of what it costs: 4 steps of 0.5 s beside it, clear steps 0.2 s.
    slowed = AutoInterval(clock=clock)
    for seconds, beside in [(0.2, False), (0.2, False), (0.5, True), (0.5, True), (0.5, True), (0.5, True)]:
        slowed.observe_step(seconds, beside_commit=beside)
    slowed.observe_commit(blocked_s=0.1, commit_s=2.0)
    assert slowed.checkpoint_s == pytest.approx(0.1 + 4 * 0.3)
    slowed.observe_commit(blocked_s=0.2, commit_s=2.0)  # no step beside the second: its blocked time only
    assert slowed.checkpoint_s == pytest.approx((1.3 + 0.2) / 2)
    slowed.observe_step(0.6, beside_commit=False, after_commit=True)  # the step after it landed, slowed: its cost
    assert slowed.checkpoint_s == pytest.approx((1.3 + 0.2 + 0.4) / 2)
    fresh.observe_commit(blocked_s=1e4, commit_s=1e4)
    assert fresh.interval_s == MAX_S


def test_auto_is_a_word_or_a_step_count_and_nothing_else(tmp_path):
    assert TrainConfig(store=str(tmp_path), checkpoint_every="AUTO").auto_interval
    assert TrainConfig(store=str(tmp_path), checkpoint_every="25").every_steps == 25
    for bad in ("-1", "sometimes", "2.5"):
        with pytest.raises(ConfigError, match="--checkpoint-every must be"):
            TrainConfig(store=str(tmp_path), checkpoint_every=bad)


def test_auto_counts_what_a_background_commit_slows_the_steps_beside_it(tmp_path, monkeypatch):
    """The real trainer and background saver, in-process: each commit takes 0.4 s, steps take 0.1 s longer while one
    is in flight (what serialising and uploading on the training machine's cores does). The interval's C must be the
    blocked time plus that slowing, measured from the steps themselves; blocked time alone is a few ms.

    A step is slowed when a save is in flight at its end, the moment the trainer labels it beside a commit or clear
    (the saver's ``in_flight``, set and cleared by the training thread only): the slowing and the label cannot
    disagree, whatever the load does to the save thread (its encoding before ``commit``, its start, its end)."""
    from trainproof.lifecycle import autointerval
    from trainproof.train import async_save, checkpoint, loop
    from trainproof.train.progress import Reporter

    savers: list[async_save.BackgroundSaver] = []
    step, commit, submit = loop.train_step, checkpoint.Checkpointer.commit, async_save.BackgroundSaver.submit

    def slow_step(run):
        record = step(run)
        time.sleep(0.02 + (0.1 if any(s.in_flight is not None for s in savers) else 0.0))
        return record

    def slow_commit(self, capture):
        time.sleep(0.4)
        return commit(self, capture)

    def seen_submit(self, *args, **kwargs):
        savers.append(self)
        return submit(self, *args, **kwargs)

    monkeypatch.setattr(loop, "train_step", slow_step)
    monkeypatch.setattr(checkpoint.Checkpointer, "commit", slow_commit)
    monkeypatch.setattr(async_save.BackgroundSaver, "submit", seen_submit)
    monkeypatch.setattr(autointerval, "MIN_S", 1.0)  # many commits in a short test; the planner would pick less

    class Seen(AutoInterval):
        def __init__(self) -> None:
            super().__init__(past_checkpoint_s=1e-3, past_exposure_s=1.0, interruptions=10)  # M ~ 0.1 s: the floor
            self.steps: list[tuple[float, bool]] = []
            self.costs: list[tuple[float, float]] = []

        def observe_step(self, seconds: float, *, beside_commit: bool, after_commit: bool = False) -> None:
            self.steps.append((seconds, beside_commit))
            super().observe_step(seconds, beside_commit=beside_commit, after_commit=after_commit)
            if after_commit and not beside_commit and self.costs:  # the step after a landing adds to its cost
                blocked, _, beside = self.costs[-1]
                self.costs[-1] = (blocked, self._cost[-1], beside)

        def observe_commit(self, blocked_s: float, commit_s: float) -> None:
            beside = [s for s, b in self.steps if b]
            self.steps.clear()
            super().observe_commit(blocked_s, commit_s)
            self.costs.append((blocked_s, self._cost[-1], len(beside)))


    seen = Seen()
    cfg = TrainConfig(store=str(tmp_path / "run"), max_steps=150, checkpoint_every="auto", log_format="json",
                      log_every=10**6, tensorboard="off")
    assert train_in_process(cfg, reporter=Reporter(), interval=seen).exit_code == 0
    mid = [c for c in seen.costs if c[2]]  # commits with steps beside them (not the final one, after the loop)
    assert len(mid) >= 2, seen.costs
    for blocked, cost, beside in mid:
        # At least 0.1 s per step beside it (load makes the clear steps slower too, never the difference smaller
        # than what the sleep adds, less the mean's spread), at most what the steps beside it took in all.
        assert cost - blocked >= 0.7 * 0.1 * beside, seen.costs
        assert cost - blocked <= beside * 1.0, seen.costs
    # Blocked alone would have been C: a few ms (the median; under load a commit can outlast the 1 s interval, and
    # the next one then blocks while it waits for it to land).
    assert seen.checkpoint_s > 10 * statistics.median(b for b, _, _ in mid)


def test_the_clock_follows_the_interval_replanned_by_the_step_after_a_landing():
    """The step after a commit landed adds to that commit's cost, and may move the interval: the trainer's clock must
    use the moved one from the next step boundary on (not only after the next commit)."""
    from trainproof.train.progress import Reporter
    from trainproof.train.saver import SaveClock, Saving

    class Moving:
        interval_s = 30.0

        def observe_step(self, seconds: float, *, beside_commit: bool, after_commit: bool = False) -> None:
            if after_commit:
                self.interval_s = 12.0

        def change(self):
            return {"interval_s": self.interval_s}

    class Idle:
        in_flight = None

    events: list[tuple[str, dict]] = []

    class Seen(Reporter):
        def event(self, name: str, **fields) -> None:
            events.append((name, fields))

    saving = Saving.__new__(Saving)  # only what a step boundary touches: no store, no checkpointer
    saving.interval, saving.saver, saving.reporter = Moving(), Idle(), Seen()
    saving.clock = SaveClock(every_seconds=30.0)
    saving._step_at, saving._skip_step, saving._touched = time.perf_counter(), False, True
    saving._time_step()
    assert saving.clock.every_seconds == 12.0 and events == [("checkpoint_interval", {"interval_s": 12.0})]
