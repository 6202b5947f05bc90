"""The few primitives a store needs from a filesystem, over ``str`` paths (a ``Path`` would collapse ``s3://``).

Three implementations: ``LocalBackend`` (a folder, with fsync and exclusive-create by hard link),
``FsspecBackend`` (``memory://`` and any other fsspec filesystem) and ``S3Backend`` (``storage/s3.py``).
Every method is one whole operation, safe to retry, and safe to call from a background thread: a backend
holds no buffers between calls.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from typing import BinaryIO, Iterator, Protocol, Union

CHUNK = 8 * 2**20
Source = Union[bytes, bytearray, memoryview, BinaryIO]


@dataclass(frozen=True)
class Entry:
    """One listing entry."""

    name: str
    size: int
    is_dir: bool
    mtime: float | None = None


class Backend(Protocol):
    """What the store needs.  Errors are builtins: FileNotFoundError, FileExistsError, PermissionError."""

    def write(self, path: str, data: Source, *, create_only: bool = False) -> tuple[int, str]:
        """Store ``data`` whole at ``path`` and return (size, sha256) computed while writing.
        Never leaves a partial object behind on failure.  ``create_only`` raises FileExistsError if
        ``path`` exists, atomically (no check-then-write window)."""

    def read(self, path: str) -> bytes:
        """The object's bytes, read from the store itself (no cache)."""

    def listdir(self, path: str) -> list[Entry]:
        """Direct children of ``path`` (fresh listing, never a cache); [] when it does not exist."""

    def delete(self, path: str) -> None:
        """Delete one object; a missing one is fine (idempotent)."""

    def delete_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it; missing is fine."""

    def copy(self, src: str, dst: str) -> None:
        """Copy one object (server-side where the backend can)."""

    def exists(self, path: str) -> bool:
        """Whether an object exists (asked of the store, not a cache)."""


def iter_chunks(data: Source) -> Iterator[memoryview | bytes]:
    """Chunks of ``data`` without copying bytes-like input."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        view = memoryview(data)
        for start in range(0, len(view), CHUNK):
            yield view[start : start + CHUNK]
        return
    while True:
        block = data.read(CHUNK)
        if not block:
            return
        yield block


def digest(data: bytes | memoryview) -> tuple[int, str]:
    """(size, sha256 hex) of bytes already in memory."""
    return len(data), hashlib.sha256(data).hexdigest()


def join(*parts: str) -> str:
    """Join path parts with '/', whatever the OS (fsspec paths are always '/')."""
    return "/".join(p.strip("/") if i else p.rstrip("/") for i, p in enumerate(parts) if p)


class LocalBackend:
    """A local folder.  Writes go to a hidden temp file in the same folder, are fsynced, then published by
    ``os.replace`` (overwrite) or ``os.link`` (create-only: fails atomically if the name exists), so a
    reader never sees a half-written file under its final name and a crash leaves only a ``.tmp-`` file."""

    def write(self, path: str, data: Source, *, create_only: bool = False) -> tuple[int, str]:
        folder, name = os.path.split(path)
        os.makedirs(folder, exist_ok=True)
        tmp = os.path.join(folder, f".{name}.tmp-{uuid.uuid4().hex[:12]}")
        sha, size = hashlib.sha256(), 0
        try:
            with open(tmp, "xb") as fh:
                for chunk in iter_chunks(data):
                    sha.update(chunk)
                    fh.write(chunk)
                    size += len(chunk)
                fh.flush()
                os.fsync(fh.fileno())
            if create_only:
                os.link(tmp, path)  # FileExistsError if another writer got there first
            else:
                os.replace(tmp, path)
            _fsync_dir(folder)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return size, sha.hexdigest()

    def read(self, path: str) -> bytes:
        with open(path, "rb") as fh:
            return fh.read()

    def listdir(self, path: str) -> list[Entry]:
        try:
            with os.scandir(path) as it:
                entries = []
                for e in it:
                    st = e.stat()
                    entries.append(Entry(e.name, st.st_size, e.is_dir(), st.st_mtime))
                return entries
        except (FileNotFoundError, NotADirectoryError):
            return []

    def delete(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def delete_tree(self, path: str) -> None:
        shutil.rmtree(path, ignore_errors=False, onerror=_ignore_missing)

    def copy(self, src: str, dst: str) -> None:
        with open(src, "rb") as fh:
            self.write(dst, fh)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def rename_dir(self, src: str, dst: str) -> None:
        """Atomic move of a whole folder (used by quarantine)."""
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        os.rename(src, dst)
        _fsync_dir(os.path.dirname(dst))


def _fsync_dir(folder: str) -> None:
    # The new name must survive a power cut, not only the bytes.
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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

    def listdir(self, path: str) -> list[Entry]:
        try:
            items = self.fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        out = []
        for item in items:
            name = item["name"].rstrip("/").rsplit("/", 1)[-1]
            if item["name"].rstrip("/") == path.rstrip("/"):
                continue
            mtime = item.get("created") or item.get("mtime") or item.get("LastModified")
            out.append(Entry(name, int(item.get("size") or 0), item["type"] == "directory", _timestamp(mtime)))
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

