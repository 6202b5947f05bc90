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


def test_a_folder_store_links_a_spool_once_it_is_written(tmp_path):
    store = open_store(str(tmp_path / "run"))
    blocks = [_block(3 * 2**20, i) for i in range(3)]
    gate = threading.Event()
    live = LiveSpool.serialise(_paced(blocks, {2: gate}), store.spool_folder(), expected=9 * 2**20)
    threading.Timer(0.2, gate.set).start()
    store.commit(1, {"training_state.pt": live}, contract=C, world=1, code_version="t")
    stored = os.path.join(store.root, "step-00000001", "training_state.pt")
    assert os.path.samefile(stored, live.path), "linked, not copied"
    with open(stored, "rb") as fh:
        assert fh.read() == b"".join(blocks)
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
