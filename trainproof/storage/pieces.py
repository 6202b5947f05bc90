"""One object's bytes given as several buffers, back to back, that nobody joins.

A writer whose object is made of buffers it already holds (a shard file: each tensor's own memory, with alignment
padding between them) hands the store a :class:`Pieces` instead of copying them into one ``bytearray`` first. That
copy is not free: for a 1 GiB shard it costs a GiB of fresh pages faulted in and a memcpy, about a fifth of the
whole save. The store writes the pieces in order, hashes them in the same order (``trainproof.storage.digest``: a part
may span pieces), and compares the read-back with them piece by piece, exactly as it does for one buffer.

The pieces must not change until the write has returned (the store reads them twice: to write and to verify).
"""

from __future__ import annotations

from bisect import bisect_right
from typing import Iterator


class Pieces:
    """The concatenation of ``buffers`` (bytes-like), without copying them. Empty buffers are dropped."""

    def __init__(self, buffers) -> None:
        self.views: list[memoryview] = []
        self._starts: list[int] = []
        size = 0
        for buf in buffers:
            view = memoryview(buf)
            if not view.c_contiguous:  # e.g. a strided slice: its bytes are not one run of memory
                raise ValueError("Pieces needs contiguous buffers; copy a strided one first")
            if view.ndim != 1 or view.format != "B":
                view = view.cast("B")
            if view.nbytes:
                self.views.append(view)
                self._starts.append(size)
                size += view.nbytes
        self.nbytes = size

    def __len__(self) -> int:
        return self.nbytes

    def span(self, start: int, end: int) -> list[memoryview]:
        """Views of bytes ``start:end`` (clipped to the object), in order, sharing the pieces' memory."""
        start, end = max(0, start), min(end, self.nbytes)
        out: list[memoryview] = []
        i = max(0, bisect_right(self._starts, start) - 1)
        while start < end and i < len(self.views):
            base, view = self._starts[i], self.views[i]
            lo, hi = start - base, min(end - base, view.nbytes)
            if lo < hi:
                out.append(view[lo:hi])
                start = base + hi
            i += 1
        return out

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``start:end`` as one ``bytes`` (a copy of that range only: e.g. one multipart part)."""
        return b"".join(self.span(start, end))

    def chunks(self, size: int) -> Iterator[memoryview]:
        """The bytes in order, as views of at most ``size`` bytes (never crossing a piece)."""
        for view in self.views:
            for off in range(0, view.nbytes, size):
                yield view[off:off + size]

    def tobytes(self) -> bytes:
        """All of it as one ``bytes`` (a full copy: only for small objects or in-memory stores)."""
        return b"".join(self.views)


def as_pieces(data) -> Pieces:
    """``data`` (bytes-like or :class:`Pieces`) as :class:`Pieces` (no copy)."""
    return data if isinstance(data, Pieces) else Pieces([data])


def nbytes(data) -> int:
    """The size of bytes-like ``data`` or of :class:`Pieces`."""
    return data.nbytes if isinstance(data, Pieces) else memoryview(data).nbytes
