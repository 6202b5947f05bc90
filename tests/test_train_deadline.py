"""``--deadline``: stop early enough to commit, export and reload-check the export before it, then exit 0;
a relative deadline counts from the run's first start (deadline.json), not from each restart."""

from __future__ import annotations

import json
import time
from datetime import datetime, timedelta, timezone

import pytest

from job.errors import ConfigError
from job.lifecycle.finish import DEADLINE_FILE, resolve_run_deadline
from storage import open_store
from tests.test_train_helpers import run

HOOKS = {"TPHOOK_STEP_DELAY": "0.02"}
SLACK_S = 2.0


def test_deadline_commits_exports_and_verifies_before_it(tmp_path):
    store = tmp_path / "run"
    t0 = datetime.now(timezone.utc)
    result = run(store, "--task", "regression", "--max-steps", "1000000", "--deadline", "30s", env=HOOKS)
    ended = datetime.now(timezone.utc)
    assert result.code == 0, result.stderr
    record = json.loads((store / DEADLINE_FILE).read_text())
    at, first = datetime.fromisoformat(record["at"]), datetime.fromisoformat(record["first_start"])
    # The deadline counts from the run's first start as recorded (after the interpreter started: seconds on a
    # loaded machine), and the process ends by it.
    assert at - first == timedelta(seconds=30) and t0 <= first <= t0 + timedelta(seconds=15)
    assert ended <= at + timedelta(seconds=SLACK_S)
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
    from job.lifecycle.signals import Deadline

    d = Deadline(datetime.now(timezone.utc) + timedelta(seconds=10), margin_s=1.0, initial_save_s=1.0)
    d.finish_s = 20.0  # the export would need 30 s: too late from the start, so only the save is reserved
    assert not d.too_close() and d.finish_given_up
    fits = Deadline(datetime.now(timezone.utc) + timedelta(seconds=60), margin_s=1.0, initial_save_s=1.0)
    fits.finish_s = 20.0
    assert not fits.too_close() and not fits.finish_given_up
    fits.finish_s = 40.0  # later, a slower measured save makes the export no longer fit: stop now
    assert fits.too_close()
