"""A shared or hostile bucket: whatever sits under the run's prefix, discovery classifies it and never raises,
never reads more than the caps, and never takes a name from a manifest as a path.

Run on every backend (memory, local folder, S3 over loopback) unless a case only exists on one of them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading

import pytest

from trainproof.storage.retention import RetentionPolicy
from trainproof.storage import COMPLETE, CORRUPT, CorruptGenerationError, StoreOptions, open_store
from trainproof.storage.backend import CHUNK, join
from trainproof.storage.limits import Limits, UntrustedJSONError, loads_untrusted
from trainproof.storage.manifest import MARKER, SCHEMA, ManifestError, parse
from tests.support.timing import budget
from tests.support.tamper import wrap

C = "contract-h"
STATE = b"state bytes " * 100
SHA = hashlib.sha256(STATE).hexdigest()


def commit(store, step, payload=STATE, **kw):
    return store.commit(step, {"training_state.pt": payload}, contract=kw.pop("contract", C), world=1,
                        code_version="t", **kw)


def manifest(step=3, **over):
    doc = {"schema": SCHEMA, "step": step, "contract": C, "world": 1, "attempt": "a" * 32, "code_version": "t",
           "files": {"training_state.pt": {"bytes": len(STATE), "sha256": SHA}}}
    doc.update(over)
    return doc


def plant(store, step, raw: bytes, files=None):
    """A generation written by someone else: its data files, then the given bytes as COMPLETE.json."""
    folder = f"step-{step:08d}"
    for name, data in (files if files is not None else {"training_state.pt": STATE}).items():
        store.backend.write(join(store.root, folder, name), data)
    store.backend.write(join(store.root, folder, MARKER), raw)


DEEP = b'{"a":' * 100_000 + b"1" + b"}" * 100_000
MALFORMED = {
    "deeply-nested": DEEP,
    "nested-past-depth-cap": json.dumps(manifest(extra={"x": 0})).encode()
    .replace(b'{"x": 0}', b'{"x": ' + b"[" * 40 + b"]" * 40 + b"}"),
    "5000-digit-int": json.dumps(manifest()).encode().replace(b'"step": 3', b'"step": ' + b"9" * 5000),
    "5000-digit-size": json.dumps(manifest()).encode().replace(str(len(STATE)).encode(), b"1" * 5000),
    "nan": json.dumps(manifest()).encode().replace(b'"world": 1', b'"world": NaN'),
    "infinity-float": json.dumps(manifest()).encode().replace(b'"world": 1', b'"world": 1e999'),
    "top-level-list": b"[1, 2, 3]",
    "top-level-string": b'"COMPLETE"',
    "one-byte": b"1",
    "not-utf8": b"\xff\xfe{}",
    "world-is-bool": json.dumps(manifest(world=True)).encode(),
    "step-is-string": json.dumps(manifest(step="3")).encode(),
    "files-is-list": json.dumps(manifest(files=["training_state.pt"])).encode(),
    "bytes-is-string": json.dumps(manifest(files={"training_state.pt": {"bytes": "1200", "sha256": SHA}})).encode(),
    "bytes-negative": json.dumps(manifest(files={"training_state.pt": {"bytes": -1, "sha256": SHA}})).encode(),
    "digest-field-wrong-type": json.dumps(manifest(state_sha256=12)).encode(),
    "extra-not-object": json.dumps(manifest(extra=[1])).encode(),
    "duplicate-key": json.dumps(manifest()).encode()[:-1] + b', "contract": "other"}',
    "dotdot-file": json.dumps(manifest(files={"..": {"bytes": 1, "sha256": SHA}})).encode(),
    "dotdot-object": json.dumps(manifest(files={"training_state.pt": {
        "bytes": len(STATE), "sha256": SHA, "object": "../step-00000001/training_state.pt"}})).encode(),
    "absolute-object": json.dumps(manifest(files={"training_state.pt": {
        "bytes": len(STATE), "sha256": SHA, "object": "/etc/passwd"}})).encode(),
    "empty-name": json.dumps(manifest(files={"": {"bytes": 1, "sha256": SHA}})).encode(),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_manifests_are_classified_corrupt_never_raised(store_url, case, caplog):
    store = open_store(store_url)
    commit(store, 1)
    plant(store, 3, MALFORMED[case])
    gens = store.scan(contract=C, world=1)  # must not raise
    assert [(g.step, g.status) for g in gens] == [(1, COMPLETE), (3, CORRUPT)], gens[-1].reason
    with pytest.raises(CorruptGenerationError):
        store.load(3)
    with caplog.at_level(logging.WARNING, logger="trainproof.storage"):
        assert store.load_latest(contract=C, world=1, quarantine=False).info.step == 1


@pytest.mark.parametrize("case", list(MALFORMED))
def test_the_parser_itself_refuses_each_malformed_manifest(case):
    """The unit under the scan test: only ManifestError comes out, whatever the bytes."""
    with pytest.raises(ManifestError):
        parse(MALFORMED[case], dir_name="step-00000003")


@pytest.mark.parametrize("name", ["..", ".", "../x.pt", "a/b.pt", "/abs.pt", "a\\b.pt", "", "a\nb.pt",
                                  "esc\x1b[2J.pt", "nul\x00.pt", "x" * 256, MARKER, "REASON"])
def test_manifest_file_and_object_names_must_be_plain(name):
    good = manifest()
    as_file = manifest(files={name: {"bytes": 1, "sha256": SHA}})
    as_object = manifest(files={"training_state.pt": {"bytes": 1, "sha256": SHA, "object": name}})
    parse(json.dumps(good).encode(), dir_name="step-00000003")
    for doc in (as_file, as_object):
        with pytest.raises(ManifestError, match="invalid"):
            parse(json.dumps(doc).encode(), dir_name="step-00000003")


@pytest.mark.parametrize("name", ["..", "../escape.pt", "a/b", "x\ny"])
def test_commit_refuses_a_file_name_that_is_not_plain(store_url, name):
    store = open_store(store_url)
    with pytest.raises(ValueError, match="invalid file names"):
        store.commit(1, {name: b"x"}, contract=C, world=1, code_version="t")
    assert store.scan() == []


def test_a_control_character_object_that_exists_is_still_refused(tmp_path):
    """The listing can hold such a name (a folder does), so the name rule is what refuses it."""
    store = open_store(str(tmp_path / "run"))
    evil = "state\x1b[2J.pt"
    doc = manifest(files={evil: {"bytes": len(STATE), "sha256": SHA}})
    plant(store, 3, json.dumps(doc).encode(), files={evil: STATE})
    [gen] = store.scan()
    assert gen.status == CORRUPT and "control character" in gen.reason


def test_an_oversized_manifest_is_corrupt_without_being_read(store_url):
    store = wrap(open_store(store_url, StoreOptions.from_env(limits=Limits(manifest_bytes=4096))))
    doc = manifest(extra={"pad": "x" * 10_000})
    plant(store, 3, json.dumps(doc).encode())
    [gen] = store.scan()
    assert gen.status == CORRUPT and "Limits.manifest_bytes" in gen.reason
    assert store.backend.bytes_read.get(join(store.root, "step-00000003", MARKER), 0) == 0


def test_a_claimed_size_above_the_cap_is_corrupt_without_reading(store_url):
    """A manifest claiming 100 GB (and an object that says so too: the listing agrees) is refused by the cap."""
    store = wrap(open_store(store_url, StoreOptions.from_env(limits=Limits(file_bytes=1000))))
    doc = manifest(files={"training_state.pt": {"bytes": 100 * 10**9, "sha256": SHA}})
    plant(store, 3, json.dumps(doc).encode())
    [gen] = store.scan()
    assert gen.status == CORRUPT and "Limits.file_bytes" in gen.reason
    assert store.backend.bytes_read.get(join(store.root, "step-00000003", "training_state.pt"), 0) == 0
    # the default cap refuses an absurd claim too
    assert "Limits.file_bytes" in pytest.raises(ManifestError, parse, json.dumps(manifest(files={
        "training_state.pt": {"bytes": 10**15, "sha256": SHA}})).encode(), dir_name="step-00000003").value.args[0]


def test_a_claimed_size_above_what_the_object_holds_is_corrupt_without_reading(store_url):
    store = wrap(open_store(store_url))
    doc = manifest(files={"training_state.pt": {"bytes": 100 * 10**9, "sha256": SHA}})
    plant(store, 3, json.dumps(doc).encode())
    [gen] = store.scan()
    assert gen.status == CORRUPT and "says 100000000000" in gen.reason
    assert store.backend.bytes_read.get(join(store.root, "step-00000003", "training_state.pt"), 0) == 0


def test_an_object_swapped_for_a_bigger_one_is_not_read_whole(store_url):
    """Listed with the right size at scan time, then replaced by 40 MiB: each of load's two reads (it re-reads
    once on a mismatch) takes at most one chunk of it."""
    store = wrap(open_store(store_url))
    commit(store, 1)
    [info] = store.scan()
    big = b"z" * (5 * CHUNK)
    store.backend.inner.write(join(store.root, "step-00000001", "training_state.pt"), big)
    from trainproof.storage.generations import load

    store.backend.bytes_read.clear()
    with pytest.raises(CorruptGenerationError, match="more than"):
        load(store._ctx, info)
    read = store.backend.bytes_read[join(store.root, "step-00000001", "training_state.pt")]
    assert 0 < read <= 2 * CHUNK, read


def test_scans_are_not_cut_by_count_but_fail_whole_past_their_time_budget(store_url):
    """A cut view could miss the newest generation (a resume from an older one, or from step 0, and retention
    deleting what it did not see): a scan sees every generation, or raises and decides nothing."""
    from trainproof.storage.errors import ListingIncompleteError

    store = open_store(store_url, StoreOptions.from_env(limits=Limits(scan_entries=3)))
    for step in range(1, 6):
        commit(store, step)
    assert [g.step for g in store.scan()] == [1, 2, 3, 4, 5]
    slow = open_store(store_url, StoreOptions.from_env(limits=Limits(scan_seconds=1e-9)))
    with pytest.raises(ListingIncompleteError, match="did not finish"):
        slow.scan()
    with pytest.raises(ListingIncompleteError):
        slow.apply_retention(RetentionPolicy(keep=1))
    assert len(open_store(store_url).scan()) == 5


def test_a_generation_with_too_many_objects_is_corrupt(store_url):
    store = open_store(store_url, StoreOptions.from_env(limits=Limits(scan_entries=4)))
    commit(store, 1)
    for i in range(6):
        store.backend.write(join(store.root, "step-00000001", f"junk-{i}"), b"j")
    [gen] = store.scan()
    assert gen.status == CORRUPT and "more than 4 objects" in gen.reason


def test_latest_hint_is_capped_and_must_name_a_generation(store_url):
    store = open_store(store_url)
    commit(store, 3)
    assert store.latest_hint() == "step-00000003"
    store.write_file("LATEST", b"[red]rm -rf /[/red]\n")
    assert store.latest_hint() is None
    store.write_file("LATEST", b"step-00000003" + b" " * (128 * 1024))  # valid text, but over the cap
    assert store.latest_hint() is None
    store.write_file("LATEST", b"\xff\xfe")
    assert store.latest_hint() is None


def test_a_hostile_reason_file_does_not_break_listing_quarantine(store_url):
    store = open_store(store_url)
    commit(store, 1)
    commit(store, 2)
    folders = [store.quarantine(1, "first"), store.quarantine(2, "second")]
    store.backend.write(join(store.root, "quarantine", folders[0], "REASON"), b"[" * 20_000)
    store.backend.write(join(store.root, "quarantine", folders[1], "REASON"), json.dumps({"reason": [1]}).encode())
    reasons = dict(store.quarantined())
    assert reasons[f"quarantine/{folders[0]}"].startswith("(unreadable REASON file")
    assert reasons[f"quarantine/{folders[1]}"] == "(REASON file without a reason)"


@pytest.mark.parametrize("raw, why", [
    (b"[" * 10_000, "nested"), (b"[" * 40 + b"]" * 40, "nested"), (b'{"a": NaN}', "non-finite"), (b'{"a": -Infinity}', "non-finite"),
    (b'{"a": 1e400}', "non-finite"), (b'{"a": ' + b"7" * 5000 + b"}", "digits"), (b'{"a":1,"a":2}', "duplicate"),
    (b" " * 70_000, "larger than"), (b"\xc3\x28", "not valid JSON"),
])
def test_untrusted_json_refuses_what_a_store_never_writes(raw, why):
    with pytest.raises(UntrustedJSONError, match=why):
        loads_untrusted(raw, what="x.json", max_bytes=65536)
    assert loads_untrusted(b'{"a": [1, 2.5, "s", null, true]}', what="x", max_bytes=100) == {"a": [1, 2.5, "s", None, True]}


def test_read_json_of_a_run_file_is_defensive(store_url):
    store = open_store(store_url)
    store.write_file("plan.json", b'{"contract": "c", "lr": NaN}')
    with pytest.raises(ValueError, match="non-finite"):
        store.read_json("plan.json")
    store.write_file("plan.json", b'{"contract": "c"}' + b" " * 2000)
    with pytest.raises(ValueError, match="larger than"):
        store.read_json("plan.json", max_bytes=1000)
    store.write_file("plan.json", b'{"contract": "c"}')
    assert store.read_json("plan.json") == {"contract": "c"}
    with pytest.raises(FileNotFoundError):
        store.read_json("nope.json")


def test_a_data_file_swapped_for_a_symlink_is_never_read_through(tmp_path):
    """Same bytes outside the run, linked in after the scan: load refuses the link instead of following it."""
    store = open_store(str(tmp_path / "run"))
    commit(store, 1)
    [info] = store.scan()
    (tmp_path / "outside.pt").write_bytes(STATE)
    inside = tmp_path / "run" / "step-00000001" / "training_state.pt"
    inside.unlink()
    os.symlink(tmp_path / "outside.pt", inside)
    from trainproof.storage.generations import load

    with pytest.raises(CorruptGenerationError, match="not a regular file"):
        load(store._ctx, info)
    [gen] = store.scan()
    assert gen.status == CORRUPT and "not a regular file" in gen.reason


def test_a_data_file_swapped_for_a_fifo_does_not_hang_a_load(tmp_path):
    store = open_store(str(tmp_path / "run"))
    commit(store, 1)
    [info] = store.scan()
    inside = tmp_path / "run" / "step-00000001" / "training_state.pt"
    inside.unlink()
    os.mkfifo(inside)
    from trainproof.storage.generations import load

    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(pytest.raises(CorruptGenerationError, load, store._ctx, info)),
                              daemon=True)
    worker.start()
    worker.join(timeout=budget(10))
    if worker.is_alive():  # unblock the stuck open() so the thread can end, then fail
        os.close(os.open(inside, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail("load blocked on a FIFO")
    assert outcome and "not a regular file" in str(outcome[0].value)


def test_a_reason_never_carries_a_huge_value():
    doc = manifest(files={"training_state.pt": {"bytes": 1, "sha256": SHA, "object": ["x" * 1000] * 500}})
    with pytest.raises(ManifestError) as err:
        parse(json.dumps(doc).encode(), dir_name="step-00000003")
    assert len(str(err.value)) < 300


def test_a_symlinked_latest_hint_is_no_hint(tmp_path):
    store = open_store(str(tmp_path / "run"))
    commit(store, 1)
    (tmp_path / "run" / "LATEST").unlink()
    (tmp_path / "secret").write_bytes(b"step-00000001\n")
    os.symlink(tmp_path / "secret", tmp_path / "run" / "LATEST")
    assert store.latest_hint() is None
