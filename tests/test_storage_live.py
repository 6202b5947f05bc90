"""A spool uploaded while it is written (``LiveSpool``): on S3 the commit's multipart upload sends each part as soon
as the serialising thread has written it, instead of after the whole file; readers wait only for the bytes they ask
for; a serialisation that fails leaves no object and nothing marked usable, and the caller sees its own error.

Parts of 5 MiB (S3's smallest), two in flight, on the session's Ceph RADOS Gateway."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import threading
from dataclasses import replace

import pytest
import torch

from trainproof.storage import StoreOptions, open_store
from trainproof.storage import s3 as s3_backend
from trainproof.storage.spool import LiveSpool, SerialiseError, SpoolWriter
from tests.support.timing import budget

PART = 5 * 2**20
C = "contract-live"


def _block(n: int, seed: int) -> bytes:
    return (hashlib.sha256(str(seed).encode()).digest() * (n // 32 + 1))[:n]


def _paced(blocks: list[bytes], gates: dict[int, threading.Event], fail_at: int | None = None):
    """A fill writing ``blocks`` in order, waiting (at most 10 s, scaled) on ``gates[i]`` before block i, and
    raising OSError(ENOSPC) instead of writing block ``fail_at``."""

    def fill(out) -> None:
        for i, block in enumerate(blocks):
            if i in gates:
                gates[i].wait(budget(10))
            if i == fail_at:
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            out.write(block)

    return fill


def _finished(folder, blocks: list[bytes]):
    with SpoolWriter(str(folder)) as out:
        for block in blocks:
            out.write(block)
    return out.finish()


def test_readers_wait_for_the_bytes_they_ask_for_and_get_the_writers_digest(tmp_path):
    blocks = [_block(3 * 2**20, i) for i in range(3)]
    gate = threading.Event()
    live = LiveSpool.serialise(_paced(blocks, {2: gate}), str(tmp_path), expected=9 * 2**20)
    assert live.available(2 * 2**20) == 2 * 2**20
    assert live.read_range(2**20, 6 * 2**20) == b"".join(blocks)[2**20:6 * 2**20]
    got: list[bytes] = []
    reader = threading.Thread(target=lambda: got.append(live.read_range(6 * 2**20, 8 * 2**20)))
    reader.start()
    reader.join(0.3)
    assert reader.is_alive() and not live.done, "a range not yet written is waited for, not read short"
    gate.set()
    reader.join(budget(10))
    assert got == [b"".join(blocks)[6 * 2**20:8 * 2**20]]
    assert live.available(10 * 2**20) == 9 * 2**20, "past the end of a finished file: what there is"
    done = _finished(tmp_path, blocks)
    assert (live.size, live.sha256) == (done.size, done.sha256)
    live.unlink()
    assert not os.path.exists(live.path)


def test_a_failed_serialisation_reaches_every_reader_and_its_caller(tmp_path):
    live = LiveSpool.serialise(_paced([_block(2**20, 0), _block(2**20, 1)], {}, fail_at=1), str(tmp_path))
    with pytest.raises(SerialiseError) as caught:
        live.read_range(0, 2 * 2**20)
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    with pytest.raises(SerialiseError):
        live.size
    assert isinstance(live.join(), OSError)
    live.unlink()
    assert not os.path.exists(live.path)


def test_deleting_a_spool_stops_its_writer(tmp_path):
    # A commit that failed deletes its spool: the writer stops at its next write instead of serialising the rest.
    writes = []
    never = threading.Event()

    def fill(out):
        for i in range(100):
            writes.append(i)
            out.write(_block(2**20, i))
            if i == 1:
                never.wait(0.2)  # the commit fails meanwhile

    live = LiveSpool.serialise(fill, str(tmp_path))
    live.available(2**20)
    live.unlink()
    assert len(writes) <= 3 and isinstance(live.error, SerialiseError) and not os.path.exists(live.path)


def _spying_syncs(monkeypatch, then: threading.Event, after: int, live_of) -> list[tuple[str, int, bool]]:
    """Record what a folder's read-back does to the file, in order: ("wait", offset, whether the writer was done) when
    it waits for a part to be on the device, ("drop", offset, ...) when it drops it from the cache, ("read", offset,
    ...) for each read; set ``then`` once ``after`` parts were waited for."""
    from trainproof.storage import backend, writeback

    events: list[tuple[str, int, bool]] = []

    class Spy:
        def __getattr__(self, name):
            return getattr(writeback, name)

        def wait(self, fd, offset, length):
            events.append(("wait", offset, live_of().done))
            writeback.wait(fd, offset, length)
            if sum(e[0] == "wait" for e in events) >= after:
                then.set()

        def drop(self, fd, offset, length):
            events.append(("drop", offset, live_of().done))
            writeback.drop(fd, offset, length)

    real_preadv = os.preadv

    def preadv(fd, buffers, offset):
        events.append(("read", offset, live_of().done))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(backend, "writeback", Spy())
    monkeypatch.setattr(backend.os, "preadv", preadv)
    return events


@pytest.mark.parametrize("keep", [True, False], ids=["parts-kept", "parts-hashed"])
@pytest.mark.parametrize("range_sync", [True, False], ids=["sync_file_range", "fdatasync"])
def test_a_folder_reads_a_spool_back_from_its_device_while_it_is_written_and_links_it(tmp_path, monkeypatch,
                                                                                      range_sync, keep):
    from trainproof.storage import digest, writeback
    from trainproof.storage.backend import LocalBackend

    monkeypatch.setattr(digest, "PART_BYTES", 2**20)
    if not range_sync:  # a platform without sync_file_range: each part waited for by an fdatasync of the file
        monkeypatch.setattr(writeback, "_CALL", False)
    store = open_store(str(tmp_path / "run"))
    blocks = [_block(2**20, i) for i in range(6)] + [_block(12345, 6)]
    two_read = threading.Event()
    lives: list[LiveSpool] = []
    events = _spying_syncs(monkeypatch, two_read, 2, lambda: lives[0])
    reads, compared = [], []
    monkeypatch.setattr(LocalBackend, "read_range", lambda self, path, a, b: reads.append(path) or b"")
    from trainproof.storage import backend

    same = backend.same_bytes
    monkeypatch.setattr(backend, "same_bytes", lambda a, b: compared.append(a.nbytes) or same(a, b))
    # The writer holds its last blocks until two parts were read back: a read-back that waited for the finished file
    # would read nothing before the gate's timeout.
    lives.append(LiveSpool.serialise(_paced(blocks, {4: two_read}), store.spool_folder(), write_behind=True,
                                     keep_parts=keep))
    live = lives[0]
    try:
        store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
        waits = [(off, done) for what, off, done in events if what == "wait"]
        assert [done for _, done in waits[:2]] == [False, False], "read back while written"
        assert sorted(off for off, _ in waits) == [i * 2**20 for i in range(7)], "every part, the short last one too"
        for i in range(7):  # each part: on the device, then dropped from the cache, then read
            seen = [what for what, off, _ in events if i * 2**20 <= off < (i + 1) * 2**20]
            assert seen[:2] == ["wait", "drop"] and set(seen[2:]) == {"read"}, (i, seen)
        assert reads == [], "not read a second time after it was published"
        stored = os.path.join(store.root, "step-00000001", "training_state.pt")
        assert os.path.samefile(stored, live.path), "linked, not copied"
        with open(stored, "rb") as fh:
            assert fh.read() == b"".join(blocks)
        monkeypatch.undo()  # the store's own reads again, for the verification below
        assert store.verify(1, contract=C) is None
        entry = store.load_latest(contract=C).info.manifest["files"]["training_state.pt"]
        assert entry["sha256"] == live.sha256 and len(entry["parts"]) == 7
        assert (live.kept is not None and live.kept.counts == {"kept": 7, "passed": 0}) is keep
        assert sum(compared) == (6 * 2**20 + 12345 if keep else 0), "kept parts compared, not hashed"
    finally:
        live.unlink()


@pytest.mark.parametrize("keep", [True, False], ids=["parts-kept", "parts-hashed"])
def test_a_folder_refuses_a_spool_whose_device_bytes_are_not_the_serialised_ones(tmp_path, monkeypatch, keep):
    # What verification is for: the device holds other bytes than the ones serialised and hashed (a write the disk
    # changed). Nothing is published or marked, and the next writer commits the step.
    from trainproof.storage import CorruptGenerationError, digest, spool

    monkeypatch.setattr(digest, "PART_BYTES", 2**20)
    inner, writes = spool.write_all, []

    def write_all(fh, view):
        writes.append(view.nbytes)
        if len(writes) == 3:  # the third block reaches the file with one bit flipped
            view = memoryview(bytes([view[0] ^ 1]) + bytes(view[1:]))
        inner(fh, view)

    monkeypatch.setattr(spool, "write_all", write_all)
    store = open_store(str(tmp_path / "run"))
    blocks = [_block(2**20, i) for i in range(5)]
    live = LiveSpool.serialise(_paced(blocks, {}), store.spool_folder(), write_behind=True, keep_parts=keep)
    try:
        with pytest.raises(CorruptGenerationError, match="read back from the store differs"):
            store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
    finally:
        live.unlink()
    assert store.load_latest(contract=C) is None
    assert not os.path.exists(os.path.join(store.root, "step-00000001", "training_state.pt")), "nothing published"
    monkeypatch.setattr(spool, "write_all", inner)
    again = LiveSpool.serialise(_paced(blocks, {}), store.spool_folder(), write_behind=True, keep_parts=keep)
    store.commit(1, {"training_state.pt": again}, contract=C, world=1, code_version="t")
    again.unlink()
    assert store.load_latest(contract=C).info.step == 1 and store.verify(1, contract=C) is None


def test_a_write_back_error_the_device_reports_fails_the_commit_with_it(tmp_path, monkeypatch):
    # EIO or ENOSPC from sync_file_range is the error to report: not a fallback to fdatasync, which would find the
    # error already reported and return 0, nor a digest mismatch that hides what happened.
    import ctypes

    from trainproof.storage import digest, writeback

    monkeypatch.setattr(digest, "PART_BYTES", 2**20)
    calls = []

    def failing(fd, offset, length, flags):
        calls.append(offset)
        ctypes.set_errno(errno.EIO)
        return -1

    monkeypatch.setattr(writeback, "_CALL", failing)
    store = open_store(str(tmp_path / "run"))
    blocks = [_block(2**20, i) for i in range(3)]
    live = LiveSpool.serialise(_paced(blocks, {}), store.spool_folder())
    try:
        with pytest.raises(OSError) as caught:
            store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
        assert caught.value.errno == errno.EIO and calls
    finally:
        live.unlink()
    assert store.load_latest(contract=C) is None
    assert not os.path.exists(os.path.join(store.root, "step-00000001", "training_state.pt")), "nothing published"


@pytest.mark.parametrize("keep", [True, False], ids=["parts-kept", "parts-hashed"])
def test_a_folder_commit_of_a_serialisation_failing_midway_publishes_nothing(tmp_path, monkeypatch, keep):
    from trainproof.storage import digest

    monkeypatch.setattr(digest, "PART_BYTES", 2**20)
    store = open_store(str(tmp_path / "run"))
    blocks = [_block(2**20, i) for i in range(5)]
    two_read = threading.Event()
    lives: list[LiveSpool] = []
    _spying_syncs(monkeypatch, two_read, 2, lambda: lives[0])
    lives.append(LiveSpool.serialise(_paced(blocks, {3: two_read}, fail_at=3), store.spool_folder(),
                                     write_behind=True, keep_parts=keep))
    try:
        with pytest.raises(SerialiseError):
            store.commit(1, {"training_state.pt": lives[0]}, contract=C, world=1, code_version="t")
        assert two_read.is_set(), "the failure came while parts were being read back"
        assert isinstance(lives[0].join(), OSError)
    finally:
        lives[0].unlink()
    assert store.load_latest(contract=C) is None
    assert not os.path.exists(os.path.join(store.root, "step-00000001", "training_state.pt")), "nothing published"


@pytest.mark.parametrize("why", ["another file system", "a digest of one part"])
def test_a_live_spool_a_folder_cannot_read_back_as_written_is_committed_the_ordinary_way(tmp_path, monkeypatch,
                                                                                            why):
    # (Its parts are kept for the read-back that does not come: the writer stops keeping them, and nothing waits.)
    from trainproof.storage import digest

    store = open_store(str(tmp_path / "run"))
    folder = store.spool_folder()
    if why == "another file system":
        if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(tmp_path).st_dev:
            pytest.skip("no other file system at hand")
        folder = "/dev/shm"
    else:
        monkeypatch.setattr(digest, "PART_BYTES", 0)
    blocks = [_block(2**20, i) for i in range(3)]
    live = LiveSpool.serialise(_paced(blocks, {}), folder, write_behind=True, keep_parts=True)
    try:
        store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
        assert live.kept is None or live.kept.held == 0, "nothing kept once the commit is over"
        stored = os.path.join(store.root, "step-00000001", "training_state.pt")
        assert os.path.samefile(stored, live.path) is (why != "another file system")
        with open(stored, "rb") as fh:
            assert fh.read() == b"".join(blocks)
        assert store.verify(1, contract=C) is None
    finally:
        live.unlink()


def test_the_expected_size_counts_each_storage_once():
    from trainproof.format.state import tensor_bytes

    flat = torch.zeros(1000)
    tied = torch.ones(10, 10)
    state = {"flat": flat, "views": [flat[:10], flat.view(10, 100)], "a": tied, "b": tied, "n": 3,
             "sparse": torch.eye(4).to_sparse(), "bf16": torch.zeros(8, dtype=torch.bfloat16)}
    assert tensor_bytes(state) == 4000 + 400 + (2 * 4 * 8 + 4 * 4) + 16


def _s3_store(s3_env):
    return open_store(f"s3://{s3_env}/live/run",
                      replace(StoreOptions.from_env(), part_size=PART, concurrency=2))


def _uploads(store) -> list:
    bucket = store.root.split("/")[0]
    return store.backend._call("list_multipart_uploads", Bucket=bucket).get("Uploads", [])


def test_s3_uploads_the_parts_while_the_file_is_written(s3_env, tmp_path):
    store = _s3_store(s3_env)
    blocks = [_block(PART, i) for i in range(6)] + [_block(12345, 6)]
    sent: list[tuple[int, bool]] = []
    two_sent = threading.Event()
    inner = store.backend._call

    def call(method, **kwargs):
        out = inner(method, **kwargs)
        if method == "upload_part":
            sent.append((kwargs["PartNumber"], live.done))
            if len(sent) >= 2:
                two_sent.set()
        return out

    store.backend._call = call
    # The writer holds its last blocks until two parts are up: an upload that waited for the finished file would
    # send nothing before the gate's timeout.
    live = LiveSpool.serialise(_paced(blocks, {4: two_sent}), str(tmp_path), expected=sum(map(len, blocks)))
    store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
    assert {n for n, _ in sent[:2]} == {1, 2} and not any(done for _, done in sent[:2]), "sent while written"
    assert sorted(n for n, _ in sent) == list(range(1, 8))
    loaded = store.load(1, contract=C, spool_dir=str(tmp_path / "load"))
    try:
        got = loaded.files["training_state.pt"]
        with open(got.path, "rb") as fh:
            assert fh.read() == b"".join(blocks)
        assert got.sha256 == live.sha256
    finally:
        loaded.close()
        live.unlink()
    assert _uploads(store) == []


def test_s3_a_serialisation_failing_midway_leaves_nothing_marked_and_no_upload(s3_env, tmp_path):
    store = _s3_store(s3_env)
    gate = threading.Event()
    inner = store.backend._call
    store.backend._call = lambda method, **kw: (gate.set() if method == "upload_part" else None) or inner(method, **kw)
    blocks = [_block(PART, i) for i in range(5)]
    live = LiveSpool.serialise(_paced(blocks, {3: gate}, fail_at=3), str(tmp_path), expected=5 * PART)
    with pytest.raises(SerialiseError):
        store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
    assert gate.is_set(), "the failure came while parts were being uploaded"
    assert isinstance(live.join(), OSError)
    live.unlink()
    assert store.load_latest(contract=C) is None
    assert _uploads(store) == [], "the multipart upload was aborted"
    # The next writer commits the step over what the failed one left (its claimed key).
    again = LiveSpool.serialise(_paced(blocks, {}), str(tmp_path), expected=5 * PART)
    store.commit(1, {"training_state.pt": again}, contract=C, world=1, code_version="t")
    again.unlink()
    assert store.load_latest(contract=C).info.step == 1


def test_s3_a_file_outgrowing_its_expected_size_is_uploaded_once_finished(s3_env, tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(s3_backend, "MAX_PARTS", 3)
    store = _s3_store(s3_env)
    sent = threading.Event()
    inner = store.backend._call
    store.backend._call = lambda method, **kw: (sent.set() if method == "upload_part" else None) or inner(method, **kw)
    blocks = [_block(PART, i) for i in range(5)]
    # Still being written when the upload starts (its last block waits for a part to be sent).
    live = LiveSpool.serialise(_paced(blocks, {4: sent}), str(tmp_path), expected=1)
    with caplog.at_level(logging.INFO, logger="trainproof"):
        store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
    assert "uploading the finished file" in caplog.text
    loaded = store.load(1, contract=C, spool_dir=str(tmp_path / "load"))
    try:
        with open(loaded.files["training_state.pt"].path, "rb") as fh:
            assert fh.read() == b"".join(blocks)
    finally:
        loaded.close()
        live.unlink()
    assert _uploads(store) == []


def test_the_checkpointer_raises_the_serialisations_own_error(s3_env, tmp_path, monkeypatch):
    from trainproof.errors import TrainError
    from trainproof.train.checkpoint import Capture, Checkpointer
    from trainproof.train.progress import Reporter

    store = _s3_store(s3_env)
    assert store.uploads_while_written
    written = [0]
    inner = SpoolWriter.write

    def write(self, data):  # the spool's disk fills up after 12 MiB
        if written[0] > 12 * 2**20:
            raise OSError(errno.ENOSPC, "No space left on device (injected)")
        written[0] += memoryview(data).nbytes
        return inner(self, data)

    monkeypatch.setattr(SpoolWriter, "write", write)
    state = {"progress": {"step": 1}, "history": [], "history_chain": "",
             "weights": [torch.full((2**20,), float(i)) for i in range(6)]}  # 24 MiB
    ckpt = Checkpointer(store, contract=C, world=1, code_version="t", keep=0, reporter=Reporter(),
                        spool_dir=str(tmp_path))
    assert not ckpt.links_spools, "an uploaded spool is read again by the upload: not written behind"
    with pytest.raises(Exception) as caught:  # noqa: PT011 - torch's own error, whatever it wraps the OSError in
        ckpt.commit(Capture(step=1, state=state, extra={}))
    # What torch.save raised (as a spool serialised before the upload would have), not where the upload read it.
    assert not isinstance(caught.value, (SerialiseError, TrainError))
    chain, link = [], caught.value
    while link is not None and link not in chain:
        chain.append(link)
        link = link.__cause__ or link.__context__
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in chain), chain
    assert store.load_latest(contract=C) is None
    assert os.listdir(tmp_path) == [], "the spool is deleted"


@pytest.mark.parametrize("own_folder", [True, False])
def test_a_folder_checkpointer_writes_behind_only_the_spool_it_links(tmp_path, monkeypatch, own_folder):
    """On a folder store the spool made in the run's spool folder becomes the stored file: it is written behind
    (SpoolWriter's write_behind) and linked. One made elsewhere is copied: not written behind. Either way the
    generation verifies and holds the state."""
    from trainproof.format.state import STATE_FILE, load_weights_only
    from trainproof.train.checkpoint import Capture, Checkpointer
    from trainproof.train.progress import Reporter

    kinds = []
    inner = SpoolWriter.__init__

    def init(self, *args, write_behind=False, **kwargs):
        kinds.append(write_behind)
        inner(self, *args, write_behind=write_behind, **kwargs)

    monkeypatch.setattr(SpoolWriter, "__init__", init)
    loaded = {}  # the content check loads what was stored (a test state lacks the trainer's other sections)
    monkeypatch.setattr(Checkpointer, "_check",
                        lambda self, name, stored: loaded.setdefault(name, load_weights_only(stored)))
    store = open_store(str(tmp_path / "run"))
    spools = store.spool_folder() if own_folder else None
    ckpt = Checkpointer(store, contract=C, world=1, code_version="t", keep=0, reporter=Reporter(), spool_dir=spools)
    assert ckpt.links_spools is own_folder
    weights = [torch.full((2**20,), float(i)) for i in range(6)]  # 24 MiB: several write-behind windows
    state = {"progress": {"step": 1}, "history": [], "history_chain": "", "weights": weights}
    ckpt.commit(Capture(step=1, state=state, extra={}))
    assert kinds == [own_folder]
    stored = loaded[STATE_FILE]["weights"]
    assert all(torch.equal(a, b) for a, b in zip(stored, weights, strict=True))
    assert store.verify(1, contract=C) is None
    assert [g.step for g in store.scan(contract=C)] == [1]
    if own_folder:
        assert os.listdir(spools) == [], "the linked spool's own name is gone"


@pytest.mark.parametrize("flip", [None, "a kept part", "a part not kept"])
def test_a_folder_hashes_the_parts_it_could_not_keep_and_compares_the_rest(tmp_path, monkeypatch, flip):
    """The writer keeps at most a budget of parts for the read-back: a part begun while the read-back is that far
    behind is not kept, and the read-back hashes it instead of comparing it. Either way the stored file is verified
    (a flipped bit in a kept part or in one that was not is refused), the digest is the writer's, and the writer made
    only the budget's buffers."""
    from trainproof.storage import CorruptGenerationError, backend, digest, spool

    monkeypatch.setattr(digest, "PART_BYTES", 2**20)
    monkeypatch.setattr(spool, "KEEP_BYTES", 2 * 2**20)  # two parts at a time
    # The read-back starts only once the writer is done: every part after the budget's two is written through.
    lives: list[LiveSpool] = []
    inner_wait = backend.writeback.wait

    def late_wait(fd, offset, length):
        lives[0].join()
        inner_wait(fd, offset, length)

    monkeypatch.setattr(backend.writeback, "wait", late_wait)
    inner, writes = spool.write_all, []
    target = {None: -1, "a kept part": 1, "a part not kept": 4}[flip]

    def write_all(fh, view):
        writes.append(view.nbytes)
        if len(writes) - 1 == target:
            view = memoryview(bytes([view[0] ^ 1]) + bytes(view[1:]))
        inner(fh, view)

    monkeypatch.setattr(spool, "write_all", write_all)
    store = open_store(str(tmp_path / "run"))
    blocks = [_block(2**20 - 1000, i) for i in range(6)]  # parts straddle the writes; the last part is short
    lives.append(LiveSpool.serialise(_paced(blocks, {}), store.spool_folder(), write_behind=True, keep_parts=True))
    live = lives[0]
    try:
        if flip is None:
            store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
        else:
            with pytest.raises(CorruptGenerationError, match="read back from the store differs"):
                store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
        assert live.kept.counts == {"kept": 2, "passed": 4} and live.kept.allocated == 2
        assert live.kept.held == 0
        assert live.sha256 == digest.digest_bytes(b"".join(blocks))
    finally:
        live.unlink()
    if flip is None:
        assert store.verify(1, contract=C) is None
    else:
        assert store.load_latest(contract=C) is None


@pytest.mark.parametrize("sizes", [[], [7], [2**20], [3 * 2**20 + 5], [1, 2**20 - 1, 2**20 + 1, 3, 5 * 2**19],
                                   [4096] * 700])
def test_a_spool_keeping_its_parts_holds_what_a_plain_one_holds(tmp_path, monkeypatch, sizes):
    """Writes of any size, across part boundaries or not, make the same file and digest whether the writer keeps its
    parts (copying into them, writing whole parts) or writes them as they come."""
    from trainproof.storage import digest

    monkeypatch.setattr(digest, "PART_BYTES", 2**20)
    blocks = [_block(n, i) for i, n in enumerate(sizes)]
    spools = []
    try:
        for keep in (False, True):
            out = SpoolWriter(str(tmp_path), write_behind=True, keep_bytes=4 * 2**20 if keep else 0)
            with out:
                for block in blocks:
                    out.write(block)
            spools.append(out.finish())
            assert (out.kept is not None) is keep
        plain, kept = spools
        assert (kept.size, kept.sha256) == (plain.size, plain.sha256) == (sum(sizes), digest.digest_bytes(b"".join(blocks)))
        with open(kept.path, "rb") as fh:
            assert fh.read() == b"".join(blocks)
    finally:
        for s in spools:
            s.unlink()
