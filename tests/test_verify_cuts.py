"""``trainproof verify`` beyond the protocol's cut: resumes at the epoch boundary and in the middle of a later
epoch (a permutation bug that only shows after epoch 0 fails the default verify), every generator family
really drawn on both built-in tasks (losing one fails with exit 1), a resume whose own restore self-check
fails is a failed check (exit 1, ``rng_restore``), and a task with hidden state is caught with its likely
cause named, while the same task checkpointing that state with ``Task.state_dict`` passes.

The extra cuts of the default regression verification, the permutation bug, the lost numpy generator and the failed
restore self-check are tested in tests/test_verify.py, on that module's reference verification (one default
verification of regression for both). Here: the hidden task state (a verification of its own each), and with
TRAINPROOF_SLOW=1 the ``--cuts`` option and the other generator families on both tasks (module fixtures, real
processes; the sabotage runs reuse their continuous, cut and negative paths, ``--reuse-reference``, and run the
resumed paths through the fault-injecting wrapper tests/support/hooked.py).
"""

from __future__ import annotations

import json
import textwrap

import pytest

from tests.test_verify_helpers import checks, cli, read_report, sabotaged, trainproof  # noqa: F401  (cli: a fixture)

TINYLM_CONFIG = {"n_sequences": 37}  # 5 steps an epoch (4 x 8 + a tail of 5): cuts 3 (protocol), 5, 7, 8, 10, 12


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    """The default verification of regression (18 steps, cut 5, extra cuts 6, 9, 12, 15, 17; again at 11), no export
    (slow tests only)."""
    store = str(tmp_path_factory.mktemp("cuts") / "run")
    result = trainproof("verify", "--store", store, "--id", "ref", "--no-export", "--keep-evidence")  # reused below
    assert result.returncode == 0, result.stdout + result.stderr
    return {"store": store, "report": read_report(store, "ref")}


@pytest.fixture(scope="module")
def tinylm(tmp_path_factory):
    """The default verification of tinylm on the protocol corpus (15 steps: three epochs of 5; cut 3, extra cuts 5, 7,
    10, 12 and the random 8; a resume of a resume at 9), no export (slow tests only)."""
    d = tmp_path_factory.mktemp("cuts-lm")
    config = d / "tinylm.json"
    config.write_text(json.dumps(TINYLM_CONFIG))
    store = str(d / "run")
    result = trainproof("verify", "--store", store, "--task", "tinylm", "--config", str(config), "--id", "ref",
                        "--keep-evidence",
                        "--no-export")
    assert result.returncode == 0, result.stdout + result.stderr
    return {"store": store, "config": str(config), "report": read_report(store, "ref")}


@pytest.mark.slow
def test_cuts_option_chooses_them_and_lengthens_the_continuous_path(cli, tmp_path):  # noqa: F811
    store = str(tmp_path / "run")
    result = cli("verify", "--store", store, "--cuts", "5,6,11", "--id", "c", "--no-export", "--sequential")
    assert result.exit_code == 0, result.output + result.stderr
    report = read_report(store, "c")
    assert (report["cuts"]["all"], report["cuts"]["steps"], report["step_recovered"]) == ([5, 6, 11], 12, 5)
    assert report["cuts"]["chosen"] == "--cuts" and report["all_checks_passed"] is True
    assert "cuts resumed at: [5, 6, 11]" in result.output


# (regression, lose_numpy_rng) runs by default in tests/test_verify.py, on that module's reference verification.
@pytest.mark.slow
@pytest.mark.parametrize(("task", "sabotage"), [
    ("tinylm", "lose_python_rng"), ("regression", "lose_python_rng"), ("tinylm", "lose_numpy_rng")])
def test_losing_one_generator_family_diverges_on_both_tasks(request, cli, monkeypatch, task, sabotage):  # noqa: F811
    ref = request.getfixturevalue(task)
    result, report = sabotaged(cli, monkeypatch, ref, sabotage, "--cuts", str(ref["report"]["cuts"]["protocol_cut"]))
    assert result.exit_code == 1, result.output + result.stderr
    resume = checks(report, "resume")
    assert resume["rng_restore"]["within_tolerance"]  # lost after the restore: only the comparison sees it
    # The task really draws from that generator: the trajectory moves, not only the observed next draw.
    assert {"resume.rng_next_draws", "resume.losses", "resume.parameters"} <= set(report["failing_checks"])
    assert resume["losses"]["first_step"] == ref["report"]["cuts"]["protocol_cut"] + 1


HIDDEN = '''
    import numpy as np
    import torch
    from torch.utils.data import TensorDataset

    from trainproof.tasks import DatasetTask

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


# False (the hidden state, caught and named) runs by default; True (the fix, which passes) is slow.
@pytest.mark.parametrize("checkpointed", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_hidden_task_state_is_caught_and_named_and_task_state_dict_fixes_it(tmp_path, checkpointed):
    (tmp_path / "hiddenstate.py").write_text(textwrap.dedent(HIDDEN))
    (tmp_path / "cfg.json").write_text(json.dumps({"checkpointed": checkpointed}))
    store = str(tmp_path / "run")
    result = trainproof("verify", "--store", store, "--task", "hiddenstate:factory", "--config",
                        str(tmp_path / "cfg.json"), "--id", "h", "--no-export", "--cuts", "5",
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
    first, line = [d for d in report["diagnosis"] if d.startswith("resume:")]
    assert "first difference at step 6" in first and "resume.losses" in first  # what differs, before the guess
    assert "state not captured by the checkpoint" in line and "docs/tasks.md" in line
    assert "Task.state_dict" in line
    assert "likely cause" in result.stdout and "state not captured" in " ".join(result.stdout.split())
