"""Files of several parts (trainproof/storage/digest.py): each part's sha256 in the manifest, the root over them as the
file's sha256, parts verified one by one as they are read (``GenerationStore.read_parts``), and the sharded
loader copying each verified part into its tensors without ever holding the file.

The part size is made small here (``trainproof.storage.digest.PART_BYTES``) so toy files have many parts; every write and
read goes through the real backends (a local folder, and S3 over HTTP on loopback)."""

from __future__ import annotations

import hashlib
import json
import os
import random
import tracemalloc

import pytest
import torch

import trainproof.storage.digest as dg
from trainproof.train import sharded
from trainproof.storage import open_store
from trainproof.storage.errors import CorruptGenerationError
from trainproof.storage.manifest import ManifestError, parse

PART = 4096
CONTRACT = "c" * 64


@pytest.fixture
def small_parts(monkeypatch):
    monkeypatch.setattr(dg, "PART_BYTES", PART)


def _url(kind: str, tmp_path, s3_env=None) -> str:
    return str(tmp_path / "run") if kind == "local" else f"s3://{s3_env}/run"


# -- the digest ---------------------------------------------------------------------------------------------
def test_the_digest_does_not_depend_on_how_the_bytes_were_fed():
    data = os.urandom(5 * PART + 123)
    whole = dg.digest_bytes(data, part_bytes=PART, threads=1)
    assert whole == dg.digest_bytes(data, part_bytes=PART, threads=4)
    assert whole.parts == tuple(hashlib.sha256(data[i:i + PART]).hexdigest() for i in range(0, len(data), PART))
    assert whole == hashlib.sha256(b"".join(bytes.fromhex(p) for p in whole.parts)).hexdigest()
    rng = random.Random(7)
    for _ in range(5):
        h, at = dg.FileHasher(PART), 0
        while at < len(data):
            n = rng.randint(1, 3 * PART)
            h.update(data[at:at + n])
            at += n
        assert h.digest() == whole and h.digest().parts == whole.parts


@pytest.mark.parametrize("size", [0, 1, PART])
def test_a_file_of_one_part_keeps_its_plain_sha256(size):
    data = os.urandom(size)
    h = dg.FileHasher(PART)
    h.update(data)
    assert h.digest() == hashlib.sha256(data).hexdigest() == dg.digest_bytes(data, part_bytes=PART)
    assert h.digest().entry() == {"sha256": hashlib.sha256(data).hexdigest()}
    assert dg.FileHasher(PART).digest() == hashlib.sha256(b"").hexdigest()


def test_an_exact_multiple_of_the_part_size_has_no_empty_last_part():
    data = os.urandom(3 * PART)
    assert len(dg.digest_bytes(data, part_bytes=PART).parts) == 3


# -- the manifest -------------------------------------------------------------------------------------------
def _committed(tmp_path, data: bytes) -> tuple[object, dict]:
    store = open_store(str(tmp_path / "run"))
    store.commit(1, {"big.bin": data, "small.txt": b"hi"}, contract=CONTRACT, world=1, code_version="t")
    return store, json.loads((tmp_path / "run" / "step-00000001" / "COMPLETE.json").read_text())


def test_a_committed_file_of_several_parts_lists_them(tmp_path, small_parts):
    data = os.urandom(6 * PART + 5)
    store, doc = _committed(tmp_path, data)
    entry = doc["files"]["big.bin"]
    assert entry["part_bytes"] == PART and len(entry["parts"]) == 7
    assert entry["parts"][0] == hashlib.sha256(data[:PART]).hexdigest()
    assert entry["sha256"] == dg.digest_bytes(data, part_bytes=PART)
    assert doc["files"]["small.txt"] == {"bytes": 2, "sha256": hashlib.sha256(b"hi").hexdigest()}
    assert bytes(store.load(1).files["big.bin"]) == data and store.verify(1) is None


@pytest.mark.parametrize(("change", "message"), [
    (lambda e: e["parts"].pop(), "lists 6 parts"),
    (lambda e: e["parts"].__setitem__(2, "0" * 64), "do not hash to its sha256"),
    (lambda e: e["parts"].__setitem__(2, "zz"), "not a sha256 hex digest"),
    (lambda e: e.__setitem__("part_bytes", 17), "'part_bytes' 17"),
    (lambda e: e.__setitem__("part_bytes", "4096"), "'part_bytes' '4096'"),
    (lambda e: e.pop("part_bytes"), "'part_bytes' None"),
    (lambda e: e.__setitem__("parts", {"0": "x"}), "lists {'0': 'x'} parts"),
    (lambda e: e.update(parts=e["parts"][:1], part_bytes=2**20), "lists 1 parts"),
])
def test_a_manifest_whose_parts_do_not_add_up_is_refused(tmp_path, small_parts, change, message):
    _, doc = _committed(tmp_path, os.urandom(6 * PART + 5))
    change(doc["files"]["big.bin"])
    with pytest.raises(ManifestError, match="big.bin") as caught:
        parse(json.dumps(doc).encode(), dir_name="step-00000001")
    assert message in str(caught.value)


# -- reading part by part -----------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["local", pytest.param("s3", marks=pytest.mark.s3)])
def test_parts_arrive_in_order_each_verified(tmp_path, small_parts, kind, request):
    s3 = request.getfixturevalue("s3_env") if kind == "s3" else None
    store = open_store(_url(kind, tmp_path, s3))
    data = os.urandom(9 * PART + 77)
    store.commit(2, {"big.bin": data}, contract=CONTRACT, world=1, code_version="t")
    got, offsets = bytearray(len(data)), []

    def sink(offset, piece):
        offsets.append(offset)
        got[offset:offset + len(piece)] = piece

    store.read_parts(store.generation(2), "big.bin", sink)
    assert offsets == [i * PART for i in range(10)] and bytes(got) == data


def _tamper(path, offset: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.chmod(0o644)
    path.write_bytes(bytes(raw))


def test_a_changed_part_is_named_and_nothing_after_it_is_handed_over(tmp_path, small_parts):
    store, _ = _committed(tmp_path, os.urandom(6 * PART + 5))
    _tamper(tmp_path / "run" / "step-00000001" / "big.bin", 3 * PART + 10)
    offsets = []
    with pytest.raises(CorruptGenerationError, match=r"big.bin part 4/7 \(bytes 12288..16384\) sha256 differs"):
        store.read_parts(store.generation(1), "big.bin", lambda offset, piece: offsets.append(offset))
    assert offsets == [0, PART, 2 * PART]
    assert store.verify(1).startswith("big.bin part 4/7 (bytes 12288..16384) sha256 differs")  # ls --verify, retention


def test_a_file_grown_after_the_listing_is_refused_by_its_last_part(tmp_path, small_parts):
    store, _ = _committed(tmp_path, os.urandom(6 * PART + 5))
    info = store.generation(1)  # the listing saw the committed size
    with open(tmp_path / "run" / "step-00000001" / "big.bin", "ab") as fh:
        fh.write(b"more")
    with pytest.raises(CorruptGenerationError, match="big.bin is more than 24581 bytes"):
        store.read_parts(info, "big.bin", lambda offset, piece: None)


def test_reading_by_parts_holds_a_few_parts_not_the_file(tmp_path, small_parts):
    store = open_store(str(tmp_path / "run"))
    data = os.urandom(256 * PART)  # 1 MiB in 256 parts
    store.commit(1, {"big.bin": data}, contract=CONTRACT, world=1, code_version="t")
    info = store.generation(1)
    tracemalloc.start()
    try:
        store.read_parts(info, "big.bin", lambda offset, piece: None)
        parts_peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.reset_peak()
        store.load_files(info, ["big.bin"])
        whole_peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert whole_peak >= len(data)  # the whole-file read holds the file: the measure sees it
    assert parts_peak < len(data) // 4, parts_peak  # the parts in flight (a worker per core, 8 at most) and change


# -- the sharded loader -------------------------------------------------------------------------------------
def _state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 48, generator=g), "b": torch.randn(3000, generator=g).to(torch.bfloat16),
            "t": torch.randn(40, 30, generator=g).t(), "e": torch.empty(0), "n": 4}


def _biggest(store) -> str:
    """The file holding the tensors (one process, no process group: DCP writes them as plain values)."""
    files = store.generation(store.scan()[-1].step).manifest["files"]
    return max((n for n in files if n.endswith(".distcp")), key=lambda n: files[n]["bytes"])


def _zeros(state: dict) -> dict:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()}


def _load_peak(store, step: int, state: dict) -> tuple[dict, int]:
    got = _zeros(state)
    tracemalloc.start()
    try:
        sharded.load_sharded(store, step, got, world=1, contract=CONTRACT)
        return got, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_sharded_load_copies_each_verified_part_into_its_tensors(tmp_path, small_parts, monkeypatch):
    big = {**_state(), "w": torch.randn(512, 1024)}  # 2 MiB of tensor bytes
    store = open_store(str(tmp_path / "run"))
    sharded.save_sharded(store, 3, big, contract=CONTRACT, world=1, code_version="t")
    shard = store.generation(3).manifest["files"][_biggest(store)]
    assert len(shard["parts"]) >= 500  # the tensors span several parts, and parts several tensors
    whole, load_files = [], store.load_files
    monkeypatch.setattr(store, "load_files", lambda info, names, *a, **k: whole.extend(names) or load_files(info, names))
    got, parts_peak = _load_peak(store, 3, big)
    assert all(torch.equal(got[k], big[k]) for k in ("w", "b", "t", "e")) and got["n"] == 4
    assert whole == [sharded.METADATA_FILE]  # the tensors' file was read by parts only
    # The same state in files of one part (each read whole, then copied): the load holds the file on top.
    monkeypatch.setattr(dg, "PART_BYTES", 32 * 2**20)
    sharded.save_sharded(store, 4, big, contract=CONTRACT, world=1, code_version="t")
    assert "parts" not in store.generation(4).manifest["files"][_biggest(store)]
    _, whole_peak = _load_peak(store, 4, big)
    assert parts_peak + 0.8 * shard["bytes"] < whole_peak, (parts_peak, whole_peak, shard["bytes"])


def test_a_sharded_load_refuses_a_changed_part_as_corrupt(tmp_path, small_parts):
    store = open_store(str(tmp_path / "run"))
    sharded.save_sharded(store, 3, _state(), contract=CONTRACT, world=1, code_version="t")
    name = _biggest(store)
    _tamper(tmp_path / "run" / "step-00000003" / name, 2 * PART + 1)
    with pytest.raises(sharded.ShardedLoadError, match=f"{name} part 3/") as caught:
        sharded.load_sharded(store, 3, _zeros(_state()), world=1, contract=CONTRACT)
    assert caught.value.corrupt


def test_a_part_damaged_on_its_first_read_only_is_read_again(tmp_path, small_parts, monkeypatch, caplog):
    """A transient fault (bytes damaged on the way, once): the part is read once more, and only its second read,
    which matches its digest, reaches the sink. Damaged on both reads: refused, naming the part."""
    from trainproof.storage.backend import LocalBackend

    data = os.urandom(6 * PART + 5)
    store, _ = _committed(tmp_path, data)
    info = store.generation(1)
    damaged, real_into, real_range = [], LocalBackend.read_range_into, LocalBackend.read_range

    def flip(raw, start, times):
        if start == 3 * PART and len(damaged) < times:
            damaged.append(start)
            raw[5] ^= 0x01
        return raw

    def into(self, path, start, buf):
        n = real_into(self, path, start, buf)
        flip(buf, start, limit[0])
        return n

    def whole(self, path, start, end):
        return bytes(flip(bytearray(real_range(self, path, start, end)), start, limit[0]))

    monkeypatch.setattr(LocalBackend, "read_range_into", into)
    monkeypatch.setattr(LocalBackend, "read_range", whole)
    limit, got = [1], bytearray(len(data))
    store.read_parts(info, "big.bin", lambda offset, piece: got.__setitem__(slice(offset, offset + len(piece)), piece))
    assert bytes(got) == data and damaged == [3 * PART]
    assert "big.bin part 4/7 did not match its manifest on first read" in caplog.text
    damaged.clear()
    limit[0] = 2
    with pytest.raises(CorruptGenerationError, match="big.bin part 4/7"):
        store.read_parts(info, "big.bin", lambda offset, piece: None)
    assert damaged == [3 * PART, 3 * PART]


def test_a_manifest_too_big_for_readers_is_never_committed(tmp_path, small_parts):
    """Parts make the manifest grow with the state: a commit whose COMPLETE.json no reader would accept fails
    with what to change, and leaves the generation unusable (the previous one stays the resume point)."""
    from trainproof.storage import StoreConfigError, StoreOptions
    from trainproof.storage.limits import Limits

    store = open_store(str(tmp_path / "run"), StoreOptions(limits=Limits(manifest_bytes=4000)))
    store.commit(1, {"small.txt": b"hi"}, contract=CONTRACT, world=1, code_version="t")
    with pytest.raises(StoreConfigError, match=r"step-00000002/COMPLETE.json would be \d+ bytes, over the 4000 .*"
                                               r"TRAINPROOF_DIGEST_PART_MIB above 0.00390625"):
        store.commit(2, {"big.bin": os.urandom(200 * PART)}, contract=CONTRACT, world=1, code_version="t")
    assert [(g.step, g.status) for g in store.scan()] == [(1, "complete"), (2, "incomplete")]


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_spool_handed_in_with_only_its_root_is_listed_with_the_parts_read_back(tmp_path, small_parts, kind,
                                                                                  request):
    """A Spool whose sha256 is the root as a plain string (no part list) verifies by value; the manifest must still
    list the parts, or every later read of the generation finds it corrupt."""
    from trainproof.storage.spool import Spool

    data = os.urandom(9 * PART + 77)
    path = tmp_path / "state.bin"
    path.write_bytes(data)
    root = str(dg.digest_bytes(data, part_bytes=PART))
    assert type(root) is str
    url = _url(kind, tmp_path, request.getfixturevalue("s3_env") if kind == "s3" else None)
    store = open_store(url)
    store.commit(1, {"state.bin": Spool(path=str(path), size=len(data), sha256=root)}, contract=CONTRACT, world=1,
                 code_version="t")
    entry = json.loads((store.read_file("step-00000001/COMPLETE.json")))["files"]["state.bin"]
    assert entry["sha256"] == root and len(entry["parts"]) == 10
    assert bytes(store.load(1).files["state.bin"]) == data and store.verify(1) is None
