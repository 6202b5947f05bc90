"""A file's sha256, kept per part so that a large file can be verified part by part, and hashed on many cores.

A file of at most one part (:func:`default_part_bytes`, 32 MiB by default) is identified by its plain sha256, as before.
A
longer file is cut into parts of that size (the last one shorter); its manifest entry lists every part's
sha256 (``parts``) and the part size (``part_bytes``), and its ``sha256`` is the *hash list* root: the sha256 of
the parts' binary digests, in order. The root still names the file's whole content (any changed byte changes
one part's digest, so the root), and it is what every whole-file check compares. The list is what lets a reader
use a part as soon as that part is verified (the sharded loader copies it into its tensors and drops it: a load
holds a part, not the file), and lets a writer or reader hash the parts of one file on several cores at once
(a single sha256 stream runs at ~1.3 GB/s: 77 s for a 100 GB state).

Nothing here trusts a manifest: ``trainproof.storage.manifest.parse`` checks that a listed part count fits the size and
that the listed parts hash to the listed root before anyone uses them.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import Executor, Future, ThreadPoolExecutor, wait
from typing import Callable

from trainproof.storage.pieces import as_pieces

MiB = 2**20
MIN_PART_BYTES = 4096
MAX_PART_BYTES = 1024 * MiB
PART_ENV = "TRAINPROOF_DIGEST_PART_MIB"
"""Environment variable: the part size of new files' digests in MiB (default 32; fractions allowed, for tests)."""


DEFAULT_PART_BYTES = 32 * MiB

PART_BYTES: int | None = None
"""This process's part size, once :func:`default_part_bytes` resolved it (a test may set it directly)."""


def parse_part_mib(raw: str | None) -> int:
    """Bytes per digest part from a ``TRAINPROOF_DIGEST_PART_MIB`` value (None or empty: the default);
    ValueError naming the variable when it is not a number in range."""
    if not raw:
        return DEFAULT_PART_BYTES
    try:
        value = int(float(raw) * MiB)
    except ValueError:
        raise ValueError(f"{PART_ENV}={raw!r} is not a number of MiB: set the digest part size in MiB "
                         f"(default {DEFAULT_PART_BYTES // MiB}) or unset it") from None
    if not MIN_PART_BYTES <= value <= MAX_PART_BYTES:
        raise ValueError(f"{PART_ENV}={raw!r} is outside {MIN_PART_BYTES} bytes .. {MAX_PART_BYTES // MiB} MiB")
    return value


def default_part_bytes() -> int:
    """Part size of the digests of files written by this process (a reader always uses the entry's own).

    Read from the environment once, at the first write, never at import: ``StoreOptions.from_env`` checks the
    variable when a store is opened, so a bad value is a one-line configuration error there, and every writer of
    the process (the store, the spool files a state is serialised into) then hashes with the same size."""
    global PART_BYTES
    if PART_BYTES is None:
        PART_BYTES = parse_part_mib(os.environ.get(PART_ENV))
    return PART_BYTES


class Digest(str):
    """A file's digest as a hex string (its plain sha256, or the root of its parts), carrying the parts' digests
    (empty for a file of one part) and their size, for the manifest entry."""

    parts: tuple[str, ...]
    part_bytes: int

    def __new__(cls, hexdigest: str, parts: tuple[str, ...] = (), part_bytes: int = 0) -> "Digest":
        obj = super().__new__(cls, hexdigest)
        obj.parts, obj.part_bytes = tuple(parts), part_bytes
        return obj

    def entry(self) -> dict:
        """The manifest fields of this digest: ``sha256``, and ``parts`` and ``part_bytes`` for a file of several."""
        if len(self.parts) < 2:
            return {"sha256": str(self)}
        return {"sha256": str(self), "parts": list(self.parts), "part_bytes": self.part_bytes}


def root_of(parts) -> str:
    """The root of a file of several parts: sha256 of the parts' binary digests, in order."""
    return hashlib.sha256(b"".join(bytes.fromhex(p) for p in parts)).hexdigest()


def of_parts(parts: list[str], part_bytes: int) -> Digest:
    """The digest of a file whose parts (at least one) have these digests."""
    if len(parts) == 1:
        return Digest(parts[0], (), part_bytes)
    return Digest(root_of(parts), tuple(parts), part_bytes)


class FileHasher:
    """``hashlib``-like (``update``, ``hexdigest``): the :class:`Digest` of the bytes fed to it, whatever the sizes
    of the pieces (a part boundary may fall inside one). ``part_bytes``: default :func:`default_part_bytes`;
    :meth:`plain`: one part
    whatever the size (the plain sha256, for entries that list no parts)."""

    def __init__(self, part_bytes: int | None = None) -> None:
        self.part_bytes = default_part_bytes() if part_bytes is None else part_bytes  # 0: one part, plain sha256
        self._parts: list = []  # hex digests, or a part's sha256 object until digest() (update_on)
        self._sha = hashlib.sha256()
        self._filled = 0

    @classmethod
    def plain(cls) -> "FileHasher":
        """A hasher of one part whatever the size: the plain sha256."""
        return cls(0)

    def update(self, data) -> None:
        view = memoryview(data).cast("B")
        if not self.part_bytes:
            self._sha.update(view)
            return
        while view.nbytes:
            take = min(view.nbytes, self.part_bytes - self._filled)
            self._sha.update(view[:take])  # hashlib releases the GIL for large buffers
            self._filled += take
            view = view[take:]
            if self._filled == self.part_bytes:
                self._parts.append(self._sha.hexdigest())
                self._sha, self._filled = hashlib.sha256(), 0

    def update_on(self, data, pool: Executor) -> list[Future]:
        """:meth:`update`, with the pieces that fall into different parts hashed at once on ``pool``'s threads;
        returns their futures. Each part has its own sha256, so only the bytes of one part are ordered, and one call
        gives each part at most one piece. The caller keeps ``data`` unchanged and waits for every future (the
        result, so an error surfaces) before its next update or :meth:`digest`. A plain hasher (one part) hashes its
        piece on one thread."""
        view = memoryview(data).cast("B")
        jobs: list[Future] = []
        while view.nbytes:
            take = view.nbytes if not self.part_bytes else min(view.nbytes, self.part_bytes - self._filled)
            jobs.append(pool.submit(self._sha.update, view[:take]))
            self._filled += take
            view = view[take:]
            if self.part_bytes and self._filled == self.part_bytes:
                self._parts.append(self._sha)  # its hexdigest is taken in digest(), once its piece is hashed
                self._sha, self._filled = hashlib.sha256(), 0
        return jobs

    def update_beside(self, data, pool: Executor, work: Callable[[], object]) -> None:
        """:meth:`update` on ``pool``'s threads while this thread runs ``work()`` (writing ``data`` somewhere: hashlib
        and the write both release the GIL, so the bytes are read twice at once instead of one pass after the other).
        Returns once both are done, so the caller may reuse ``data``; raises ``work``'s error first, else a hashing
        thread's."""
        pending = self.update_on(data, pool)
        try:
            work()
        finally:
            wait(pending)
        for job in pending:
            job.result()

    def digest(self) -> Digest:
        """The digest of everything fed so far."""
        if not self.part_bytes:
            return Digest(self._sha.hexdigest())
        done = [p if isinstance(p, str) else p.hexdigest() for p in self._parts]
        self._parts = done
        parts = done + ([self._sha.hexdigest()] if self._filled or not done else [])
        return of_parts(parts, self.part_bytes)

    def hexdigest(self) -> Digest:
        return self.digest()


def hasher_for(meta: dict) -> FileHasher:
    """The hasher that reproduces a (parsed) manifest entry's ``sha256``: its own part size when it lists parts,
    else the plain sha256."""
    return FileHasher(meta["part_bytes"]) if "parts" in meta else FileHasher.plain()


def digest_bytes(data, *, part_bytes: int | None = None, threads: int | None = None) -> Digest:
    """The :class:`Digest` of bytes in memory (bytes-like, or :class:`trainproof.storage.pieces.Pieces`: a part may span
    pieces); the parts of a long buffer are hashed on several threads (hashlib releases the GIL), up to ``threads``
    (default: the cores this process may use, at most 8)."""
    pieces = as_pieces(data)
    size = part_bytes or default_part_bytes()
    spans = [pieces.span(off, off + size) for off in range(0, pieces.nbytes, size)] or [[]]
    workers = max(1, min(len(spans), threads or min(8, cores())))
    if workers == 1:
        return of_parts([_sha256(s) for s in spans], size)
    with ThreadPoolExecutor(workers, thread_name_prefix="trainproof-digest") as pool:
        return of_parts(list(pool.map(_sha256, spans)), size)


def _sha256(views: list[memoryview]) -> str:
    sha = hashlib.sha256()
    for view in views:
        sha.update(view)
    return sha.hexdigest()


def cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
