"""The hostile-bucket fuzzer (tests/support/hostile.py) against real ``train`` processes: on a folder, 8 rounds of
25 planted generations plus 4 run-level plants each (>= 200 mutations); on S3 over loopback, 3 rounds of 15 plus 4 (>= 50).
Every round must end with exit 0, no traceback, a resume from the run's real newest generation, the final state
bitwise equal to an untouched run's and no genuine generation lost. bench/hostile_fuzz.py runs it longer."""

from __future__ import annotations

import random

import pytest

from tests.support.hostile import FIRST_PLANT, TARGET, Planter, check_round, copy_run, trained
from tests.test_train_helpers import run

PER_ROUND = 25


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The untouched run, a generation at every step: the donors of every planted state, and the expected end."""
    return trained(tmp_path_factory, "reference", FIRST_PLANT + PER_ROUND, 1)


@pytest.fixture(scope="module")
def genuine(tmp_path_factory):
    """The run the planter attacks: trained to 6, its own generations at 2, 4 and 6."""
    return trained(tmp_path_factory, "genuine", 6, 2)


def fuzz(url: str, reference, genuine, seed: int, local: bool, per_round: int = PER_ROUND) -> tuple[int, list[str]]:
    copy_run(genuine, url)
    planted = Planter(url, reference, random.Random(seed), local=local).round(per_round)
    result = run(url, "--max-steps", str(TARGET), "--keep", "0", "--deadline", "2h", "--checkpoint-every", "auto")
    problems = check_round(url, reference, planted, result)
    return planted.count, [f"seed {seed} ({planted.others}): {p}" for p in problems]


def test_a_hostile_bucket_on_a_folder_never_decides_how_the_run_ends(tmp_path, reference, genuine):
    total, problems = 0, []
    for seed in range(8):
        count, found = fuzz(str(tmp_path / f"run-{seed}"), reference, genuine, seed, local=True)
        total, problems = total + count, problems + found
    assert problems == [] and total >= 200, (total, problems)


def test_a_hostile_bucket_on_s3_never_decides_how_the_run_ends(s3_env, reference, genuine):
    total, problems = 0, []
    for seed in (100, 101, 102):  # rounds of 15: each skipped generation costs a scan of the run on S3
        count, found = fuzz(f"s3://{s3_env}/fuzz/run-{seed}", reference, genuine, seed, local=False, per_round=15)
        total, problems = total + count, problems + found
    assert problems == [] and total >= 50, (total, problems)
