"""Nothing planted in the bucket decides how a run ends: a newer generation that verifies (its COMPLETE.json lists
the right sizes and sha256s, as anyone who can write to the bucket can arrange) but does not restore is passed over
with one warning line, quarantined once an older one restored, and the run ends bitwise equal to an untouched one.

Real ``train`` processes on a local folder and on S3 over loopback. The planted states are genuine states of the
same run at a later step (from a reference run), with one thing changed: what a co-tenant without the signing key
can do that a correct trainer must notice.
"""

from __future__ import annotations

import shutil

import pytest
import torch

from trainproof.format.state import STATE_FILE, decode, encode
from trainproof.storage import open_store
from tests.support.hostile import trained
from tests.test_train_helpers import differences, load_state, run, trajectory

TARGET = 10


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The untouched run: 10 steps, a generation at every step (the donors of the planted states)."""
    return trained(tmp_path_factory, "reference", TARGET, 1)


@pytest.fixture(scope="module")
def six(tmp_path_factory):
    """A run trained to step 6 (generations 2, 4, 6), copied for each test."""
    return trained(tmp_path_factory, "six", 6, 2)


@pytest.fixture(params=["local", "s3"])
def run_url(request, tmp_path, six):
    """The six-step run at a fresh URL: a folder, or a prefix of a bucket on the loopback S3 server."""
    if request.param == "local":
        shutil.copytree(six, tmp_path / "run")
        return str(tmp_path / "run")
    bucket = request.getfixturevalue("s3_env")
    url = f"s3://{bucket}/runs/hostile"
    dst = open_store(url)
    for path in sorted(p for p in six.rglob("*") if p.is_file()):
        dst.write_file(str(path.relative_to(six)), path.read_bytes())
    return url


def donor(reference, step: int) -> dict:
    return decode(open_store(str(reference)).load(step).files[STATE_FILE])


def plant(url: str, step: int, files: dict[str, bytes], reference) -> None:
    """Commit ``files`` as generation ``step`` through the store API: hashes recomputed, as a co-tenant can."""
    manifest = open_store(str(reference)).load(step).info.manifest
    open_store(url).commit(step, files, contract=manifest["contract"], world=1,
                           code_version=manifest["code_version"],
                           digests={"state": STATE_FILE} if STATE_FILE in files else None)


def resumes_from_six(url: str, reference, planted: str, why: str) -> None:
    result = run(url, "--max-steps", str(TARGET), "--keep", "0")
    assert result.code == 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    assert result.last("resume")["step"] == 6, result.events
    lines = [line for line in result.stderr.splitlines() if planted in line and "skipping" in line]
    assert len(lines) == 1 and why in lines[0], result.stderr
    s = open_store(url)
    assert [name.startswith(f"quarantine/{planted}") for name, _ in s.quarantined()] == [True]
    assert {2, 4, 6, TARGET} <= {g.step for g in s.scan() if g.status == "complete"}  # nothing genuine lost
    got = load_state(url)
    assert differences(trajectory(load_state(reference)), trajectory(got)) == []


def test_a_planted_state_with_reshaped_model_tensors_is_passed_over(run_url, reference):
    state = donor(reference, 7)
    state["model"]["0.weight"] = state["model"]["0.weight"].reshape(2, 8).clone()
    plant(run_url, 7, {STATE_FILE: encode(state)}, reference)
    resumes_from_six(run_url, reference, "step-00000007", "0.weight")


def test_a_planted_state_with_reshaped_optimizer_moments_is_passed_over(run_url, reference):
    """load_state_dict accepts it; the first resumed step would fail on it."""
    state = donor(reference, 8)
    state["optimizer"]["state"][0]["exp_avg"] = torch.zeros(16, dtype=torch.float64)
    plant(run_url, 8, {STATE_FILE: encode(state)}, reference)
    resumes_from_six(run_url, reference, "step-00000008", "exp_avg")


def test_a_planted_state_with_altered_next_draws_is_passed_over(run_url, reference):
    state = donor(reference, 7)
    state["ranks"][0]["next_draws"]["numpy"] += 0.5
    plant(run_url, 7, {STATE_FILE: encode(state)}, reference)
    resumes_from_six(run_url, reference, "step-00000007", "draws")


def test_a_planted_state_with_a_moved_data_cursor_is_passed_over(run_url, reference):
    state = donor(reference, 9)
    state["ranks"][0]["data"]["cursor"] += 1
    plant(run_url, 9, {STATE_FILE: encode(state)}, reference)
    resumes_from_six(run_url, reference, "step-00000009", "cursor")


def test_a_planted_state_of_another_world_size_is_passed_over_not_exit_2(run_url, reference):
    """A newer generation saying it was written by 2 ranks, with no world change recorded: not this run's, so it
    is skipped; exit 2 (asking for --allow-world-change) would fail the Job for what someone wrote."""
    state = donor(reference, 8)
    state["meta"]["world"] = 2
    manifest = open_store(str(reference)).load(8).info.manifest
    open_store(run_url).commit(8, {STATE_FILE: encode(state)}, contract=manifest["contract"], world=2,
                               code_version=manifest["code_version"], digests={"state": STATE_FILE})
    resumes_from_six(run_url, reference, "step-00000008", "world")


def test_a_complete_json_that_omits_the_state_file_is_passed_over(run_url, reference):
    plant(run_url, 7, {"notes.txt": b"nothing to see"}, reference)
    resumes_from_six(run_url, reference, "step-00000007", STATE_FILE)


def test_text_from_a_planted_manifest_reaches_stderr_escaped(tmp_path, six):
    """A contract holding terminal escape codes and a newline: every log line stays one line of printable text."""
    shutil.copytree(six, tmp_path / "run")
    url = str(tmp_path / "run")
    evil = "\x1b[2J\x1b]0;owned\x07contract\ntrainproof: error: fake line"
    open_store(url).commit(9, {STATE_FILE: b"not a state"}, contract=evil, world=1, code_version="\x1b[31mred")
    result = run(url, "--max-steps", "7", "--keep", "0")
    assert result.code == 0, result.stderr
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr, result.stderr
    assert "fake line" not in result.stderr or "\\x0a" in result.stderr or "…" in result.stderr
    assert not any(line.startswith("trainproof: error: fake") for line in result.stderr.splitlines())


def test_a_listing_flood_never_restarts_the_run_from_step_zero(tmp_path, six, reference):
    """20 001 entries under ``step-`` that are no generation (the scan has no count cap any more, so the number only
    costs time; the memory:// test below shows the cap that used to hide generations): the real process still
    resumes from its real progress and ends equal to an untouched run."""
    shutil.copytree(six, tmp_path / "run")
    root = tmp_path / "run"
    for i in range(20_001):
        (root / f"step-0000000-j{i:06d}").touch()
    result = run(root, "--max-steps", str(TARGET), "--keep", "0")
    assert result.code == 0, result.stderr
    assert result.last("resume")["step"] == 6, result.events
    assert result.last("resume")["fetched_ahead"] is True  # its scan, beside the start-up, went through the flood
    assert differences(trajectory(load_state(reference)), trajectory(load_state(root))) == []


def test_a_listing_that_cannot_finish_in_its_budget_fails_the_scan_and_decides_nothing(tmp_path, six):
    from trainproof.storage import StoreOptions
    from trainproof.storage.errors import ListingIncompleteError
    from trainproof.storage.limits import Limits

    shutil.copytree(six, tmp_path / "run")
    for i in range(5000):
        (tmp_path / "run" / f"step-0000000-j{i:06d}").touch()
    slow = open_store(str(tmp_path / "run"), StoreOptions(limits=Limits(scan_seconds=1e-9)))
    with pytest.raises(ListingIncompleteError, match="did not finish"):
        slow.scan()
    assert [g.step for g in open_store(str(tmp_path / "run")).scan()] == [2, 4, 6]


def test_a_flood_listed_before_the_generations_hides_none_of_them():
    """On S3 (and memory://) names list in order, so ``step-0000000-j…`` comes before ``step-00000002``: a count cap
    on the listing would see only the flood. The scan keeps generations only, whatever comes before them."""
    import uuid

    from trainproof.storage import StoreOptions
    from trainproof.storage.limits import Limits

    url = f"memory://flood-{uuid.uuid4().hex[:8]}/run"
    store = open_store(url, StoreOptions(limits=Limits(scan_entries=1000)))
    for i in range(1001):  # listed first (by name on S3, by age here)
        store.write_file(f"step-0000000-j{i:06d}", b"")
    for step in (2, 4):
        store.commit(step, {STATE_FILE: b"state"}, contract="c", world=1, code_version="t")
    assert [g.step for g in store.scan()] == [2, 4]
    assert store.load_latest(contract="c", world=1, quarantine=False).info.step == 4


KEY = {"TRAINPROOF_SIGNING_KEY": "genuine-key-" + "0" * 20}


@pytest.mark.parametrize("forger", ["unsigned", "another-key"])
def test_with_a_key_a_forgery_at_the_next_step_is_moved_aside_and_the_run_commits_past_it(run_url, reference,
                                                                                          tmp_path, forger):
    """The forgery is skipped at resume (foreign) and then sat on the step the run must commit: it is moved to
    quarantine, never deleted, and the commit proceeds."""
    from trainproof.storage import StoreOptions
    from trainproof.storage.signing import Keyring

    signed = f"{run_url}-signed" if "://" in run_url else str(tmp_path / "signed")
    assert run(signed, "--max-steps", "4", "--checkpoint-every", "2", "--keep", "0", env=KEY).code == 0
    state = donor(reference, 6)
    manifest = open_store(str(reference)).load(6).info.manifest
    keys = None if forger == "unsigned" else Keyring(b"the-forgers-own-key-000000000000")
    open_store(signed, StoreOptions.from_env(signing=keys)).commit(
        6, {STATE_FILE: encode(state)}, contract=manifest["contract"], world=1, code_version=manifest["code_version"],
        digests={"state": STATE_FILE})
    result = run(signed, "--max-steps", "6", "--checkpoint-every", "2", "--keep", "0", env=KEY)
    assert result.code == 0, result.stderr
    assert result.last("resume")["step"] == 4
    assert result.last("resume")["fetched_ahead"] is True  # the fetch's own scan passed the forgery over too
    s = open_store(signed, StoreOptions.from_env(signing=Keyring(KEY["TRAINPROOF_SIGNING_KEY"].encode())))
    assert [(g.step, g.status) for g in s.scan()] == [(2, "complete"), (4, "complete"), (6, "complete")]
    assert [name.startswith("quarantine/step-00000006") for name, _ in s.quarantined()] == [True]
    assert differences(trajectory(load_state(reference, 6)), trajectory(load_state(signed, 6))) == []


def test_train_on_s3_without_a_key_says_once_that_generations_are_not_authenticated(s3_env, tmp_path):
    url = f"s3://{s3_env}/runs/unsigned"
    result = run(url, "--max-steps", "2")
    assert result.code == 0, result.stderr
    assert result.stderr.count("not authenticated") == 1, result.stderr
    signed = run(f"s3://{s3_env}/runs/signed", "--max-steps", "2", env=KEY)
    assert signed.code == 0 and "not authenticated" not in signed.stderr, signed.stderr
    assert "not authenticated" not in run(tmp_path / "run", "--max-steps", "2").stderr
