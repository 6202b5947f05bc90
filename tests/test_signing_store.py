"""Signed generations at the store's API, on every backend (memory, a folder, S3 over HTTP): what is signed and
chained, and that each check (signature present, MAC, accepted key, anchor, chain) refuses what it must.

Forgeries are made the way a writer of the bucket without the key would make them: by writing bytes
(files, a COMPLETE.json with recomputed sizes and sha256s) straight into the store, never through the
project's signing code.
"""

from __future__ import annotations

import hashlib
import json
import logging

import pytest

from trainproof.storage.retention import RetentionPolicy
from trainproof.storage import COMPLETE, FOREIGN, CorruptGenerationError, StoreOptions, open_store
from trainproof.storage.signing import Keyring, key_id

KEY, OLD, OTHER = b"k-new-0123456789abcdef", b"k-old-0123456789abcdef", b"k-other-0123456789abc"
CONTRACT = "c" * 64


def _open(url: str, keys: Keyring | None):
    return open_store(url, StoreOptions.from_env(signing=keys))


def _plan(store, run_id: str = "r1") -> None:
    # Any plan.json: the store only hashes it (its digest anchors the chain).
    store.write_file("plan.json", json.dumps({"run_id": run_id}).encode(), create_only=True)


def _commit(store, step: int, payload: bytes = b"x"):
    return store.commit(step, {"state.bin": payload * step}, contract=CONTRACT, world=1, code_version="t")


def _raw_manifest(store, step: int) -> dict:
    return json.loads(store.read_file(f"step-{step:08d}/COMPLETE.json"))


def _forge(store, step: int, manifest: dict, payload: bytes) -> None:
    """Write generation ``step`` as a keyless writer can: the file, then a COMPLETE.json whose size and sha256
    match it (everything else as given, signature included)."""
    store.write_file(f"step-{step:08d}/state.bin", payload)
    manifest = {**manifest, "step": step,
                "files": {"state.bin": {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}}}
    store.write_file(f"step-{step:08d}/COMPLETE.json", json.dumps(manifest, indent=2).encode())


def _status(store) -> dict[int, str]:
    return {g.step: g.status for g in store.scan(contract=CONTRACT)}


def test_signed_manifests_name_their_key_anchor_and_predecessor_never_the_key(store_url):
    s = _open(store_url, Keyring(KEY))
    _plan(s)
    _commit(s, 1)
    _commit(s, 2)
    m1, m2 = _raw_manifest(s, 1), _raw_manifest(s, 2)
    assert m1["signature"]["alg"] == "hmac-sha256" and m1["signature"]["key_id"] == key_id(KEY)
    assert m1["anchor"] == hashlib.sha256(s.read_file("plan.json")).hexdigest()
    assert m1["predecessor"] is None
    assert m2["predecessor"] == hashlib.sha256(s.read_file("step-00000001/COMPLETE.json")).hexdigest()
    assert KEY.decode() not in s.read_file("step-00000002/COMPLETE.json").decode()
    assert _status(s) == {1: COMPLETE, 2: COMPLETE}
    assert s.load(2).info.status == COMPLETE


def test_without_a_key_nothing_is_signed_or_checked(store_url):
    s = _open(store_url, None)
    _plan(s)
    _commit(s, 1)
    assert "signature" not in _raw_manifest(s, 1) and "predecessor" not in _raw_manifest(s, 1)
    # A store opened with a key refuses that unsigned generation; one without a key takes it.
    assert _status(_open(store_url, Keyring(KEY))) == {1: FOREIGN}
    assert _status(s) == {1: COMPLETE}


def test_a_forged_generation_with_recomputed_hashes_but_no_key_is_foreign_and_skipped(store_url, caplog):
    s = _open(store_url, Keyring(KEY))
    _plan(s)
    _commit(s, 1)
    # The forger copies step 1's signed manifest (signature and all) and changes the content: the MAC no longer fits.
    _forge(s, 2, _raw_manifest(s, 1), b"poisoned")
    assert s.scan(contract=CONTRACT)[-1].reason.startswith("wrong signature")
    with caplog.at_level(logging.WARNING, logger="trainproof.storage"):
        assert s.load_latest(contract=CONTRACT).info.step == 1
    assert sum("step-00000002" in r.getMessage() for r in caplog.records) == 1  # one warning line
    # Even a forged manifest with no field changed but the step fails: the step is inside the MAC.
    _forge(s, 3, _raw_manifest(s, 1), b"x")
    assert _status(s)[3] == FOREIGN


def test_unsigned_and_other_key_generations_are_foreign(store_url):
    s = _open(store_url, Keyring(KEY))
    _plan(s)
    _commit(s, 1)
    unsigned = {k: v for k, v in _raw_manifest(s, 1).items() if k != "signature"}
    _forge(s, 2, unsigned, b"u")
    other = _open(store_url, Keyring(OTHER))  # a writer holding another key signs a generation of its own
    _commit(other, 3)
    reasons = {g.step: g.reason for g in s.scan(contract=CONTRACT)}
    assert _status(s) == {1: COMPLETE, 2: FOREIGN, 3: FOREIGN}
    assert reasons[2].startswith("unsigned") and "not accepted" in reasons[3]
    assert s.load_latest(contract=CONTRACT).info.step == 1


def test_key_rotation_accepts_old_generations_until_the_old_key_is_dropped(store_url):
    _plan(_open(store_url, None))
    old = _open(store_url, Keyring(OLD))
    _commit(old, 1)
    rotated = _open(store_url, Keyring(KEY, [OLD]))  # new key signs, old one still accepted
    _commit(rotated, 2)
    assert _raw_manifest(rotated, 2)["signature"]["key_id"] == key_id(KEY)
    assert _status(rotated) == {1: COMPLETE, 2: COMPLETE}
    dropped = _open(store_url, Keyring(KEY))
    # 2 stays in chain: its predecessor is not a signed generation any more, as if retention had deleted it.
    assert _status(dropped) == {1: FOREIGN, 2: COMPLETE}
    assert dropped.load_latest(contract=CONTRACT).info.step == 2


def test_a_generation_of_another_run_is_foreign_even_signed_with_our_key(store_url):
    keys = Keyring(KEY)
    s = _open(store_url, keys)
    _plan(s, "ours")
    _commit(s, 2)
    other = _open(store_url.rstrip("/") + "-other", keys)
    _plan(other, "theirs")
    _commit(other, 1)
    _commit(other, 3)
    for step in (1, 3):  # spliced byte for byte: hashes, signature and step all check out
        for name in ("state.bin", "COMPLETE.json"):
            s.write_file(f"step-{step:08d}/{name}", other.read_file(f"step-{step:08d}/{name}"))
    reasons = {g.step: g.reason for g in s.scan(contract=CONTRACT)}
    assert _status(s) == {1: FOREIGN, 2: COMPLETE, 3: FOREIGN}, reasons
    assert "another run" in reasons[1]
    assert s.load_latest(contract=CONTRACT).info.step == 2
    assert s.load(2).info.status == COMPLETE


def test_a_fork_is_out_of_chain_and_retention_never_deletes_it(store_url):
    keys = Keyring(KEY)
    s = _open(store_url, keys)
    _plan(s)
    _commit(s, 1)
    _commit(s, 2)
    # A key holder's abandoned branch from step 1 (made here by committing in a copy of the run at step 1, with
    # the same plan.json, then moving its generation 3 in): generation 2 already continues step 1.
    branch_url = store_url.rstrip("/") + "-branch"
    branch = _open(branch_url, keys)
    branch.write_file("plan.json", s.read_file("plan.json"))
    for name in ("state.bin", "COMPLETE.json"):
        branch.write_file(f"step-00000001/{name}", s.read_file(f"step-00000001/{name}"))
    _commit(branch, 3)
    for name in ("state.bin", "COMPLETE.json"):
        s.write_file(f"step-00000003/{name}", branch.read_file(f"step-00000003/{name}"))
    assert _status(branch) == {1: COMPLETE, 3: COMPLETE}  # in its own run it is a good generation
    found = {g.step: g for g in s.scan(contract=CONTRACT)}
    assert found[3].status == FOREIGN and "fork" in found[3].reason
    assert s.load_latest(contract=CONTRACT).info.step == 2
    with pytest.raises(CorruptGenerationError, match="fork"):  # loading it by its step (as an audit does) too
        s.load(3)
    _commit(s, 4)  # chained to 2, the newest in-chain generation, not to the fork
    assert _raw_manifest(s, 4)["predecessor"] == hashlib.sha256(s.read_file("step-00000002/COMPLETE.json")).hexdigest()
    s.apply_retention(RetentionPolicy(keep=2, contract=CONTRACT, i_know_no_writer_is_active=True))
    # 1 deleted, the fork kept (never deleted) and still out of chain: 2 continued step 1 below it.
    assert _status(s) == {2: COMPLETE, 3: FOREIGN, 4: COMPLETE}


def test_a_predecessor_deleted_by_retention_keeps_its_successors_in_chain(store_url):
    s = _open(store_url, Keyring(KEY))
    _plan(s)
    for step in (1, 2, 3):
        _commit(s, step, payload=b"y")
    s.apply_retention(RetentionPolicy(keep=1, contract=CONTRACT, i_know_no_writer_is_active=True))
    assert _status(s) == {3: COMPLETE}
    _commit(s, 4)
    assert _status(s) == {3: COMPLETE, 4: COMPLETE}


def test_keyring_never_shows_the_key():
    keys = Keyring(KEY, [OLD])
    options = StoreOptions.from_env(signing=keys)
    for text in (repr(keys), str(keys), repr(options)):
        assert KEY.decode() not in text and OLD.decode() not in text
    assert key_id(KEY) in repr(keys)


def test_keys_from_the_environment_and_files(tmp_path, caplog):
    key_file = tmp_path / "signing-key"
    key_file.write_bytes(KEY + b"\n")  # one trailing newline, as `kubectl create secret --from-file` may keep it
    accepted = tmp_path / "accepted"
    accepted.write_bytes(OLD + b"\n" + OTHER + b"\n")
    keys = Keyring.from_env({"TRAINPROOF_SIGNING_KEY_FILE": str(key_file),
                             "TRAINPROOF_SIGNING_KEYS_ACCEPTED_FILE": str(accepted)})
    assert keys.key_id == key_id(KEY)
    signed = Keyring(OTHER).sign({"a": 1})
    assert keys.problem(signed) is None  # accepted keys verify
    assert Keyring.from_env({"TRAINPROOF_SIGNING_KEY": KEY.decode(),
                             "TRAINPROOF_SIGNING_KEYS_ACCEPTED": f"{OLD.decode()},{OTHER.decode()}"}).problem(signed) is None
    assert Keyring.from_env({}) is None
    with caplog.at_level(logging.WARNING, logger="trainproof.storage"):  # an optional Secret not mounted
        assert Keyring.from_env({"TRAINPROOF_SIGNING_KEY_FILE": str(tmp_path / "absent")}) is None
    assert len([r for r in caplog.records if "does not exist" in r.getMessage()]) == 1


def test_a_mac_is_refused_when_any_signed_field_changes():
    keys = Keyring(KEY)
    doc = keys.sign({"step": 1, "files": {"a": {"bytes": 1}}})
    assert keys.problem(doc) is None
    assert keys.problem({**doc, "step": 2}).startswith("wrong signature")
    assert keys.problem({**doc, "signature": {**doc["signature"], "mac": "0" * 64}}).startswith("wrong signature")
    assert keys.problem({**doc, "signature": "x"}) == "malformed signature"


def test_export_folders_without_a_plan_are_signed_but_not_chained(store_url):
    # Bundles may be exported in any step order (export --step 5 after step 10): no chain there, signature only.
    s = _open(store_url, Keyring(KEY))
    _commit(s, 10)
    _commit(s, 5)
    assert _raw_manifest(s, 5)["predecessor"] is None and _raw_manifest(s, 5)["anchor"] is None
    assert _status(s) == {5: COMPLETE, 10: COMPLETE}
    _forge(s, 12, {k: v for k, v in _raw_manifest(s, 10).items() if k != "signature"}, b"u")
    assert _status(s)[12] == FOREIGN


def test_unusable_key_files_are_configuration_errors_that_do_not_show_the_key(tmp_path):
    from trainproof.storage import StoreConfigError

    for content in (b"", b"\n", b"\xff\xfe" + KEY):
        path = tmp_path / "key"
        path.write_bytes(content)
        with pytest.raises(StoreConfigError) as err:
            Keyring.from_env({"TRAINPROOF_SIGNING_KEY_FILE": str(path)})
        assert KEY.decode() not in str(err.value)
