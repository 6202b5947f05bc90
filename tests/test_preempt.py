"""Preemption: signals and deadlines only ask the loop to stop; it finishes the step, commits, exits 75,
and a restart continues bit for bit, with no step repeated or skipped."""

from __future__ import annotations

import os
import random
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import pytest

from trainproof.errors import ConfigError
from trainproof.lifecycle.signals import Deadline, StopRequest, parse_deadline
from tests.test_train_helpers import (differences, finish, from_step, history_rows, load_state, parse_events, run, start,
                                      startup_s, trajectory)

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=timezone.utc)
TARGET = 400
# Test-only hooks: 10 ms steps so a signal can land mid-run; saves that block 0.8 s after writing the state
# (before COMPLETE.json), so a signal sent up to 0.2 s after "checkpoint_begin" lands inside the save.
HOOKS = {"TPHOOK_STEP_DELAY": "0.01", "TPHOOK_SAVE_DELAY": "0.8"}


@pytest.mark.parametrize(("text", "seconds"), [("90s", 90), ("10m", 600), ("2h", 7200), ("1h30m", 5400),
                                               ("1d", 86400), ("250ms", 0.25), ("1.5h", 5400),
                                               ("2d23h31m", 2 * 86400 + 23 * 3600 + 31 * 60)])
def test_durations_count_from_now(text, seconds):
    assert parse_deadline(text, NOW) == NOW + timedelta(seconds=seconds)


def test_iso_times_are_absolute():
    assert parse_deadline("2026-01-02T00:00:00Z", NOW) == datetime(2026, 1, 2, tzinfo=timezone.utc)
    assert parse_deadline("2026-01-02T01:00:00+01:00", NOW) == datetime(2026, 1, 2, tzinfo=timezone.utc)
    assert parse_deadline("2026-01-02T00:00:00", NOW).tzinfo is not None  # naive: the local zone


@pytest.mark.parametrize("text", ["", "soon", "10", "5x", "10m garbage"])
def test_bad_deadlines_are_config_errors(text):
    with pytest.raises(ConfigError, match="--deadline"):
        parse_deadline(text, NOW)


def test_deadline_reserves_a_step_a_save_and_a_margin():
    d = Deadline(datetime.now(timezone.utc) + timedelta(seconds=10), margin_s=1.0, initial_save_s=1.0)
    assert not d.too_close()  # 10 s left > 0 + 1.5 + 1
    d.observe_save(4.0)  # 1.5 x 4 + 1 = 7 s needed
    assert not d.too_close()
    d.observe_step(3.0)  # 3 + 6 + 1 = 10 s needed
    assert d.too_close()
    assert not Deadline(None).too_close()


def test_signals_only_set_the_flag_and_handlers_are_restored():
    before = signal.getsignal(signal.SIGTERM)
    with StopRequest() as stop:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt either
        time.sleep(0.01)
        assert stop.signals == ["SIGTERM", "SIGINT"]
    assert signal.getsignal(signal.SIGTERM) is before


def _read_until(proc, event: str, lines: list[str]) -> dict:
    """Read the process's JSON lines until ``event`` appears (fails if the process ends first)."""
    while True:
        line = proc.stdout.readline()
        assert line, f"process ended before {event!r}: {lines[-3:]}"
        lines.append(line)
        found = parse_events(line)
        if found and found[0]["event"] == event:
            return found[0]


def _interrupt(proc, mode: str, rnd: random.Random) -> tuple[list[str], dict | None]:
    """Deliver SIGTERM(s) according to ``mode``; return the lines read and the save it aimed at."""
    lines: list[str] = []
    _read_until(proc, "start", lines)  # handlers are installed before this line is printed
    if mode == "random":
        # From the first step on: a signal before it stops at step 0, with nothing committed (a draw of a few ms
        # did that on a fast machine: a chance in fifty per chain)
        _read_until(proc, "step", lines)
        time.sleep(rnd.uniform(0.0, 0.5))
        proc.send_signal(signal.SIGTERM)
        return lines, None
    save = _read_until(proc, "checkpoint_begin", lines)
    time.sleep(rnd.uniform(0.0, 0.2))  # the save takes > 0.8 s (test hook): this lands inside it
    proc.send_signal(signal.SIGTERM)
    if mode == "double-in-save":
        time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
    return lines, save


def _chain(store, modes: list[str], rnd: random.Random, seed: int, sync: bool) -> list[int]:
    """Start, interrupt and restart one run once per mode; return the step each process stopped at.

    ``sync``: --sync-checkpoint (a save blocks training); else asynchronous checkpoints (the default), where
    training goes on during a save and the boundary after the signal is committed too."""
    args = ("--max-steps", str(TARGET), "--checkpoint-every", "7", "--keep", "2", *(["--sync-checkpoint"] if sync else []))
    stopped_at = [0]
    for trial, mode in enumerate(modes):
        proc = start(store, *args, env=HOOKS)
        _, save = _interrupt(proc, mode, rnd)
        result = finish(proc)
        where = f"{store.name} trial {trial} ({mode}, TRAINPROOF_TEST_SEED={seed}): {result.stderr}"
        assert result.code == 75, where
        stopped = result.last("stopped")
        assert stopped["reason"] == "signal" and stopped["exit_code"] == 75, where
        if save is not None:  # signalled during a save: that save completes...
            if sync:  # ...and no further step is taken
                assert stopped["step"] == save["step"], where
            else:  # ...and so does the commit of the step the loop stopped at
                assert stopped["step"] >= save["step"], where
                assert load_state(store, save["step"], history="own")["progress"]["step"] == save["step"], where
            # The second SIGTERM of "double-in-save" is sent 50 ms after the first; on a loaded machine the save
            # may finish and the stop be recorded before it lands (then only one is listed). Never more.
            assert 1 <= len(stopped["signals"]) <= (2 if mode == "double-in-save" else 1), where
        assert load_state(store, history="own")["progress"]["step"] == stopped["step"] >= stopped_at[-1], where
        said = [ln for ln in result.stderr.splitlines() if ln.startswith("trainproof: stopped")]
        assert len(said) == 1 and f"committing step {stopped['committed_step']} of" in said[0], where  # committed
        stopped_at.append(stopped["step"])
    return stopped_at


def test_sigterm_at_random_moments_loses_nothing_and_resumes_exactly(tmp_path):
    """6 interrupted processes (two chains of 3 run side by side, one with --sync-checkpoint, one with the
    default asynchronous checkpoints; 10 with TRAINPROOF_SLOW=1), then each chain runs to the target."""
    seed = int(os.environ.get("TRAINPROOF_TEST_SEED", time.time_ns() % 10**9))
    reference = start(tmp_path / "reference", "--max-steps", str(TARGET))
    modes = ["random", "in-save", "double-in-save"]  # every kind once; TRAINPROOF_SLOW=1: five links a chain
    if os.environ.get("TRAINPROOF_SLOW") == "1":
        modes += ["random", "in-save"]
    stores = [tmp_path / "chain-a", tmp_path / "chain-b"]
    with ThreadPoolExecutor(2) as pool:
        chains = list(pool.map(lambda i: _chain(stores[i], modes, random.Random(seed + i), seed, sync=i == 0), range(2)))
    finals = [start(s, "--max-steps", str(TARGET)) for s in stores]
    results = [finish(p) for p in [reference, *finals]]
    assert [r.code for r in results] == [0, 0, 0], [r.stderr for r in results]
    reference = load_state(tmp_path / "reference")
    for store, stopped_at in zip(stores, chains):
        assert stopped_at[-1] > stopped_at[1] > 0, stopped_at  # the chain made progress across restarts
        # --keep 2 deleted the older generations and, with them, the history rows before the kept ones: the rows
        # kept and the chain value before them (which covers every older row) are compared.
        got = load_state(store, history="kept")
        assert differences(trajectory(from_step(reference, got["history_chain"]["first"])), trajectory(got)) == []
        assert [r["step"] for r in history_rows(got)] == list(range(got["history_chain"]["first"], TARGET + 1))


def test_deadline_stops_in_time_after_committing(tmp_path):
    # The periodic checkpoints give the deadline logic a measured save time early on. The export and its reload
    # check are given up at the first check when the time left is under a step + 1.5 x the 1 s save guess + the
    # 1 s margin + 1.5 x the export's reserve (3.5 s + 1.5 x this process's start-up s): ~7.75 s + 2.25 s. A deadline
    # of 5 s + 2 x the start-up measured just before (s') gives that up whenever s' < 1.4 + 1.6 s, and leaves time to
    # train (more than a step, the save and the margin after the start-up) whenever s < 2.5 + 2 s'. So the export is
    # given up: commit, exit 75, whatever the machine's speed (a deadline scaled by the load average alone was
    # long enough to export on a machine whose load average was high and whose start-up was quick).
    deadline_s = 5 + 2 * min(startup_s(tmp_path / "probe-1"), startup_s(tmp_path / "probe-2"))  # not one spike
    result = run(tmp_path / "run", "--max-steps", "100000", "--deadline", f"{round(deadline_s)}s",
                 "--checkpoint-every", "25",
                 "--log-every", "1000", env={"TPHOOK_STEP_DELAY": "0.01"})
    assert result.code == 75, result.stderr
    stopped = result.last("stopped")
    assert stopped["reason"] == "deadline" and stopped["step"] > 0 and not stopped["export"]["ok"]
    assert load_state(tmp_path / "run", history="own")["progress"]["step"] == stopped["step"]
    deadline = datetime.fromisoformat(result.last("start")["deadline"])
    assert datetime.fromisoformat(stopped["time"]) < deadline
