"""Large objects never sit whole in memory: spool files, parallel multipart parts, ranged read-back and loads.

Every backend (memory://, a local folder, S3 over HTTP on loopback) with a part size of 5 MiB (S3's smallest) and
two parts in flight, so an object of a few tens of MiB crosses many parts. Memory is measured with tracemalloc:
the bytes objects holding parts are Python allocations, so a copy of the whole object would show.
"""

from __future__ import annotations

import hashlib
import os
import random
import threading
import tracemalloc
from dataclasses import replace

import pytest

from trainproof.storage import digest
from trainproof.storage import CorruptGenerationError, StoreOptions, open_store
from trainproof.storage.backend import CHUNK
from trainproof.storage.spool import Spool, SpoolWriter, download, hashed_ranges, spans
from tests.support.tamper import TamperingBackend, flip_first_byte
from tests.support.timing import budget


class ThreadsSeen:
    """The names of the threads that called, for a test that the work was spread: a caller that has seen no other
    thread yet waits (at most 5 s, scaled by the load) for one to arrive, so a fast first thread cannot take every part before the pool
    starts its others (a pool starts a thread only when none is idle)."""

    def __init__(self):
        self.names, self._lock, self._second = set(), threading.Lock(), threading.Event()

    def __call__(self):
        with self._lock:
            self.names.add(threading.current_thread().name)
            if len(self.names) > 1:
                self._second.set()
        if not self._second.is_set() and not self._second.wait(budget(5)):
            self._second.set()  # waited once in vain: a single-threaded reader fails the test, without more waits

    def __len__(self):
        return len(self.names)

PART = 5 * 2**20
C = "contract-spool"


def _store(url: str, **options):
    store = open_store(url, replace(StoreOptions.from_env(), part_size=PART, concurrency=2, **options))
    return store


def _spool(folder, size: int, seed: int = 1) -> Spool:
    block = hashlib.sha256(str(seed).encode()).digest() * (2**16 // 32)  # 64 KiB of varied bytes
    with SpoolWriter(str(folder)) as out:
        left = size
        while left:
            n = min(left, len(block))
            out.write(block[:n])
            left -= n
    return out.finish()


def test_spool_writer_hashes_what_it_writes_and_discards_on_error(tmp_path):
    spool = _spool(tmp_path, 3 * 2**20 + 7)
    data = open(spool.path, "rb").read()
    assert (spool.size, spool.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert spool.read_range(10, 20) == data[10:20]
    with pytest.raises(RuntimeError):
        with SpoolWriter(str(tmp_path)) as out:
            out.write(b"partial")
            raise RuntimeError("serialisation failed")
    assert not os.path.exists(out.path), "a failed serialisation leaves no spool file behind"


def test_a_spool_hashes_the_parts_of_a_large_write_beside_it_and_before_it_returns(tmp_path, monkeypatch):
    # Parts of 1 MiB: writes of 4 MiB and more are hashed on the pool, piece by part, while the file is written.
    monkeypatch.setattr(digest, "PART_BYTES", 2**20)
    rng = random.Random(7)
    sizes = [5, 4 * 2**20, 2**20 - 3, 9 * 2**20 + 11, 100, 4 * 2**20 + 2**19, 6 * 2**20]
    written = bytearray()
    with SpoolWriter(str(tmp_path)) as out:
        for n in sizes:
            buf = bytearray(rng.randbytes(n))
            assert out.write(memoryview(buf)) == n
            written += buf
            buf[:] = bytes(n)  # the caller reuses its buffer once write returned: the digest must not see this
    spool = out.finish()
    expected = digest.FileHasher(2**20)
    expected.update(written)
    with open(spool.path, "rb") as fh:
        assert fh.read() == written
    assert (spool.size, spool.sha256) == (len(written), expected.hexdigest())
    assert len(expected.digest().parts) == -(-len(written) // 2**20) > 20, "the writes crossed many parts"


def test_a_spool_write_of_more_than_2_gib_writes_every_byte(tmp_path):
    # Linux writes at most 2 GiB - 4 KiB per write call: one tensor that large (an embedding's float32 Adam moment)
    # is one write of torch.save. The buffer is calloc'd: its pages cost nothing until read.
    size = 2**31 + 4096 + 7
    buf = bytearray(size)
    buf[-8:] = b"the tail"
    with SpoolWriter(str(tmp_path)) as out:
        out.write(buf)
    spool = out.finish()
    try:
        assert os.path.getsize(spool.path) == spool.size == size
        assert spool.read_range(size - 8, size) == b"the tail"
        assert spool.sha256 == digest.digest_bytes(buf)
    finally:
        spool.unlink()


@pytest.mark.parametrize("size", [0, 1, PART - 1, PART, PART + 1, 3 * PART + 17])
def test_hashed_ranges_hash_in_order_and_see_an_extra_byte(size):
    data = os.urandom(size + 1)  # one byte more than claimed: the probe must see it
    calls = []

    def read(a, b):
        calls.append((a, b))
        return data[a:b]

    seen, sha = hashed_ranges(read, size, part_size=PART, concurrency=3)
    assert seen == size + 1, "an object longer than claimed shows as size + 1 bytes"
    assert sha == hashlib.sha256(data).hexdigest()
    assert sorted(calls)[-1][1] == size + 1 and len(calls) == len(spans(size, PART))
    seen, sha = hashed_ranges(lambda a, b: data[:size][a:b], size, part_size=PART, concurrency=3)
    assert (seen, sha) == (size, hashlib.sha256(data[:size]).hexdigest())


def test_download_stops_at_a_short_object_and_reports_it(tmp_path):
    data = os.urandom(2 * PART + 5)
    spool, seen, sha = download(lambda a, b: data[a:b], 3 * PART, str(tmp_path), part_size=PART, concurrency=2)
    try:
        assert seen == len(data) and sha == hashlib.sha256(data).hexdigest()
        assert open(spool.path, "rb").read() == data
    finally:
        spool.unlink()


@pytest.mark.parametrize("extra", [1, 0, -5, -(PART + 3)])  # longer than claimed, exact, short, short by parts
def test_a_download_of_many_digest_parts_hashes_them_on_the_fetching_threads(tmp_path, extra):
    """A digest of 2 MiB parts over 1 MiB ranges: each digest part is fetched and hashed by one thread, and
    written by the download's writer thread; the answer (bytes seen, root digest, spool bytes) is the in-order path's, whatever the object's true length."""
    from trainproof.storage.digest import FileHasher, digest_bytes

    size, digest_part, part = 7 * 2**20 + 11, 2 * 2**20, 2**20
    data = os.urandom(size + max(extra, 0))[: size + extra]
    threads, ranges = ThreadsSeen(), []

    def read(a, b):
        threads()
        ranges.append((a, b))
        return data[a:b]

    spool, seen, sha = download(read, size, str(tmp_path), part_size=part, concurrency=3,
                                hasher=FileHasher(digest_part))
    try:
        reference = FileHasher(digest_part)
        expected_seen, expected_sha = hashed_ranges(lambda a, b: data[a:b], size, part_size=part, concurrency=3,
                                                    hasher=reference)
        assert (seen, sha) == (expected_seen, expected_sha)
        if extra == 0:
            assert seen == size and sha == digest_bytes(data, part_bytes=digest_part)
        else:  # longer: the probe byte is seen; shorter: it stops at the end (the caller refuses either)
            assert seen == min(size + 1, len(data))
        assert open(spool.path, "rb").read() == data[:size]
        assert max(b - a for a, b in ranges) <= part + 1
        if extra >= 0:  # a short object's later parts may be cancelled before a thread takes them
            assert len(threads) > 1
    finally:
        spool.unlink()


@pytest.mark.parametrize("extra", [1, 0, -5])
def test_a_read_back_of_many_digest_parts_hashes_them_on_the_fetching_threads(extra):
    """The commit's read-back (no sink): each digest part hashed by the thread that fetched it, with the in-order
    path's answer, an object longer or shorter than claimed included; a one-part digest keeps the in-order path."""
    from trainproof.storage.digest import FileHasher
    from trainproof.storage.spool import hashed_parts

    size, digest_part, part = 5 * 2**20 + 3, 2**20, 2**19
    data = os.urandom(size + max(extra, 0))[: size + extra]
    threads = ThreadsSeen()

    def read(a, b):
        threads()
        return data[a:b]

    got = hashed_parts(read, size, FileHasher(digest_part), part_size=part, concurrency=3)
    assert got == hashed_ranges(lambda a, b: data[a:b], size, part_size=part, concurrency=3,
                                hasher=FileHasher(digest_part))
    assert got[0] == (size if extra == 0 else min(size + 1, len(data)))
    if extra >= 0:
        assert len(threads) > 1
    plain = hashed_parts(lambda a, b: data[a:b], size, FileHasher(0), part_size=part, concurrency=3)
    assert plain[1] == hashlib.sha256(data[: size + 1]).hexdigest()
    # A download (a sink) is hashed on the fetching threads too, but written by one thread, every range once:
    # fetching threads that each wrote their own parts into the one file cost several times the system time.
    writers, hashing = [], ThreadsSeen()

    def read_data(a, b):
        hashing()
        return data[a:b]

    def sink(offset, chunk):
        writers.append((threading.current_thread().name, offset, len(chunk)))

    sunk = hashed_parts(read_data, size, FileHasher(digest_part), part_size=part, concurrency=3, sink=sink)
    assert sunk == got
    assert {name for name, _, _ in writers} == {"trainproof-spool-write"}
    assert not hashing.names & {"trainproof-spool-write", threading.current_thread().name}
    if extra >= 0:
        assert len(hashing) > 1
    covered = sorted((offset, n) for _, offset, n in writers)
    assert [o for o, _ in covered] == [o for o, _ in spans(size, part)][: len(covered)]
    assert sum(n for _, n in covered) == min(len(data), size + 1)
    assert not [t for t in threading.enumerate() if t.name == "trainproof-spool-write"]


@pytest.mark.parametrize("fails", ["write", "last write", "read"])
def test_a_download_whose_write_or_read_fails_raises_it_and_leaves_no_thread_or_file(tmp_path, monkeypatch, fails):
    """A full disk under the spool writer (or a read error of a fetching thread) ends the download with that
    error: the fetching threads stop instead of waiting on a writer that is gone, the writer thread ends, and the
    partial spool file is deleted."""
    from trainproof.storage import spool as spool_mod
    from trainproof.storage.digest import FileHasher

    size, digest_part, part = 9 * 2**20, 2**20, 2**18
    data = os.urandom(size)
    reads = []

    def read(a, b):
        reads.append(a)
        if fails == "read" and a >= size // 2:
            raise OSError(5, "read failed")
        return data[a:b]

    pwrite, writes = os.pwrite, []

    def full_disk(fd, view, offset):  # ranges of one pwrite each (WRITE_SLICE): the last one is the size // part-th
        writes.append(offset)
        if offset >= 2 * 2**20 if fails == "write" else len(writes) == size // part:
            raise OSError(28, "No space left on device")
        return pwrite(fd, view, offset)

    if fails != "read":
        monkeypatch.setattr(spool_mod.os, "pwrite", full_disk)
    with pytest.raises(OSError) as err:
        download(read, size, str(tmp_path), part_size=part, concurrency=3, hasher=FileHasher(digest_part))
    assert err.value.errno == (5 if fails == "read" else 28)
    assert os.listdir(tmp_path) == []
    assert not [t for t in threading.enumerate() if t.name.startswith(("trainproof-spool-write", "trainproof-part"))]
    if fails == "write":  # the fetching threads stopped soon after the writer failed, not at the object's end
        assert len(reads) < size // part


def test_commit_and_spooled_load_of_a_large_object_stay_within_the_parts_in_flight(store_url, tmp_path):
    store = _store(store_url)
    reads: list[int] = []
    inner_read = store.backend.read_range
    store.backend.read_range = lambda path, a, b: reads.append(b - a) or inner_read(path, a, b)
    size = 40 * 2**20 + 123
    spool = _spool(tmp_path, size)
    checked = []
    tracemalloc.start()
    try:
        store.commit(1, {"training_state.pt": spool}, contract=C, world=1, code_version="t",
                     check=lambda name, data: checked.append((name, type(data).__name__, data.size)))
        _, commit_peak = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        loaded = store.load(1, contract=C, spool_dir=str(tmp_path / "load"))
        _, load_peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    got = loaded.files["training_state.pt"]
    try:
        assert isinstance(got, Spool) and (got.size, got.sha256) == (spool.size, spool.sha256)
        assert open(got.path, "rb").read() == open(spool.path, "rb").read()
    finally:
        loaded.close()
    assert not os.path.exists(got.path), "Loaded.close() deletes the downloaded spool"
    # The content check got the spool, proven identical to the stored object by the read-back hash.
    assert checked == [("training_state.pt", "Spool", size)]
    # Ranged reads of one part at most: S3's part size, or one 8 MiB chunk on a local disk / memory.
    assert reads and max(reads) <= max(PART, CHUNK) + 1, "read-back and load never read a whole object"
    # memory:// and the moto server (a thread of this process) hold the stored objects in this process by design:
    # the allocation bound is checked on a local folder; bench/ measures the process's RSS against S3.
    if store_url.startswith("/") or "://" not in store_url:
        bound = 5 * PART  # (concurrency + 1) parts, plus slack for one part being hashed/handed over
        assert commit_peak < bound, f"commit held {commit_peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB object"
        assert load_peak < bound, f"load held {load_peak / 2**20:.1f} MiB for a {size / 2**20:.0f} MiB object"


def test_a_damaged_read_back_of_a_spooled_file_is_never_marked_usable(store_url, tmp_path):
    store = _store(store_url)
    tampered = type(store)(TamperingBackend(store.backend, alter_read=flip_first_byte), store.root, store.url,
                           store.options)
    spool = _spool(tmp_path, 12 * 2**20)
    with pytest.raises(CorruptGenerationError, match="differs from what was written"):
        tampered.commit(1, {"training_state.pt": spool}, contract=C, world=1, code_version="t")
    assert store.load_latest(contract=C) is None


def test_a_spooled_load_refuses_a_damaged_or_grown_object(store_url, tmp_path):
    store = _store(store_url)
    spool = _spool(tmp_path, 11 * 2**20)
    store.commit(1, {"training_state.pt": spool}, contract=C, world=1, code_version="t")
    flip = lambda p, d: flip_first_byte(p, d) if p.endswith(".pt") else d  # noqa: E731 - the state only
    tampered = type(store)(TamperingBackend(store.backend, alter_read=flip), store.root, store.url, store.options)
    with pytest.raises(CorruptGenerationError, match="sha256 differs"):
        tampered.load(1, contract=C, spool_dir=str(tmp_path / "a"))
    grown = type(store)(TamperingBackend(store.backend, alter_read=lambda p, d: d + b"!" if p.endswith(".pt") else d),
                        store.root, store.url, store.options)
    with pytest.raises(CorruptGenerationError, match="more than"):
        grown.load(1, contract=C, spool_dir=str(tmp_path / "b"))
    leftovers = [p for d in ("a", "b") if (tmp_path / d).exists() for p in os.listdir(tmp_path / d)]
    assert leftovers == [], "a refused load deletes its spool files"


def test_a_spool_changed_after_serialising_is_refused(tmp_path):
    store = _store(str(tmp_path / "run"))
    spool = _spool(tmp_path, 6 * 2**20)
    with open(spool.path, "r+b") as fh:  # something rewrote the local file after it was hashed
        fh.write(b"\xff")
    with pytest.raises(CorruptGenerationError, match="differs from what was written|spool file changed"):
        store.commit(1, {"training_state.pt": spool}, contract=C, world=1, code_version="t")
    assert store.load_latest(contract=C) is None


def test_a_folder_store_links_a_spool_from_its_spool_folder_and_copies_one_from_another_file_system(tmp_path):
    """A folder store's writer spools into ``<run>/.spool`` (the run's own file system): the commit links that file in
    (the stored file is the spool's inode, with a stored file's usual mode, not the spool's private 0600), so the
    state is written once. Spools a killed writer left there are deleted when the next writer takes the folder; a
    spool on another file system (tmpfs) is copied as before. Both load verified."""
    store = _store(str(tmp_path / "run"))
    (tmp_path / "run" / ".spool").mkdir(parents=True)
    leftover = tmp_path / "run" / ".spool" / "trainproof-spool-killed"
    leftover.write_bytes(b"a killed writer's state")
    folder = store.spool_folder()
    assert folder == str(tmp_path / "run" / ".spool") and not leftover.exists()
    spool = _spool(folder, 6 * 2**20)
    inode = os.stat(spool.path).st_ino
    store.commit(1, {"training_state.pt": spool}, contract=C, world=1, code_version="t")
    spool.unlink()
    stored = os.stat(tmp_path / "run" / "step-00000001" / "training_state.pt")
    umask = os.umask(0o022)
    os.umask(umask)
    assert stored.st_ino == inode and stored.st_nlink == 1 and stored.st_mode & 0o777 == 0o666 & ~umask
    assert os.listdir(folder) == []
    shm = "/dev/shm"
    if not os.path.isdir(shm) or os.stat(shm).st_dev == os.stat(tmp_path).st_dev:
        pytest.skip("no second file system to spool on")
    elsewhere = _spool(shm, 6 * 2**20, seed=2)
    try:
        store.commit(2, {"training_state.pt": elsewhere}, contract=C, world=1, code_version="t")
        assert os.stat(tmp_path / "run" / "step-00000002" / "training_state.pt").st_ino != \
            os.stat(elsewhere.path).st_ino
    finally:
        elsewhere.unlink()
    for step, seed in ((1, 1), (2, 2)):
        loaded = store.load(step, contract=C)
        assert loaded.files["training_state.pt"] == _spool_bytes(6 * 2**20, seed)


def _cached_pages(path) -> int:
    """How many of ``path``'s pages are in the page cache now (mincore on a mapping that faults none in)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype, libc.mmap.argtypes = ctypes.c_void_p, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                              ctypes.c_int, ctypes.c_int, ctypes.c_long]
    size, page = os.path.getsize(path), mmap.PAGESIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()
        vec = (ctypes.c_ubyte * (-(-size // page)))()
        try:
            assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, ctypes.get_errno()
        finally:
            libc.munmap(ctypes.c_void_p(addr), ctypes.c_size_t(size))
    finally:
        os.close(fd)
    return sum(v & 1 for v in vec)


def test_a_folder_write_leaves_nothing_in_the_page_cache_so_the_read_back_reads_the_disk(tmp_path):
    """Every way a folder store writes a state file (bytes, a spool linked in, a spool copied from elsewhere) ends with
    the file's pages dropped from the cache after its fsync (markers, under 1 MiB, stay): the commit's read-back that follows verifies what the device
    holds, not the pages the writer just filled. Without that, the whole file would still be cached here."""
    import subprocess

    from trainproof.storage.backend import LocalBackend

    if subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True, text=True).stdout.strip() in (
            "tmpfs", "ramfs"):
        pytest.skip("the temp folder is in memory: its pages are the file, nothing to drop")
    backend, size = LocalBackend(), 8 * 2**20
    run = tmp_path / "run"
    run.mkdir()
    (run / ".spool").mkdir()
    cases = [("bytes.bin", _spool_bytes(size, 5)), ("linked.bin", _spool(str(run / ".spool"), size, seed=3))]
    if os.path.isdir("/dev/shm") and os.stat("/dev/shm").st_dev != os.stat(tmp_path).st_dev:
        cases.append(("copied.bin", _spool("/dev/shm", size, seed=4)))  # another file system: copied, not linked
    for name, data in cases:
        written = backend.write(str(run / name), data, create_only=True)
        if isinstance(data, Spool):
            assert (os.stat(run / name).st_ino == os.stat(data.path).st_ino) == (name == "linked.bin")
            data.unlink()
        assert written[0] == size
        assert _cached_pages(run / name) == 0, name
        assert hashlib.sha256((run / name).read_bytes()).hexdigest() == written[1]  # read from the disk, same bytes
    backend.write(str(run / "COMPLETE.json"), b"{}" * 100)  # a marker: small, read by every scan, stays cached
    assert _cached_pages(run / "COMPLETE.json") == 1


@pytest.mark.parametrize("range_sync", [True, False], ids=["sync_file_range", "without"])
def test_a_spool_written_behind_holds_the_same_bytes_and_leaves_little_for_the_fsync(tmp_path, monkeypatch,
                                                                                      range_sync):
    """A spool that becomes the stored file (a folder store links it) starts the write-back of each window of its
    bytes while it is written: at the end all but the last window are being written or on the device, where the same
    writes without it leave the whole file dirty for the fsync. Where ranges cannot be synced alone (not Linux), the
    same bytes still."""
    from trainproof.storage import writeback
    from trainproof.storage.spool import WRITE_BEHIND_BYTES

    if not range_sync:
        monkeypatch.setattr(writeback, "_CALL", False)
    started = []
    inner = writeback.start
    monkeypatch.setattr(writeback, "start", lambda fd, off, n: started.append((off, n)) or inner(fd, off, n))
    blocks = [_spool_bytes(WRITE_BEHIND_BYTES // 2, seed) for seed in range(16)]  # a window every second write
    spools = []
    try:
        for behind in (False, True):
            with SpoolWriter(str(tmp_path), write_behind=behind) as out:
                for block in blocks:
                    out.write(block)
            spools.append(out.finish())
            assert len(started) == (8 if behind else 0)
        assert started == [(i * WRITE_BEHIND_BYTES, WRITE_BEHIND_BYTES) for i in range(8)], "every byte, once"
        plain, behind_ = spools
        whole = b"".join(blocks)
        assert (behind_.size, behind_.sha256) == (plain.size, plain.sha256) == (len(whole), digest.digest_bytes(whole))
        with open(behind_.path, "rb") as fh:
            assert hashlib.sha256(fh.read()).digest() == hashlib.sha256(whole).digest()
    finally:
        for spool in spools:
            spool.unlink()


def _spool_bytes(size: int, seed: int) -> bytes:
    block = hashlib.sha256(str(seed).encode()).digest() * (2**16 // 32)
    return (block * (size // len(block) + 1))[:size]


def test_bad_transfer_settings_are_one_line_errors():
    from trainproof.storage import StoreConfigError

    with pytest.raises(StoreConfigError, match="TRAINPROOF_PART_SIZE_MB"):
        StoreOptions.from_env({"TRAINPROOF_PART_SIZE_MB": "1"})
    with pytest.raises(StoreConfigError, match="TRAINPROOF_IO_CONCURRENCY"):
        StoreOptions.from_env({"TRAINPROOF_IO_CONCURRENCY": "lots"})
    options = StoreOptions.from_env({"TRAINPROOF_PART_SIZE_MB": "32", "TRAINPROOF_IO_CONCURRENCY": "4"})
    assert (options.part_size, options.concurrency) == (32 * 2**20, 4)


def test_a_failed_read_stops_the_other_parts_at_their_next_range_and_is_what_the_caller_gets(tmp_path):
    """Each fetching thread reads a whole digest part: when one read fails, the others stop at their next range (not
    at the end of their part, reading what will be deleted and holding up the retry), and the caller gets that
    read's error, not a stop of another part."""
    import time

    from trainproof.storage.digest import FileHasher

    size, digest_part, part = 6 * 2**20, 2**20, 2**16  # 16 ranges a part
    data = os.urandom(size)
    failed_at, after = [], []

    def read(a, b):
        time.sleep(0.005)
        if failed_at:
            after.append(a)
        if a == digest_part + 2 * part:  # part 1's third range
            failed_at.append(a)
            raise OSError(5, "read failed")
        return data[a:b]

    with pytest.raises(OSError) as err:
        download(read, size, str(tmp_path), part_size=part, concurrency=3, hasher=FileHasher(digest_part))
    assert err.value.errno == 5 and os.listdir(tmp_path) == []
    assert len(after) <= 2 * 3, f"{len(after)} ranges read after the failure"


def test_the_writers_end_is_waited_for_through_a_keyboard_interrupt():
    """A spool's writer thread must be over before the spool is deleted (its descriptor's number is reused by the next
    file opened): every step runs to its end through a KeyboardInterrupt, which is raised after them."""
    from trainproof.storage.spool import _uninterrupted

    calls, stopped = [], []

    def interrupted_once():
        calls.append("put")
        if calls.count("put") == 1:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _uninterrupted(interrupted_once, lambda: calls.append("join"), on_interrupt=lambda: stopped.append(1))
    assert calls == ["put", "put", "join"] and stopped == [1]
