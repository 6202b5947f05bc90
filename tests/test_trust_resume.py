"""A planted or damaged generation never crash-loops the Job: resume falls back to the previous one.

Each case plants a generation that *verifies* (its COMPLETE.json lists the right sizes and sha256s, as a
writer of the bucket can arrange) but must not be resumed from, then restarts the real trainer and checks
that it falls back, says so in one warning line, exits 0 and reaches exactly the state of an untouched run.
"""

from __future__ import annotations

import pytest

from trainproof.format.state import STATE_FILE, decode, encode
from trainproof.storage import open_store
from tests.test_train_helpers import differences, from_step, load_state, run, trajectory

TARGET = 10


@pytest.fixture(scope="module")
def untouched(tmp_path_factory):
    """The reference: 10 steps, uninterrupted."""
    d = tmp_path_factory.mktemp("untouched")
    result = run(d / "run", "--max-steps", str(TARGET))
    assert result.code == 0, result.stderr
    return load_state(d / "run")


def _trained_to_six(tmp_path):
    store = tmp_path / "run"
    result = run(store, "--max-steps", "6", "--checkpoint-every", "2", "--keep", "0")
    assert result.code == 0, result.stderr
    return store, open_store(str(store))


def _plant(s, step: int, state_bytes: bytes, code_version: str) -> None:
    """Commit ``state_bytes`` as generation ``step`` through the store API, hashes and all."""
    manifest = s.load(6).info.manifest
    s.commit(step, {STATE_FILE: state_bytes}, contract=manifest["contract"], world=1, code_version=code_version,
             digests={"state": STATE_FILE})


def _resume_to_target(store, untouched):
    result = run(store, "--max-steps", str(TARGET))
    assert result.code == 0, result.stderr
    assert result.last("resume")["step"] == 6, result.events
    got = load_state(store, history="kept")  # the default --keep 3 deleted the oldest generations
    assert differences(trajectory(from_step(untouched, got["history_chain"]["first"])), trajectory(got)) == []
    return result


def test_an_older_state_under_a_newer_name_is_quarantined_and_the_run_falls_back(tmp_path, untouched):
    store, s = _trained_to_six(tmp_path)
    older = s.load(4).files[STATE_FILE]
    _plant(s, 7, older, decode(older)["meta"]["code_version"])
    assert s.load(7).info.step == 7  # it verifies: sizes and sha256 match its manifest
    result = _resume_to_target(store, untouched)
    warnings = [line for line in result.stderr.splitlines() if "step-00000007" in line and "inconsistent" in line]
    assert len(warnings) == 1 and "progress.step is 4" in warnings[0], result.stderr
    assert [name.startswith("quarantine/step-00000007") for name, _ in s.quarantined()] == [True]


def test_a_state_of_another_contract_under_this_runs_manifest_is_quarantined(tmp_path, untouched):
    store, s = _trained_to_six(tmp_path)
    state = decode(s.load(6).files[STATE_FILE])
    state["meta"]["contract"] = "0" * 64
    _plant(s, 8, encode(state), state["meta"]["code_version"])
    result = _resume_to_target(store, untouched)
    assert "state contract is" in result.stderr and "step-00000008" in result.stderr


def test_a_newer_generation_of_other_code_is_passed_over_for_one_of_this_build(tmp_path, untouched):
    """Not damage (it is not quarantined), but not a reason to fail the Job when this build's own is there."""
    store, s = _trained_to_six(tmp_path)
    other = tmp_path / "other"
    assert run(other, "--max-steps", "7").code == 0
    state = decode(open_store(str(other)).load(7).files[STATE_FILE])
    state["meta"]["code_version"] = "trainproof 9.9.9"
    _plant(s, 7, encode(state), "trainproof 9.9.9")
    result = _resume_to_target(store, untouched)
    assert "step-00000007: written by 'trainproof 9.9.9'" in result.stderr
    assert s.quarantined() == []


def test_only_generations_of_other_code_is_the_persons_call_exit_2(tmp_path):
    store = tmp_path / "run"
    assert run(store, "--max-steps", "3").code == 0
    s = open_store(str(store))
    state = decode(s.load(3).files[STATE_FILE])
    state["meta"]["code_version"] = "trainproof 9.9.9"
    manifest = s.load(3).info.manifest
    s.quarantine(3, "moved aside by the test")
    s.commit(3, {STATE_FILE: encode(state)}, contract=manifest["contract"], world=1, code_version="trainproof 9.9.9",
             digests={"state": STATE_FILE})
    result = run(store, "--max-steps", "5")
    assert result.code == 2 and "--allow-code-change" in result.stderr and "9.9.9" in result.stderr, result.stderr


def test_a_run_restarted_after_its_deadline_finishes_instead_of_failing_the_job(tmp_path):
    """deadline.json says the rental ended: no exit 2 (a Job would fail for good), no exit 75 (it would restart
    into the same past deadline forever): nothing more is trained, the newest generation is exported and
    reload-checked, exit 0."""
    import json
    from datetime import datetime, timedelta, timezone

    store = tmp_path / "run"
    assert run(store, "--max-steps", "4").code == 0
    past = datetime.now(timezone.utc) - timedelta(minutes=5)
    plan = json.loads((store / "plan.json").read_text())  # the run was planned when its rental began
    plan["created_at"] = (past - timedelta(hours=1)).isoformat(timespec="seconds")
    (store / "plan.json").write_text(json.dumps(plan))
    (store / "deadline.json").write_text(json.dumps({
        "schema": "trainproof.deadline/1", "spec": "1h", "first_start": (past - timedelta(hours=1)).isoformat(),
        "at": past.isoformat()}))
    result = run(store, "--max-steps", "100", "--deadline", "1h")
    assert result.code == 0, result.stderr
    done = result.last("done")
    assert done["reason"] == "deadline" and done["step"] == 4 and done["export"]["ok"], done
    assert "has passed" in result.stderr
    assert (store / "exports" / "step-00000004" / "COMPLETE.json").exists()


def test_a_damaged_deadline_record_is_replaced_not_fatal(tmp_path):
    store = tmp_path / "run"
    store.mkdir()
    (store / "deadline.json").write_text('{"at": [[[[[[' * 2000)
    result = run(store, "--max-steps", "3", "--deadline", "1h")
    assert result.code == 0, result.stderr
    assert "deadline.json is unreadable" in result.stderr
