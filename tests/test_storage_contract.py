"""The store contract, run once against every backend (memory://, a local folder, S3 over loopback).

Organised by invariant: a generation is usable iff COMPLETE.json exists and checks out; discovery skips and
reports everything else; retention never deletes the newest complete generation; create-only commits.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os

import pytest

from trainproof.storage.retention import RetentionPolicy
from trainproof.storage import (COMPLETE, FOREIGN, INCOMPLETE, CommitConflictError, CorruptGenerationError, StoreOptions,
                     open_store)
from trainproof.storage.pieces import Pieces
from trainproof.storage.spool import SpoolWriter
from trainproof.storage.manifest import MARKER, SCHEMA
from trainproof.storage.backend import join

C = "contract-a"
MiB = 2**20


def commit(store, step, payload=None, **kw):
    payload = payload if payload is not None else f"state-{step}".encode() * 100
    kw.setdefault("contract", C)
    kw.setdefault("world", 1)
    kw.setdefault("code_version", "test")
    return store.commit(step, {"training_state.pt": payload, "meta.json": b"{}"}, **kw)


def raw(store, *parts):
    return join(store.root, *parts)


def test_commit_writes_manifest_last_with_digests(store_url):
    store = open_store(store_url)
    payload = b"x" * 12345
    info = commit(store, 5, payload, digests={"state": "training_state.pt"})
    assert info.name == "step-00000005"
    manifest = json.loads(store.read_file(f"step-00000005/{MARKER}"))
    assert manifest["schema"] == SCHEMA and manifest["step"] == 5 and manifest["world"] == 1
    assert manifest["contract"] == C
    assert manifest["files"]["training_state.pt"] == {"bytes": 12345, "sha256": hashlib.sha256(payload).hexdigest()}
    assert manifest["state_bytes"] == 12345 and manifest["state_sha256"] == hashlib.sha256(payload).hexdigest()
    assert store.latest_hint() == "step-00000005"


def test_verify_runs_the_callers_check_on_read_back_bytes(store_url):
    store = open_store(store_url)
    seen = {}

    def check(name, data):
        seen[name] = data

    commit(store, 1, b"abc", check=check)
    assert seen["training_state.pt"] == b"abc"

    def refuse(name, data):
        raise ValueError("not a torch file")

    with pytest.raises(CorruptGenerationError, match="content check"):
        commit(store, 2, b"abc", check=refuse)
    assert [g.status for g in store.scan()] == [COMPLETE, INCOMPLETE]  # never marked usable


def test_latest_is_the_highest_complete_generation_even_with_a_stale_or_missing_hint(store_url):
    store = open_store(store_url)
    for step in (1, 2, 3):
        commit(store, step)
    store.write_file("LATEST", b"step-00000001\n")  # stale
    assert store.load_latest(contract=C, world=1).info.step == 3
    store.backend.delete(raw(store, "LATEST"))  # missing
    assert store.load_latest(contract=C, world=1).info.step == 3
    store.write_file("LATEST", b"step-00000099\n")  # dangling
    assert store.load_latest(contract=C, world=1).info.step == 3


def test_partial_newer_generation_is_skipped_loudly(store_url, caplog):
    store = open_store(store_url)
    commit(store, 1)
    store.backend.write(raw(store, "step-00000002", "training_state.pt"), b"half")  # killed before COMPLETE.json
    with caplog.at_level(logging.WARNING, logger="trainproof.storage"):
        loaded = store.load_latest(contract=C, world=1)
    assert loaded.info.step == 1
    assert any("step-00000002" in r.message and "incomplete" in r.message for r in caplog.records)
    assert store.backend.exists(raw(store, "step-00000002", "training_state.pt"))  # never silently deleted


def test_foreign_contract_and_world_are_skipped(store_url):
    store = open_store(store_url)
    commit(store, 1)
    commit(store, 2, contract="contract-b")
    commit(store, 3, world=2)
    statuses = {g.step: g.status for g in store.scan(contract=C, world=1)}
    assert statuses == {1: COMPLETE, 2: FOREIGN, 3: FOREIGN}
    assert store.load_latest(contract=C, world=1).info.step == 1


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "bad_manifest", "wrong_step_manifest"])
def test_damage_is_detected_quarantined_and_the_step_can_be_committed_again(store_url, damage):
    store = open_store(store_url)
    commit(store, 1)
    commit(store, 2, b"precious" * 1000)
    target = raw(store, "step-00000002", "training_state.pt")
    data = store.backend.read(target)
    if damage == "flip":
        store.backend.write(target, data[:100] + bytes([data[100] ^ 0x01]) + data[101:])
    elif damage == "truncate":
        store.backend.write(target, data[:-7])
    elif damage == "delete":
        store.backend.delete(target)
    elif damage == "bad_manifest":
        store.backend.delete(raw(store, "step-00000002", MARKER))
        store.backend.write(raw(store, "step-00000002", MARKER), b"{not json")
    else:
        m = json.loads(store.backend.read(raw(store, "step-00000002", MARKER)))
        m["step"] = 7
        store.backend.delete(raw(store, "step-00000002", MARKER))
        store.backend.write(raw(store, "step-00000002", MARKER), json.dumps(m).encode())

    loaded = store.load_latest(contract=C, world=1)
    assert loaded.info.step == 1  # fell back to the previous generation
    q = store.quarantined()
    assert len(q) == 1 and q[0][0].startswith("quarantine/step-00000002-") and q[0][1]
    assert store.backend.exists(raw(store, *q[0][0].split("/"), "REASON"))
    assert [g.step for g in store.scan()] == [1]
    commit(store, 2, b"again")  # the resumed run can commit that step again
    assert store.load_latest(contract=C, world=1).files["training_state.pt"] == b"again"


def test_load_a_specific_generation_verifies_content(store_url):
    store = open_store(store_url)
    commit(store, 4, b"hello world")
    assert store.load(4).files["training_state.pt"] == b"hello world"
    store.backend.write(raw(store, "step-00000004", "training_state.pt"), b"hello wOrld")
    with pytest.raises(CorruptGenerationError, match="sha256"):
        store.load(4)


def test_read_only_discovery_does_not_quarantine(store_url):
    store = open_store(store_url)
    commit(store, 1)
    commit(store, 2)
    store.backend.write(raw(store, "step-00000002", "meta.json"), b"{!}")  # same size, other bytes
    assert store.load_latest(contract=C, world=1, quarantine=False).info.step == 1
    assert store.quarantined() == []
    assert store.backend.exists(raw(store, "step-00000002", MARKER))


def test_committing_a_committed_step_is_a_conflict(store_url):
    store = open_store(store_url)
    commit(store, 3, b"first")
    with pytest.raises(CommitConflictError, match="already committed"):
        commit(store, 3, b"second")
    assert store.load(3).files["training_state.pt"] == b"first"


def test_abandoned_partial_of_the_same_step_never_mixes_with_the_new_commit(store_url):
    store = open_store(store_url)
    commit(store, 1)
    store.backend.write(raw(store, "step-00000002", "training_state.pt"), b"half-written by a killed writer")
    commit(store, 2, b"complete now")
    assert store.load(2).files["training_state.pt"] == b"complete now"
    assert store.load_latest(contract=C, world=1).files["training_state.pt"] == b"complete now"
    # the leftover is neither overwritten nor deleted (it may belong to a live writer); retention removes it later
    assert store.backend.read(raw(store, "step-00000002", "training_state.pt")) == b"half-written by a killed writer"


def test_retention_keeps_k_newest_and_never_the_newest_complete(store_url):
    store = open_store(store_url)
    for step in range(1, 6):
        commit(store, step, retention=RetentionPolicy(keep=2))
    assert [g.step for g in store.scan()] == [4, 5]
    # a partial newer than the newest complete is never collected, however old
    store.backend.write(raw(store, "step-00000006", "training_state.pt"), b"in flight")
    store.apply_retention(RetentionPolicy(keep=1, grace_seconds=0, i_know_no_writer_is_active=True))
    assert [g.step for g in store.scan()] == [5, 6]


def test_retention_collects_old_partials_but_not_exports_or_quarantine(store_url):
    store = open_store(store_url)
    commit(store, 1)
    store.backend.write(raw(store, "step-00000002", "training_state.pt"), b"abandoned")
    commit(store, 3)
    exports = store.child("exports")
    exports.commit(1, {"model_bf16.pt": b"w"}, contract=C, world=1, code_version="t")
    oldest = [g.name for g in store.scan() if g.step == 1]
    assert [g.name for g in store.apply_retention(RetentionPolicy(keep=1, grace_seconds=3600))] == oldest
    assert [g.step for g in store.scan()] == [2, 3]  # the fresh partial is within its grace period
    store.apply_retention(RetentionPolicy(keep=1, grace_seconds=0))  # raised to MIN_GRACE_SECONDS: a writer may still be writing it
    assert [g.step for g in store.scan()] == [2, 3]
    store.apply_retention(RetentionPolicy(keep=1, grace_seconds=0, i_know_no_writer_is_active=True))
    assert [g.step for g in store.scan()] == [3]
    assert [g.step for g in exports.scan()] == [1]


def test_run_files_create_only(store_url):
    store = open_store(store_url)
    store.write_file("plan.json", b"{}", create_only=True)
    with pytest.raises(FileExistsError):
        store.write_file("plan.json", b"{\"other\": 1}", create_only=True)
    assert store.read_file("plan.json") == b"{}"
    with pytest.raises(FileNotFoundError):
        store.read_file("nope.json")


@pytest.mark.parametrize("source", ["bytes", "pieces", "spool"])
def test_a_create_only_write_of_any_size_never_replaces_an_existing_object(store_url, source, tmp_path):
    """Large sources go up as multipart uploads on S3, whose completion Ceph RGW does not make create-only: the
    store must refuse the second write there too, and leave the first object's bytes in place."""
    store = open_store(store_url, StoreOptions.from_env(part_size=5 * MiB))
    first, second = os.urandom(11 * MiB), os.urandom(11 * MiB)  # over 2 parts: the multipart path on S3

    def as_source(data):
        if source == "pieces":
            return Pieces([memoryview(data)[: 3 * MiB], memoryview(data)[3 * MiB:]])
        if source == "spool":
            with SpoolWriter(str(tmp_path)) as w:
                w.write(data)
            return w.finish()
        return data

    store.write_file("big.bin", as_source(first), create_only=True)
    with pytest.raises(FileExistsError):
        store.write_file("big.bin", as_source(second), create_only=True)
    assert store.read_file("big.bin") == first


def test_empty_store_has_no_latest(store_url):
    store = open_store(store_url)
    assert store.scan() == [] and store.load_latest(contract=C, world=1) is None and store.latest_hint() is None


def test_parts_written_by_several_writers_commit_as_one_generation(store_url):
    """One writer per rank writes and verifies its own file; one of them commits every file's entry."""
    rank0, rank1 = open_store(store_url), open_store(store_url)
    e1 = rank1.write_part(3, {"rank-00001.pt": b"rank one"})
    e0 = rank0.write_part(3, {"training_state.pt": b"rank zero"})
    assert [g.status for g in rank0.scan()] == [INCOMPLETE]  # nothing usable before the commit
    rank0.commit_parts(3, {**e0, **e1}, contract=C, world=2, code_version="t", digests={"state": "training_state.pt"})
    loaded = open_store(store_url).load_latest(contract=C, world=2)
    assert loaded.files == {"training_state.pt": b"rank zero", "rank-00001.pt": b"rank one"}
    assert loaded.info.manifest["state_bytes"] == len(b"rank zero")
    with pytest.raises(CommitConflictError):
        rank1.write_part(3, {"rank-00001.pt": b"late"})


def test_commit_parts_refuses_an_entry_whose_object_is_not_there(store_url):
    store = open_store(store_url)
    entries = store.write_part(4, {"training_state.pt": b"zero"})
    entries["rank-00001.pt"] = [5, hashlib.sha256(b"never").hexdigest(), "rank-00001.pt"]  # a rank that died
    with pytest.raises(CorruptGenerationError, match="rank-00001.pt"):
        store.commit_parts(4, entries, contract=C, world=2, code_version="t")
    assert [g.status for g in store.scan()] == [INCOMPLETE]
