"""Shared objects: a file several generations hold alike (a frozen base model) stored once for the run, under
``shared/<sha256>``, and referenced by digest from each generation's manifest.

On every backend: the object is written once and each commit after it writes only its own files; a load reads and
verifies the shared file like any other; a damaged or missing one makes every generation that references it unusable
(never loaded), like damage in its own folder; something planted at the name is moved aside and the object written
again; retention (``--keep 1``) deletes old generations, never the shared object the kept one references.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from trainproof.storage import CorruptGenerationError, open_store
from trainproof.storage.backend import join
from trainproof.storage.manifest import ManifestError, parse
from trainproof.storage.retention import RetentionPolicy
from trainproof.storage.spool import SpoolWriter

C = "contract-shared"
FROZEN = "frozen.pt"


def _spool(tmp_path, data: bytes):
    with SpoolWriter(str(tmp_path)) as out:
        out.write(data)
    return out.finish()


def _names(store, relpath: str) -> list[str]:
    return sorted(e.name for e in store.list_dir(relpath) if not e.is_dir)


def test_a_shared_object_is_written_once_and_read_verified_by_every_generation_that_references_it(store_url,
                                                                                                   tmp_path):
    store = open_store(store_url)
    frozen = hashlib.sha256(b"base").digest() * 4096  # 128 KiB
    spool = _spool(tmp_path, frozen)
    size, sha = store.put_shared(spool)
    assert size == len(frozen) and _names(store, "shared") == [str(sha)]
    for step in (1, 2, 3):
        store.commit(step, {"training_state.pt": b"%d" % step * 100}, contract=C, world=1, code_version="t",
                     shared={FROZEN: (size, sha)}, retention=RetentionPolicy(keep=1, contract=C))
        assert _names(store, f"step-{step:08d}") == ["COMPLETE.json", "training_state.pt"]  # the state only
    assert [g.step for g in store.scan() if g.status == "complete"] == [3]
    assert _names(store, "shared") == [str(sha)]  # retention kept what the kept generation references
    again = store.put_shared(_spool(tmp_path, frozen))  # a later process, the same frozen bytes: nothing new
    assert again == (size, sha) and _names(store, "shared") == [str(sha)]
    loaded = store.load(3, contract=C)
    assert bytes(loaded.files[FROZEN]) == frozen and loaded.files["training_state.pt"] == b"3" * 100
    assert store.verify(3, contract=C) is None
    manifest = store.generation(3).manifest["files"][FROZEN]
    assert manifest == {"bytes": size, "sha256": str(sha), "shared": True}


def test_a_damaged_or_missing_shared_object_makes_its_generations_unusable(tmp_path):
    store = open_store(str(tmp_path / "run"))
    spool = _spool(tmp_path, b"frozen" * 1000)
    size, sha = store.put_shared(spool)
    for step in (1, 2):
        store.commit(step, {"training_state.pt": b"s%d" % step}, contract=C, world=1, code_version="t",
                     shared={FROZEN: (size, sha)})
    path = tmp_path / "run" / "shared" / str(sha)
    path.write_bytes(b"F" + path.read_bytes()[1:])
    assert "sha256 differs" in store.verify(2, contract=C)
    with pytest.raises(CorruptGenerationError, match="shared/.*frozen.pt.*sha256 differs"):
        store.load(2, contract=C)
    assert store.load_latest(contract=C, quarantine=False) is None  # neither generation loads
    path.unlink()
    with pytest.raises(CorruptGenerationError, match="shared/.*missing|No such file"):
        store.load(1, contract=C)
    with pytest.raises(CorruptGenerationError, match="not in the store"):  # never referenced while missing
        store.commit(3, {"training_state.pt": b"s3"}, contract=C, world=1, code_version="t",
                     shared={FROZEN: (size, sha)})


def test_bytes_planted_at_a_shared_objects_name_are_moved_aside_and_the_object_written(tmp_path):
    store = open_store(str(tmp_path / "run"))
    data = b"the frozen base" * 500
    spool = _spool(tmp_path, data)
    planted = tmp_path / "run" / "shared" / str(spool.sha256)
    planted.parent.mkdir(parents=True)
    planted.write_bytes(b"x" * len(data))  # the right size, other bytes
    assert store.put_shared(spool) == (len(data), spool.sha256)
    assert planted.read_bytes() == data
    (moved,) = (tmp_path / "run" / "quarantine").iterdir()
    assert moved.name.startswith("shared-") and (moved / "OCCUPANT").read_bytes() == b"x" * len(data)


@pytest.mark.parametrize("entry", [{"shared": 1}, {"shared": True, "object": "other.pt"}, {"shared": False}])
def test_a_manifest_entry_that_is_not_a_plain_shared_reference_is_refused(entry):
    manifest = {"schema": "trainproof.generation/1", "step": 1, "contract": C, "world": 1, "attempt": "a",
                "files": {FROZEN: {"bytes": 1, "sha256": "0" * 64, **entry}}}
    with pytest.raises(ManifestError, match="shared"):
        parse(json.dumps(manifest).encode(), dir_name="step-00000001")


def test_a_shared_reference_never_leaves_shared(tmp_path):
    """The object's name is its sha256, which the manifest check allows only as 64 hex digits: a reference cannot
    name a path (``../step-00000001/x``)."""
    manifest = {"schema": "trainproof.generation/1", "step": 1, "contract": C, "world": 1, "attempt": "a",
                "files": {FROZEN: {"bytes": 1, "sha256": "../step-00000001/training_state.pt", "shared": True}}}
    with pytest.raises(ManifestError, match="sha256"):
        parse(json.dumps(manifest).encode(), dir_name="step-00000001")
    assert join("root", "shared", "0" * 64) == "root/shared/" + "0" * 64


def _collect(store, dry_run=False, **policy):
    """Retention (keep=1) of this run's generations; (steps deleted, names of the shared objects deleted)."""
    named: list[str] = []
    removed = store.apply_retention(RetentionPolicy(keep=1, contract=C, **policy), dry_run=dry_run,
                                    on_shared=named.append)
    return [g.step for g in removed], sorted(named)


def test_retention_deletes_the_shared_objects_no_generation_left_references_and_keeps_every_referenced_one(
        store_url, tmp_path):
    """A base changed twice (an EMA copy, layers unfrozen): generations 1-2 reference A, 3 references B, 4-5 C, and a
    generation of another contract references A too; D was stored and never referenced (a commit that never
    landed). keep=1 deletes 1-4 and, with them, B (the default: what the deleted generations released). A stays
    while the other contract's generation references it, C while 5 does. D is left to ``shared="all"`` (gc), which
    lists shared/ and takes it once older than the grace; a dry run names what it would delete and deletes nothing;
    a folder planted under shared/ is never deleted."""
    store = open_store(store_url)
    objects = {}
    for label in "ABCD":
        objects[label] = store.put_shared(_spool(tmp_path, hashlib.sha256(label.encode()).digest() * 2048))
    for step, label in ((1, "A"), (2, "A"), (3, "B"), (4, "C"), (5, "C")):
        store.commit(step, {"training_state.pt": b"%d" % step * 100}, contract=C, world=1, code_version="t",
                     shared={FROZEN: objects[label]})
    store.commit(99, {"training_state.pt": b"x"}, contract="another-run", world=1, code_version="t",
                 shared={FROZEN: objects["A"]})
    sha = {label: str(obj[1]) for label, obj in objects.items()}
    store.backend.write(join(store.root, "shared", "planted-folder", "x"), b"x")

    assert _collect(store, dry_run=True) == ([1, 2, 3, 4], [sha["B"]])
    assert _names(store, "shared") == sorted(sha.values())
    assert _collect(store) == ([1, 2, 3, 4], [sha["B"]])
    assert _names(store, "shared") == sorted([sha["A"], sha["C"], sha["D"]])
    assert _collect(store, shared="all") == ([], [])  # D is young: it could be a commit in flight
    assert _collect(store, shared="all", grace_seconds=0, i_know_no_writer_is_active=True) == ([], [sha["D"]])
    assert _names(store, "shared") == sorted([sha["A"], sha["C"]])
    assert any(e.name == "planted-folder" and e.is_dir for e in store.list_dir("shared"))
    assert store.load(5, contract=C).files["training_state.pt"] == b"5" * 100  # its base verified as it loaded
    assert store.load(99, contract="another-run").files[FROZEN] is not None

    # The other run's generation gone, nothing deleted it: A waits for a listing (gc); C stays while 5 references it.
    store.backend.delete_folder(join(store.root, "step-00000099"), first="COMPLETE.json")
    assert _collect(store) == ([], [])
    assert _collect(store, shared="all", grace_seconds=0, i_know_no_writer_is_active=True) == ([], [sha["A"]])
    assert _names(store, "shared") == [sha["C"]]
    assert _collect(store, shared="none", grace_seconds=0, i_know_no_writer_is_active=True) == ([], [])
    with pytest.raises(ValueError, match="shared must be one of"):
        RetentionPolicy(keep=1, shared="everything")


def test_retention_that_finds_no_verified_generation_deletes_no_shared_object(store_url, tmp_path):
    """The newest generation fails its re-verification: retention deletes nothing, an unreferenced object included
    (it cannot tell what a good copy needs when it has none)."""
    store = open_store(store_url)
    a = store.put_shared(_spool(tmp_path, b"a" * 5000))
    b = store.put_shared(_spool(tmp_path, b"b" * 5000))
    store.commit(1, {"training_state.pt": b"1" * 100}, contract=C, world=1, code_version="t", shared={FROZEN: a})
    store.commit(2, {"training_state.pt": b"2" * 100}, contract=C, world=1, code_version="t", shared={FROZEN: b})
    store.backend.write(join(store.root, "shared", str(b[1])), b"B" * 5000)  # damaged: 2 no longer verifies
    assert _collect(store) == ([], [])
    assert _collect(store, shared="all", grace_seconds=0, i_know_no_writer_is_active=True) == ([], [])
    assert _names(store, "shared") == sorted([str(a[1]), str(b[1])])



def test_collection_never_goes_through_a_symlinked_shared_folder_nor_takes_other_names_or_a_busy_runs_objects(
        tmp_path, monkeypatch, caplog):
    """On a local folder. ``shared`` a symlink to a folder outside the run: nothing there is deleted (it is not the
    run's). A real ``shared/`` holding a writer's temporary file, a planted name and aged unreferenced objects: only
    the objects are taken, and only once no generation was written within the grace (a writer may be reusing an old
    object for a commit in flight). A store error while collecting is a warning, and the generations deleted are
    still reported."""
    import os
    import time

    from trainproof.storage.errors import StoreUnavailableError

    def age(*paths):
        for path in paths:
            os.utime(path, (time.time() - 3600,) * 2)

    run, outside = tmp_path / "run", tmp_path / "outside"
    outside.mkdir()
    store = open_store(str(run))
    a = store.put_shared(_spool(tmp_path, b"a" * 5000))
    store.commit(1, {"training_state.pt": b"1" * 100}, contract=C, world=1, code_version="t", shared={FROZEN: a})
    store.commit(2, {"training_state.pt": b"2" * 100}, contract=C, world=1, code_version="t")
    precious = outside / ("f" * 64)
    precious.write_bytes(b"not the run's")
    age(precious)
    (run / "shared").rename(tmp_path / "real-shared")
    (run / "shared").symlink_to(outside)
    assert _collect(store, shared="all", grace_seconds=0, i_know_no_writer_is_active=True) == ([1], [])
    assert precious.exists()
    (run / "shared").unlink()
    (tmp_path / "real-shared").rename(run / "shared")

    temporary, planted, unused = (run / "shared" / f".{'e' * 64}.tmp-1", run / "shared" / "notes.txt",
                                  run / "shared" / ("d" * 64))
    for path in (temporary, planted, unused):
        path.write_bytes(b"x")
    age(temporary, planted, unused, run / "shared" / str(a[1]))
    assert _collect(store, shared="all", grace_seconds=600) == ([], [])  # step 2 was written just now
    age(*run.glob("step-*/*"))
    assert _collect(store, shared="all", grace_seconds=600) == ([], sorted([str(a[1]), unused.name]))
    assert sorted(p.name for p in (run / "shared").iterdir()) == sorted([temporary.name, planted.name])

    b = store.put_shared(_spool(tmp_path, b"b" * 5000))
    store.commit(3, {"training_state.pt": b"3" * 100}, contract=C, world=1, code_version="t", shared={FROZEN: b})
    store.commit(4, {"training_state.pt": b"4" * 100}, contract=C, world=1, code_version="t")
    listdir = store.backend.listdir

    def unavailable(path, **kw):
        if path.rstrip("/").endswith("shared"):
            raise StoreUnavailableError("list shared", "the server is down")
        return listdir(path, **kw)

    monkeypatch.setattr(store.backend, "listdir", unavailable)
    with caplog.at_level("WARNING", logger="trainproof.storage"):
        assert _collect(store) == ([2, 3], [])
    assert "could not collect unreferenced objects under shared/" in caplog.text


def test_the_writers_retention_asks_the_store_nothing_about_shared_objects_when_it_released_none(store_url):
    """A run without frozen entries (most): its retention after each commit costs no request under ``shared/``, nor a
    look for the folder, whatever is planted there."""
    store = open_store(store_url)
    for step in (1, 2, 3):
        store.commit(step, {"training_state.pt": b"%d" % step * 100}, contract=C, world=1, code_version="t")
    store.backend.write(join(store.root, "shared", "f" * 64), b"planted")
    asked, listdir = [], store.backend.listdir

    def recorded(path, **kw):
        asked.append((path, kw.get("prefix", "")))
        return listdir(path, **kw)

    store.backend.listdir = recorded
    assert _collect(store) == ([1, 2], [])
    assert not [a for a in asked if "shared" in a[0] or a[1].startswith("shared")], asked
