"""World-size equivalence: W=2 ranks with the same global batch reproduce the one-rank run, and a wrongly
normalised objective (the mean of per-rank means) is caught.

Why a tolerance and not bitwise: the ranks hold other slices of each step than the single process's
micro-batches (the epoch's tail of 5 sequences is 4 + 1 in one process, 3 + 2 over two ranks), and the
gradient all-reduce adds the ranks' sums in the backend's order. Floating-point addition is not
associative, so the parameters may differ in the last bits. In float64 those differences stay around
1e-12 after 12 AdamW steps; a real change of the objective moves them by 1e-2 and more.

The runs use no randomness but the data order: each rank draws dropout masks and noise from its own
stream (trainproof.train.dist.rank_seed), so with dropout a W=2 run is another, equally valid, random realisation
and cannot be compared with the one-rank run. The data order is global and world-independent.
"""

from __future__ import annotations

import json

import pytest

from tests.support.timing import budget
from tests.test_dist_helpers import load_world_state, start_world
from tests.test_train_helpers import finish, history_rows, start

# Slow: by default the verifier makes the same comparisons through its own runs: 2 ranks vs 1 rank of regression with
# the per-rank-mean control (tests/test_verify_world.py, the world-size equivalence) and tinylm over 2 ranks with
# the mean-of-means control (tests/test_verify_objective.py). These are the trainer-level originals, with numbers.
pytestmark = pytest.mark.slow

TOLERANCE = 1e-9  # absolute, float64; the observed W=2 vs W=1 differences are ~1e-12 (printed below)
STEPS = 12  # 37 sequences in global batches of 8: five steps an epoch, the fifth a tail of 5 (crosses an epoch)
TASK = "tests.test_dist_helpers:tinylm64"  # tinylm in float64: global_token_mean_v1 over padded sequences
TINY = {"n_sequences": 37, "micro_batch_size": 4, "dropout": 0.0, "input_noise": 0.0}
REGRESSION = {"rows": 21, "dropout": 0.0, "gain": 0.0, "noise": 0.0}  # mse_mean_v1, tail of 5 rows (3 + 2)


def _config(tmp, name: str, cfg: dict) -> str:
    path = tmp / f"{name}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """tinylm: one rank with batch 8, two ranks with batch 4 each, and two ranks with per-rank means;
    regression: one rank with batch 8, two ranks with batch 4 each."""
    d = tmp_path_factory.mktemp("equivalence")
    lm = ("--task", TASK, "--max-steps", str(STEPS))
    rg = ("--task", "regression", "--max-steps", str(STEPS))
    procs = {
        "lm1": start(d / "lm1", *lm, "--config", _config(d, "lm1", {**TINY, "batch_size": 8})),
        "lm2": start_world(d / "lm2", *lm, "--config", _config(d, "lm2", {**TINY, "batch_size": 4})),
        "rg1": start(d / "rg1", *rg, "--config", _config(d, "rg1", {**REGRESSION, "batch_size": 8})),
    }
    results = {name: finish(p, timeout=budget(300)) for name, p in procs.items()}
    negative = start_world(d / "lm2-per-rank-mean", *lm, "--config", str(d / "lm2.json"),
                           env={"TPHOOK_PER_RANK_MEAN": "1"})
    regression2 = start_world(d / "rg2", *rg, "--config", _config(d, "rg2", {**REGRESSION, "batch_size": 4}))
    results.update({"neg": finish(negative, timeout=budget(300)), "rg2": finish(regression2, timeout=budget(300))})
    assert {n: r.code for n, r in results.items()} == dict.fromkeys(results, 0), {n: r.stderr for n, r in results.items()}
    stores = {"lm1": "lm1", "lm2": "lm2", "neg": "lm2-per-rank-mean", "rg1": "rg1", "rg2": "rg2"}
    return {name: load_world_state(d / folder) for name, folder in stores.items()}


def _max_differences(a: dict, b: dict) -> dict[str, float]:
    """Largest absolute difference per compared section (parameters, optimizer moments, per-step losses)."""
    opt_a, opt_b = a["optimizer"]["state"], b["optimizer"]["state"]
    return {
        "parameters": max(float((a["model"][k] - b["model"][k]).abs().max()) for k in a["model"]),
        "optimizer": max(float((opt_a[i][k] - opt_b[i][k]).abs().max())
                         for i in opt_a for k in opt_a[i] if opt_a[i][k].is_floating_point()),
        "loss": max(abs(x["loss"] - y["loss"]) for x, y in zip(history_rows(a), history_rows(b))),
    }


def _same_experience(a: dict, b: dict) -> None:
    """Same samples in the same steps, same target counts and learning rates: only the arithmetic may differ."""
    rows_a, rows_b = history_rows(a), history_rows(b)
    assert [r["sample_ids"] for r in rows_a] == [r["sample_ids"] for r in rows_b]
    assert [(r["targets"], r["lr"], r["epoch"]) for r in rows_a] == [(r["targets"], r["lr"], r["epoch"]) for r in rows_b]


@pytest.mark.parametrize(("one", "two"), [("lm1", "lm2"), ("rg1", "rg2")], ids=["tinylm-token-mean", "regression-mse"])
def test_two_ranks_reproduce_one_rank_within_tolerance(runs, one, two):
    a, b = runs[one], runs[two]
    assert (a["meta"]["world"], b["meta"]["world"]) == (1, 2)
    _same_experience(a, b)
    diffs = _max_differences(a, b)
    print(f"\n{one} vs {two} (W=1 vs W=2, float64): {diffs}, tolerance {TOLERANCE}")
    assert all(v <= TOLERANCE for v in diffs.values()), diffs
    assert b["ranks"][0]["rng"]["torch"].tolist() != b["ranks"][1]["rng"]["torch"].tolist()  # per-rank streams


def test_tails_are_split_unevenly_so_the_normalisation_matters(runs):
    rows = history_rows(runs["lm1"])
    assert [len(r["sample_ids"]) for r in rows[:5]] == [8, 8, 8, 8, 5]  # no tail dropped, none padded
    assert sorted(i for r in rows[:5] for i in r["sample_ids"]) == list(range(37))


def test_mean_of_per_rank_means_is_detected(runs):
    a, neg = runs["lm1"], runs["neg"]
    _same_experience(a, neg)  # the same data: only the normalisation differs
    diffs = _max_differences(a, neg)
    print(f"\nW=1 vs W=2 with per-rank means (negative control): {diffs}, tolerance {TOLERANCE}")
    assert diffs["parameters"] > TOLERANCE and diffs["optimizer"] > TOLERANCE, diffs
    assert diffs["parameters"] > 1e3 * _max_differences(a, runs["lm2"])["parameters"]

