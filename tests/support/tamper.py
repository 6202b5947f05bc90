"""A backend wrapper that misbehaves on purpose, around a real backend (memory, local folder or S3).

The store's code paths run unchanged; only what the storage layer below them returns is altered, the way a
faulty disk, a buggy proxy, or a process racing on a shared bucket would alter it.
"""

from __future__ import annotations

from typing import Callable, Iterator

from trainproof.storage import GenerationStore


class TamperingBackend:
    """Delegates everything to ``inner``, except what the hooks change.

    ``alter_read(path, data) -> data``: applied to what ``read``/``iter_read``/``read_range`` (its first range) return for every path.
    ``on_write(path, create_only, write)``: called instead of the write; ``write()`` performs the real one.
    Counts the bytes handed out by reads per path in ``bytes_read``."""

    def __init__(self, inner, *, alter_read: Callable[[str, bytes], bytes] | None = None,
                 on_write: Callable | None = None) -> None:
        self.inner, self.alter_read, self.on_write = inner, alter_read, on_write
        self.bytes_read: dict[str, int] = {}

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _count(self, path: str, data: bytes) -> bytes:
        self.bytes_read[path] = self.bytes_read.get(path, 0) + len(data)
        return data

    def read(self, path: str) -> bytes:
        data = self.inner.read(path)
        return self._count(path, self.alter_read(path, data) if self.alter_read else data)

    def iter_read(self, path: str) -> Iterator[bytes]:
        chunks = self.inner.iter_read(path)
        try:
            first = True
            for chunk in chunks:
                if self.alter_read and first:  # alter the first chunk: enough to change the digest
                    chunk = self.alter_read(path, bytes(chunk))
                first = False
                yield self._count(path, chunk)
        finally:
            chunks.close()

    def read_range(self, path: str, start: int, end: int) -> bytes:
        data = self.inner.read_range(path, start, end)
        if self.alter_read and start == 0:  # the first range, as iter_read alters the first chunk
            data = self.alter_read(path, bytes(data))
        return self._count(path, data)

    def write_verified(self, path: str, data, **kwargs):
        """Never (``VerifiesWhileWritten``: the inner folder would read its device itself, past ``alter_read``): a
        spool still being written is written and read back the ordinary way, through the hooks."""
        return None

    def write(self, path: str, data, *, create_only: bool = False):
        if self.on_write is None:
            return self.inner.write(path, data, create_only=create_only)
        return self.on_write(path, create_only, lambda: self.inner.write(path, data, create_only=create_only))


def flip_first_byte(path: str, data: bytes) -> bytes:
    """Same size, other bytes."""
    return bytes([data[0] ^ 0x01]) + data[1:] if data else data


def wrap(store: GenerationStore, **hooks) -> GenerationStore:
    """The same run, seen through a TamperingBackend (``.backend`` of the result is the wrapper)."""
    return GenerationStore(TamperingBackend(store.backend, **hooks), store.root, store.url, store.options)
