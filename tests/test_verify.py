"""``trainproof verify``: the four-path protocol passes on a folder (regression) and on S3 (tinylm);
it catches the resume bugs it claims to (each sabotage exits 1 naming the failing check), at the protocol's cut and at
the extra cuts (the epoch boundary and the middle of epoch 1: a permutation bug after epoch 0); it exits 2 when it
cannot complete (a path crashes, the store is unreachable).

The passing runs go through the real entry point (``python -m trainproof verify``); the sabotage runs reuse the
passing run's continuous, cut and negative-control paths (``--reuse-reference``: read back from the store and
re-checked) and run only the resumed path(s), through the Typer app in this process (torch is already imported).
"""

from __future__ import annotations

import collections
import json
import os
from pathlib import Path
from typing import Any

import pytest

from trainproof.storage import open_store
from tests.test_verify_helpers import HOOKED, checks, cli, read_report, sabotaged, trainproof  # noqa: F401  (cli)

TINYLM_CONFIG = {"n_sequences": 37}  # 5 steps an epoch, the last a tail of 5: cut at 3, 8 steps cross an epoch


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The default protocol (regression, 10 steps, cut at 5) on a local folder, through the entry point."""
    store = str(tmp_path_factory.mktemp("verify") / "run")
    # --keep-evidence: later tests reuse its continuous, cut and negative paths' generations (--reuse-reference).
    result = trainproof("verify", "--store", store, "--id", "ref", "--keep-evidence")
    return {"store": store, "result": result, "report": read_report(store, "ref")}


def _assert_passed(report: dict[str, Any]) -> None:
    assert report["completed"] and report["failing_checks"] == [], report["failing_checks"]
    verdicts = report["all_checks_passed"], report["positive"], report["negative_divergence_detected"]
    assert verdicts == (True, True, True)
    assert report["export"]["reload_check"]["passed"] is True


def test_protocol_passes_on_a_folder_bitwise(reference):
    result, report = reference["result"], reference["report"]
    assert result.returncode == 0, result.stderr
    _assert_passed(report)
    resume = checks(report, "resume")
    assert set(resume) >= {"sample_ids", "learning_rates", "losses", "parameters", "buffers", "optimizer",
                           "scheduler", "progress", "next_lr", "rng_next_draws", "data_position", "configuration"}
    # On the CPU the default comparison is exact: every difference 0, and the report says so.
    assert all(c["max_abs_diff"] == 0.0 and (c["mode"], c["atol"], c["rtol"]) == ("exact", 0.0, 0.0)
               for c in resume.values())
    assert report["tolerance"]["mode"] == "exact" and report["tolerance"]["bitwise_equal_observed"] is True
    assert report["step_recovered"] == 5 and report["settings"] | {"config": None} == {
        "task": "regression", "config": None, "steps": 18, "cut": 5, "seed": 1234, "atol": 0.0, "rtol": 0.0,
        "comparison": "exact",
        "device": "auto", "checkpoint_every": 1, "reused_reference": None, "world": 1, "fsdp": False,
        "objective_check": True, "samples": None, "fitted_to_schedule": None}
    assert "all_checks_passed: true" in result.stdout and "negative_divergence_detected: true" in result.stdout


def test_the_live_state_at_every_cut_equals_the_restored_state(reference):
    """live_vs_restored (trainproof.proof.live): the continuous path's live state at every cut equals, bitwise and
    component by component, what each resumed path restored there; the resume without RNG restore differs."""
    report = reference["report"]
    live = report["live_vs_restored"]
    assert report["live_vs_restored_passed"] is True and report["live_vs_restored_negative_detected"] is True
    assert live["recorded_at"] == [5, 6, 9, 11, 12, 15, 17] and live["not_recorded"] == []
    assert {(c["path"], c["step"], c["equal"]) for c in live["compared"]} == {
        ("resume", 5, True), ("resume_without_rng", 5, False), ("resume_of_resume_at_11", 11, True),
        *((f"resume_at_{c}", c, True) for c in (6, 9, 12, 15, 17))}
    assert set(live["components"]) == {"parameters", "buffers", "optimizer", "scheduler", "grad_scaler", "rng_states",
                                       "data_position", "progress", "task_state", "task_attributes"}
    assert live["components"]["optimizer"] > 0 and live["empty"] == ["buffers", "grad_scaler", "task_state"]
    assert set(live["negative_control"]["differing"]) >= {"rng_states"}
    rows = checks(report, "live_vs_restored")
    assert all(r["within_tolerance"] and r["max_abs_diff"] == 0.0 for r in rows.values())
    assert rows["grad_scaler"]["exercised"] is False  # no GradScaler on the CPU fixture: compared, not exercised


def test_the_report_records_what_each_path_exercised_and_what_it_did_not(reference):
    report = reference["report"]
    exercised = report["exercised"]
    assert exercised["continuous"] == {"steps": [1, 18], "micro_batches_per_step": [1], "clipping": None,
                                       "grad_scaler": False, "epochs": [0, 1, 2], "epochs_crossed": 2}
    assert exercised["resume"]["steps"] == [6, 18] and exercised["resume_at_9"]["steps"] == [10, 18]
    assert exercised["resume_of_resume_at_11"]["steps"] == [12, 18]
    # The fixture draws from Python's random, the run's NumPy generator and torch (dropout); not from np.random.
    assert report["generators_drew"] == {"python": True, "numpy": True, "numpy_global": False, "torch": True}
    missing = {m["what"]: m for m in report["not_exercised"]}
    assert set(missing) == {"gradient accumulation", "GradScaler", "task state", "generator numpy_global"}, missing
    assert all(m["hint"] for m in missing.values())
    rows = checks(report, "resume")
    assert rows["grad_scaler"]["exercised"] is False and rows["task_state"]["exercised"] is False
    assert "exercised" not in rows["parameters"]
    out = " ".join(reference["result"].stdout.split())
    assert "not exercised: GradScaler" in out and "not exercised: task state" in out


def test_each_path_was_a_fresh_process_with_the_protocol_options(reference):
    report = reference["report"]
    paths = report["paths"]
    assert [p["exit_code"] for p in paths.values()] == [0, 0, 0, 0]
    assert (paths["resume"]["resumed_from"], paths["resume"]["rng_restored"]) == (5, True)
    assert (paths["resume_without_rng"]["resumed_from"], paths["resume_without_rng"]["rng_restored"]) == (5, False)
    assert "--omit-rng-restore" in paths["resume_without_rng"]["command"]
    assert "--steps 13" in paths["resume"]["command"]  # additional updates: a path that started over ends at 13
    assert len(report["commands"]) == 5 and "reload-check" in report["commands"][-1]
    env = report["environment"]
    assert env["device"] == "cpu" and env["threads"] == 1 and env["precision"] == "float64"
    assert env["torch"] and env["numpy"] and env["python"] and env["code_revision"]


def test_the_cut_checkpoint_holds_the_continuous_state_and_history_prefix(reference):
    cut = checks(reference["report"], "cut")
    assert all(c["within_tolerance"] and c["max_abs_diff"] == 0.0 for c in cut.values())
    # history prefix and progress from the continuous path's history, plus the full state at step 5
    assert {"sample_ids", "losses", "learning_rates", "next_lr", "data_position", "parameters", "optimizer",
            "rng_next_draws"} <= set(cut)


def test_the_negative_path_diverges_where_the_generators_matter(reference):
    report = reference["report"]
    negative = checks(report, "resume_without_rng")
    diverged = {n for n, c in negative.items() if not c["within_tolerance"]}
    assert {"losses", "parameters", "rng_next_draws"} <= diverged
    assert {"learning_rates", "next_lr", "scheduler"}.isdisjoint(diverged)  # the schedule alone cannot catch it
    assert negative["parameters"]["first_step"] == 6
    assert 1e-3 < negative["parameters"]["max_abs_diff"] < 0.1  # docs/protocol.md: about 0.0117 in the reference
    assert report["parameter_distance"]["resume"] == {str(s): 0.0 for s in range(6, 19)}
    assert report["losses"]["continuous"] == report["losses"]["resume"] != report["losses"]["resume_without_rng"]


def test_the_export_bundle_is_recorded_with_checksums(reference):
    export = reference["report"]["export"]
    assert export["location"].endswith("verification/ref/resume/exports/step-00000018")
    assert export["files"]["model_bf16.pt"] == export["export_sha256"]
    assert {"README.md", "SHA256SUMS", "config.json", "metrics.json", "data.json"} <= set(export["files"])
    record = export["reload_check"]
    assert record["pid"] != os.getpid() and record["metric"] == "mse"
    assert Path(export["reload_check_location"]).is_file()


@pytest.mark.s3
def test_tinylm_protocol_passes_on_s3(cli, s3_env, tmp_path, monkeypatch):
    """tinylm's protocol on S3 (the folder reference above is regression's): every path writes to and is read back
    from the bucket, over HTTP. Checkpoints are committed inline in every path (TRAINPROOF_SYNC_CHECKPOINT, inherited
    by the path processes); the reference uses the default asynchronous ones: the protocol passes with both. Only
    the protocol's cut (--cuts 3): the extra cuts are the same code over the same store API (the reference)."""
    monkeypatch.setenv("TRAINPROOF_SYNC_CHECKPOINT", "1")
    config = tmp_path / "tinylm.json"
    config.write_text(json.dumps(TINYLM_CONFIG))
    store = f"s3://{s3_env}/prefix/run"
    # --no-objective-check: tinylm's objective check has tests of its own (tests/test_verify_objective.py)
    result = cli("verify", "--store", store, "--task", "tinylm", "--config", str(config), "--id", "lm", "--cuts", "3",
                 "--no-objective-check")
    assert result.exit_code == 0, result.output + result.stderr
    report = read_report(store, "lm")
    _assert_passed(report)
    assert report["settings"]["objective_check"] is False and "objective_equivalence_passed" not in report
    assert report["objective_equivalence"] == {"skipped": "--no-objective-check"}
    assert "objective check: skipped (--no-objective-check)" in " ".join(result.output.split())
    assert (report["settings"]["steps"], report["settings"]["cut"], report["step_recovered"]) == (8, 3, 3)
    assert len(report["losses"]["continuous"]) == 8 and report["environment"]["precision"] == "float32"
    assert all(c["max_abs_diff"] == 0.0 for c in report["checks"]["resume"])
    assert report["export"]["reload_check"]["metric"] == "heldout_token_loss"
    # A passed verdict keeps the report, the plot and the export, and removes the paths' generations.
    root = f"{store}/verification/lm"
    assert open_store(root).read_file("verification.png").startswith(b"\x89PNG")
    paths = ("continuous", "cut", "resume", "resume_without_rng")
    assert [open_store(f"{root}/{p}").scan() for p in paths] == [[]] * 4
    # The four protocol paths' generations, and no others (no extra cuts, no objective runs).
    per_path = collections.Counter(r.split("/")[0] for r in report["evidence"]["removed_generations"])
    assert set(per_path) == set(paths), per_path
    assert [per_path[p] for p in paths] == [8, 1, 6, 6], per_path
    assert report["export"]["location"] == f"{root}/resume/exports/step-00000008"
    bundle = open_store(f"{root}/resume/exports")
    assert [g.status for g in bundle.scan()] == ["complete"]
    assert json.loads(bundle.read_file("step-00000008.reload-check.json"))["passed"] is True


# -- it catches what it claims --------------------------------------------------------------------------
SABOTAGES = {  # sabotage -> checks that must fail, and the one that fails at the first resumed step (6)
    "skip_optimizer": ({"optimizer", "parameters", "losses"}, "optimizer"),
    "rebuild_scheduler": ({"scheduler", "learning_rates", "next_lr"}, "scheduler"),
    "reseed_rng": ({"rng_next_draws", "rng_states", "losses"}, "rng_next_draws"),
    "lose_cursor": ({"sample_ids", "data_position"}, "sample_ids"),
    "repeat_batch": ({"sample_ids", "data_position"}, "sample_ids"),
}


FIRST_COMPONENT = {"skip_optimizer": "the optimizer's step counters", "rebuild_scheduler": "learning-rate scheduler",
                   "reseed_rng": "a random generator", "lose_cursor": "the data position",
                   "repeat_batch": "the data position"}


@pytest.mark.parametrize("sabotage", SABOTAGES)
def test_a_broken_resume_fails_naming_the_check(reference, cli, monkeypatch, sabotage):
    # --cuts 5: the protocol's cut alone (each sabotage acts on every resumed path; the extra cuts are tested below)
    result, report = sabotaged(cli, monkeypatch, reference, sabotage, "--cuts", "5")
    vid = f"sabotage-{sabotage}"
    assert result.exit_code == 1, result.output + result.stderr
    assert report["completed"] and not report["all_checks_passed"] and not report["positive"]
    failing = {name.split(".", 1)[1] for name in report["failing_checks"] if name.startswith("resume.")}
    must_fail, at_once = SABOTAGES[sabotage]
    assert must_fail <= failing, failing
    assert checks(report, "resume")[at_once]["first_step"] == 6
    assert "failing checks: resume." in " ".join(result.output.split())
    # The diagnosis names the state component that differs first, and guesses no hidden state.
    first = next(line for line in report["diagnosis"] if line.startswith("resume: first difference at step 6"))
    assert FIRST_COMPONENT[sabotage] in first, report["diagnosis"]
    assert not any("state not captured" in line for line in report["diagnosis"]), report["diagnosis"]
    # The reference's continuous, cut and negative paths were reused: only the resumed path ran.
    assert {p: e.get("reused_from") for p, e in report["paths"].items()} == {
        "continuous": "ref", "cut": "ref", "resume": None, "resume_without_rng": "ref"}
    assert report["negative_divergence_detected"] is True and report["paths"]["resume_without_rng"]["exit_code"] == 0
    assert open_store(f"{reference['store']}/verification/{vid}/resume_without_rng").scan() == []
    # A failed verdict keeps every generation (the evidence someone will want to look at).
    assert [g.step for g in open_store(f"{reference['store']}/verification/{vid}/resume").scan()] == [5, 6, 7, 8, 9, 10]
    assert "evidence" not in report


def test_a_1e17_drift_on_resume_fails_the_exact_comparison(reference, cli, monkeypatch):
    """Adam's second moment replaced by the square of its square root on resume: differences of ~1e-17, which the old
    default (--atol 1e-12) let through; the CPU's default comparison is exact and fails it, naming the check. The
    correct twin is the reference itself (every difference 0, mode exact)."""
    result, report = sabotaged(cli, monkeypatch, reference, "sqrt_square", "--cuts", "5")
    assert result.exit_code == 1, result.output + result.stderr
    assert "resume.optimizer" in report["failing_checks"], report["failing_checks"]
    optimizer = checks(report, "resume")["optimizer"]
    assert optimizer["mode"] == "exact" and 0.0 < optimizer["max_abs_diff"] < 1e-12, optimizer
    assert checks(report, "resume")["optimizer"]["first_step"] == 6
    assert "resume.optimizer" in " ".join(result.output.split())
    # The same drift under the old absolute tolerance passes: why the default is exact (the mode is recorded).
    result, report = sabotaged(cli, monkeypatch, reference, "sqrt_square", "--cuts", "5", "--atol", "1e-12",
                               vid="sqrt-square-atol")
    assert result.exit_code == 0, result.output
    assert report["tolerance"]["mode"] == "given" and checks(report, "resume")["optimizer"]["mode"] == "given"


def test_a_path_that_crashes_while_restoring_is_a_resume_failure_exit_1(reference, cli, monkeypatch):
    """Every resumed path crashes while restoring the generation the continuous path wrote and trained on from (an
    exception in the restore, test hook): a failure only resumed paths have, so a resume failure (exit 1) naming the
    paths' ``finished`` check and the error, never INCOMPLETE."""
    monkeypatch.setenv("TPHOOK_SABOTAGE", "crash")
    monkeypatch.setattr("trainproof.train.launch.ENTRY_MODULE", HOOKED)
    result = cli("verify", "--store", reference["store"], "--reuse-reference", "ref", "--id", "crash", "--cuts", "5")
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.stderr and "Traceback" not in result.output  # its last error lines, not all
    report = read_report(reference["store"], "crash")
    assert report["verdict"] != "INCOMPLETE" and report["all_checks_passed"] is False
    assert "resume.finished" in report["failing_checks"], report["failing_checks"]
    detail = checks(report, "resume")["finished"]["detail"]
    assert "while restoring step 5" in detail and "SabotageCrash" in detail


@pytest.mark.s3
def test_an_unreachable_store_is_exit_2(cli, s3_env):
    result = cli("verify", "--store", "s3://no-such-bucket-here/run")
    assert result.exit_code == 2 and "no-such-bucket-here" in result.stderr


def test_bad_options_are_exit_2(cli, tmp_path):
    assert cli("verify", "--store", str(tmp_path), "--steps", "4", "--cut", "4").exit_code == 2
    assert cli("verify", "--store", "memory://x/run").exit_code == 2
    assert cli("verify", "--store", str(tmp_path), "--task", "nope").exit_code == 2
    result = cli("verify", "--store", str(tmp_path), "--reuse-reference", "absent", "--id", "x")
    assert result.exit_code == 2, result.output
    result = cli("verify", "--store", str(tmp_path), "--audit", "--no-objective-check")
    assert result.exit_code == 2 and "--no-objective-check is for the protocol" in result.stderr, result.output


def test_plot_of_losses_and_parameter_distance(reference):
    # matplotlib comes with the test extras: no skip, the plot must be there (uploaded beside the report).
    png = open_store(f"{reference['store']}/verification/ref").read_file("verification.png")
    assert png.startswith(b"\x89PNG") and len(png) > 10_000


# -- the extra cuts (every epoch boundary and later mid-epoch of three epochs, a random step, a resume of a resume) ---
def test_default_verify_covers_three_epochs_every_boundary_a_random_cut_and_a_resume_of_a_resume(reference):
    report = reference["report"]
    cuts = report["cuts"]
    assert (cuts["protocol_cut"], cuts["all"], cuts["steps_per_epoch"]) == (5, [5, 6, 9, 12, 15, 17], 6)
    assert cuts["steps"] == 18 and report["settings"]["steps"] == 18  # three epochs of six steps
    # One seeded random step besides the boundaries (6, 12) and the middles of epochs 1 and 2 (9, 15): recorded.
    assert cuts["random_cut"] == {"step": 17, "seed": 1234, "replay": "verify --cuts 17 --seed 1234"}
    assert cuts["passed"] == {str(c): True for c in (6, 9, 12, 15, 17)} and report["cuts_passed"] is True
    # The resume of a resume: from the generation the protocol's resume path (a resumed process) wrote at step 11.
    again = cuts["resume_of_resume"]
    assert (again["at"], again["path"], again["passed"], again["skipped"]) == (11, "resume_of_resume_at_11", True, None)
    assert set(cuts["paths"]) == {"resume_at_6", "resume_at_9", "resume_at_12", "resume_at_15", "resume_at_17",
                                  "resume_of_resume_at_11"}
    assert all(p["exit_code"] == 0 and "--steps" in p["command"] for p in cuts["paths"].values())
    assert {k: p["resumed_from"] for k, p in cuts["paths"].items()} == {
        "resume_at_6": 6, "resume_at_9": 9, "resume_at_12": 12, "resume_at_15": 15, "resume_at_17": 17,
        "resume_of_resume_at_11": 11}
    for path in cuts["paths"]:
        resumed = checks(report, path)
        assert all(x["within_tolerance"] and x["max_abs_diff"] == 0.0 for x in resumed.values())
        assert {"sample_ids", "data_position", "parameters", "rng_restore"} <= set(resumed)


def test_a_permutation_bug_after_epoch_0_fails_the_default_verify(reference, cli, monkeypatch):
    result, report = sabotaged(cli, monkeypatch, reference, "regen_permutation")
    assert result.exit_code == 1, result.output + result.stderr
    assert report["positive"] is True  # the protocol's cut (epoch 0) alone would not have caught it
    assert report["cuts"]["passed"]["6"] is True and report["cuts"]["passed"]["9"] is False
    assert report["all_checks_passed"] is False
    mid = checks(report, "resume_at_9")
    assert not mid["sample_ids"]["within_tolerance"] and mid["sample_ids"]["first_step"] == 10
    assert "resume_at_9.sample_ids" in report["failing_checks"]


def test_a_restore_bug_from_epoch_2_on_fails_the_default_verify(reference, cli, monkeypatch):
    """A cursor stepped back only when the restored position is in epoch 2: the old default (cuts 5, 6, 9 of 10 steps)
    never resumed there; three epochs with a cut in the middle of epoch 2 do."""
    result, report = sabotaged(cli, monkeypatch, reference, "late_repeat_batch")
    assert result.exit_code == 1, result.output + result.stderr
    assert report["positive"] is True and report["cuts"]["passed"]["9"] is True  # earlier epochs: fine
    assert report["cuts"]["passed"]["15"] is False and "resume_at_15.sample_ids" in report["failing_checks"]
    assert checks(report, "resume_at_15")["sample_ids"]["first_step"] == 16


def test_a_bug_after_a_second_resume_fails_the_resume_of_a_resume(reference, cli, monkeypatch):
    """Python's generator re-seeded only when the state was written by a process that had itself resumed: every
    protocol path resumes a fresh process's generation; only the resume of a resume catches it."""
    result, report = sabotaged(cli, monkeypatch, reference, "second_resume")
    assert result.exit_code == 1, result.output + result.stderr
    assert report["positive"] is True
    assert all(report["cuts"]["passed"][str(c)] for c in (6, 9, 12, 15, 17))
    assert report["cuts"]["resume_of_resume"]["passed"] is False
    assert "resume_of_resume_at_11.rng_next_draws" in report["failing_checks"], report["failing_checks"]
    assert "resume_of_resume_at_11" in " ".join(result.output.split())


def test_losing_the_numpy_generator_diverges(reference, cli, monkeypatch):
    """A generator family lost after the restore (the other families and tinylm: tests/test_verify_cuts.py, slow)."""
    result, report = sabotaged(cli, monkeypatch, reference, "lose_numpy_rng", "--cuts", "5")
    assert result.exit_code == 1, result.output + result.stderr
    resume = checks(report, "resume")
    assert resume["rng_restore"]["within_tolerance"]  # lost after the restore: only the comparison sees it
    # The task really draws from that generator: the trajectory moves, not only the observed next draw.
    assert {"resume.rng_next_draws", "resume.losses", "resume.parameters"} <= set(report["failing_checks"])
    assert resume["losses"]["first_step"] == 6


def test_a_failed_restore_self_check_is_a_failed_check_not_exit_2(reference, cli, monkeypatch):
    result, report = sabotaged(cli, monkeypatch, reference, "rng_mismatch", "--cuts", "5")
    assert result.exit_code == 1, result.output + result.stderr
    assert report["completed"] is True and report["error"] is None
    assert report["failing_checks"] == ["resume.rng_restore"]
    restore = checks(report, "resume")["rng_restore"]
    assert not restore["within_tolerance"] and "['python']" in restore["detail"] and restore["first_step"] == 6
    assert report["paths"]["resume"]["exit_code"] == 2  # the path itself refused to train on
    assert any("self-check failed" in line for line in report["diagnosis"])
