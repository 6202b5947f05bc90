"""The verifier's arithmetic (job.proof.compare), without processes: tolerance semantics, exact integers,
structural differences and non-finite values as failures, and the state a cut must hold."""

from __future__ import annotations

import math

import pytest
import torch

from job.proof.compare import Diff, Tolerance, compare_cut, diff_tree, expected_at_cut
from job.train.state import History

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


def _state(rows: list[tuple[int, list[int]]], perm: list[int], cursor: int) -> dict:
    """A minimal state: history rows (epoch, sample ids), a data position, and progress."""
    hist = History()
    for i, (epoch, ids) in enumerate(rows):
        hist.append(step=i + 1, epoch=epoch, loss=0.5 / (i + 1), lr=0.1 if i < 3 else 0.05, targets=len(ids),
                    sample_ids=ids)
    n = len(rows)
    progress = {"step": n, "epoch": rows[-1][0], "samples_seen": sum(len(r[1]) for r in rows),
                "targets_seen": sum(len(r[1]) for r in rows), "next_lr": 0.1 if n < 3 else 0.05}
    return {"history": hist.state_dict(), "progress": progress,
            "ranks": [{"data": {"permutation": torch.tensor(perm), "cursor": cursor}}]}


def test_a_cut_is_checked_against_the_reference_history_prefix():
    rows = [(0, [2, 0]), (0, [1, 3]), (1, [3, 1]), (1, [0, 2])]  # 4 samples, batches of 2: 2 steps an epoch
    reference = _state(rows, perm=[3, 1, 0, 2], cursor=4)
    expected = expected_at_cut(reference, 3)
    assert expected["progress"] == {"step": 3, "epoch": 1, "samples_seen": 6, "targets_seen": 6, "next_lr": 0.05}
    assert expected["consumed_in_epoch"].tolist() == [3, 1]
    good = _state(rows[:3], perm=[3, 1, 0, 2], cursor=2)
    assert all(d.within for d in compare_cut(good, reference, 3, TOL).values())
    lost_cursor = _state(rows[:3], perm=[3, 1, 0, 2], cursor=0)
    assert not compare_cut(lost_cursor, reference, 3, TOL)["data_position"].within
    other_data = _state([rows[0], rows[1], (1, [1, 3])], perm=[1, 3, 0, 2], cursor=2)
    failed = {n for n, d in compare_cut(other_data, reference, 3, TOL).items() if not d.within}
    assert {"sample_ids", "data_position"} <= failed
