"""The verifier's arithmetic (trainproof.proof.compare), without processes: tolerance semantics, exact integers,
structural differences and non-finite values as failures, and the state a cut must hold."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from trainproof.proof.compare import Diff, Tolerance, compare_cut, diff_tree, expected_at_cut
from trainproof.train.data import EpochSampler
from trainproof.format.state import History

TOL = Tolerance(atol=1e-12, rtol=0.0)


def test_equal_trees_are_within_tolerance_with_zero_difference():
    tree = {"w": torch.randn(3, 2, dtype=torch.float64), "lr": 0.03, "step": 5, "name": "PCG64", "none": None}
    diff = diff_tree(tree, {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in tree.items()}, TOL)
    assert diff.within and diff.max_abs == 0.0 and not diff.problems


@pytest.mark.parametrize("delta,tol,within", [
    (1e-13, Tolerance(), True),
    (1e-11, Tolerance(), False),
    (1e-3, Tolerance(atol=0.0, rtol=1e-2), True),   # relative to the reference's magnitude (|ref| = 1)
    (2e-2, Tolerance(atol=0.0, rtol=1e-2), False),
])
def test_floats_are_held_to_atol_plus_rtol_times_the_reference(delta, tol, within):
    ref = torch.ones(4, dtype=torch.float64)
    diff = diff_tree({"p": ref}, {"p": ref + delta}, tol)
    assert diff.within is within and diff.max_abs == pytest.approx(delta)
    assert within or diff.detail.startswith("p:")


def test_integers_are_exact_whatever_the_tolerance():
    loose = Tolerance(atol=10.0, rtol=1.0)
    assert not diff_tree(torch.tensor([3, 1, 2]), torch.tensor([3, 2, 1]), loose).within  # sample ids
    assert not diff_tree({"step": 5}, {"step": 6}, loose).within
    assert not diff_tree("a", "b", loose).within


@pytest.mark.parametrize("ref,other,problem", [
    ({"a": 1, "b": 2}, {"a": 1}, "present on one side only"),
    (torch.zeros(2), torch.zeros(3), "torch.float32(2,) vs torch.float32(3,)"),
    (torch.zeros(2), torch.zeros(2, dtype=torch.float64), "torch.float32(2,) vs torch.float64(2,)"),
    ([1, 2], [1, 2, 3], "length 2 vs 3"),
    (torch.zeros(2), [0.0, 0.0], "tensor on one side only"),
    (torch.tensor([1.0, math.nan]), torch.tensor([1.0, math.nan]), "non-finite"),  # even when both agree
    (math.inf, math.inf, "non-finite"),
])
def test_structural_differences_and_non_finite_values_are_failures(ref, other, problem):
    diff = diff_tree(ref, other, Tolerance(atol=1e9))
    assert not diff.within and any(problem in p for p in diff.problems), diff.problems


def test_merge_keeps_the_first_failing_step_and_the_largest_difference():
    total = Diff()
    total.merge(Diff(max_abs=0.0), 6)
    total.merge(Diff(max_abs=0.5, exceeded=True, detail="at 7"), 7)
    total.merge(Diff(max_abs=0.2, exceeded=True, detail="at 8"), 8)
    assert (total.first_step, total.max_abs, total.detail, total.within) == (7, 0.5, "at 7", False)


def _sampled(steps: int, *, epoch1_seed: int | None = None) -> tuple[list[tuple[int, list[int]]], dict]:
    """``steps`` batches of 2 of 4 samples (2 steps an epoch) from a real sampler: (epoch, ids) rows and the data
    position after them. ``epoch1_seed``: epoch 1's permutation drawn from another stream (a re-derived data order)."""
    sampler = EpochSampler(4, np.random.Generator(np.random.PCG64(5)))
    rows = []
    for i in range(steps):
        if i == 2 and epoch1_seed is not None:
            sampler._gen.bit_generator.state = np.random.Generator(np.random.PCG64(epoch1_seed)).bit_generator.state
        ids = sampler.next_ids(2)
        rows.append((sampler.epoch, ids))
    return rows, sampler.state_dict()


def _state(rows: list[tuple[int, list[int]]], data: dict, **position: int) -> dict:
    """A minimal state: history rows (epoch, sample ids), a data position (``position`` overrides), and progress."""
    hist = History()
    for i, (epoch, ids) in enumerate(rows):
        hist.append(step=i + 1, epoch=epoch, loss=0.5 / (i + 1), lr=0.1 if i < 3 else 0.05, targets=len(ids),
                    sample_ids=ids)
    n = len(rows)
    progress = {"step": n, "epoch": rows[-1][0], "samples_seen": sum(len(r[1]) for r in rows),
                "targets_seen": sum(len(r[1]) for r in rows), "next_lr": 0.1 if n < 3 else 0.05}
    return {"history": hist.state_dict(), "progress": progress, "ranks": [{"data": {**data, **position}}]}


def test_a_cut_is_checked_against_the_reference_history_prefix():
    rows, data = _sampled(4)
    reference = _state(rows, data)
    expected = expected_at_cut(reference, 3)
    assert expected["progress"] == {"step": 3, "epoch": 1, "samples_seen": 6, "targets_seen": 6, "next_lr": 0.05}
    assert expected["consumed_in_epoch"].tolist() == rows[2][1]
    good = _state(*_sampled(3))
    assert all(d.within for d in compare_cut(good, reference, 3, TOL).values())
    lost_cursor = _state(*_sampled(3), cursor=0)
    assert not compare_cut(lost_cursor, reference, 3, TOL)["data_position"].within
    other_rows, other_position = _sampled(3, epoch1_seed=11)
    assert other_rows[:2] == rows[:2] and other_rows[2] != rows[2]
    failed = {n for n, d in compare_cut(_state(other_rows, other_position), reference, 3, TOL).items() if not d.within}
    assert {"sample_ids", "data_position"} <= failed
    forged = _state(*_sampled(3), generator=other_position["generator"])  # a generator pair that does not chain
    assert compare_cut(forged, reference, 3, TOL)["data_position"].problems
