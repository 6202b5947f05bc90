"""``verify --audit`` across a real preemption: a run SIGTERMed mid-training and resumed in a new process keeps the
restore point and the generation before it from retention (``--keep 2``); the default audit replays from before it to the newest
generation, says so in ``audit_span``, passes on an honest run and records that in ``verification/audited.json``,
and fails (exit 1) when the resuming process lost the optimizer's state (tests/support/hooked.py ``skip_optimizer``).
"""

from __future__ import annotations

import json
import shutil
import signal

import pytest

from trainproof.storage import open_store
from tests.test_train_helpers import finish, parse_events, start
from tests.test_verify_helpers import read_report, trainproof

TARGET = 12
ARGS = ("--max-steps", str(TARGET), "--checkpoint-every", "1", "--keep", "2", "--log-format", "json")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One run SIGTERMed after a few commits; copies resumed honestly and with a broken resume."""
    d = tmp_path_factory.mktemp("audit-resume")
    proc = start(d / "run", *ARGS, env={"TPHOOK_STEP_DELAY": "0.3"})
    lines = []
    while True:
        line = proc.stdout.readline()
        assert line, lines[-3:]
        lines.append(line)
        event = (parse_events(line) or [{}])[0]
        if event.get("event") == "checkpoint" and event["step"] >= 3:
            proc.send_signal(signal.SIGTERM)
            break
    stopped = finish(proc)
    assert stopped.code == 75, stopped.stderr
    cut = stopped.last("stopped")["step"]
    assert 3 <= cut < TARGET - 3
    shutil.copytree(d / "run", d / "broken")
    honest, broken = start(d / "run", *ARGS), start(d / "broken", *ARGS, env={"TPHOOK_SABOTAGE": "skip_optimizer"})
    assert [finish(honest).code, finish(broken).code] == [0, 0]
    return {"dir": d, "cut": cut}


def _steps(store) -> list[int]:
    return [g.step for g in open_store(str(store)).scan() if g.status == "complete"]


def test_retention_kept_the_restore_point_and_generations_record_it(runs):
    d, cut = runs["dir"], runs["cut"]
    # --keep 2, plus the restore point and the generation before it (no audit has passed across it yet)
    assert _steps(d / "run") == [cut - 1, cut, TARGET - 1, TARGET]
    newest = open_store(str(d / "run")).scan()[-1].manifest
    assert newest["extra"]["resumed_from"] == cut


def test_the_default_audit_spans_the_restore_and_passes_on_an_honest_run(runs):
    d, cut = runs["dir"], runs["cut"]
    result = trainproof("verify", "--store", str(d / "run"), "--audit", "--id", "a")
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(str(d / "run"), "a")
    span = report["audit_span"]
    assert (span["from"], span["to"], span["newest_restore_point"], span["spans_restore"]) == (cut - 1, TARGET, cut, True)
    assert span["crosses_code_change"] is False and "restore point" in span["chosen"]
    assert "audit span: replays" in result.stdout
    # Retention (--keep 2) deleted the generations between the restore point and step 11, but not their rows (kept
    # under <run>/history/, trainproof.format.history): the per-step rows compare over every replayed step.
    compared = report["history_compared"]
    assert (compared["first_step"], compared["last_step"], compared["covers_replay"]) == (cut, TARGET, True)
    assert compared["stopped"] is None and compared["chain_digest_equal"] is True
    recorded = json.loads(open_store(str(d / "run" / "verification")).read_file("audited.json"))
    assert (recorded["from"], recorded["to"], recorded["passed"]) == (cut - 1, TARGET, True)


def test_the_default_audit_fails_when_the_resume_lost_the_optimizer_state(runs):
    d, cut = runs["dir"], runs["cut"]
    result = trainproof("verify", "--store", str(d / "broken"), "--audit", "--id", "a")
    assert result.returncode == 1, result.stdout + result.stderr
    report = read_report(str(d / "broken"), "a")
    assert report["audit_span"]["spans_restore"] is True and report["audit_span"]["from"] <= cut
    assert {"replay.optimizer", "replay.parameters"} <= set(report["failing_checks"])
    with pytest.raises(FileNotFoundError):
        open_store(str(d / "broken" / "verification")).read_file("audited.json")


def test_the_default_audit_does_not_pass_when_the_restore_point_is_gone(runs):
    """The restore point and everything before it deleted (what a planted audited.json once made retention do): the
    default audit could only replay after the resume, proving nothing about it, even on the broken run. It does not
    pass: INCOMPLETE (exit 2), naming the restore point; an explicit --from/--to pair is still the operator's call."""
    d, cut = runs["dir"], runs["cut"]
    gone = d / "gone"
    shutil.copytree(d / "broken", gone)
    for step in _steps(gone):
        if step <= cut:
            shutil.rmtree(gone / f"step-{step:08d}")
    result = trainproof("verify", "--store", str(gone), "--audit", "--id", "g")
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"resumed from step {cut}" in result.stdout + result.stderr and "PASSED" not in result.stdout
    with pytest.raises(FileNotFoundError):
        open_store(str(gone / "verification")).read_file("audited.json")
