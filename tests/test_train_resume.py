"""Exact resume, in fresh processes: continuous N steps == cut at k + resume to N, bit for bit on CPU.

Per task, the continuous reference, the cut runs, the resumed runs and the negative control
(``--omit-rng-restore``) are real ``python -m trainproof train`` processes against a local-folder store;
states are read back through the store and compared section by section (parameters, optimizer state,
scheduler, GradScaler, progress, per-step loss/lr/sample ids, data position, every RNG state and the
next draw of every generator).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.test_train_helpers import differences, history_rows, load_state, run_all, trajectory

# Slow: by default `trainproof verify` runs the same four paths in fresh processes and compares the same sections
# (tests/test_verify.py: regression on a folder, tinylm on S3); these are the trainer-level originals.
pytestmark = pytest.mark.slow

TINYLM_CONFIG = {"n_sequences": 37}  # 5 steps per epoch of 8, the last one a tail of 5 (micro-batches 4 + 1)


@pytest.fixture(scope="module")
def regression(tmp_path_factory):
    """Stores: continuous 10; cut at 5 (mid-epoch) then +5 (crossing into epoch 2); the same cut, omit-RNG.

    (A cut exactly at an epoch boundary is covered in-process by tests/test_state.py.)
    """
    d = tmp_path_factory.mktemp("regression")
    cuts = run_all((d / "cont", "--max-steps", "10"), (d / "cut5", "--max-steps", "5"))
    assert [r.code for r in cuts] == [0, 0], [r.stderr for r in cuts]
    shutil.copytree(d / "cut5", d / "omit")
    states = {"cut5@5": load_state(d / "cut5")}
    resumed = run_all((d / "cut5", "--steps", "5"), (d / "omit", "--steps", "5", "--omit-rng-restore"))
    assert [r.code for r in resumed] == [0, 0], [r.stderr for r in resumed]
    states.update({name: load_state(d / name) for name in ("cont", "cut5", "omit")})
    return {"dir": d, "states": states, "resumed": resumed}


@pytest.fixture(scope="module")
def tinylm(tmp_path_factory):
    """Stores: continuous 8; cut at 3 (mid-epoch) then resumed to 8 (crossing into epoch 2); omit-RNG."""
    d = tmp_path_factory.mktemp("tinylm")
    cfg = d / "tinylm.json"
    cfg.write_text(json.dumps(TINYLM_CONFIG))
    common = ("--task", "tinylm", "--config", str(cfg))
    cuts = run_all((d / "cont", *common, "--max-steps", "8"), (d / "cut", *common, "--max-steps", "3"))
    assert [r.code for r in cuts] == [0, 0], [r.stderr for r in cuts]
    shutil.copytree(d / "cut", d / "omit")
    resumed = run_all((d / "cut", *common, "--max-steps", "8"),
                      (d / "omit", *common, "--steps", "5", "--omit-rng-restore"))
    assert [r.code for r in resumed] == [0, 0], [r.stderr for r in resumed]
    return {"dir": d, "states": {name: load_state(d / name) for name in ("cont", "cut", "omit")}, "cut_at": 3}


def test_regression_resume_is_bitwise_equal(regression):
    cont, resumed = regression["states"]["cont"], regression["states"]["cut5"]
    assert differences(trajectory(cont), trajectory(resumed)) == []
    assert regression["resumed"][0].last("resume") | {"time": None} == {
        "event": "resume", "step": 5, "generation": "step-00000005", "rng_restored": True, "fetched_ahead": True,
        "time": None}
    assert regression["resumed"][1].last("resume")["rng_restored"] is False


def test_regression_protocol_facts(regression):
    s5, s10 = regression["states"]["cut5@5"], regression["states"]["cont"]
    assert s5["ranks"][0]["data"]["cursor"] == 20 and s5["ranks"][0]["data"]["epoch"] == 0  # a mid-epoch cut
    assert s10["ranks"][0]["data"]["epoch"] == 1 and s10["ranks"][0]["data"]["cursor"] == 16  # crossed an epoch
    assert s10["progress"]["next_lr"] == 0.00375
    assert sum(p.numel() for p in s10["model"].values()) == 33
    rows = history_rows(s10)
    assert [r["step"] for r in rows] == list(range(1, 11))
    first_epoch = [i for r in rows[:6] for i in r["sample_ids"]]
    assert sorted(first_epoch) == list(range(24))  # every row exactly once per epoch
    second = [i for r in rows[6:] for i in r["sample_ids"]]
    assert second != first_epoch[: len(second)]  # a new permutation, not a replay
    assert [r["lr"] for r in rows] == [0.03] * 3 + [0.015] * 3 + [0.0075] * 3 + [0.00375]
    assert s10["meta"]["objective"] == "mse_mean_v1" and s10["model"]["0.weight"].dtype == torch.float64


def test_regression_omit_rng_restore_diverges(regression):
    cont, omit = regression["states"]["cont"], regression["states"]["omit"]
    rows_c, rows_o = history_rows(cont), history_rows(omit)
    assert rows_c[:5] == rows_o[:5]  # everything up to the checkpoint is restored...
    assert all(c["loss"] != o["loss"] for c, o in zip(rows_c[5:], rows_o[5:]))  # ...every later step differs
    assert [r["sample_ids"] for r in rows_c[6:]] != [r["sample_ids"] for r in rows_o[6:]]  # NumPy permutation
    assert not torch.equal(cont["model"]["0.weight"], omit["model"]["0.weight"])
    assert cont["ranks"][0]["next_draws"] != omit["ranks"][0]["next_draws"]
    assert cont["progress"]["next_lr"] == omit["progress"]["next_lr"]  # the scheduler alone cannot catch it


def test_tinylm_resume_is_bitwise_equal(tinylm):
    cont, resumed = tinylm["states"]["cont"], tinylm["states"]["cut"]
    assert differences(trajectory(cont), trajectory(resumed)) == []
    rows = history_rows(cont)
    assert [r["epoch"] for r in rows] == [0] * 5 + [1] * 3  # the resumed part crosses an epoch boundary
    assert sorted(i for r in rows[:5] for i in r["sample_ids"]) == list(range(37))  # tail kept, nothing padded
    assert [len(r["sample_ids"]) for r in rows[:5]] == [8, 8, 8, 8, 5]
    assert cont["meta"]["objective"] == "global_token_mean_v1"


def test_tinylm_omit_rng_restore_diverges(tinylm):
    cont, omit, k = tinylm["states"]["cont"], tinylm["states"]["omit"], tinylm["cut_at"]
    rows_c, rows_o = history_rows(cont), history_rows(omit)
    assert rows_c[:k] == rows_o[:k]
    assert rows_c[k]["sample_ids"] == rows_o[k]["sample_ids"]  # data position restored...
    assert rows_c[k]["loss"] != rows_o[k]["loss"]  # ...but dropout masks differ at once
    assert differences(cont["model"], omit["model"])
