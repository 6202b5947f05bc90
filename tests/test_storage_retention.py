"""Retention cannot lose the last good copy: strangers' generations never count as the newest, the newest kept
generation is re-verified before anything older goes, young partials survive a zero grace period, and a
symlinked step folder is never followed.  Memory, local folder and S3 over loopback unless noted."""

from __future__ import annotations

import json
import logging
import os
import time

import pytest

from trainproof.storage.retention import RetentionPolicy
from trainproof.storage import COMPLETE, CORRUPT, FOREIGN, INCOMPLETE, open_store
from trainproof.storage.backend import LocalBackend, join
from trainproof.storage.manifest import MARKER
from trainproof.storage.generations import GenerationInfo
from trainproof.storage.retention import MIN_GRACE_SECONDS, KeepEvery, plan_retention

C = "contract-r"


def commit(store, step, contract=C, world=1, **kw):
    return store.commit(step, {"training_state.pt": b"%d" % step * 500, "meta.json": b"{}"}, contract=contract,
                        world=world, code_version="t", **kw)


def steps(store, **kw):
    return [(g.step, g.status) for g in store.scan(**kw)]


def test_a_one_byte_foreign_manifest_at_the_top_never_counts_as_the_newest(store_url):
    """(a) step-99999999/COMPLETE.json of one byte, keep=1: the real newest survives and still loads."""
    store = open_store(store_url)
    for step in (1, 2, 3):
        commit(store, step)
    store.backend.write(join(store.root, "step-99999999", MARKER), b"1")
    store.apply_retention(RetentionPolicy(keep=1, contract=C, world=1))
    assert steps(store) == [(3, COMPLETE), (99_999_999, CORRUPT)]
    assert store.load(3).files["training_state.pt"] == b"3" * 500
    store.apply_retention(RetentionPolicy(keep=1))  # without a contract too
    assert steps(store) == [(3, COMPLETE), (99_999_999, CORRUPT)]


def test_a_valid_generation_of_another_contract_is_neither_newest_nor_deleted(store_url):
    store = open_store(store_url)
    for step in (1, 2, 3):
        commit(store, step)
    commit(store, 99_999_999, contract="someone-else")
    store.apply_retention(RetentionPolicy(keep=1, contract=C))
    assert steps(store) == [(3, COMPLETE), (99_999_999, COMPLETE)]
    assert store.load_latest(contract=C).info.step == 3


def test_without_a_contract_mixed_contracts_delete_nothing(store_url, caplog):
    store = open_store(store_url)
    for step in (1, 2):
        commit(store, step)
    commit(store, 99_999_999, contract="someone-else")
    with caplog.at_level(logging.WARNING, logger="trainproof.storage"):
        assert store.apply_retention(RetentionPolicy(keep=1)) == []
    assert [s for s, _ in steps(store)] == [1, 2, 99_999_999]
    assert any("different contracts" in r.getMessage() for r in caplog.records)


def test_commit_with_keep_counts_only_its_own_contract(store_url):
    """A stranger's valid generation numbered above ours must not make the commit delete what it just wrote."""
    store = open_store(store_url)
    commit(store, 99_999_999, contract="someone-else")
    for step in (1, 2, 3):
        commit(store, step, retention=RetentionPolicy(keep=1))
    assert steps(store) == [(3, COMPLETE), (99_999_999, COMPLETE)]


def test_world_filter_leaves_other_worlds_alone(store_url):
    store = open_store(store_url)
    commit(store, 1, world=2)
    commit(store, 2)
    commit(store, 3)
    commit(store, 4, world=2)
    store.apply_retention(RetentionPolicy(keep=1, contract=C, world=1))
    assert steps(store) == [(1, COMPLETE), (3, COMPLETE), (4, COMPLETE)]
    assert steps(store, world=1) == [(1, FOREIGN), (3, COMPLETE), (4, FOREIGN)]


def test_a_newest_generation_that_fails_verification_keeps_the_older_good_one(store_url, caplog):
    """(b) one flipped byte (same size) in the newest generation: the older, verifying one is kept."""
    store = open_store(store_url)
    for step in (1, 2, 3):
        commit(store, step)
    target = join(store.root, "step-00000003", "training_state.pt")
    data = store.backend.read(target)
    store.backend.write(target, bytes([data[0] ^ 0x01]) + data[1:])
    with caplog.at_level(logging.WARNING, logger="trainproof.storage"):
        assert store.apply_retention(RetentionPolicy(keep=1, contract=C)) == []
    assert steps(store) == [(1, COMPLETE), (2, COMPLETE), (3, COMPLETE)]  # listing cannot see a same-size flip
    assert store.load(2).files["training_state.pt"] == b"2" * 500
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "step-00000003 does not verify" in messages and "step-00000002 is the newest generation that verifies" in messages


def test_nothing_is_deleted_when_no_generation_verifies(store_url):
    store = open_store(store_url)
    for step in (1, 2):
        commit(store, step)
    for step in (1, 2):
        target = join(store.root, f"step-{step:08d}", "meta.json")
        store.backend.write(target, b"{!")
    assert store.apply_retention(RetentionPolicy(keep=1, contract=C)) == []
    assert [s for s, _ in steps(store)] == [1, 2]


def test_a_young_partial_survives_a_zero_grace_period(store_url, caplog):
    """(c) files present, no COMPLETE.json, fresh mtime: grace 0 is raised to the floor and it stays."""
    store = open_store(store_url)
    commit(store, 1)
    store.backend.write(join(store.root, "step-00000002", "training_state.pt"), b"being written")
    commit(store, 3)
    with caplog.at_level(logging.WARNING, logger="trainproof.storage"):
        store.apply_retention(RetentionPolicy(keep=1, grace_seconds=0, contract=C))
    assert steps(store) == [(2, INCOMPLETE), (3, COMPLETE)]
    assert any("raised to 60s" in r.getMessage() for r in caplog.records)
    store.apply_retention(RetentionPolicy(keep=1, grace_seconds=0, contract=C, i_know_no_writer_is_active=True))
    assert steps(store) == [(3, COMPLETE)]


def test_plan_retention_applies_the_grace_floor():
    from trainproof.storage.generations import GenerationInfo

    now = 1_000_000.0
    gens = [GenerationInfo(step=1, name="step-00000001", status=INCOMPLETE, mtime=now - MIN_GRACE_SECONDS / 2),
            GenerationInfo(step=2, name="step-00000002", status=COMPLETE, mtime=now,
                           manifest={"contract": C, "world": 1})]
    assert plan_retention(gens, RetentionPolicy(keep=1, grace_seconds=0), now=now) == []
    assert [g.step for g in plan_retention(gens, RetentionPolicy(keep=1, grace_seconds=0,
                                                                 i_know_no_writer_is_active=True), now=now)] == [1]


def test_a_symlinked_step_folder_is_never_followed_or_deleted_through(tmp_path):
    """(d) step-00000001 is a symlink to a complete generation outside the run: gc leaves it and its target."""
    outside = open_store(str(tmp_path / "elsewhere"))
    commit(outside, 1)
    target = tmp_path / "elsewhere" / "step-00000001"
    store = open_store(str(tmp_path / "run"))
    for step in (2, 3, 4):
        commit(store, step)
    os.symlink(target, tmp_path / "run" / "step-00000001")
    [link] = [g for g in store.scan() if g.step == 1]
    assert link.status == FOREIGN and "symlink" in link.reason
    store.apply_retention(RetentionPolicy(keep=1, grace_seconds=0, i_know_no_writer_is_active=True))
    assert [s for s, _ in steps(store)] == [1, 4]
    assert (target / MARKER).exists() and (target / "training_state.pt").exists()
    assert os.path.islink(tmp_path / "run" / "step-00000001")
    assert outside.load(1).files["training_state.pt"] == b"1" * 500


def test_local_folder_deletes_refuse_a_symlink(tmp_path):
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / MARKER).write_bytes(b"{}")
    (tmp_path / "real" / "keep.pt").write_bytes(b"x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    backend = LocalBackend()
    with pytest.raises(OSError, match="symlink"):
        backend.delete_folder(str(tmp_path / "link"), first=MARKER)
    with pytest.raises(OSError, match="symlink"):
        backend.delete_tree(str(tmp_path / "link"))
    assert sorted(os.listdir(tmp_path / "real")) == [MARKER, "keep.pt"]


def test_commit_never_writes_through_a_symlinked_step_folder_but_moves_the_link_aside(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    store = open_store(str(tmp_path / "run"))
    commit(store, 1)
    os.symlink(tmp_path / "elsewhere", tmp_path / "run" / "step-00000002")
    commit(store, 2)
    assert os.listdir(tmp_path / "elsewhere") == []
    assert (tmp_path / "run" / "step-00000002").is_dir() and not (tmp_path / "run" / "step-00000002").is_symlink()
    (moved,) = (tmp_path / "run" / "quarantine").iterdir()
    assert os.readlink(moved / "OCCUPANT") == str(tmp_path / "elsewhere")  # the link itself, not what it led to


def test_only_step_generations_are_subject_to_keep(store_url):
    store = open_store(store_url)
    commit(store, 1)
    commit(store, 2)
    exports = store.child("exports")
    exports.commit(1, {"model.pt": b"w"}, contract=C, world=1, code_version="t")
    store.write_file("verification/report.json", b"{}")
    store.quarantine(1, "evidence")
    commit(store, 3)
    commit(store, 4)
    store.backend.write(join(store.root, "step-junk", "x"), b"not a generation")
    store.apply_retention(RetentionPolicy(keep=1, grace_seconds=0, contract=C, i_know_no_writer_is_active=True))
    assert steps(store) == [(4, COMPLETE)]
    assert [g.step for g in exports.scan()] == [1]
    assert store.read_file("verification/report.json") == b"{}"
    assert [r for _, r in store.quarantined()] == ["evidence"]
    assert store.backend.read(join(store.root, "step-junk", "x")) == b"not a generation"


def test_dry_run_verifies_but_deletes_nothing(store_url):
    store = open_store(store_url)
    for step in (1, 2, 3):
        commit(store, step)
    assert [g.step for g in store.apply_retention(RetentionPolicy(keep=1, contract=C), dry_run=True)] == [1, 2]
    assert [s for s, _ in steps(store)] == [1, 2, 3]
    manifest = json.loads(store.read_file(f"step-00000003/{MARKER}"))
    assert manifest["contract"] == C


def test_plan_retention_counts_only_the_given_contract_and_world():
    """The pure function itself filters (a caller may hand it a scan made without a contract)."""
    from trainproof.storage.generations import GenerationInfo

    def gen(step, contract=C, world=1):
        return GenerationInfo(step=step, name=f"step-{step:08d}", status=COMPLETE, mtime=0.0,
                              manifest={"contract": contract, "world": world})

    gens = [gen(1), gen(2), gen(3, world=2), gen(99_999_999, contract="someone-else")]
    plan = plan_retention(gens, RetentionPolicy(keep=1, grace_seconds=3600, contract=C), now=1000000000.0)
    assert [g.step for g in plan] == [1, 2]  # 3 (world 2) is the newest of contract C; 99999999 is not ours
    plan = plan_retention(gens, RetentionPolicy(keep=1, grace_seconds=3600, contract=C, world=1), now=1000000000.0)
    assert [g.step for g in plan] == [1]


def test_verify_streams_every_file_and_names_the_fault(store_url):
    store = open_store(store_url)
    commit(store, 1)
    assert store.verify(1, contract=C) is None
    assert "contract" in store.verify(1, contract="other")
    target = join(store.root, "step-00000001", "training_state.pt")
    data = store.backend.read(target)
    store.backend.write(target, data[:-1] + b"X")
    assert "sha256" in store.verify(1)
    assert "no COMPLETE.json" in store.verify(2)


def test_stale_partials_above_the_newest_are_collected_too_a_bounded_number_a_pass():
    """A flood of partial step-* folders planted above the run is collected by the writer's own retention (none of
    its writes is then in flight) once older than the grace, at most COLLECT_PER_PASS a retention, oldest-touched
    first; young ones above the newest stay. Other retentions (gc) never collect above the newest: a writer's
    upload of a large file may outlast any grace."""
    from trainproof.storage.generations import GenerationInfo
    from trainproof.storage.retention import COLLECT_PER_PASS

    now, grace = 1_000_000.0, 3600.0
    complete = GenerationInfo(step=5, name="step-00000005", status=COMPLETE, mtime=now,
                              manifest={"contract": C, "world": 1})
    flood = [GenerationInfo(step=90_000_000 + i, name=f"step-{90_000_000 + i:08d}", status=INCOMPLETE,
                            mtime=now - grace - 1 - i) for i in range(COLLECT_PER_PASS + 10)]
    young = GenerationInfo(step=6, name="step-00000006", status=INCOMPLETE, mtime=now - grace / 2)
    assert plan_retention([complete, young, *flood], RetentionPolicy(keep=1, grace_seconds=grace, contract=C,
                                                                      upto=5), now=now) == []  # gc: never above
    policy = RetentionPolicy(keep=1, grace_seconds=grace, contract=C, upto=5, partials_above_newest=True)
    doomed = plan_retention([complete, young, *flood], policy, now=now)
    assert len(doomed) == COLLECT_PER_PASS and young not in doomed and complete not in doomed
    assert {g.step for g in doomed} == {g.step for g in flood[10:]}  # the longest untouched first
    assert plan_retention([complete, young], policy, now=now) == []


def test_a_flood_of_stale_partials_is_gone_after_a_retention(tmp_path):
    """On a folder: partial folders above the run, older than the grace, are deleted by the writer's retention
    (partials_above_newest); its generations stay."""
    store = open_store(str(tmp_path / "run"))
    for step in (1, 2):
        commit(store, step)
    old = time.time() - 7200
    for i in range(20):
        folder = tmp_path / "run" / f"step-{90_000_000 + i:08d}"
        folder.mkdir()
        (folder / "x").write_bytes(b"")
        os.utime(folder / "x", (old, old))
    store.apply_retention(RetentionPolicy(keep=2, grace_seconds=3600, contract=C, upto=2, partials_above_newest=True))
    assert steps(store) == [(1, COMPLETE), (2, COMPLETE)]


# -- a sparse permanent series besides the K newest (--keep-every) ------------------------------------------------

T0 = 1_800_000_000.0


def _gen(step, at=None, contract=C):
    stamp = None if at is None else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(at))
    return GenerationInfo(step=step, name=f"step-{step:08d}", status=COMPLETE, mtime=at,
                          manifest={"contract": contract, "world": 1, **({"created_at": stamp} if stamp else {})})


def _kept(gens, **policy):
    doomed = {g.step for g in plan_retention(gens, RetentionPolicy(contract=C, **policy), now=T0 + 10 ** 6)}
    return sorted(g.step for g in gens if g.step not in doomed)


def test_keep_every_steps_keeps_the_first_generation_at_or_after_each_multiple():
    """Commits every 7 steps never land on a multiple of 10 past 70: each window [10m, 10m+10) keeps its lowest
    step (the first at or after 10m), a window without a commit keeps none, the K newest are kept as before."""
    gens = [_gen(s) for s in range(7, 120, 7)]  # 7, 14, ..., 119
    assert _kept(gens, keep=2) == [112, 119]
    assert _kept(gens, keep=2, keep_every=KeepEvery(steps=10)) == [14, 21, 35, 42, 56, 63, 70, 84, 91, 105, 112, 119]
    on = [_gen(s) for s in range(5, 101, 5)]  # commits on multiples: exactly the multiples
    assert _kept(on, keep=1, keep_every=KeepEvery(steps=20)) == [20, 40, 60, 80, 100]
    # Sparse commits: the first one after a multiple stands for every multiple it passed (1000 and 2000 -> 2100).
    assert _kept([_gen(900), _gen(2100), _gen(2500), _gen(3300)], keep=1,
                 keep_every=KeepEvery(steps=1000)) == [2100, 3300]


def test_keep_every_duration_keeps_the_first_generation_committed_in_each_window_of_the_runs_time():
    """A commit every 25 minutes, windows of 1 h counted from the oldest generation: the first of each window is
    kept (the oldest included, so the windows never move as retention deletes); K=1 with the series keeps the
    newest too; a generation with no time is not part of the series."""
    gens = [_gen(10 * i, at=T0 + 25 * 60 * i) for i in range(1, 12)]  # 25 min apart: minutes 25, 50, ..., 275
    # windows from minute 25: [25,85) -> 10 (25 min), [85,145) -> 40 (100 min), [145,205) -> 60, [205,265) -> 90 (225 min), [265,325) -> 110
    assert _kept(gens, keep=1, keep_every=KeepEvery(seconds=3600)) == [10, 40, 60, 90, 110]
    assert _kept(gens, keep=1) == [110]
    # Still the same series once the deleted ones are gone (the windows are anchored at the oldest, which is kept).
    survivors = [g for g in gens if g.step in (10, 40, 60, 90, 110)]
    assert _kept(survivors + [_gen(120, at=T0 + 25 * 60 * 12)], keep=1,
                 keep_every=KeepEvery(seconds=3600)) == [10, 40, 60, 90, 110, 120]
    untimed = [_gen(5)] + gens  # no created_at and no mtime: not in the series, deleted like any other
    assert _kept(untimed, keep=1, keep_every=KeepEvery(seconds=3600)) == [10, 40, 60, 90, 110]


def test_keep_every_leaves_the_safety_rules_as_they_were():
    """The series only ever keeps more: other contracts are untouched, generations above ``upto`` are neither
    counted nor deleted, stale partials still go after their grace, young ones stay."""
    gens = [_gen(s) for s in range(5, 51, 5)] + [_gen(1000, contract="someone-else")]
    partial = GenerationInfo(step=12, name="step-00000012", status=INCOMPLETE, mtime=T0)
    young = GenerationInfo(step=13, name="step-00000013", status=INCOMPLETE, mtime=T0 + 10 ** 6 - 1)
    plan = plan_retention(gens + [partial, young], RetentionPolicy(keep=1, contract=C, upto=45,
                                                                    keep_every=KeepEvery(steps=20)), now=T0 + 10 ** 6)
    assert [g.step for g in plan] == [5, 10, 12, 15, 25, 30, 35]  # kept: 20, 40 (series), 45 (newest); 50 above upto


def test_keep_every_parses_steps_and_durations_and_names_the_forms():
    assert KeepEvery.parse("1000") == KeepEvery(steps=1000)
    assert KeepEvery.parse(" 6h ") == KeepEvery(seconds=6 * 3600)
    assert KeepEvery.parse("1h30m") == KeepEvery(seconds=5400) and str(KeepEvery.parse("1h30m")) == "1h30m"
    for bad in ("0", "-5", "6x", "", "1.5", "0s", "9" * 40):
        with pytest.raises(ValueError, match=r"a step count \(1000\) or a duration \(90s, 10m, 6h"):
            KeepEvery.parse(bad)
