"""The few primitives a store needs from a filesystem, over ``str`` paths (a ``Path`` would collapse ``s3://``).

Three implementations: ``LocalBackend`` (a folder, with fsync and exclusive-create by hard link),
``FsspecBackend`` (``memory://`` and any other fsspec filesystem) and ``S3Backend`` (``trainproof/storage/s3.py``).
Every method is one whole operation, safe to retry, and safe to call from a background thread: a backend
holds no buffers between calls.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import io
import os
import shutil
import stat
import threading
import uuid
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Protocol, Union, runtime_checkable

from trainproof.storage import writeback
from trainproof.storage.digest import FileHasher, digest_bytes
from trainproof.storage.pieces import Pieces, as_pieces
from trainproof.storage.spool import KeptParts, LiveSpool, Spool, same_bytes

CHUNK = 8 * 2**20
Source = Union[bytes, bytearray, memoryview, Pieces, BinaryIO, Spool]
"""What a write takes: bytes, buffers written back to back (:class:`trainproof.storage.pieces.Pieces`, never joined), a
stream read once, or a :class:`trainproof.storage.spool.Spool` (a local file re-opened by every attempt, never read
whole into memory)."""
IN_MEMORY = (bytes, bytearray, memoryview, Pieces)
"""The sources already in memory: written without a copy, hashed beside the write."""


@dataclass(frozen=True)
class Entry:
    """One listing entry."""

    name: str
    size: int
    is_dir: bool
    mtime: float | None = None
    is_special: bool = False
    """A symlink, FIFO, socket or device (local folders only): never read, followed, or deleted through."""


class Backend(Protocol):
    """What the store needs.  Errors are builtins: FileNotFoundError, FileExistsError, PermissionError."""

    def write(self, path: str, data: Source, *, create_only: bool = False) -> tuple[int, str]:
        """Store ``data`` whole at ``path`` and return (size, sha256) computed while writing.
        Never leaves a partial object behind on failure.  ``create_only`` raises FileExistsError if
        ``path`` exists, atomically (no check-then-write window)."""

    def read(self, path: str) -> bytes:
        """The object's bytes, read from the store itself (no cache)."""

    def iter_read(self, path: str) -> Iterator[bytes]:
        """The object's bytes in chunks, from the store; closing the iterator early stops the download, so a
        caller can hash or cap an object without holding all of it."""

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of the object (fewer when it ends sooner; ``start`` is below its size), from the
        store: one ranged GET on S3, so several can run in parallel threads."""

    def listdir(self, path: str, *, prefix: str = "", limit: int | None = None) -> list[Entry]:
        """Direct children of ``path`` whose name starts with ``prefix`` (fresh listing, never a cache);
        [] when it does not exist.  With ``limit``, at most ``limit + 1`` entries (one more, so the caller
        can tell the listing was cut), without listing the rest."""

    def delete(self, path: str) -> None:
        """Delete one object; a missing one is fine (idempotent)."""

    def delete_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it; missing is fine; never through a symlink."""

    def delete_folder(self, path: str, *, first: str) -> None:
        """Delete folder ``path``, its object ``first`` before anything else (so an interrupted delete leaves
        the folder without it), never following a symlink at ``path``; missing is fine."""

    def copy(self, src: str, dst: str) -> None:
        """Copy one object (server-side where the backend can)."""

    def exists(self, path: str) -> bool:
        """Whether an object exists (asked of the store, not a cache)."""


# -- optional capabilities: a backend has them or not; the store asks with isinstance, never getattr ---------------
@runtime_checkable
class ParallelRanges(Protocol):
    """A backend whose ranged reads are worth running many at once (S3: one GET each, latency-bound). A local disk
    reads a download's chunks one at a time (one thread reads and hashes, another writes the spool); its pure
    read-backs (a commit's verification) run in parallel too (``Ctx.hashed``)."""

    parallel_ranges: bool


@runtime_checkable
class UploadsWhileWritten(Protocol):
    """A backend whose ``write`` of a :class:`trainproof.storage.spool.LiveSpool` uploads its parts as they are
    written (S3's multipart upload), so a writer gains by handing it over before the serialisation ends. Other
    backends wait for the finished spool (a folder links it)."""

    uploads_while_written: bool


@runtime_checkable
class VerifiesWhileWritten(Protocol):
    """A backend that reads a :class:`trainproof.storage.spool.LiveSpool` back from its device while it is written
    (a folder, whose spool becomes the stored file): each part is sent to the device, dropped from the page cache and
    read back as soon as the serialising thread has written it, so the commit's verification runs beside the
    serialisation instead of after it."""

    def write_verified(self, path: str, data: LiveSpool, *, create_only: bool = False,
                       concurrency: int = 8) -> tuple[int, str] | None:
        """Publish ``data`` under ``path`` and return (bytes, digest) of what was read back from the device: the bytes
        now stored there. None when it cannot (the spool is not where it can be linked from): nothing was published,
        and the caller writes and verifies it the ordinary way."""


@runtime_checkable
class StreamsListing(Protocol):
    """A backend that hands a folder's children over as they are listed (a local folder's scandir, S3's pages), so a
    caller can drop the ones it does not want at once: memory is what it keeps, not the listing."""

    def iterdir(self, path: str, *, prefix: str = "") -> Iterator[Entry]:
        """Direct children of ``path`` whose name starts with ``prefix``, as listed (fresh); none when missing."""


def iter_listing(backend: Backend, path: str, *, prefix: str = "") -> Iterator[Entry]:
    """``path``'s children streamed where the backend can, else from one ``listdir``."""
    if isinstance(backend, StreamsListing):
        return backend.iterdir(path, prefix=prefix)
    return iter(backend.listdir(path, prefix=prefix))


@runtime_checkable
class ListsTrees(Protocol):
    """A backend that lists every object below a folder in one paged listing (S3 without a delimiter: 1000 keys a
    request), so a scan of many small folders costs a page per thousand objects instead of a request per folder."""

    def itertree(self, path: str, *, prefix: str = "", cap: int | None = None) -> Iterator[tuple[str, Entry]]:
        """``(folder, child)`` for each object below the folders of ``path`` whose names start with ``prefix``:
        ``folder`` is the first part of its key below ``path``, ``child`` its entry directly in that folder (a key
        deeper than that shows as a folder entry, once per key). Objects directly in ``path`` are not yielded. With
        ``cap``, a folder yields at most ``cap + 1`` children (one more, so the caller can tell it was cut) and the
        rest of it is not listed."""


@runtime_checkable
class ReadsIntoBuffers(Protocol):
    """A backend that can read a range into a caller's buffer (no allocation per part: a local file's pread)."""

    def read_range_into(self, path: str, start: int, buf: memoryview) -> int:
        """Read bytes ``start:start+len(buf)`` of the object into ``buf``; the count read (fewer at its end)."""


@runtime_checkable
class RenamesFolders(Protocol):
    """A backend that moves a folder in one step (a local rename); others copy every object, then delete."""

    def rename_dir(self, src: str, dst: str) -> None:
        """Move folder ``src`` to ``dst`` (which must not exist). Any entry moves the same way, itself: a file, a
        FIFO, a symlink (the link, never what it points to)."""


def reads_in_parallel(backend: object) -> bool:
    """Whether ranged reads of ``backend`` should run in parallel (:class:`ParallelRanges`)."""
    return isinstance(backend, ParallelRanges) and bool(backend.parallel_ranges)


def iter_chunks(data: Source) -> Iterator[memoryview | bytes]:
    """Chunks of ``data`` without copying bytes-like input (a spool is opened and read chunk by chunk)."""
    if isinstance(data, Spool):
        with data.open() as fh:
            yield from iter_chunks(fh)
        return
    if isinstance(data, IN_MEMORY):
        yield from as_pieces(data).chunks(CHUNK)
        return
    while True:
        block = data.read(CHUNK)
        if not block:
            return
        yield block


def digest(data: bytes | memoryview) -> tuple[int, str]:
    """(size, digest) of bytes already in memory (``trainproof.storage.digest``: the plain sha256 up to one part)."""
    return len(data), digest_bytes(data)


def read_at_most(backend: "Backend", path: str, max_bytes: int) -> bytes:
    """The object's bytes, but never more than ``max_bytes + 1`` of them (one more than allowed, so the caller
    sees it is too big) — a hostile object cannot make the reader hold more than the cap."""
    return read_hashed(backend, path, max_bytes)[0]


def read_hashed(backend: "Backend", path: str, max_bytes: int, hasher: FileHasher | None = None) -> tuple[bytes, str]:
    """``read_at_most`` and the digest of what it returns (``hasher``'s: by default a new file's, see
    ``trainproof.storage.digest``), hashed chunk by chunk as the bytes arrive (one pass)."""
    out, sha, chunks = io.BytesIO(), hasher or FileHasher(), backend.iter_read(path)
    try:
        for chunk in chunks:
            chunk = memoryview(chunk)[: max_bytes + 1 - out.tell()]
            sha.update(chunk)
            out.write(chunk)
            if out.tell() > max_bytes:
                break
    finally:
        chunks.close()
    return out.getvalue(), sha.hexdigest()  # BytesIO hands over its buffer without a copy


def hash_object(backend: "Backend", path: str, max_bytes: int, hasher: FileHasher | None = None) -> tuple[int, str]:
    """(size, digest) of the object (``hasher``'s), streamed chunk by chunk; stops after ``max_bytes + 1`` bytes,
    so a size above ``max_bytes`` means "too big" and its digest is of that prefix only."""
    sha, size, chunks = hasher or FileHasher(), 0, backend.iter_read(path)
    try:
        for chunk in chunks:
            chunk = memoryview(chunk)[: max_bytes + 1 - size]
            sha.update(chunk)
            size += len(chunk)
            if size > max_bytes:
                break
    finally:
        chunks.close()
    return size, sha.hexdigest()


def join(*parts: str) -> str:
    """Join path parts with '/', whatever the OS (fsspec paths are always '/')."""
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)


class LocalBackend:
    """A local folder.  Writes go to a hidden temp file in the same folder, are fsynced, then published by
    ``os.replace`` (overwrite) or ``os.link`` (create-only: fails atomically if the name exists), so a
    reader never sees a half-written file under its final name and a crash leaves only a ``.tmp-`` file.
    Once fsynced, a file of :data:`DROP_CACHED_BYTES` or more (a state) has its pages dropped from the page
    cache, so the read-back that verifies it reads the device (:func:`_drop_cached`); markers, manifests and records
    stay cached."""

    def write(self, path: str, data: Source, *, create_only: bool = False) -> tuple[int, str]:
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        if isinstance(data, LiveSpool):  # still being written: a folder takes the whole file, once it is there
            data = data.result()
        if isinstance(data, Spool) and (linked := _link_spool(data, path, create_only)) is not None:
            return linked
        tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
        sha, size, known = FileHasher(), 0, None
        try:
            with open(tmp, "xb") as fh:
                if isinstance(data, Spool):
                    # A kernel copy (sendfile), no hashing: the spool's sha256 was computed as it was written, and
                    # the caller's read-back compares the stored bytes with it, so a changed spool is still caught.
                    with data.open() as src:
                        if hasattr(os, "sendfile"):
                            _sendfile(src, fh)
                        else:
                            shutil.copyfileobj(src, fh, CHUNK)
                    size = os.fstat(fh.fileno()).st_size
                    known = data.sha256 if size == data.size else "spool-changed-while-copying"
                elif isinstance(data, IN_MEMORY) and len(pieces := as_pieces(data)) >= OVERLAP_BYTES:
                    # In memory: hash in a second thread while this one writes and fsyncs (both release the GIL).
                    hasher = _Hasher(pieces)
                    for view in pieces.views:
                        fh.write(view)
                    fh.flush()
                    os.fsync(fh.fileno())
                    size, known = pieces.nbytes, hasher.result()
                else:
                    for chunk in iter_chunks(data):
                        sha.update(chunk)
                        fh.write(chunk)
                        size += len(chunk)
                fh.flush()
                os.fsync(fh.fileno())
                _drop_cached(fh.fileno(), size)
            if create_only:
                os.link(tmp, path)  # FileExistsError if another writer got there first
            else:
                os.replace(tmp, path)
            _fsync_dir(folder)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return size, known or sha.hexdigest()

    def write_verified(self, path: str, data: LiveSpool, *, create_only: bool = False,
                       concurrency: int = 8) -> tuple[int, str] | None:
        """:class:`VerifiesWhileWritten`: read ``data`` back from the device as it is written (:func:`_read_back`),
        then fsync it (little is left to write: the read-back sent every part to the device) and link it in as
        :func:`_link_spool` does. None, having published nothing, when the spool cannot be linked (another file
        system, no hard links), pages cannot be dropped (no ``posix_fadvise``: the read-back would read the cache) or
        its digest is of one part (nothing to verify part by part)."""
        folder = os.path.dirname(path)
        os.makedirs(folder, exist_ok=True)
        hasher = FileHasher()
        if not hasher.part_bytes or not writeback.can_drop() or (opened := _open_linkable(data.path, folder)) is None:
            if data.kept is not None:
                data.kept.stop()  # no reader: the writer keeps nothing more
            return None
        fd, st = opened
        try:
            read_back = _read_back(fd, data, hasher.part_bytes, concurrency)
            spool = data.result()
            if read_back != (spool.size, spool.sha256):
                return read_back  # nothing published: the caller refuses what the device holds
            if _link_spool(spool, path, create_only, dropped=True) is None:
                return None
            if not os.path.samestat(os.stat(path, follow_symlinks=False), st):
                return -1, ""  # what is published under the name is not the file read back: the caller refuses it
            return read_back
        finally:
            os.close(fd)

    def read(self, path: str) -> bytes:
        with _open_regular(path) as fh:
            return fh.read()

    def iter_read(self, path: str) -> Iterator[bytes]:
        with _open_regular(path) as fh:
            while block := fh.read(CHUNK):
                yield block

    def read_range(self, path: str, start: int, end: int) -> bytes:
        with _open_regular(path) as fh:
            return os.pread(fh.fileno(), max(0, end - start), start)

    def read_range_into(self, path: str, start: int, buf: memoryview) -> int:
        """``read_range`` into a caller's buffer (reused across parts: no fresh pages to fault in per part);
        the count of bytes read, fewer when the file ends sooner."""
        filled = 0
        with _open_regular(path) as fh:
            while filled < buf.nbytes:
                n = os.preadv(fh.fileno(), [buf[filled:]], start + filled)
                if n == 0:
                    break
                filled += n
        return filled

    def listdir(self, path: str, *, prefix: str = "", limit: int | None = None) -> list[Entry]:
        entries = []
        for entry in self.iterdir(path, prefix=prefix):
            entries.append(entry)
            if limit is not None and len(entries) > limit:
                break
        return entries

    def iterdir(self, path: str, *, prefix: str = "") -> Iterator[Entry]:
        try:
            with os.scandir(path) as it:
                for e in it:
                    if not e.name.startswith(prefix):
                        continue
                    try:  # lstat: a symlink is reported as what it is, never as what it points to
                        st = e.stat(follow_symlinks=False)
                    except FileNotFoundError:  # deleted since the directory was read
                        continue
                    is_dir = stat.S_ISDIR(st.st_mode)
                    special = not is_dir and not stat.S_ISREG(st.st_mode)
                    yield Entry(e.name, st.st_size, is_dir, st.st_mtime, special)
        except (FileNotFoundError, NotADirectoryError):
            return

    def delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        if os.path.islink(path):  # rmtree refuses one too; say why in our words
            raise OSError(errno.ELOOP, "refusing to delete through a symlink", path)
        # shutil.rmtree uses the fd-based walk on Linux: a folder swapped for a symlink mid-walk is not followed.
        shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)

    def delete_folder(self, path: str, *, first: str) -> None:
        try:
            # O_NOFOLLOW on the folder itself: unlinking through a symlinked step folder would delete a file
            # outside the run.  The marker is then removed relative to that very folder (no second lookup).
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except FileNotFoundError:
            return
        except NotADirectoryError:
            raise OSError(errno.ELOOP, "refusing to delete through a symlink or a non-folder", path) from None
        try:
            try:
                os.unlink(first, dir_fd=fd)
            except FileNotFoundError:
                pass
            os.fsync(fd)
        finally:
            os.close(fd)
        self.delete_tree(path)

    def copy(self, src: str, dst: str) -> None:
        with open(src, "rb") as fh:
            self.write(dst, fh)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomic move of a whole folder, or of any other entry itself (used by quarantine)."""
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.rename(src, dst)
        _fsync_dir(os.path.dirname(dst))


OVERLAP_BYTES = 1 << 20
"""In-memory writes at least this big are hashed in a second thread while they are written."""


class _Hasher(threading.Thread):
    """The digest of a buffer (``trainproof.storage.digest``: its parts on several threads), computed beside the
    caller's write (hashlib releases the GIL for large updates)."""

    def __init__(self, pieces: Pieces) -> None:
        super().__init__(name="trainproof-hash", daemon=True)
        self._pieces, self._digest, self._error = pieces, "", None
        self.start()

    def run(self) -> None:
        try:
            self._digest = digest_bytes(self._pieces)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller in result()
            self._error = exc

    def result(self) -> str:
        self.join()
        if self._error is not None:
            raise self._error
        return self._digest


def _read_back(fd: int, live: LiveSpool, part_bytes: int, concurrency: int) -> tuple[int, str]:
    """(bytes, digest) of the spool open as ``fd``, read back from the device while ``live``'s writer writes it: each
    digest part, once written, is written to the device and waited for, dropped from the page cache
    (``trainproof.storage.writeback``) and read again with ``pread``, on ``concurrency`` threads, parts in order. The
    pages read back stay cached, for the content check that reads the spool next. Best effort as the drop is: a file
    system that keeps a file's pages (tmpfs) is read from them.

    A part the writer kept in memory (``live.kept``, :class:`trainproof.storage.spool.KeptParts`) is compared with
    what was read, byte for byte; equal, its digest is the one the writer computed of those very bytes. Any other
    part, and a kept one that differs, is hashed as read."""
    from trainproof.storage.digest import of_parts
    from trainproof.storage.spool import in_order

    kept = live.kept if live.kept is not None and live.kept.part_bytes == part_bytes else None
    if live.kept is not None and kept is None:
        live.kept.stop()  # parts of another size than the read-back's: none is compared, none is to be held
    check = functools.partial(_check_part, fd, kept, part_bytes, threading.local())
    seen, parts = 0, []
    try:
        with contextlib.closing(in_order(check, _written_parts(live, part_bytes), concurrency,
                                         "trainproof-readback")) as results:
            for (start, end), (n, hexdigest) in results:
                seen += n
                parts.append(hexdigest)
                if n < end - start:  # shorter on the device than written: the caller refuses the size
                    break
    finally:
        if kept is not None:
            kept.stop()
    return seen, of_parts(_writers_where_equal(parts, live) or [hashlib.sha256().hexdigest()], part_bytes)


def _written_parts(live: LiveSpool, part_bytes: int) -> Iterator[tuple[int, int]]:
    """The ``[start, end)`` of each digest part of ``live``, as soon as its writer has written it."""
    start = 0
    while (end := live.available(start + part_bytes)) > start:
        yield start, end
        start = end


def _check_part(fd: int, kept: KeptParts | None, part_bytes: int, buffers: threading.local,
                span: tuple[int, int]) -> tuple[int, str | None]:
    """One part of :func:`_read_back`: on the device and dropped from the cache, then read; (bytes read, None) when
    they equal the part the writer kept, else (bytes read, their sha256)."""
    start, end = span
    writeback.wait(fd, start, end - start)  # on the device, clean: then dropped, so what follows reads the device
    writeback.drop(fd, start, end - start)
    mine = kept.take(start // part_bytes) if kept is not None else None
    if mine is not None:
        try:
            seen, digest = _read_part(fd, start, end, buffers, memoryview(mine[0])[:mine[1]])
        finally:
            kept.release(mine[0])  # type: ignore[union-attr]
        if digest is None and seen == mine[1] == end - start:
            return seen, None
    return _read_part(fd, start, end, buffers, None)  # not kept, or not as kept: what the device holds, hashed


READ_BACK_BYTES = 2 * 2**20
"""Bytes per ``pread`` of a folder's read-back while written: each of its threads holds one buffer of this size (2 MiB
reads were as fast as 8 MiB ones on the test VM's disk, for a quarter of the memory)."""


def _read_part(fd: int, start: int, end: int, buffers: threading.local,
               compare: memoryview | None) -> tuple[int, str | None]:
    """Read ``start:end`` of ``fd`` into this thread's buffer (``buffers.buf``, reused: no fresh pages to fault in per
    range); (bytes read, their sha256), or with ``compare`` (the kept bytes) None for the digest when every byte read
    equals it, "" at the first range that does not."""
    from trainproof.storage.spool import spans

    buf = getattr(buffers, "buf", None)
    if buf is None:
        buf = buffers.buf = memoryview(bytearray(READ_BACK_BYTES))
    sha, seen = hashlib.sha256(), 0
    for a, b in spans(end - start, READ_BACK_BYTES):
        n = 0
        while n < b - a and (got := os.preadv(fd, [buf[n:b - a]], start + a + n)):
            n += got
        if compare is None:
            sha.update(buf[:n])
        elif not same_bytes(buf[:n], compare[a:a + n]):
            return seen + n, ""
        seen += n
        if n < b - a:  # the end of the file
            break
    return seen, None if compare is not None else sha.hexdigest()


def _writers_where_equal(parts: list[str | None], live: LiveSpool) -> list[str]:
    """The read-back's part digests, with the writer's own for the parts that compared equal (None)."""
    if None not in parts:
        return [p or "" for p in parts]
    written = live.result().sha256
    writers = list(getattr(written, "parts", ())) or [str(written)]
    return [p if p is not None else writers[i] if i < len(writers) else "" for i, p in enumerate(parts)]


def _open_linkable(path: str, folder: str) -> tuple[int, os.stat_result] | None:
    """``path`` opened read-only, a link not followed, with its stat: when it is a regular file on ``folder``'s file
    system (one that can be hard-linked into it); None otherwise, nothing left open."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if stat.S_ISREG(st.st_mode) and st.st_dev == os.stat(folder).st_dev:
            return fd, st
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    return None


def _link_spool(spool: Spool, path: str, create_only: bool, *, dropped: bool = False) -> tuple[int, str] | None:
    """Publish a spool that lies on the destination's file system under ``path`` without copying it: fsync its bytes
    once, hard-link it in (create-only: fails atomically if the name exists; else through a temp name and
    ``os.replace``), fsync the folder. None when it cannot be linked (another file system, a file system without hard
    links, a spool that is not a regular file of its own size): the caller copies it instead."""
    folder, name = os.path.split(path)
    if (opened := _open_linkable(spool.path, folder)) is None:
        return None
    fd, st = opened
    try:
        if st.st_size != spool.size:
            return None
        os.fchmod(fd, 0o666 & ~_umask())  # a spool is private (mkstemp: 0600); a stored file is as any other
        os.fsync(fd)
        if not dropped:  # (``dropped``: already read back from the device; its pages are for the content check)
            _drop_cached(fd, st.st_size)
    finally:
        os.close(fd)
    target = path if create_only else os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        os.link(spool.path, target, follow_symlinks=False)  # FileExistsError if another writer got there first
    except FileExistsError:
        raise
    except OSError as exc:
        if exc.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
            return None
        raise
    if not create_only:
        try:
            os.replace(target, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(target)
            raise
    _fsync_dir(folder)
    return spool.size, spool.sha256


def _umask() -> int:
    """The process's umask, read without changing it (Linux: /proc/self/status; elsewhere the usual 022)."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o022


def _sendfile(src, dst) -> None:
    """Copy the whole of ``src`` into ``dst`` inside the kernel (no bytes through Python)."""
    offset, size = 0, os.fstat(src.fileno()).st_size
    while offset < size:
        sent = os.sendfile(dst.fileno(), src.fileno(), offset, min(size - offset, 2**30))
        if sent == 0:
            break
        offset += sent


DROP_CACHED_BYTES = 2**20
"""Files from this size on (states, not markers or manifests) leave the page cache once fsynced."""


def _drop_cached(fd: int, size: int) -> None:
    """Ask the kernel to drop the file's cached pages, clean after its fsync: the read-back that verifies a commit
    then reads what the device holds, not the pages this process just wrote into memory (a write the disk lost or
    changed is caught, not masked by the cache). Best effort: a file system without a separate cache (tmpfs) or a
    platform without ``posix_fadvise`` keeps them, and the read-back reads the cache as before. Small files (under
    :data:`DROP_CACHED_BYTES`: markers, manifests, records) stay cached: every scan reads them again."""
    if size >= DROP_CACHED_BYTES and hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _fsync_dir(folder: str) -> None:
    # The new name must survive a power cut, not only the bytes.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _open_regular(path: str):
    """Open a regular file for reading without following a symlink and without blocking on a FIFO: in a
    shared folder, ``training_state.pt`` may have been replaced by a link to another file or by a pipe."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file", path)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def _ignore_missing(func, path, exc_info) -> None:
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


class FsspecBackend:
    """Any fsspec filesystem (used for ``memory://``).  Create-only is check-then-write under a lock, which
    is exact for in-process filesystems only; remote ones need a backend with a real conditional write."""

    # One lock for every in-process memory filesystem: fsspec's MemoryFileSystem keeps a class-level store.
    _create_lock = threading.Lock()

    def __init__(self, fs) -> None:
        self.fs = fs

    def write(self, path: str, data: Source, *, create_only: bool = False) -> tuple[int, str]:
        if isinstance(data, Spool):
            with data.open() as fh:
                data = fh.read()  # in-process filesystems (memory://) hold the bytes anyway
        if isinstance(data, Pieces):
            data = data.tobytes()
        payload = data if isinstance(data, (bytes, bytearray, memoryview)) else data.read()
        payload = bytes(payload)
        size, sha = digest(payload)
        if create_only:
            with self._create_lock:
                if self.fs.exists(path):
                    raise FileExistsError(path)
                self.fs.pipe_file(path, payload)
        else:
            self.fs.pipe_file(path, payload)
        return size, sha

    def read(self, path: str) -> bytes:
        return self.fs.cat_file(path)

    def iter_read(self, path: str) -> Iterator[bytes]:
        with self.fs.open(path, "rb") as fh:
            while block := fh.read(CHUNK):
                yield block

    def read_range(self, path: str, start: int, end: int) -> bytes:
        return self.fs.cat_file(path, start=start, end=end)

    def listdir(self, path: str, *, prefix: str = "", limit: int | None = None) -> list[Entry]:
        # In-process filesystems only (memory://): listing everything costs no requests, so just filter.
        try:
            items = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for item in items:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            if item["name"].rstrip("/") == path.rstrip("/") or not name.startswith(prefix):
                continue
            mtime = item.get("created") or item.get("mtime") or item.get("LastModified")
            out.append(Entry(name, int(item.get("size") or 0), item["type"] == "directory", _timestamp(mtime)))
            if limit is not None and len(out) > limit:
                break
        return out

    def delete(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass

    def delete_folder(self, path: str, *, first: str) -> None:
        # Object stores have no symlinks; deleting ``first`` alone first is what makes an interruption safe.
        self.delete(join(path, first))
        self.delete_tree(path)

    def copy(self, src: str, dst: str) -> None:
        self.fs.copy(src, dst)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)


def _timestamp(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)):
        return float(value)
    if hasattr(value, "timestamp"):
        return value.timestamp()
    return None

