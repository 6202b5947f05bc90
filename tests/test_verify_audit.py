"""``trainproof verify --audit``: replaying a real run's generations a -> b in a fresh process matches an
untouched run, and fails (exit 1) when generation b was produced by another trajectory; the audit never
writes, quarantines or deletes anything among the run's generations."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import pytest

from tests.test_train_helpers import finish, run, start
from tests.test_verify_helpers import checks, cli, read_report, trainproof  # noqa: F401  (cli: a fixture)


def _fingerprint(store: Path) -> dict[str, str]:
    """Every file of the run except the verification folder, by sha256."""
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and "verification" not in p.parts}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A run trained to 5 then (a second process) to 10, and a copy whose 5 -> 10 ran with a broken resume."""
    d = tmp_path_factory.mktemp("audit")
    first = run(d / "run", "--max-steps", "5")
    assert first.code == 0, first.stderr
    shutil.copytree(d / "run", d / "sabotaged")
    procs = [start(d / "run", "--max-steps", "10"),
             start(d / "sabotaged", "--max-steps", "10", env={"TPHOOK_SABOTAGE": "reseed_rng"})]
    assert [finish(p).code for p in procs] == [0, 0]
    return d


def test_audit_passes_on_an_untouched_run_and_leaves_it_untouched(runs):
    before = _fingerprint(runs / "run")
    result = trainproof("verify", "--store", str(runs / "run"), "--audit", "--id", "audit")
    assert result.returncode == 0, result.stderr
    report = read_report(str(runs / "run"), "audit")
    assert report["kind"] == "audit" and report["all_checks_passed"] is True and report["positive"] is True
    assert report["negative_divergence_detected"] is None  # an audit has no negative path
    assert (report["settings"]["from"], report["settings"]["to"], report["step_recovered"]) == (5, 10, 5)
    assert all(c["max_abs_diff"] == 0.0 for c in report["checks"]["replay"])
    assert report["paths"]["replay"]["resumed_from"] == 5 and "--steps 5" in report["paths"]["replay"]["command"]
    assert report["audited_generations"]["to"]["generation"] == "step-00000010"
    compared = report["history_compared"]  # every replayed step's sample ids, loss and learning rate
    assert (compared["first_step"], compared["last_step"], compared["covers_replay"]) == (6, 10, True)
    assert compared["chain_digest_equal"] is True
    assert {"sample_ids", "losses", "learning_rates"} <= {c["name"] for c in report["checks"]["replay"]}
    assert "step-00000005 -> step-00000010" in " ".join(result.stdout.split())  # the table says what it compared
    assert _fingerprint(runs / "run") == before
    assert not (runs / "run" / "quarantine").exists()


def test_audit_fails_when_the_newer_generation_followed_another_trajectory(runs, cli):  # noqa: F811
    result = cli("verify", "--store", str(runs / "sabotaged"), "--audit", "--id", "audit")
    assert result.exit_code == 1, result.output + result.stderr
    report = read_report(str(runs / "sabotaged"), "audit")
    assert report["completed"] and report["all_checks_passed"] is False
    assert {"replay.rng_next_draws", "replay.parameters", "replay.losses"} <= set(report["failing_checks"])
    assert checks(report, "replay")["learning_rates"]["within_tolerance"]  # only the generators were broken
    assert report["history_compared"]["chain_digest_equal"] is False


@pytest.mark.parametrize("args", [
    ["--from", "10", "--to", "5"],   # a must be older than b
    ["--from", "3"],                 # not a generation of the run
    ["--task", "tinylm"],            # the audit replays the run's own plan.json
])
def test_audit_usage_errors_are_exit_2(runs, cli, args):  # noqa: F811
    result = cli("verify", "--store", str(runs / "run"), "--audit", *args)
    assert result.exit_code == 2, result.output + result.stderr


def test_audit_of_a_store_without_a_run_is_exit_2(cli, tmp_path):  # noqa: F811
    result = cli("verify", "--store", str(tmp_path / "nothing"), "--audit")
    assert result.exit_code == 2 and "plan.json" in result.stderr


def test_audit_replays_a_run_resumed_from_two_ranks_onto_one_with_each_spans_world(tmp_path):
    """A correct run trained on 2 ranks, resumed on 1 (``--allow-world-change``): the default audit replays 2 -> 4 on
    2 ranks and 4 -> 6 on one, as the generations record, and passes naming the world change."""
    from tests.test_dist_helpers import start_world

    store = tmp_path / "run"
    first = finish(start_world(store, "--max-steps", "4", "--checkpoint-every", "2"))
    assert first.code == 0, first.stderr
    second = run(store, "--max-steps", "6", "--allow-world-change")
    assert second.code == 0 and second.last("resume")["world_change"] == {"step": 4, "from": 2, "to": 1}
    result = trainproof("verify", "--store", str(store), "--audit", "--id", "audit")
    assert result.returncode == 0, result.stdout + result.stderr
    report = read_report(str(store), "audit")
    span = report["audit_span"]
    assert (span["from"], span["to"], span["world_changes"]) == (2, 6, [{"step": 4, "from": 2, "to": 1}])
    assert span["replayed_worlds"] == [{"from": 2, "to": 4, "world": 2}, {"from": 4, "to": 6, "world": 1}]
    assert "world change at step 4 (2 -> 1 ranks)" in span["summary"]
    assert "--nproc-per-node 2" in report["paths"]["replay_2_4"]["command"]
    assert "--allow-world-change" in report["paths"]["replay"]["command"]
    assert all(c["max_abs_diff"] == 0.0 for c in report["checks"]["replay"])
