"""Spools: a large object's bytes in a local file, hashed as they were written, so no one holds them in memory.

A checkpoint of a 1-8 B-parameter model is 12-100 GB. Held as ``bytes`` it would need that much RAM again (and
again for the read-back). Instead the writer serialises straight into a :class:`Spool` (a local file, sha256 and
size computed while the bytes go by: a tensor's digest parts on other cores while this one writes it), the
backend uploads from it (parallel multipart parts read with ``os.pread``: memory is the parts in flight, not the
object), the read-back verification streams the stored object through sha256 in parallel ranged reads
(:func:`hashed_ranges`), and the caller's content check reads the spool itself: bytes proven identical to the
stored ones by the hash.

Loading does the same in reverse: :func:`download` fetches an object in parallel ranges into a new spool,
hashing the ranges in order as they arrive; the caller then maps the file (``torch.load(mmap=True)``) instead
of copying it into memory.

Memory bound of either direction: ``part_size × (concurrency + 1)``. A spool is deleted by :meth:`Spool.unlink`
(the owner's job); a process killed mid-write leaves a ``trainproof-spool-*`` file in the spool folder, which
is scratch space (an emptyDir in Kubernetes) and never read again.
"""

from __future__ import annotations

import os
import tempfile
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import closing
from dataclasses import dataclass
from itertools import islice
from typing import BinaryIO, Callable, Iterable, Iterator, TypeVar

from trainproof.storage.digest import FileHasher, cores

T = TypeVar("T")
R = TypeVar("R")

SPOOL_PREFIX = "trainproof-spool-"
"""How a spool file's name starts (a folder store's spool folder is cleaned of them, GenerationStore.spool_folder)."""
PART_SIZE = 8 * 2**20
"""Default size of one ranged read or multipart part (8 MiB: AWS's recommended range, and with 8 in flight a
transfer holds ~72 MiB, under 1 % of a multi-GB state; see bench/RESULTS.md)."""
CONCURRENCY = 8
"""Default number of parts in flight at once."""
WRITE_SLICE = 256 * 2**10
"""Bytes per ``pwrite`` when the fetching threads write a download's ranges into one spool file. The kernel holds
the file's lock for a whole write, and the other writers spin on it: 8 threads writing 8 MiB each made the
download 1.9x boto3's ``download_file`` on ext4 (3.3-3.6 s vs 1.8-1.9 s for 1 GiB, ``bench/bench_s3_split.py``),
256 KiB writes of the same ranges match it."""


@dataclass(frozen=True)
class Spool:
    """A local file holding one object's bytes, with the size and digest (``trainproof.storage.digest``) computed as
    they were written."""

    path: str
    size: int
    sha256: str

    def open(self) -> BinaryIO:
        """The bytes, from the start (every write attempt re-opens: a retry never resumes a half-read stream)."""
        return open(self.path, "rb")

    def read_range(self, start: int, end: int) -> bytes:
        """Bytes ``start:end`` (``os.pread``: no shared file position, so threads can read parts at once)."""
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)

    def unlink(self) -> None:
        """Delete the file (missing is fine). Tensors already mapped from it stay valid on POSIX systems."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


def write_all(fh: BinaryIO, view: memoryview) -> None:
    """Write all of ``view`` to an unbuffered file: one ``write`` may write less (Linux writes at most 2 GiB - 4 KiB
    per call, so one tensor of 2 GiB or more, an embedding's Adam moment in float32, would lose its tail)."""
    while view.nbytes:
        written = fh.write(view)
        if not written:
            raise OSError(f"writing {view.nbytes} bytes to {getattr(fh, 'name', 'a spool')} made no progress")
        view = view[written:]


HASH_BESIDE_BYTES = 4 * 2**20
"""A spool write of at least this many bytes (a tensor's storage) is hashed on :func:`hash_pool`'s threads while it
is written; smaller ones (the pickle, headers) inline."""
_POOL: tuple[int, ThreadPoolExecutor] | None = None
_POOL_LOCK = threading.Lock()


def hash_pool() -> ThreadPoolExecutor:
    """The process's threads that hash spool writes (the cores it may use, at most 8), made at the first use; a
    forked child (whose copy has no threads) makes its own."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[0] != os.getpid():
            _POOL = (os.getpid(), ThreadPoolExecutor(min(8, cores()), thread_name_prefix="trainproof-hash"))
        return _POOL[1]


def spool_dir(directory: str | None = None) -> str:
    """The folder spools go to: ``directory``, else ``TRAINPROOF_SPOOL_DIR``, else the system temp folder."""
    folder = directory or os.environ.get("TRAINPROOF_SPOOL_DIR") or tempfile.gettempdir()
    os.makedirs(folder, exist_ok=True)
    return folder


class SpoolWriter:
    """A write-only binary file that hashes as it writes; :meth:`finish` returns the :class:`Spool`.

    Used as ``with SpoolWriter(folder) as w: torch.save(obj, w)``; an exception inside the block deletes the file.
    """

    def __init__(self, directory: str | None = None, *, prefix: str = SPOOL_PREFIX) -> None:
        fd, self.path = tempfile.mkstemp(prefix=prefix, dir=spool_dir(directory))
        self._fh = os.fdopen(fd, "wb", buffering=0)
        self._sha = FileHasher()
        self._size = 0
        self.spool: Spool | None = None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if view.nbytes < HASH_BESIDE_BYTES:
            self._sha.update(view)
            write_all(self._fh, view)
        else:
            # The digest's parts hashed on other threads while this one writes (hashlib and the write both release
            # the GIL): the bytes are read twice at once instead of one pass after the other. Every piece is hashed
            # before this returns: the caller (torch.save) may reuse its buffer then.
            pending = self._sha.update_on(view, hash_pool())
            try:
                write_all(self._fh, view)
            finally:
                wait(pending)
            for job in pending:
                job.result()
        self._size += view.nbytes
        return view.nbytes

    def flush(self) -> None:
        pass  # unbuffered

    def finish(self) -> Spool:
        """Close the file and return what it holds."""
        if self.spool is None:
            self._fh.close()
            self.spool = Spool(path=self.path, size=self._size, sha256=self._sha.hexdigest())
        return self.spool

    def discard(self) -> None:
        self._fh.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "SpoolWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.discard()


def spans(size: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``size`` bytes in parts of ``part_size`` (at least one range)."""
    return [(off, min(off + part_size, size)) for off in range(0, size, part_size)] or [(0, 0)]


def in_order(fn: Callable[[T], R], items: Iterable[T], workers: int, name: str) -> Iterator[tuple[T, R]]:
    """Run ``fn`` over ``items`` on ``workers`` threads and yield ``(item, result)`` in the items' order. At most
    ``workers`` calls are in flight besides the result being yielded; the next call starts before the caller gets a
    result, so reading overlaps the caller's work. An error of ``fn`` is raised when its item's turn comes. Close
    the generator (``contextlib.closing``) to stop early: calls not started are cancelled, running ones finished."""
    workers = max(1, workers)
    queued = iter(items)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name) as pool:
        pending: deque = deque((item, pool.submit(fn, item)) for item in islice(queued, workers))
        try:
            while pending:
                item, fut = pending.popleft()
                result = fut.result()
                for nxt in islice(queued, 1):
                    pending.append((nxt, pool.submit(fn, nxt)))
                yield item, result
                del result
        finally:
            for _, fut in pending:
                fut.cancel()


def hashed_ranges(read_range: Callable[[int, int], bytes], size: int, *, part_size: int = PART_SIZE,
                  concurrency: int = CONCURRENCY, sink: Callable[[int, bytes], None] | None = None,
                  digest: bool = True, hasher: FileHasher | None = None) -> tuple[int, str]:
    """Read ``size`` bytes as parallel ranged reads and hash them in order; return (bytes seen, digest): the
    digest of ``hasher`` (default: a new file's, ``trainproof.storage.digest``). ``digest=False``: only hand them to
    ``sink`` (the digest returned is then ``""``).

    At most ``concurrency`` parts are in flight and each is hashed (and handed to ``sink(offset, data)``)
    as soon as every part before it was, so memory stays ``part_size × (concurrency + 1)``. The last range
    asks for one byte more than ``size``: an object longer than claimed shows as ``size + 1`` bytes seen; a
    shorter one stops at its end. Errors of ``read_range`` propagate (the caller's retry wraps the whole read).
    """
    ranges = spans(size, part_size)
    last_start, _ = ranges[-1]
    ranges[-1] = (last_start, size + 1)
    sha, seen = hasher or FileHasher(), 0
    with closing(in_order(lambda r: read_range(*r), ranges, concurrency, "trainproof-range")) as reads:
        for (start, end), data in reads:
            beside = digest and sink is not None and len(data) >= HASH_BESIDE_BYTES
            if digest and not beside:
                sha.update(data)
            if sink is not None and data:
                # A large part is hashed on the pool while this thread hands it on (a download's pwrite: both
                # release the GIL), and done before the next part.
                pending = sha.update_on(data, hash_pool()) if beside else []
                try:
                    sink(start, data)
                finally:
                    wait(pending)
                for job in pending:
                    job.result()
            seen += len(data)
            short = len(data) < end - start
            del data
            if short:  # the object ended here: later parts would read nothing (closing cancels them)
                break
    return seen, sha.hexdigest() if digest else ""


def hashed_parts(read_range: Callable[[int, int], bytes], size: int, hasher: FileHasher | None, *,
                 part_size: int = PART_SIZE, concurrency: int = CONCURRENCY,
                 sink: Callable[[int, bytes], None] | None = None) -> tuple[int, str]:
    """:func:`hashed_ranges`' answer, with the hashing spread over the fetching threads when ``hasher`` makes a digest
    of several parts (``trainproof.storage.digest``), the object has more than one and nothing is written
    (``sink`` None: a commit's read-back). It then hashes on every thread instead of one consumer, which on a machine
    whose cores the S3 server shares is the difference between the read-back's speed and the network's.

    A download (a ``sink``) keeps one consumer that hashes and writes in order. Fetching threads that each wrote
    their own parts into the one spool file cost 3-8x the system time of a single writer on the test VM (1 GiB from
    Ceph RGW, fresh processes: 5-10 s against 3.2-3.8 s, for the same digest)."""
    digest_part = getattr(hasher, "part_bytes", 0)
    if digest_part and size > digest_part and sink is None:
        return _parts_in_parallel(read_range, size, digest_part, part_size, concurrency, sink)
    return hashed_ranges(read_range, size, part_size=part_size, concurrency=concurrency, sink=sink, hasher=hasher)


def _parts_in_parallel(read_range: Callable[[int, int], bytes], size: int, digest_part: int, part_size: int,
                       concurrency: int, sink: Callable[[int, bytes], None] | None) -> tuple[int, str]:
    """:func:`hashed_parts`' path for a digest of several parts (``trainproof.storage.digest``): each digest part is one
    task for a fetching thread, which reads it as consecutive ranges of ``part_size``, hashes them and hands them to
    ``sink`` (a download's spool) itself; only the parts' digests come back in order. Hashing and writing then run
    on every fetching thread instead of one consumer, and memory stays ``part_size`` per thread. Same answer as
    :func:`hashed_ranges`: (bytes seen, the root of the parts' digests), the last range asking for one byte past
    ``size`` (an object longer than claimed shows as ``size + 1``), a short object stopping at its end."""
    from hashlib import sha256

    from trainproof.storage.digest import of_parts

    def fetch(unit: tuple[int, int]) -> tuple[int, str, bool]:
        first, stop = unit
        sha, seen = sha256(), 0
        for start, end in spans(stop - first, part_size):
            start, end = first + start, first + end
            data = read_range(start, end + (end == size))
            sha.update(data)  # the probe byte too, if there is one: as hashed_ranges does
            if sink is not None:
                sink(start, data)
            seen += len(data)
            if len(data) < end - start:
                return seen, sha.hexdigest(), True
        return seen, sha.hexdigest(), False

    parts, seen = [], 0
    with closing(in_order(fetch, spans(size, digest_part), concurrency, "trainproof-part")) as fetched:
        for _, (got, digest, short) in fetched:
            parts.append(digest)
            seen += got
            if short:  # the object ended inside this part: the parts after it would read nothing
                break
    return seen, of_parts(parts, digest_part)


def download(read_range: Callable[[int, int], bytes], size: int, directory: str | None = None, *,
             part_size: int = PART_SIZE, concurrency: int = CONCURRENCY,
             hasher: FileHasher | None = None) -> tuple[Spool, int, str]:
    """Fetch an object of ``size`` bytes into a new spool with :func:`hashed_parts` (ranges fetched in parallel,
    hashed and written in order by the calling thread); return the spool and the
    (bytes seen, digest by ``hasher``) of what was read, for the caller to compare with what it expects. On any
    error the partial spool is deleted."""
    writer = SpoolWriter(directory, prefix="trainproof-load-")
    fd = writer._fh.fileno()

    def sink(offset: int, data: bytes) -> None:
        view = memoryview(data)[: max(0, size - offset)]  # never write the probe byte past the claimed end
        while view:
            written = os.pwrite(fd, view[:WRITE_SLICE], offset)
            view, offset = view[written:], offset + written

    try:
        seen, sha = hashed_parts(read_range, size, hasher, part_size=part_size, concurrency=concurrency, sink=sink)
    except BaseException:
        writer.discard()
        raise
    writer._fh.close()
    spool = Spool(path=writer.path, size=min(seen, size), sha256=sha)
    writer.spool = spool
    return spool, seen, sha
