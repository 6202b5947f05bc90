"""Frozen model entries (a LoRA run's base) stored once for the run, not in every generation (issue 39 item 2).

Real ``train`` processes on tests.support.frozen_task (a ~0.5 MB frozen "base", a 257-parameter trainable head): the
base is one shared object under ``shared/`` that every generation references; each generation holds only what
training changes; a run SIGTERMed and resumed ends bitwise equal to an uninterrupted one, its base stored once still;
a task that writes into a frozen parameter gets the changed base stored again and referenced from then on, with
retention (``--keep 1``) deleting generations, never what the kept one references; and ``verify`` fails a resume that
restores the frozen part off (as from another base) naming the parameters.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import torch

from tests.test_dist_helpers import read_until
from tests.test_train_helpers import finish, kept_differences, load_state, run, start
from tests.test_verify_helpers import read_report, trainproof

TASK = "tests.support.frozen_task:factory"
STEPS = 12
ARGS = ("--task", TASK, "--max-steps", str(STEPS), "--checkpoint-every", "2", "--log-format", "json")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    store = tmp_path_factory.mktemp("frozen") / "reference"
    done = run(store, *ARGS, "--keep", "0")
    assert done.code == 0, done.stderr
    return store, done


def _shared(store) -> list:
    return sorted((store / "shared").iterdir())


def test_the_base_is_stored_once_and_each_generation_holds_what_training_changes(reference):
    store, done = reference
    (base,) = _shared(store)
    commits = [e for e in done.events if e.get("event") == "checkpoint"]
    assert len(commits) == STEPS // 2
    # The first commit stored the base (its bytes written once); no later one wrote any.
    assert [e.get("shared_bytes") for e in commits] == [base.stat().st_size] + [None] * (len(commits) - 1)
    for e in commits:
        folder = store / e["generation"]
        held = sum(p.stat().st_size for p in folder.iterdir())
        assert sorted(p.name for p in folder.iterdir()) == ["COMPLETE.json", "history.pt", "training_state.pt"]
        assert e["bytes"] < held and held < base.stat().st_size / 10, (held, base.stat().st_size)
        entry = json.loads((folder / "COMPLETE.json").read_text())["files"]["frozen.pt"]
        assert entry["shared"] is True and entry["sha256"] == base.name
    state = load_state(store)
    assert {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight"} <= set(state["model"])  # merged back whole
    assert state["meta"]["frozen"]["keys"] == ["0.bias", "0.weight", "2.bias", "2.weight"]


def test_a_run_stopped_and_resumed_ends_bitwise_equal_with_its_base_still_stored_once(reference, tmp_path):
    store = tmp_path / "run"
    first = start(store, *ARGS, env={"TPHOOK_STEP_DELAY": "0.05"})
    read_until(first, lambda e: e.get("event") == "checkpoint" and e["step"] >= 4, [])
    first.send_signal(signal.SIGTERM)
    assert finish(first).code == 75
    second = run(store, *ARGS)
    assert second.code == 0 and second.last("resume")["step"] >= 4, second.stderr
    # The resumed process references the base it restored: its commits store nothing under shared/.
    assert [e for e in second.events if e.get("event") == "checkpoint" and "shared_bytes" in e] == []
    assert kept_differences(load_state(reference[0], history="kept"), load_state(store, history="kept")) == []
    assert [p.name for p in _shared(store)] == [p.name for p in _shared(reference[0])]


def test_a_frozen_parameter_the_task_writes_is_stored_again_and_retention_keeps_what_is_referenced(reference,
                                                                                                     tmp_path):
    store = tmp_path / "run"
    done = run(store, *ARGS, "--keep", "1", env={"TP_FROZEN_WRITE_AT": "7"})
    assert done.code == 0, done.stderr
    (kept,) = sorted(store.glob("step-*"))
    referenced = json.loads((kept / "COMPLETE.json").read_text())["files"]["frozen.pt"]["sha256"]
    # The base before step 7 went with the last generation that referenced it (retention); the changed one stays.
    (first,) = {e["removed_shared"][0] for e in done.events if e["event"] == "retention" and "removed_shared" in e}
    assert first != referenced and [p.name for p in _shared(store)] == [referenced]
    written, untouched = load_state(store)["model"]["0.bias"], load_state(reference[0])["model"]["0.bias"]
    assert torch.equal(written, untouched + 0.5)  # the written base, not the one stored first
    # gc also takes what no generation ever referenced (a copy under another name), once older than its
    # --grace-hours (at least a minute: a writer stores its object before the commit that references it), and says
    # so; --dry-run only names it.
    stray = store / "shared" / ("0" * 64)
    stray.write_bytes(first.encode())
    young = trainproof("gc", "--store", str(store), "--keep", "1", "--grace-hours", "0")
    assert young.returncode == 0 and "shared/" not in young.stdout, young.stdout
    os.utime(stray, (time.time() - 120,) * 2)
    busy = trainproof("gc", "--store", str(store), "--keep", "1", "--grace-hours", "0")  # a generation just written:
    assert busy.returncode == 0 and "shared/" not in busy.stdout, busy.stdout  # a writer may be reusing an object
    for path in store.glob("step-*/*"):
        os.utime(path, (time.time() - 120,) * 2)
    listed = trainproof("gc", "--store", str(store), "--keep", "1", "--grace-hours", "0", "--dry-run")
    assert listed.returncode == 0 and f"would delete shared/{stray.name}" in listed.stdout, listed.stdout
    assert stray.exists()
    collected = trainproof("gc", "--store", str(store), "--keep", "1", "--grace-hours", "0")
    assert collected.returncode == 0 and f"deleted shared/{stray.name}" in collected.stdout, collected.stdout
    assert [p.name for p in _shared(store)] == [referenced]


def test_verify_passes_the_frozen_task_and_fails_a_resume_that_restores_its_base_off(tmp_path):
    store = str(tmp_path / "v")
    passed = trainproof("verify", "--store", store, "--task", TASK, "--id", "ok", "--cuts", "5",
                        "--no-objective-check", "--no-export", "--keep-evidence")
    assert passed.returncode == 0, passed.stdout[-3000:] + passed.stderr[-3000:]
    assert len(list((tmp_path / "v" / "verification" / "ok" / "continuous" / "shared").iterdir())) == 1
    result = trainproof("verify", "--store", store, "--task", TASK, "--reuse-reference", "ok", "--id", "base", "--cuts", "5",
                        "--no-objective-check", "--no-export", env={"TPHOOK_SABOTAGE": "other_base"})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    failing = read_report(store, "base")["failing_checks"]
    assert "resume.parameters" in failing, failing


def test_generations_whose_base_is_damaged_are_passed_over_like_any_damaged_generation(tmp_path):
    """The base changed at step 7 (the task wrote into it): generations 2-6 reference the first object, 8-12 the
    second. A flipped byte in the second makes 8-12 unusable: the restart passes over them loudly (quarantined, the
    object named) to step 6, whose base verifies, and trains on from there."""
    store = tmp_path / "run"
    done = run(store, *ARGS, "--keep", "0", env={"TP_FROZEN_WRITE_AT": "7"})
    assert done.code == 0, done.stderr
    newest = json.loads((store / "step-00000012" / "COMPLETE.json").read_text())["files"]["frozen.pt"]["sha256"]
    damaged = store / "shared" / newest
    damaged.write_bytes(bytes([damaged.read_bytes()[0] ^ 1]) + damaged.read_bytes()[1:])
    again = run(store, "--task", TASK, "--max-steps", "14", "--checkpoint-every", "2", "--log-format", "json")
    assert again.code == 0, again.stderr
    assert again.last("resume")["step"] == 6
    assert f"shared/{newest[:16]}" in again.stderr
    assert sorted(p.name[:13] for p in (store / "quarantine").iterdir()) == [f"step-{s:08d}" for s in (8, 10, 12)]
    assert (store / "step-00000014" / "COMPLETE.json").is_file()
