"""Spools: a large object's bytes in a local file, hashed as they were written, so no one holds them in memory.

A checkpoint of a 1-8 B-parameter model is 12-100 GB. Held as ``bytes`` it would need that much RAM again (and
again for the read-back). Instead the writer serialises straight into a :class:`Spool` (a local file, sha256 and
size computed while the bytes go by: a tensor's digest parts on other cores while this one writes it), the
backend uploads from it (parallel multipart parts read with ``os.pread``: memory is the parts in flight, not the
object), the read-back verification streams the stored object through sha256 in parallel ranged reads
(:func:`hashed_ranges`), and the caller's content check reads the spool itself: bytes proven identical to the
stored ones by the hash.

Loading does the same in reverse: :func:`download` fetches an object in parallel ranged reads into a new spool,
each digest part hashed by the thread that fetched it and every range written by one writer thread; the caller
then maps the file (``torch.load(mmap=True)``) instead of copying it into memory.

Memory bound of either direction: ``part_size × (concurrency + 1)``, a download's ``WRITER_DEPTH`` more. A spool
is deleted by :meth:`Spool.unlink` (the owner's job); a process killed mid-write leaves a ``trainproof-spool-*``
file in the spool folder, which is scratch space (an emptyDir in Kubernetes) and never read again.
"""

from __future__ import annotations

import os
import queue
import tempfile
import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, closing
from dataclasses import dataclass
from functools import partial
from itertools import islice
from typing import Any, BinaryIO, Callable, Generator, Iterable, TypeVar

from trainproof.storage import writeback
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


WRITE_BEHIND_BYTES = 8 * 2**20
"""A ``write_behind`` spool starts the write-back of its bytes to the device each time this many more are written."""
HASH_BESIDE_BYTES = 4 * 2**20
"""A spool write of at least this many bytes (a tensor's storage) is hashed on :func:`hash_pool`'s threads while it
is written; smaller ones (the pickle, headers) inline."""


KEEP_BYTES = 128 * 2**20
"""At most this many bytes of a spool's digest parts are kept in memory at once (:class:`KeptParts`)."""


class KeptParts:
    """A spool's digest parts (``trainproof.storage.digest``) kept in memory from the moment they are written until
    the reader that verifies the stored file has compared them with what its device holds: a byte comparison
    (:func:`same_bytes`, about 10 GB/s) instead of a second sha256 of everything read back (about 1.3 GB/s; 0.6 CPU-s
    per GiB on the test VM, bench/RESULTS.md).

    The writer (:class:`SpoolWriter` made with ``keep_bytes``) serialises into these buffers and writes and hashes
    each part from there, so the bytes compared are the very bytes written and hashed, whatever becomes of the
    caller's buffers meanwhile. Bounded: at most ``budget`` parts are held (being filled, kept or
    being compared); a part begun while the reader is that far behind is written as it comes and not kept, and the
    reader hashes it as it would without this. The writer never waits for the reader, so a reader that never comes
    (a commit that failed first) costs at most ``budget`` parts of memory, until :meth:`stop`.
    """

    def __init__(self, part_bytes: int, budget: int) -> None:
        self.part_bytes = part_bytes
        self._budget = max(1, budget)
        self._lock = threading.Lock()
        self._kept: dict[int, tuple[bytearray, int]] = {}  # part index -> (its buffer, its length)
        self._held = 0  # parts reserved for keeping: being filled, kept, or taken by the reader
        self._free: list[bytearray] = []  # buffers to reuse (a fresh one faults its pages in: 1.6 GB/s here)
        self._stopped = False
        self._writer_done = False
        self.counts = {"kept": 0, "passed": 0}  # parts kept / written as they came (benchmarks)
        self.allocated = 0  # buffers made: at most budget

    @property
    def held(self) -> int:
        """Parts held for the reader now (being filled to be kept, kept, or being compared)."""
        return self._held

    def begin(self) -> bytearray | None:
        """Writer: a buffer to fill with the next part, which will be kept (it counts against the budget until the
        reader releases it); None when the budget is full (or keeping stopped): the writer writes that part as it
        comes, and the reader hashes it."""
        with self._lock:
            if self._stopped or self._held >= self._budget:
                self.counts["passed"] += 1
                return None
            self._held += 1
            self.counts["kept"] += 1
            if self._free:
                return self._free.pop()
            self.allocated += 1
            return bytearray(self.part_bytes)

    def written(self, index: int, buf: bytearray, size: int) -> None:
        """Writer: part ``index`` (``size`` bytes of ``buf``, from :meth:`begin`) is in the file and hashed; ``size``
        0: it was not written (a failed write), and the buffer is let go."""
        with self._lock:
            if size and not self._stopped:
                self._kept[index] = (buf, size)
            else:
                self._let_go(buf)

    def writer_done(self) -> None:
        """Writer: no more parts; spare buffers are let go."""
        with self._lock:
            self._writer_done = True
            self._free.clear()

    def take(self, index: int) -> tuple[bytearray, int] | None:
        """Reader: part ``index``'s buffer and length, now the reader's until :meth:`release`; None when it was not
        kept (or was taken already)."""
        with self._lock:
            return self._kept.pop(index, None)

    def release(self, buf: bytearray) -> None:
        """Reader: done with a buffer :meth:`take` gave."""
        with self._lock:
            self._let_go(buf)

    def _let_go(self, buf: bytearray) -> None:
        """(Lock held.) A held part's buffer is no longer held: reused for a later part while the writer writes."""
        self._held -= 1
        if not self._stopped and not self._writer_done:
            self._free.append(buf)

    def stop(self) -> None:
        """Keep nothing more and let go of every kept part (no reader is coming for them, or it is done)."""
        with self._lock:
            self._stopped = True
            self._held -= len(self._kept)
            self._kept.clear()
            self._free.clear()


_MEMCMP: Any = None


def same_bytes(a: memoryview, b: memoryview) -> bool:
    """Whether two buffers hold the same bytes. libc's ``memcmp`` through ctypes, which lets go of the GIL, so the
    threads of a read-back compare their parts at once; ``==`` of copies where that is not available (no libc, a
    read-only buffer)."""
    global _MEMCMP
    if a.nbytes != b.nbytes:
        return False
    if not a.nbytes:
        return True
    if _MEMCMP is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None).memcmp
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int
            _MEMCMP = (ctypes, fn)
        except (OSError, AttributeError):
            _MEMCMP = False
    if _MEMCMP:
        ctypes, fn = _MEMCMP
        try:
            left = (ctypes.c_char * a.nbytes).from_buffer(a)
            right = (ctypes.c_char * b.nbytes).from_buffer(b)
        except TypeError:  # read-only
            return bytes(a) == bytes(b)
        return fn(ctypes.addressof(left), ctypes.addressof(right), a.nbytes) == 0
    return bytes(a) == bytes(b)


def hash_pool() -> ThreadPoolExecutor:
    """Threads that hash beside a writer (the cores this process may use, at most 8), for one spool or one
    download: made by the writing thread, so they run at its priority (a background save's lowered one,
    trainproof.train.async_save), and shut down by the caller."""
    return ThreadPoolExecutor(min(8, cores()), thread_name_prefix="trainproof-hash")


def spool_dir(directory: str | None = None) -> str:
    """The folder spools go to: ``directory``, else ``TRAINPROOF_SPOOL_DIR``, else the system temp folder."""
    folder = directory or os.environ.get("TRAINPROOF_SPOOL_DIR") or tempfile.gettempdir()
    os.makedirs(folder, exist_ok=True)
    return folder


class SpoolWriter:
    """A write-only binary file that hashes as it writes; :meth:`finish` returns the :class:`Spool`.

    Used as ``with SpoolWriter(folder) as w: torch.save(obj, w)``; an exception inside the block deletes the file.

    ``write_behind``: for a spool that becomes the stored file itself (a folder store links it into its generation,
    then verifies it read back from the device): every :data:`WRITE_BEHIND_BYTES` written are sent on to the device
    while serialising goes on (:meth:`_start_writeback`), so the dirty pages of a state of many GB do not pile up for
    the commit's fsync. Measured on a 512 MiB spool, the fsync took 0.001 s instead of 0.23 (bench/RESULTS.md). Not
    for a spool that is uploaded (S3): the upload reads it back, from the page cache at best. A write-back error
    (EIO, ENOSPC) fails the write.
    """

    def __init__(self, directory: str | None = None, *, prefix: str = SPOOL_PREFIX, write_behind: bool = False,
                 keep_bytes: int = 0) -> None:
        fd, self.path = tempfile.mkstemp(prefix=prefix, dir=spool_dir(directory))
        self._fh = os.fdopen(fd, "wb", buffering=0)
        self._sha = FileHasher()
        self._size = 0  # bytes accepted
        self.on_file = 0  # bytes in the file (fewer than accepted while a kept part is being filled)
        self._write_behind = write_behind
        self._behind = 0  # written up to here when the write-back was last started
        self._pool: ThreadPoolExecutor | None = None
        self.spool: Spool | None = None
        part = self._sha.part_bytes
        # ``keep_bytes``: serialised into KeptParts' buffers, each written and hashed from there once full, and up to
        # this many bytes of them kept for the reader that verifies the stored file (a folder's read-back while
        # written). Not where one part would not fit in that (a small state, a digest part size set large) or the
        # digest has a single part (nothing to follow).
        self.kept = KeptParts(part, keep_bytes // part) if 0 < part <= min(keep_bytes, KEEP_BYTES) else None
        self._part: tuple[memoryview, bytearray] | None = None  # the kept part being filled: a view of its buffer
        self._fill = 0  # bytes of the current part so far (kept or not: a part begun with no _part is not kept)

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        if self.kept is not None:
            self._fill_parts(view)
        else:
            self._write_out(view)
        self._size += view.nbytes
        return view.nbytes

    def _write_out(self, view: memoryview) -> None:
        """Hash ``view`` and write it to the file (then start its write-back, ``write_behind``)."""
        if view.nbytes < HASH_BESIDE_BYTES:
            self._sha.update(view)
            write_all(self._fh, view)
        else:
            # The digest's parts hashed on other threads while this one writes (hashlib and the write both release
            # the GIL): the bytes are read twice at once instead of one pass after the other. Every piece is hashed
            # before this returns: the caller (torch.save) may reuse its buffer then.
            self._pool = self._pool or hash_pool()
            self._sha.update_beside(view, self._pool, lambda: write_all(self._fh, view))
        self.on_file += view.nbytes
        if self._write_behind and self.on_file - self._behind >= WRITE_BEHIND_BYTES:
            self._start_writeback()

    def _fill_parts(self, view: memoryview) -> None:
        """``keep_bytes``: copy ``view`` into the kept parts' buffers, each full one written out and handed to
        :attr:`kept`; a part :attr:`kept` has no room for is written as it comes."""
        assert self.kept is not None
        part = self.kept.part_bytes
        while view.nbytes:
            if self._fill == 0 and (buf := self.kept.begin()) is not None:  # a new part: kept, if there is room
                self._part = (memoryview(buf), buf)
            take = min(view.nbytes, part - self._fill)
            if self._part is not None:
                self._part[0][self._fill:self._fill + take] = view[:take]
            else:
                self._write_out(view[:take])
            self._fill += take
            view = view[take:]
            if self._fill == part:
                self._end_part()

    def _end_part(self) -> None:
        """The current part is complete (or the file ends): a kept one is written out and handed to :attr:`kept`."""
        assert self.kept is not None
        current, fill = self._part, self._fill
        self._part, self._fill = None, 0
        if current is None:  # not kept: already written
            return
        target, buf = current
        index = self.on_file // self.kept.part_bytes
        try:
            self._write_out(target[:fill])
        except BaseException:
            self.kept.written(index, buf, 0)
            raise
        self.kept.written(index, buf, fill)

    def _start_writeback(self) -> None:
        """Start the write-back to the device of what was written since the last call, without waiting for it
        (``trainproof.storage.writeback.start``: Linux; elsewhere the kernel's own write-back and the commit's fsync do
        it). The final ``fsync`` then finds little left to write. The pages stay cached, clean, until whoever
        verifies the file drops them: waiting here for a window to be on the device and dropping it slowed the
        serialisation beside a folder's read-back by a fifth (bench/RESULTS.md)."""
        writeback.start(self._fh.fileno(), self._behind, self.on_file - self._behind)
        self._behind = self.on_file

    def flush(self) -> None:
        pass  # unbuffered

    def finish(self) -> Spool:
        """Close the file and return what it holds."""
        if self.spool is None:
            if self._fill:
                self._end_part()
            self.close()
            self.spool = Spool(path=self.path, size=self._size, sha256=self._sha.hexdigest())
        return self.spool

    def _stop_pool(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def discard(self) -> None:
        self.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def close(self) -> None:
        """Close the file and stop the hashing threads, keeping the file (:meth:`discard` deletes it too). A part still
        being filled is not written (:meth:`finish` writes it)."""
        try:
            self._fh.close()
        finally:
            self._stop_pool()
            if self.kept is not None:
                if self._part is not None:
                    self.kept.written(0, self._part[1], 0)
                    self._part = None
                self.kept.writer_done()

    def __enter__(self) -> "SpoolWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.discard()


class SerialiseError(RuntimeError):
    """Raised by a :class:`LiveSpool`'s readers when its serialisation failed; ``__cause__`` is that failure (the
    caller re-raises :attr:`LiveSpool.error` itself, so the user sees what went wrong, not where it was read)."""


class LiveSpool(Spool):
    """A spool another thread is still writing: its ranges can be read as soon as they are written, so an upload
    runs beside the serialisation instead of after it (``S3Backend`` streams its parts; every other reader waits).

    ``size`` and ``sha256`` block until the writer is done and raise :class:`SerialiseError` when it failed; so do
    :meth:`open` and :meth:`result` (the finished :class:`Spool`, for whoever needs the whole file by its ``path``:
    ``path`` itself does not wait). :meth:`read_range` waits only for the bytes it asks for; :meth:`available` is
    the upload's clock. :meth:`unlink` stops a writer still running (its next write fails) and waits for it.
    ``expected``: the caller's estimate of the size (the tensors' bytes), for choosing a part size before the size
    is known."""

    expected: int
    _cond: threading.Condition
    _state: dict[str, Any]
    _writer: SpoolWriter
    _thread: threading.Thread | None

    def __init__(self, writer: SpoolWriter, expected: int) -> None:
        object.__setattr__(self, "path", writer.path)  # a frozen dataclass's field; the rest is this class's own
        object.__setattr__(self, "expected", expected)
        object.__setattr__(self, "_cond", threading.Condition())
        object.__setattr__(self, "_state", {"written": 0, "spool": None, "error": None, "cancelled": False})
        object.__setattr__(self, "_writer", writer)
        object.__setattr__(self, "_thread", None)

    @classmethod
    def serialise(cls, fill: Callable[[BinaryIO], None], directory: str | None = None, *,
                  expected: int = 0, write_behind: bool = False, keep_parts: bool = False) -> "LiveSpool":
        """Start ``fill(writer)`` (e.g. ``torch.save(state, writer)``) on a thread of its own, writing a new spool
        in ``directory`` (:func:`spool_dir`; ``write_behind``: :class:`SpoolWriter`'s); return the spool at once.
        ``keep_parts``: the writer keeps its parts for the reader that compares them with the stored file
        (:class:`KeptParts`), :data:`KEEP_BYTES` of them at most, an eighth of ``expected`` at most where that is
        known (a state under eight parts keeps none)."""
        budget = (min(KEEP_BYTES, expected // 8) if expected else KEEP_BYTES) if keep_parts else 0
        live = cls(SpoolWriter(directory, write_behind=write_behind, keep_bytes=budget), expected)
        thread = threading.Thread(target=live._run, args=(fill,), name="trainproof-serialise", daemon=True)
        object.__setattr__(live, "_thread", thread)
        thread.start()
        return live

    def _run(self, fill: Callable[[BinaryIO], None]) -> None:
        writer = self._writer
        state, cond = self._state, self._cond
        inner = writer.write

        def write(data) -> int:
            if state["cancelled"]:
                raise SerialiseError(f"the writing of {self.path} was stopped: its commit is over")
            n = inner(data)
            if writer.on_file != state["written"]:  # (a part a writer keeps reaches the file once it is whole)
                with cond:
                    state["written"] = writer.on_file
                    cond.notify_all()
            return n

        writer.write = write  # type: ignore[method-assign]
        spool: Spool | None = None
        error: BaseException | None = None
        try:
            fill(writer)  # type: ignore[arg-type]
            spool = writer.finish()
        except BaseException as exc:  # noqa: BLE001 - handed to every reader
            error = exc
            try:
                writer.close()
            except BaseException:  # noqa: BLE001,S110 - the writer's own failure is the one to report
                pass
        finally:  # whatever happens, readers are woken with an outcome: none of them waits forever
            with cond:
                if spool is None and error is None:
                    error = SerialiseError(f"the writer of {self.path} ended without a file")
                state["spool"], state["error"] = spool, error
                if spool is not None:
                    state["written"] = spool.size
                cond.notify_all()

    @property
    def done(self) -> bool:
        """Whether the writer has finished (or failed)."""
        return self._state["spool"] is not None or self._state["error"] is not None

    @property
    def error(self) -> BaseException | None:
        """The writer's failure, once it failed."""
        return self._state["error"]

    @property
    def kept(self) -> KeptParts | None:
        """The parts the writer keeps for a reader that compares them with the stored file (``keep_bytes``)."""
        return self._writer.kept

    def _raise(self) -> None:
        if self._state["error"] is not None:
            raise SerialiseError(f"serialising {self.path} failed: {self._state['error']!r}") from self._state["error"]

    def available(self, end: int) -> int:
        """Wait until the first ``end`` bytes are written, or the writer is done; return how many of them exist
        (less than ``end`` only at the end of a finished file). SerialiseError when the writer failed."""
        with self._cond:
            self._cond.wait_for(lambda: self._state["written"] >= end or self.done)
            self._raise()
            return min(end, self._state["written"])

    def result(self) -> Spool:
        """The finished spool (waits for the writer); SerialiseError when it failed."""
        with self._cond:
            self._cond.wait_for(lambda: self.done)
            self._raise()
            return self._state["spool"]

    @property  # type: ignore[override]
    def size(self) -> int:
        return self.result().size

    @property  # type: ignore[override]
    def sha256(self) -> str:
        return self.result().sha256

    def open(self) -> BinaryIO:
        return self.result().open()

    def read_range(self, start: int, end: int) -> bytes:
        self.available(end)
        return super().read_range(start, end)

    def join(self) -> BaseException | None:
        """Wait for the writer to end; its failure, if it failed."""
        if self._thread is not None:
            self._thread.join()
        return self.error

    def unlink(self) -> None:
        """Stop the writer if it still runs (its next write fails: the spool is not wanted any more), wait for it,
        delete the file."""
        self._state["cancelled"] = True
        if self.kept is not None:
            self.kept.stop()
        self.join()
        super().unlink()

    def __repr__(self) -> str:
        return f"LiveSpool({self.path!r}, written={self._state['written']}, done={self.done})"


def spans(size: int, part_size: int) -> list[tuple[int, int]]:
    """``[start, end)`` ranges covering ``size`` bytes in parts of ``part_size`` (at least one range)."""
    return [(off, min(off + part_size, size)) for off in range(0, size, part_size)] or [(0, 0)]


def in_order(fn: Callable[[T], R], items: Iterable[T], workers: int, name: str) -> Generator[tuple[T, R], None, None]:
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
    with ExitStack() as stack:
        reads = stack.enter_context(closing(in_order(lambda r: read_range(*r), ranges, concurrency,
                                                     "trainproof-range")))
        large = digest and sink is not None and size >= HASH_BESIDE_BYTES
        pool = stack.enter_context(hash_pool()) if large else None
        for (start, end), data in reads:
            beside = pool is not None and len(data) >= HASH_BESIDE_BYTES
            if digest and not beside:
                sha.update(data)
            if sink is not None and data:
                # A large part is hashed on the pool while this thread hands it on (a download's pwrite: both
                # release the GIL), and done before the next part.
                if pool is not None and beside:
                    sha.update_beside(data, pool, partial(sink, start, data))
                else:
                    sink(start, data)
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
    of several parts (``trainproof.storage.digest``) and the object has more than one. It then hashes on every
    fetching thread instead of one consumer: a single sha256 stream runs at ~1.3 GB/s, which caps a download (a
    100 GB state: 77 s) and, on a machine whose cores the S3 server shares, a commit's read-back.

    A ``sink`` (a download's spool) is still fed by one thread (:class:`_OneWriter`), in the order the parts arrive.
    Fetching threads that each wrote their own parts into the one spool file cost 3-8x the system time of a single
    writer on the test VM (1 GiB from Ceph RGW, fresh processes: 5-10 s against 3.2-3.8 s, for the same digest)."""
    digest_part = getattr(hasher, "part_bytes", 0)
    if digest_part and size > digest_part:
        return _parts_in_parallel(read_range, size, digest_part, part_size, concurrency, sink)
    return hashed_ranges(read_range, size, part_size=part_size, concurrency=concurrency, sink=sink, hasher=hasher)


WRITER_DEPTH = 1
"""Ranges queued for a download's one spool writer (:class:`_OneWriter`) beyond the one it is writing: a fetching
thread that finds the queue full waits, so a download holds at most ``part_size × (concurrency + WRITER_DEPTH + 1)``."""


class _Stopped(Exception):
    """Raised in a download's fetching threads once another part (or the writer) failed: they stop at their next
    range; the caller gets the first failure itself (:class:`_Failure`)."""


class _Failure:
    """The first failure of one download's threads, and the event that stops the others at their next range."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self._lock = threading.Lock()

    def set(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc
        self.stop.set()

    def check(self) -> None:
        if self.stop.is_set():
            raise _Stopped()


def _uninterrupted(*steps: Callable[[], object], on_interrupt: Callable[[], None] = lambda: None) -> None:
    """Each of ``steps`` run to its end, in order, even through a KeyboardInterrupt (``on_interrupt()`` called, and
    the interrupt raised once every step returned): a spool's writer must be over before the caller deletes the
    spool, or its descriptor's number, reused by the next file opened, takes the writer's bytes."""
    interrupted: BaseException | None = None
    for step in steps:
        while True:
            try:
                step()
                break
            except KeyboardInterrupt as exc:
                interrupted = interrupted or exc
                on_interrupt()
    if interrupted is not None:
        raise interrupted


class _OneWriter:
    """One thread handing a download's ranges to ``sink`` (pwrite into the spool), fed by the fetching threads through
    a queue of ``depth``. A failed write is the download's failure (``failure``): the writer then only drains, and a
    fetching thread's :meth:`put` raises :class:`_Stopped` once the download is stopped, never waiting on a writer that
    will not take its range. :meth:`close` waits for the writer, through a KeyboardInterrupt too."""

    def __init__(self, sink: Callable[[int, bytes], None], failure: _Failure, depth: int = WRITER_DEPTH) -> None:
        self._sink, self._failure = sink, failure
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self._thread = threading.Thread(target=self._run, name="trainproof-spool-write", daemon=True)
        self._thread.start()

    def put(self, offset: int, data: bytes) -> None:
        while True:
            self._failure.check()
            try:
                self._queue.put((offset, data), timeout=0.05)
                return
            except queue.Full:
                continue

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if not self._failure.stop.is_set():  # once the download failed, only drained
                try:
                    self._sink(*item)
                except BaseException as exc:  # noqa: BLE001 - the download's failure, raised by its caller
                    self._failure.set(exc)
            del item

    def close(self) -> None:
        """Write what is queued (nothing more once the download failed), end the thread and wait for it."""
        _uninterrupted(lambda: self._queue.put(None), self._thread.join,
                       on_interrupt=self._failure.stop.set)  # interrupted: what is queued is drained, not written


def _parts_in_parallel(read_range: Callable[[int, int], bytes], size: int, digest_part: int, part_size: int,
                       concurrency: int, sink: Callable[[int, bytes], None] | None) -> tuple[int, str]:
    """:func:`hashed_parts`' path for a digest of several parts (``trainproof.storage.digest``): each digest part is one
    task for a fetching thread, which reads it as consecutive ranges of ``part_size`` and hashes them; only the
    parts' digests come back in order. A ``sink`` gets every range from one writer thread (:class:`_OneWriter`).
    Memory stays ``part_size`` per fetching thread (and the writer's queue). Same answer as :func:`hashed_ranges`:
    (bytes seen, the root of the parts' digests), the last range asking for one byte past ``size`` (an object
    longer than claimed shows as ``size + 1``), a short object stopping at its end.

    The first failure (a read, a write, a cancelled fetch) stops every other thread at its next range and is what
    the caller gets; nothing runs or writes once this returns or raises."""
    from trainproof.storage.digest import of_parts

    failure = _Failure()
    writer = _OneWriter(sink, failure) if sink is not None else None
    fetch = partial(_fetch_part, read_range, size, part_size, failure, writer)
    parts, seen, done = [], 0, False
    try:
        with closing(in_order(fetch, spans(size, digest_part), concurrency, "trainproof-part")) as fetched:
            for _, (got, digest, short) in fetched:
                parts.append(digest)
                seen += got
                if short:  # the object ended inside this part: the parts after it would read nothing
                    break
        done = True
    except _Stopped:  # this part was stopped by a later part's failure (or the writer's): raise that one
        assert failure.error is not None
        raise failure.error from None
    finally:
        if not done:
            failure.stop.set()  # threads an interrupt left running stop at their next range
        if writer is not None:
            writer.close()
    if failure.error is not None:  # the writer's, on the last ranges: every fetch had ended well
        raise failure.error
    return seen, of_parts(parts, digest_part)


def _fetch_part(read_range: Callable[[int, int], bytes], size: int, part_size: int, failure: _Failure,
                writer: _OneWriter | None, unit: tuple[int, int]) -> tuple[int, str, bool]:
    """One fetching thread's task in :func:`_parts_in_parallel`: digest part ``unit`` (``[first, stop)``) read as
    ranges of ``part_size`` and hashed, each range handed to ``writer``; (bytes seen, its sha256, whether the object
    ended in it). Stops at the next range once the download failed; its own failure is the download's."""
    from hashlib import sha256

    first, stop = unit
    sha, seen = sha256(), 0
    try:
        for start, end in spans(stop - first, part_size):
            start, end = first + start, first + end
            failure.check()
            data = read_range(start, end + (end == size))
            sha.update(data)  # the probe byte too, if there is one: as hashed_ranges does
            if writer is not None and data:
                writer.put(start, data)
            seen += len(data)
            if len(data) < end - start:
                return seen, sha.hexdigest(), True
            del data
    except _Stopped:
        raise
    except BaseException as exc:
        failure.set(exc)
        raise
    return seen, sha.hexdigest(), False


def download(read_range: Callable[[int, int], bytes], size: int, directory: str | None = None, *,
             part_size: int = PART_SIZE, concurrency: int = CONCURRENCY,
             hasher: FileHasher | None = None) -> tuple[Spool, int, str]:
    """Fetch an object of ``size`` bytes into a new spool with :func:`hashed_parts` (ranges fetched in parallel, each
    digest part hashed by its fetching thread, one thread writing); return the spool and the
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
    writer.close()
    spool = Spool(path=writer.path, size=min(seen, size), sha256=sha)
    writer.spool = spool
    return spool, seen, sha
