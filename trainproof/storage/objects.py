"""Objects read by byte range, every part verified against its listed sha256 before a byte of it is used, through a
size-bounded local cache shared by the processes of a machine.

The generation store reads a generation whole, once, at a resume. Some readers need something else: a few byte
ranges at a time, at random places in many large objects, in several processes at once, for as long as training
lasts (trainproof.data's bucket datasets). This module is that reader; it knows nothing of what the bytes mean.

- An object is described by an :class:`ObjectEntry`: its name under the store's root, its size, and the sha256 of
  each of its parts, which hash to its ``sha256`` (the hash list of ``trainproof.storage.digest``: the root names the
  whole content, a part can be checked on its own). :func:`parse_entry` checks an entry read from an untrusted manifest.
- :meth:`ObjectReader.read` fetches the parts holding the wanted ranges that are not cached yet, each as one ranged
  read through the store (so S3 GETs, in parallel, each retried by the store's one retry layer), hashes each, and
  refuses a part whose digest is not the listed one (after one re-read: the first may have hit a transient fault)
  with :class:`CorruptObjectError` naming the object and the part. A missing object is the same error ("missing").
- :class:`PartCache` keeps verified parts as files in a local folder, named by their sha256 and published by an
  atomic rename (another process never sees half a part), at most ``max_bytes`` in all: when a process's count
  passes the bound it re-lists the folder and removes the least recently used parts. A cached part is verified
  again before this process first uses it (and again whenever the file at its name is another file: another inode),
  so a part changed on the local disk is fetched again, never used; the folder's owner and mode are checked too
  (trainproof.data.reader), as defence in depth. Eviction only touches what looks like the cache's own files.

Memory of a read: at most ``concurrency`` parts being fetched and one being cut into the ranges wanted, plus the
ranges returned.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import tempfile
import threading
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from contextlib import closing
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Callable, Iterator, TypeVar

from trainproof.storage import digest as dg
from trainproof.storage.errors import StoreError
from trainproof.storage.limits import plain_name_problem
from trainproof.storage.manifest import SHA256_HEX

if TYPE_CHECKING:
    from trainproof.storage.store import GenerationStore

log = logging.getLogger("trainproof.storage")
T = TypeVar("T")
R = TypeVar("R")
_CACHE_SUB = re.compile(r"^[0-9a-f]{2}\Z")
MIN_OBJECT_PART = 4096
MAX_OBJECT_PART = 256 * dg.MiB


class CorruptObjectError(StoreError):
    """An object's stored bytes disagree with its entry (missing, shorter or longer, a part's sha256)."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name, self.reason = name, reason


@dataclass(frozen=True)
class ObjectEntry:
    """An object under the store's root and the digests that vouch for it (``trainproof.storage.digest``'s hash
    list)."""

    name: str
    size: int
    sha256: str
    """The root: sha256 of the parts' binary digests in order (the plain sha256 when there is one part)."""
    part_bytes: int
    parts: tuple[str, ...]

    def span(self, i: int) -> tuple[int, int]:
        """Bytes ``[start, end)`` of part ``i``."""
        start = i * self.part_bytes
        return start, min(start + self.part_bytes, self.size)

    def meta(self) -> dict:
        """The entry as a manifest stores it (the fields :func:`parse_entry` reads back)."""
        out = {"name": self.name, "bytes": self.size, "sha256": self.sha256, "part_bytes": self.part_bytes}
        return {**out, "parts": list(self.parts)} if len(self.parts) > 1 else out


def parse_entry(meta: object, *, max_bytes: int) -> ObjectEntry:
    """An :class:`ObjectEntry` from a manifest's dict (``name``, ``bytes``, ``sha256``, ``part_bytes`` and, for more
    than one part, ``parts``); ValueError naming what is wrong. Nothing is trusted: the name must be a plain name,
    the size at most ``max_bytes``, the part count what the size needs, and the parts must hash to the root."""
    if not isinstance(meta, dict):
        raise ValueError("an object entry is not a JSON object")
    name = meta.get("name")
    problem = plain_name_problem(name)
    if problem:
        raise ValueError(f"an object entry has an invalid name: {problem}")
    size, part, sha = meta.get("bytes"), meta.get("part_bytes"), meta.get("sha256")
    if not _is_int(size) or not 0 <= size <= max_bytes:
        raise ValueError(f"object {name!r}: 'bytes' is not a size in 0..{max_bytes}")
    if not _is_int(part) or not MIN_OBJECT_PART <= part <= MAX_OBJECT_PART:
        raise ValueError(f"object {name!r}: 'part_bytes' is not in {MIN_OBJECT_PART}..{MAX_OBJECT_PART}")
    if not isinstance(sha, str) or not SHA256_HEX.match(sha):
        raise ValueError(f"object {name!r}: 'sha256' is not a sha256 hex digest")
    needed = max(1, -(-size // part))
    parts = meta.get("parts", [sha] if needed == 1 else None)
    if not isinstance(parts, list) or len(parts) != needed or not all(isinstance(p, str) and SHA256_HEX.match(p)
                                                                        for p in parts):
        raise ValueError(f"object {name!r}: {size} bytes in parts of {part} need {needed} part digest(s)")
    if needed > 1 and dg.root_of(parts) != sha:
        raise ValueError(f"object {name!r}: its parts do not hash to its sha256")
    return ObjectEntry(name=name, size=size, sha256=sha, part_bytes=part, parts=tuple(parts))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def write_verified(store: GenerationStore, name: str, data: bytes, *, part_bytes: int) -> ObjectEntry:
    """Write ``data`` as object ``name`` (create-only), read it back from the store part by part and compare each
    part's sha256 with the bytes written: the entry of an object known to be stored as it was meant to be."""
    digest = dg.digest_bytes(data, part_bytes=part_bytes)
    parts = digest.parts or (str(digest),)
    entry = ObjectEntry(name=name, size=len(data), sha256=str(digest), part_bytes=part_bytes, parts=tuple(parts))
    store.write_file(name, data, create_only=True)
    with ThreadPoolExecutor(max(1, min(len(parts), store.options.concurrency))) as pool:
        # CorruptObjectError when a stored part is not the one written
        for _ in pool.map(lambda i: len(_fetch(store, entry, i)), range(len(parts))):
            pass
    return entry


def _fetch(store: GenerationStore, entry: ObjectEntry, i: int) -> bytes:
    """Part ``i`` of ``entry`` read from the store and verified (one re-read on a mismatch)."""
    start, end = entry.span(i)
    last = i == len(entry.parts) - 1
    for attempt in (1, 2):
        try:
            data = store.read_range(entry.name, start, end + last) if end > start else b""
        except FileNotFoundError:
            raise CorruptObjectError(entry.name, "is missing") from None
        if len(data) == end - start and hashlib.sha256(data).hexdigest() == entry.parts[i]:
            return data
        if attempt == 1 and len(data) == end - start:
            log.warning("%s part %d/%d did not match its sha256 on first read; reading it again", entry.name, i + 1,
                        len(entry.parts))
    if len(data) != end - start:
        size = f"more than {entry.size}" if len(data) > end - start else str(start + len(data))
        raise CorruptObjectError(entry.name, f"is {size} bytes, its entry says {entry.size}")
    raise CorruptObjectError(entry.name, f"part {i + 1}/{len(entry.parts)} (bytes {start}..{end}) does not match "
                                         "its sha256 (changed or damaged after it was written)")


class PartCache:
    """Verified parts on local disk, named by their sha256, at most about ``max_bytes`` in all (least recently used
    removed first). Several processes may share the folder: each publishes a part by an atomic rename and, when its
    own count passes the bound, re-lists the folder and removes the oldest parts, so the folder may exceed the bound
    by at most what other processes wrote since their last look."""

    def __init__(self, directory: str, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"a part cache needs a positive size bound, got {max_bytes} bytes")
        self.directory, self.max_bytes = directory, max_bytes
        os.makedirs(directory, exist_ok=True)
        self._lock = threading.Lock()
        self._checked: dict[str, tuple[int, int]] = {}
        """sha -> (device, inode) of the file this process verified (or wrote) at that name."""
        self._bytes = self._evict()  # a folder left over a smaller bound is brought under this one now

    def path(self, sha: str) -> str:
        return os.path.join(self.directory, sha[:2], sha)

    def read(self, sha: str, size: int, ranges: list[tuple[int, int]]) -> list[bytes] | None:
        """Byte ranges of a cached part of ``size`` bytes, or None when it is not cached (or was evicted)."""
        try:
            fd = os.open(self.path(sha), os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except FileNotFoundError:
            return None
        try:
            st = os.fstat(fd)
            if st.st_size != size:  # a truncated file is no cached part (the disk is scratch, not trusted)
                return None
            if self._checked.get(sha) != (st.st_dev, st.st_ino) and not self._verify(fd, sha, size, st):
                return None
            os.utime(fd)  # most recently used: the last to be evicted
            return [os.pread(fd, end - start, start) for start, end in ranges]
        finally:
            os.close(fd)

    def _verify(self, fd: int, sha: str, size: int, st: os.stat_result) -> bool:
        """Whether the open cached file holds the part ``sha`` (hashed whole); a file that does not is removed, so the
        part is fetched again from the store and verified there."""
        data = os.pread(fd, size, 0)
        if len(data) == size and hashlib.sha256(data).hexdigest() == sha:
            self._checked[sha] = (st.st_dev, st.st_ino)
            return True
        log.warning("cached part %s in %s does not match its sha256: fetching it again", sha, self.directory)
        _unlink(self.path(sha))
        return False

    def put(self, sha: str, data: bytes) -> None:
        """Publish a verified part (an existing copy is replaced by identical bytes), then keep to the bound."""
        path = self.path(sha)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".part-", dir=os.path.dirname(path))
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                st = os.fstat(fh.fileno())
            os.replace(tmp, path)
            self._checked[sha] = (st.st_dev, st.st_ino)  # written from verified bytes
        except BaseException:
            _unlink(tmp)
            raise
        with self._lock:
            self._bytes += len(data)
            if self._bytes > self.max_bytes:
                self._bytes = self._evict()

    def _files(self) -> list[tuple[float, int, str]]:
        found = []
        for sub in os.scandir(self.directory):
            if not sub.is_dir(follow_symlinks=False) or not _CACHE_SUB.match(sub.name):
                continue  # only the cache's own folders: eviction never deletes anything else found there
            for entry in os.scandir(sub.path):
                if not (SHA256_HEX.match(entry.name) or entry.name.startswith(".part-")):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if entry.name.startswith(".part-") and time.time() - st.st_mtime < 3600:
                    continue  # another process's part being written
                found.append((st.st_mtime, st.st_size, entry.path))
        return found

    def _evict(self) -> int:
        """The folder's total; when over the bound, after removing the least recently used parts down to 3/4 of it."""
        files = sorted(self._files())
        total = sum(size for _, size, _ in files)
        if total <= self.max_bytes:
            return total
        for _, size, path in files:
            if total <= self.max_bytes * 3 // 4:
                break
            _unlink(path)
            total -= size
        return total


def _as_done(fn: Callable[[T], R], items: list[T], workers: int) -> Iterator[tuple[T, R]]:
    """``(item, fn(item))`` as each call completes, on up to ``workers`` threads, a new call started for each result
    taken: never more than ``workers`` results in memory, and no thread idle behind a slow one (unlike
    ``trainproof.storage.spool.in_order``, which keeps the order a stream needs). Close the generator to stop early."""
    if not items:
        return
    queued = iter(items)
    with ThreadPoolExecutor(max_workers=min(workers, len(items)), thread_name_prefix="trainproof-object") as pool:
        running = {pool.submit(fn, item): item for item in islice(queued, workers)}
        try:
            while running:
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in done:
                    item = running.pop(future)
                    result = future.result()
                    for nxt in islice(queued, 1):
                        running[pool.submit(fn, nxt)] = nxt
                    yield item, result
                    del result
        finally:
            for future in running:
                future.cancel()


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ObjectReader:
    """Byte ranges of objects of ``store``, every part verified before use, through ``cache``. One per process (a
    forked child makes its own: its store's client does not survive the fork)."""

    def __init__(self, store: GenerationStore, cache: PartCache, *, concurrency: int = 8) -> None:
        self.store, self.cache, self.concurrency = store, cache, max(1, concurrency)
        self.fetched_bytes = 0
        """Bytes read from the store by this reader (cache misses)."""

    def read(self, wanted: list[tuple[ObjectEntry, int, int]]) -> list[bytes]:
        """The bytes of each ``(entry, start, end)`` range (within the object), from verified parts only: a cached
        part is read only where a range falls; the missing ones (of every object asked for) are fetched at once,
        in parallel, each whole, verified and cached."""
        need: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (object, part) -> ranges inside the part
        entries: dict[str, ObjectEntry] = {}
        for entry, start, end in wanted:
            if not 0 <= start <= end <= entry.size:
                raise ValueError(f"range {start}..{end} is outside {entry.name} ({entry.size} bytes)")
            entries[entry.name] = entry
            for i, a, b in self._pieces(entry, start, end):
                need.setdefault((entry.name, i), []).append((a, b))
        got: dict[tuple[str, int, int, int], bytes] = {}
        missing = []
        for (name, i), local in need.items():
            start, end = entries[name].span(i)
            found = self.cache.read(entries[name].parts[i], end - start, local)
            if found is None:
                missing.append((entries[name], i))
            else:
                got.update(zip(((name, i, a, b) for a, b in local), found))
        # At most ``concurrency`` parts in memory: each is cached and cut into the pieces wanted, then dropped.
        with closing(_as_done(self._fetch_cached, missing, self.concurrency)) as fetched:
            for (entry, i), data in fetched:
                self.fetched_bytes += len(data)
                got.update(((entry.name, i, a, b), data[a:b]) for a, b in need[(entry.name, i)])
                del data
        return [b"".join(got[(entry.name, *piece)] for piece in self._pieces(entry, start, end))
                for entry, start, end in wanted]

    def verify(self, entries: list[ObjectEntry]) -> int:
        """Read every part of ``entries`` from the store (cached or not) and check it, ``concurrency`` parts in flight
        across objects (memory: that many parts), caching what it read; the bytes read."""
        parts = [(entry, i) for entry in entries for i in range(len(entry.parts))]
        read = 0
        with closing(_as_done(self._fetch_cached, parts, self.concurrency)) as fetched:
            for _, data in fetched:
                read += len(data)
                del data
        self.fetched_bytes += read
        return read

    def _fetch_cached(self, part: tuple[ObjectEntry, int]) -> bytes:
        """Part ``i`` of ``entry`` fetched, verified and cached (on a fetching thread: the writes overlap too)."""
        entry, i = part
        data = _fetch(self.store, entry, i)
        self.cache.put(entry.parts[i], data)
        return data

    @staticmethod
    def _pieces(entry: ObjectEntry, start: int, end: int) -> list[tuple[int, int, int]]:
        """(part, start, end) of the range ``[start, end)`` in each part it touches, relative to the part."""
        step = entry.part_bytes
        return [(i, max(start, i * step) - i * step, min(end, (i + 1) * step) - i * step)
                for i in range(start // step, -(-end // step))] if end > start else []
