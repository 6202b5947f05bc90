"""``trainproof verify`` beyond the protocol's cut: resumes at the epoch boundary and in the middle of a later
epoch (a permutation bug that only shows after epoch 0 fails the default verify), every generator family
really drawn on both built-in tasks (losing one fails with exit 1), a resume whose own restore self-check
fails is a failed check (exit 1, ``rng_restore``), and a task with hidden state is caught with its likely
cause named, while the same task checkpointing that state with ``Task.state_dict`` passes.

The default regression and tinylm verifications run once each (module fixtures, real processes); the
sabotage runs reuse their continuous and cut paths (``--reuse-reference``) and run the resumed paths
through the fault-injecting wrapper tests/support/hooked.py.
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.test_verify_helpers import checks, cli, read_report, trainproof  # noqa: F401  (cli: a fixture)

HOOKED = "tests.support.hooked"
TINYLM_CONFIG = {"n_sequences": 37}  # 5 steps an epoch (4 x 8 + a tail of 5): cuts 3 (protocol), 5, 7


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    """The default verification of regression (10 steps, cut 5, extra cuts 6 and 9), no export."""
    store = str(tmp_path_factory.mktemp("cuts") / "run")
    result = trainproof("verify", "--store", store, "--id", "ref", "--no-export", "--keep-evidence")  # reused below
    assert result.returncode == 0, result.stdout + result.stderr
    return {"store": store, "report": read_report(store, "ref")}


@pytest.fixture(scope="module")
def tinylm(tmp_path_factory):
    """The default verification of tinylm on the protocol corpus (8 steps, cut 3, extra cuts 5 and 7), no export."""
    d = tmp_path_factory.mktemp("cuts-lm")
    config = d / "tinylm.json"
    config.write_text(json.dumps(TINYLM_CONFIG))
    store = str(d / "run")
    result = trainproof("verify", "--store", store, "--task", "tinylm", "--config", str(config), "--id", "ref",
                        "--keep-evidence",
                        "--no-export")
    assert result.returncode == 0, result.stdout + result.stderr
    return {"store": store, "config": str(config), "report": read_report(store, "ref")}


def _sabotaged(cli, monkeypatch, ref, sabotage, *extra):  # noqa: F811
    monkeypatch.setenv("TPHOOK_SABOTAGE", sabotage)  # inherited by every path, acts on resumed ones only
    monkeypatch.setattr("job.train.launch.ENTRY_MODULE", HOOKED)
    vid = f"sabotage-{sabotage}"
    config = ["--task", "tinylm", "--config", ref["config"]] if "config" in ref else []
    result = cli("verify", "--store", ref["store"], *config, "--reuse-reference", "ref", "--id", vid, "--no-export",
                 *extra)
    return result, read_report(ref["store"], vid)


def test_default_verify_resumes_at_the_epoch_boundary_and_mid_epoch_1(regression):
    report = regression["report"]
    cuts = report["cuts"]
    assert (cuts["protocol_cut"], cuts["extra"], cuts["all"], cuts["steps_per_epoch"]) == (5, [6, 9], [5, 6, 9], 6)
    assert cuts["steps"] == 10 and report["settings"]["steps"] == 10  # both extra cuts fit the protocol's path
    assert cuts["passed"] == {"6": True, "9": True} and report["cuts_passed"] is True
    assert set(cuts["paths"]) == {"resume_at_6", "resume_at_9"}
    assert all(p["exit_code"] == 0 and "--steps" in p["command"] for p in cuts["paths"].values())
    assert (cuts["paths"]["resume_at_6"]["resumed_from"], cuts["paths"]["resume_at_9"]["resumed_from"]) == (6, 9)
    for c in (6, 9):
        resumed = checks(report, f"resume_at_{c}")
        assert all(x["within_tolerance"] and x["max_abs_diff"] == 0.0 for x in resumed.values())
        assert {"sample_ids", "data_position", "parameters", "rng_restore"} <= set(resumed)


@pytest.mark.slow
def test_cuts_option_chooses_them_and_lengthens_the_continuous_path(cli, tmp_path):  # noqa: F811
    store = str(tmp_path / "run")
    result = cli("verify", "--store", store, "--cuts", "5,6,11", "--id", "c", "--no-export", "--sequential")
    assert result.exit_code == 0, result.output + result.stderr
    report = read_report(store, "c")
    assert (report["cuts"]["all"], report["cuts"]["steps"], report["step_recovered"]) == ([5, 6, 11], 12, 5)
    assert report["cuts"]["chosen"] == "--cuts" and report["all_checks_passed"] is True
    assert "cuts resumed at: [5, 6, 11]" in result.output


def test_a_permutation_bug_after_epoch_0_fails_the_default_verify(regression, cli, monkeypatch):  # noqa: F811
    result, report = _sabotaged(cli, monkeypatch, regression, "regen_permutation")
    assert result.exit_code == 1, result.output + result.stderr
    assert report["positive"] is True  # the protocol's cut (epoch 0) alone would not have caught it
    assert report["cuts"]["passed"] == {"6": True, "9": False} and report["all_checks_passed"] is False
    mid = checks(report, "resume_at_9")
    assert not mid["sample_ids"]["within_tolerance"] and mid["sample_ids"]["first_step"] == 10
    assert "resume_at_9.sample_ids" in report["failing_checks"]


@pytest.mark.parametrize(("task", "sabotage"), [
    ("regression", "lose_numpy_rng"), pytest.param("tinylm", "lose_python_rng", marks=pytest.mark.slow),
    pytest.param("regression", "lose_python_rng", marks=pytest.mark.slow),
    pytest.param("tinylm", "lose_numpy_rng", marks=pytest.mark.slow)])
def test_losing_one_generator_family_diverges_on_both_tasks(request, cli, monkeypatch, task, sabotage):  # noqa: F811
    ref = request.getfixturevalue(task)
    result, report = _sabotaged(cli, monkeypatch, ref, sabotage, "--cuts", str(ref["report"]["cuts"]["protocol_cut"]))
    assert result.exit_code == 1, result.output + result.stderr
    resume = checks(report, "resume")
    assert resume["rng_restore"]["within_tolerance"]  # lost after the restore: only the comparison sees it
    # The task really draws from that generator: the trajectory moves, not only the observed next draw.
    assert {"resume.rng_next_draws", "resume.losses", "resume.parameters"} <= set(report["failing_checks"])
    assert resume["losses"]["first_step"] == ref["report"]["cuts"]["protocol_cut"] + 1


def test_a_failed_restore_self_check_is_a_failed_check_not_exit_2(regression, cli, monkeypatch):  # noqa: F811
    result, report = _sabotaged(cli, monkeypatch, regression, "rng_mismatch", "--cuts", "5")
    assert result.exit_code == 1, result.output + result.stderr
    assert report["completed"] is True and report["error"] is None
    assert report["failing_checks"] == ["resume.rng_restore"]
    restore = checks(report, "resume")["rng_restore"]
    assert not restore["within_tolerance"] and "['python']" in restore["detail"] and restore["first_step"] == 6
    assert report["paths"]["resume"]["exit_code"] == 2  # the path itself refused to train on
    assert any("self-check failed" in line for line in report["diagnosis"])


HIDDEN = '''
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    from job.tasks import DatasetTask

    ROWS = torch.linspace(-1, 1, 12, dtype=torch.float64).unsqueeze(1)


    def loss(model, batch):
        x, y = batch
        return ((model(x) - y) ** 2).squeeze(1)


    class Task(DatasetTask):
        def __init__(self, checkpointed):
            self.private = np.random.default_rng(0)  # a private generator, created when the task is built
            self.checkpointed = checkpointed
            super().__init__(dataset=TensorDataset(ROWS, 3 * ROWS - 1), build_model=lambda: torch.nn.Linear(1, 1),
                             per_sample_loss=loss, config={"checkpointed": checkpointed}, batch_size=4,
                             optimizer="sgd", lr=0.1, dtype=torch.float64,
                             augment=lambda s, rng: (s[0] + float(self.private.normal(0.0, 0.1)), s[1]))

        def state_dict(self):
            return {"private": self.private.bit_generator.state} if self.checkpointed else {}

        def load_state_dict(self, state):
            if self.checkpointed:
                self.private.bit_generator.state = state["private"]


    def factory(config):
        return Task(bool(config.get("checkpointed")))
'''


@pytest.mark.parametrize("checkpointed", [pytest.param(False, marks=pytest.mark.slow), True])
def test_hidden_task_state_is_caught_and_named_and_task_state_dict_fixes_it(tmp_path, checkpointed):
    (tmp_path / "hiddenstate.py").write_text(textwrap.dedent(HIDDEN))
    (tmp_path / "cfg.json").write_text(json.dumps({"checkpointed": checkpointed}))
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", "hiddenstate:factory", "--config",
                        str(tmp_path / "cfg.json"), "--id", "h", "--no-export",
                        env={"PYTHONPATH": str(tmp_path)})
    report = read_report(store, "h")
    if checkpointed:
        assert result.returncode == 0, result.stdout + result.stderr
        assert report["all_checks_passed"] is True and report["diagnosis"] == []
        assert checks(report, "resume")["task_state"]["within_tolerance"]
        return
    assert result.returncode == 1, result.stdout + result.stderr
    resume = checks(report, "resume")
    assert resume["sample_ids"]["within_tolerance"] and resume["rng_next_draws"]["within_tolerance"]
    assert not resume["losses"]["within_tolerance"]
    assert report["objective_equivalence_passed"] is True  # the check trains without the augmentation
    (line,) = [d for d in report["diagnosis"] if d.startswith("resume:")]
    assert "state not captured by the checkpoint" in line and "docs/tasks.md" in line
    assert "Task.state_dict" in line
    assert "likely cause" in result.stdout and "state not captured" in " ".join(result.stdout.split())
