"""A file handed to the store as :class:`trainproof.storage.pieces.Pieces` (buffers written back to back, never joined): the
same stored bytes, digest and verification as the joined buffer, on every backend (memory://, a local folder, S3
over HTTP on loopback with 5 MiB multipart parts), and no copy of the whole file in memory."""

from __future__ import annotations

import os
import random
import tracemalloc
from dataclasses import replace

import pytest

import trainproof.storage.digest as dg
from trainproof.storage import CorruptGenerationError, StoreOptions, open_store
from trainproof.storage.pieces import Pieces, as_pieces, nbytes
from tests.support.tamper import TamperingBackend, flip_first_byte

C = "contract-pieces"
PART = 5 * 2**20  # S3's smallest multipart part


def _buffers(sizes: list[int], seed: int = 3) -> list[bytearray]:
    rng = random.Random(seed)
    return [bytearray(rng.randbytes(n)) for n in sizes]


def test_spans_reads_and_chunks_equal_slices_of_the_joined_bytes():
    bufs = _buffers([0, 1, 7, 0, 4096, 3, 10_000, 1])
    joined = b"".join(bufs)
    pieces = Pieces(bufs)
    assert len(pieces) == nbytes(pieces) == len(joined) and len(pieces.views) == 6, "empty buffers are dropped"
    rng = random.Random(5)
    cuts = [(a, b) for a in range(0, len(joined) + 2, 97) for b in (a, a + 1, a + 4095, a + 4097, len(joined) + 5)]
    cuts += [(rng.randrange(len(joined)), rng.randrange(len(joined) + 3)) for _ in range(200)]
    for a, b in cuts:
        assert pieces.read(a, b) == joined[a:b], (a, b)
        assert b"".join(pieces.span(a, b)) == joined[a:b]
    assert b"".join(pieces.chunks(1000)) == joined and max(v.nbytes for v in pieces.chunks(1000)) == 1000
    assert pieces.tobytes() == joined
    assert as_pieces(pieces) is pieces and as_pieces(joined).tobytes() == joined and nbytes(joined) == len(joined)
    with pytest.raises(ValueError, match="contiguous"):
        Pieces([memoryview(joined)[::2]])  # a strided view is not one run of bytes


def test_the_spans_share_the_buffers_memory():
    bufs = _buffers([10, 10])
    pieces = Pieces(bufs)
    bufs[1][0] ^= 0xFF
    assert pieces.read(10, 11) == bytes(bufs[1][:1]), "a view, not a copy made when the Pieces was built"


@pytest.mark.parametrize("threads", [1, 4])
def test_the_digest_of_pieces_is_the_digest_of_the_joined_bytes(threads):
    bufs = _buffers([4095, 1, 4097, 12_000, 5, 0, 8192])
    joined = b"".join(bufs)
    for part in (4096, 1000, 2**20):  # parts spanning pieces, inside pieces, and one part for all
        got = dg.digest_bytes(Pieces(bufs), part_bytes=part, threads=threads)
        want = dg.FileHasher(part)  # the streaming hasher: no Pieces involved
        want.update(joined)
        assert got == want.digest() and got.parts == want.digest().parts
    assert dg.digest_bytes(Pieces([])) == dg.digest_bytes(b"")


def _store(url: str):
    return open_store(url, replace(StoreOptions.from_env(), part_size=PART, concurrency=2))


def test_a_file_given_as_pieces_is_stored_digested_and_loaded_as_its_joined_bytes(store_url, monkeypatch):
    monkeypatch.setattr(dg, "PART_BYTES", 2**20)  # digest parts that span pieces
    # 12 MiB and a bit: several multipart parts on S3 (each joined from the pieces it spans), uneven pieces.
    bufs = _buffers([3 * 2**20 + 1, 17, 0, 5 * 2**20 - 3, 64, 4 * 2**20 + 999])
    joined = b"".join(bufs)
    store = _store(store_url)
    checked = []
    info = store.commit(1, {"shard.bin": Pieces(bufs), "small.bin": Pieces([b"ab", b"", b"c"])}, contract=C, world=1,
                        code_version="t", check=lambda name, data: checked.append((name, nbytes(data))))
    entry = info.manifest["files"]["shard.bin"]
    want = dg.FileHasher()
    want.update(joined)
    want = want.digest()
    assert entry["bytes"] == len(joined) and entry["sha256"] == want and entry["parts"] == list(want.parts)
    assert sorted(checked) == [("shard.bin", len(joined)), ("small.bin", 3)]
    loaded = store.load(1, contract=C)
    assert bytes(loaded.files["shard.bin"]) == joined and bytes(loaded.files["small.bin"]) == b"abc"
    assert store.verify(1, contract=C) is None


def test_a_damaged_read_back_of_pieces_is_never_marked_usable(store_url):
    store = _store(store_url)
    tampered = type(store)(TamperingBackend(store.backend, alter_read=flip_first_byte), store.root, store.url,
                           store.options)
    with pytest.raises(CorruptGenerationError, match="differs from what was written"):
        tampered.commit(1, {"shard.bin": Pieces(_buffers([2**20, 3, 2**20]))}, contract=C, world=1, code_version="t")
    assert store.load_latest(contract=C) is None


def test_a_leftover_of_the_same_name_is_claimed_when_identical_and_kept_beside_otherwise(tmp_path):
    bufs = _buffers([2**20, 5, 2**20 + 7])
    joined = b"".join(bufs)
    for leftover, claimed in ((joined, True), (joined[:-1] + b"x", False)):
        run = tmp_path / f"run-{claimed}"
        (run / "step-00000001").mkdir(parents=True)
        (run / "step-00000001" / "shard.bin").write_bytes(leftover)  # a killed writer's file, no COMPLETE.json
        store = open_store(str(run))
        info = store.commit(1, {"shard.bin": Pieces(bufs)}, contract=C, world=1, code_version="t")
        obj = info.manifest["files"]["shard.bin"].get("object", "shard.bin")
        assert (obj == "shard.bin") is claimed, obj
        assert bytes(store.load(1, contract=C).files["shard.bin"]) == joined
        assert (run / "step-00000001" / "shard.bin").read_bytes() == leftover, "nobody overwrites an object"


def test_a_local_write_of_pieces_holds_no_copy_of_the_file(tmp_path):
    """The point of Pieces: the write hashes and writes the buffers themselves, and the read-back compares one
    ranged read at a time, so the commit's own allocations stay far below the file (a joined copy would not)."""
    bufs = _buffers([40 * 2**20, 3, 24 * 2**20 + 5, 32 * 2**20])  # 96 MiB
    size = sum(map(len, bufs))
    store = open_store(str(tmp_path / "run"))
    tracemalloc.start()
    try:
        store.commit(1, {"shard.bin": Pieces(bufs)}, contract=C, world=1, code_version="t")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # The read-back holds a few of its 8 MiB ranges at a time (one being read, one compared, its copy): ~24 MiB.
    assert peak < 40 * 2**20, f"the commit allocated {peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB file"
    assert os.path.getsize(tmp_path / "run" / "step-00000001" / "shard.bin") == size
