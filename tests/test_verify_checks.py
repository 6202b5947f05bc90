"""The verifier's declared interfaces, without training anything: every check of the protocol is a
``trainproof.proof.check.Check`` and the protocol derives its verdicts, failing names, diagnosis and report from its list
(a check added to the list shows up everywhere); the verification tail (``trainproof.proof.verification``) reports, prunes and
ends the same way for any runner.

The real checks' behaviour is tested with real processes in tests/test_verify*.py; here a fake check and a fake runner
stand in, so these run in a second.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from trainproof.proof.check import AFTER, REFERENCE, Check, Results, Skipped
from trainproof.proof.compare import Diff
from trainproof.proof.cuts import CutsCheck
from trainproof.proof.export_compare import ExportComparison
from trainproof.proof.four_paths import FourPaths
from trainproof.proof.live import LiveVsRestored
from trainproof.proof.objective import ObjectiveCheck
from trainproof.proof.protocol import Protocol
from trainproof.proof.report import print_summary
from trainproof.proof.settings import ProtocolSettings
from trainproof.proof.verification import Outcome, VerificationRunner, run_verification
from trainproof.proof.workers import WorkerCounts
from trainproof.proof.world import WorldEquivalence
from trainproof.proof.world_change import WorldChange
from trainproof.storage import open_store

BASE_VERDICTS = ["all_checks_passed", "positive", "negative_divergence_detected", "cut_checkpoint_ok",
                 "export_reload_ok", "cuts_passed"]
LIVE_VERDICTS = ["live_vs_restored_passed", "live_vs_restored_negative_detected"]
WORLD_VERDICTS = ["world_equivalence_passed", "world_negative_detected"]
OBJECTIVE_VERDICTS = ["objective_equivalence_passed", "objective_negative_detected"]
VARIED = [WorkerCounts, WorldChange, ExportComparison]
"""Last: the data workers and the world varied, the exports compared (no verdict key before the exports were compared;
the world change's only with --world W > 1)."""


def _protocol(tmp_path: Path, **settings: Any) -> Protocol:
    return Protocol(ProtocolSettings(store=str(tmp_path / "run"), vid="v", **settings), open_store)


@pytest.mark.parametrize("settings,kinds,verdicts", [
    ({}, [FourPaths, CutsCheck, LiveVsRestored, ObjectiveCheck, *VARIED],
     BASE_VERDICTS + LIVE_VERDICTS + OBJECTIVE_VERDICTS),
    ({"world": 2}, [FourPaths, CutsCheck, LiveVsRestored, WorldEquivalence, ObjectiveCheck, *VARIED],
     BASE_VERDICTS + LIVE_VERDICTS + WORLD_VERDICTS + OBJECTIVE_VERDICTS + ["world_change_passed"]),
    ({"objective": False}, [FourPaths, CutsCheck, LiveVsRestored, Skipped, *VARIED], BASE_VERDICTS + LIVE_VERDICTS),
    ({"reuse": "earlier"}, [FourPaths, CutsCheck, Skipped, Skipped, *VARIED], BASE_VERDICTS),
])
def test_the_protocols_checks_and_the_verdict_keys_they_give(tmp_path, settings, kinds, verdicts):
    protocol = _protocol(tmp_path, **settings)
    assert [type(c) for c in protocol.checks] == kinds and all(isinstance(c, Check) for c in protocol.checks)
    assert list(protocol.verdicts()) == verdicts
    assert not any(protocol.verdicts()[k] for k in verdicts if k != "export_reload_ok")  # nothing compared yet
    report = protocol.report()
    assert {"cuts", "objective_equivalence", "diagnosis", "negative", "data_workers", "export_comparison"} <= set(report)
    assert report["data_workers"]["varied"] == [] and report["export_comparison"]["ran"] is False  # regression
    assert ("world_equivalence" in report) == ("world" in settings)
    if "world" in settings:
        assert report["world_equivalence"] is None  # its runs never started
        assert report["world_change"]["resumed_on_another_world"] == {"from": 2, "to": 1, "at_step": 5,
                                                                      "compared_at_step": protocol.s.steps}
    else:  # one rank: no world change, and the block says so
        assert report["world_change"]["resumed_on_another_world"] is None and "--world 1" in report["world_change"]["why"]
    if "reuse" in settings:  # its continuous path recorded no live state
        assert report["live_vs_restored"] == {"skipped": "reused reference: its continuous path's live state was not "
                                                         "recorded"}
    elif not settings:  # every cut (protocol's, extra, resume of a resume), recorded by the continuous path
        assert protocol.s.live_at == (5, 6, 9, 11, 12, 15, 17)
    skipped = {"objective": "--no-objective-check", "reuse": "reused reference"}
    for key, why in skipped.items():
        if key in settings:
            assert report["objective_equivalence"] == {"skipped": why}


class Fake(Check):
    """A check added by a test: one run in the ``after`` phase, a verdict, a failing name, a line and a block."""

    def __init__(self, *, ok: bool) -> None:
        self.ok_, self.results = ok, None

    def jobs(self, phase, scratch, done):
        return [("fake", "unused", [sys.executable, "-c", "print('{\"event\": \"fake\"}')"])] if phase == AFTER else []

    def compare(self, phase, results, done):
        if phase == AFTER:
            self.results = results

    @property
    def passed(self):
        return self.ok_

    @property
    def negative_detected(self):
        return True

    def failing(self):
        return [] if self.ok_ else ["fake.thing"]

    def diagnosis(self):
        return [] if self.ok_ else ["fake: the thing differs"]

    def verdicts(self):
        return {"fake_passed": self.passed}

    def sections(self):
        return {"fake": {"ran": self.results is not None}}

    def checks(self):
        return {"fake_path": {"thing": Diff(exceeded=not self.ok_)}}


def _pretend_the_paths_passed(protocol: Protocol) -> None:
    protocol.checks = [c for c in protocol.checks if isinstance(c, (FourPaths, CutsCheck))]
    for c in protocol.checks:
        c.diffs = {name: {"parameters": Diff()} for name in c.diffs}
    protocol.four.diffs["resume_without_rng"] = {"parameters": Diff(exceeded=True, max_abs=1.0)}


@pytest.mark.parametrize("ok", [True, False])
def test_a_check_added_to_the_list_is_run_judged_and_reported(tmp_path, ok, capsys):
    protocol = _protocol(tmp_path, export=False)
    _pretend_the_paths_passed(protocol)
    assert protocol.comparisons_passed() and protocol.verdicts()["all_checks_passed"]
    fake = Fake(ok=ok)
    protocol.checks.append(fake)
    assert fake.jobs(REFERENCE, tmp_path, Results()) == [] and fake.results is None
    assert protocol._phase(AFTER) == 1 and [r.name for r in fake.results] == ["fake"]
    assert fake.results[0].code == 0 and fake.results[0].event("fake") == {"event": "fake"}
    report = protocol.report()
    assert report["fake_passed"] is ok and report["all_checks_passed"] is ok and protocol.comparisons_passed() is ok
    assert report["fake"] == {"ran": True}
    assert report["checks"]["fake_path"][0]["within_tolerance"] is ok
    assert report["failing_checks"] == ([] if ok else ["fake.thing"])
    assert report["diagnosis"] == ([] if ok else ["fake: the thing differs"])
    print_summary(report)
    assert f"fake_passed: {str(ok).lower()}" in capsys.readouterr().out
    partial = protocol.report("VerificationIncomplete: stopped")  # nothing judged: no verdict true or false
    assert partial["verdict"] == "INCOMPLETE" and partial["failing_checks"] == []
    assert partial["fake_passed"] is None and partial["all_checks_passed"] is None and partial["positive"] is None
    print_summary(partial)
    out = capsys.readouterr().out
    assert "INCOMPLETE" in out and "VerificationIncomplete: stopped" in out
    assert "_passed:" not in out and "positive:" not in out and "failing checks" not in out


class FakeRunner(VerificationRunner):
    """A runner whose verdict (or error) the test chooses."""

    def __init__(self, root, *, passed: bool = True, error: Exception | None = None, prunes: bool = True) -> None:
        self.root, self.passed, self.error, self.prunes_evidence = root, passed, error, prunes
        self.after = 0

    def run(self):
        if self.error is not None:
            raise self.error

    def verdicts(self):
        return {"all_checks_passed": self.passed}

    def after_pass(self):
        self.after += 1

    def report(self, error=None):
        passed = self.passed and error is None
        return {"kind": "fake", "id": "v", "location": self.root.url, "checks": {}, "error": error,
                "all_checks_passed": passed, "positive": passed, "negative_divergence_detected": None,
                "failing_checks": [] if passed else ["fake.thing"]}

    def plot(self):
        return b"png"


def _root_with_a_generation(tmp_path: Path):
    root = open_store(str(tmp_path / "verification" / "v"))
    root.child("resume").commit(1, {"state.pt": b"x"}, contract="c", world=1, code_version="test")
    return root


def _stored(root) -> dict[str, Any]:
    return json.loads(root.read_file("verification.json"))


@pytest.mark.parametrize("prunes,keep,removed", [(True, False, True), (True, True, False), (False, False, False)])
def test_a_passed_verification_reports_plots_and_prunes_only_when_it_may(tmp_path, prunes, keep, removed):
    root = _root_with_a_generation(tmp_path)
    runner = FakeRunner(root, prunes=prunes)
    assert run_verification(runner, keep_evidence=keep) is Outcome.PASSED and runner.after == 1
    assert root.read_file("verification.png") == b"png"
    assert ("evidence" in _stored(root)) is removed
    assert (not any(g for g in root.child("resume").scan())) is removed


def test_a_failed_verification_keeps_everything_and_triggers_nothing(tmp_path):
    root = _root_with_a_generation(tmp_path)
    runner = FakeRunner(root, passed=False)
    assert run_verification(runner) is Outcome.FAILED and runner.after == 0
    assert _stored(root)["failing_checks"] == ["fake.thing"] and list(root.child("resume").scan())


@pytest.mark.parametrize("error", [OSError("disk gone"), KeyError("a bug")])
def test_an_incomplete_verification_still_uploads_a_partial_report_without_a_plot(tmp_path, error, capsys):
    root = _root_with_a_generation(tmp_path)
    runner = FakeRunner(root, error=error)
    assert run_verification(runner) is Outcome.INCOMPLETE and runner.after == 0
    stored = _stored(root)
    assert stored["error"] == f"{type(error).__name__}: {error}" and stored["all_checks_passed"] is False
    with pytest.raises(FileNotFoundError):
        root.read_file("verification.png")
    assert "verification incomplete" in capsys.readouterr().err and list(root.child("resume").scan())
