"""``--deadline``: stop early enough to commit, export and reload-check the export before it, then exit 0;
a relative deadline counts from the run's first start (deadline.json), not from each restart."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from trainproof.errors import ConfigError
from trainproof.lifecycle.finish import DEADLINE_FILE, resolve_run_deadline
from trainproof.storage import open_store
from tests.support.timing import budget
from tests.test_train_helpers import run, startup_s

HOOKS = {"TPHOOK_STEP_DELAY": "0.02"}
SLACK_S = 2.0
"""How late after the deadline this test may see the process gone (pipes closed, the harness scheduled), on a quiet
machine; scaled by the machine's load when it is used (the product reserves its own end, Finisher.exit_s)."""


def test_deadline_commits_exports_and_verifies_before_it(tmp_path):
    store = tmp_path / "run"
    # Long enough for the export whatever this machine's start-up s now: the export is given up at the first check
    # only when the time left is under ~8.25 s + 2.25 s (trainproof.lifecycle.signals.Deadline), and 20 s + 4 s'
    # less the start-up leaves more (s' measured just before; a fixed 30 s failed once the start-up passed ~6.5 s).
    started = startup_s(tmp_path / "probe")
    seconds = round(20 + 4 * started)
    t0 = datetime.now(timezone.utc)
    result = run(store, "--task", "regression", "--max-steps", "1000000", "--deadline", f"{seconds}s", env=HOOKS)
    ended = datetime.now(timezone.utc)
    assert result.code == 0, result.stderr
    record = json.loads((store / DEADLINE_FILE).read_text())
    at, first = datetime.fromisoformat(record["at"]), datetime.fromisoformat(record["first_start"])
    # The deadline counts from the run's first start as recorded (after the interpreter started: seconds on a
    # loaded machine), and the process ends by it.
    assert at - first == timedelta(seconds=seconds) and t0 <= first <= t0 + timedelta(seconds=budget(5) + 2 * started)
    assert ended <= at + timedelta(seconds=budget(SLACK_S))
    done = result.last("done")
    assert done["reason"] == "deadline" and done["export"]["ok"], done
    step = done["step"]
    assert step > 0
    assert (store / f"step-{step:08d}" / "COMPLETE.json").exists()
    bundle = store / "exports" / f"step-{step:08d}"
    complete = json.loads((bundle / "COMPLETE.json").read_text())
    check = json.loads((store / "exports" / f"step-{step:08d}.reload-check.json").read_text())
    assert check["passed"] and check["step"] == step
    assert datetime.fromtimestamp((bundle / "COMPLETE.json").stat().st_mtime, timezone.utc) < at
    assert datetime.fromisoformat(check["checked_at"]) <= at
    assert complete["step"] == step
    summary = json.loads((store / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["export"]["ok"]


def test_the_finishing_reserve_covers_this_process_end_and_cuts_the_reload_check_before_it(monkeypatch, tmp_path):
    """The export's reserve holds the reload check (a fresh process: this one's start-up) and this process's own
    end, and the reload check is given only what is left of the deadline less that end."""
    import trainproof.proof.reload as reload
    from trainproof.lifecycle.finish import Finisher

    slow, quick = Finisher(startup_s=6.0, task="regression"), Finisher(startup_s=2.0, task="regression")
    assert slow.exit_s() > quick.exit_s() > 0
    assert slow.estimate_s(1.0) - quick.estimate_s(1.0) > 4.0  # start-up and end both grow with a slow start
    assert quick.estimate_s(3.0) - quick.estimate_s(1.0) == pytest.approx(4.0)  # twice the save
    given = {}

    def fake_export_and_check(store, *, ends_at, **_):
        given["left"] = ends_at - time.monotonic()
        raise OSError("stop here")

    monkeypatch.setattr(reload, "export_and_check", fake_export_and_check)
    result = slow.export_and_check(open_store(str(tmp_path / "run")), 60.0, 1.0)
    assert not result["ok"] and "stop here" in result["why"]
    assert 60.0 - slow.exit_s() - 1.0 < given["left"] <= 60.0 - slow.exit_s()
    assert "needs" in slow.export_and_check(open_store(str(tmp_path / "run")), slow.estimate_s(1.0) - 0.1, 1.0)["why"]


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="process start times from /proc (Linux)")
def test_process_age_counts_from_the_process_start():
    """A process 0.3 s old is 0.3 s old, whatever later fallback time it is given (that is only for other systems)."""
    import subprocess
    import sys

    code = ("import time; time.sleep(0.3); from trainproof.lifecycle.finish import process_age_s; "
            "print(process_age_s(time.monotonic()))")
    age = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    assert 0.3 <= age < 0.3 + budget(5.0)


@pytest.mark.parametrize("occupant", ["folder", "fifo", "symlink-to-fifo"])
def test_a_deadline_record_that_is_not_a_file_never_stops_a_start(tmp_path, occupant):
    """deadline.json planted as a folder, a FIFO or a link (to a FIFO: a read would block) on a folder store: the
    start counts the deadline afresh (from now: no plan yet), writes its record, and a folder is moved aside."""
    import os

    root = tmp_path / "run"
    root.mkdir()
    target = root / DEADLINE_FILE
    if occupant == "folder":
        (target / "x").mkdir(parents=True)
    elif occupant == "fifo":
        os.mkfifo(target)
    else:
        os.mkfifo(tmp_path / "pipe")
        target.symlink_to(tmp_path / "pipe")
    before = datetime.now(timezone.utc)
    at = resolve_run_deadline(open_store(str(root)), "90m")
    assert before + timedelta(minutes=90) <= at <= datetime.now(timezone.utc) + timedelta(minutes=90)
    assert target.is_file() and not target.is_symlink()
    assert datetime.fromisoformat(json.loads(target.read_text())["at"]) == at
    moved = list((root / "quarantine").glob(f"{DEADLINE_FILE}-*/OCCUPANT"))
    assert len(moved) == (1 if occupant == "folder" else 0)  # a FIFO or link is replaced by the write itself
    assert (tmp_path / "pipe").exists() == (occupant == "symlink-to-fifo")  # what a link led to is untouched


def test_relative_deadline_counts_from_the_first_start(tmp_path, caplog):
    run_store = open_store(str(tmp_path / "run"))
    first = resolve_run_deadline(run_store, "90m")
    time.sleep(0.05)
    assert resolve_run_deadline(run_store, "90m") == first  # a restart does not move it
    changed = resolve_run_deadline(run_store, "2h")  # a changed value wins, still from the first start
    assert changed - first == timedelta(minutes=30)
    assert "changed" in caplog.text
    with pytest.raises(ConfigError, match="--rental-ends"):
        resolve_run_deadline(run_store, "3h", absolute_only=True)
    at = (datetime.now(timezone.utc) + timedelta(days=1)).replace(microsecond=0)
    assert resolve_run_deadline(run_store, at.isoformat(), absolute_only=True) == at


def test_rental_ends_refuses_a_duration(tmp_path):
    result = run(tmp_path / "run", "--rental-ends", "2h")
    assert result.code == 2 and "--rental-ends" in result.stderr
    assert not (tmp_path / "run" / DEADLINE_FILE).exists()


def test_export_reserve_is_given_up_when_it_never_fitted():
    from trainproof.lifecycle.signals import Deadline

    d = Deadline(datetime.now(timezone.utc) + timedelta(seconds=10), margin_s=1.0, initial_save_s=1.0)
    d.finish_s = 20.0  # the export would need 30 s: too late from the start, so only the save is reserved
    assert not d.too_close() and d.finish_given_up
    fits = Deadline(datetime.now(timezone.utc) + timedelta(seconds=60), margin_s=1.0, initial_save_s=1.0)
    fits.finish_s = 20.0
    assert not fits.too_close() and not fits.finish_given_up
    fits.finish_s = 40.0  # later, a slower measured save makes the export no longer fit: stop now
    assert fits.too_close()


@pytest.mark.parametrize("forged", ["first-start-before-the-plan", "at-in-the-past"])
def test_an_overwritten_deadline_record_does_not_end_the_run_early(tmp_path, forged):
    """A co-tenant rewrites deadline.json so the deadline has passed: the run still trains to its target (the
    operator's --deadline, counted from its real first start) instead of stopping at once with exit 0."""
    store = tmp_path / "run"
    assert run(store, "--max-steps", "3", "--deadline", "1h").code == 0
    record = json.loads((store / DEADLINE_FILE).read_text())
    long_ago = datetime.now(timezone.utc) - timedelta(days=3)
    if forged == "first-start-before-the-plan":
        record.update(first_start=long_ago.isoformat(), at=(long_ago + timedelta(hours=1)).isoformat())
    else:
        record["at"] = long_ago.isoformat()
    (store / DEADLINE_FILE).write_text(json.dumps(record))
    result = run(store, "--max-steps", "6", "--deadline", "1h")
    assert result.code == 0, result.stderr
    done = result.last("done")
    assert done["reason"] == "target" and done["step"] == 6, done
    tampering = [line for line in result.stderr.splitlines() if "tampered" in line]
    assert len(tampering) == (1 if forged == "first-start-before-the-plan" else 0), result.stderr


def test_with_a_signing_key_the_deadline_record_is_signed_and_an_unsigned_one_is_refused(tmp_path, monkeypatch,
                                                                                      caplog):
    monkeypatch.setenv("TRAINPROOF_SIGNING_KEY", "k" * 32)
    run_store = open_store(str(tmp_path / "run"))
    first = resolve_run_deadline(run_store, "90m")
    record = json.loads((tmp_path / "run" / DEADLINE_FILE).read_text())
    assert record["signature"]["alg"] == "hmac-sha256"
    assert resolve_run_deadline(run_store, "90m") == first  # its own signed record is believed
    record.pop("signature")
    record["first_start"] = (first - timedelta(minutes=89)).isoformat()  # within the plan check (no plan here)
    (tmp_path / "run" / DEADLINE_FILE).write_text(json.dumps(record))
    later = resolve_run_deadline(run_store, "90m")
    assert later > first and "tampered" in caplog.text and "unsigned" in caplog.text
