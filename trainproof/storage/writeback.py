"""A local file's written bytes sent on to the device range by range, and dropped from the page cache once there.

A state of many GB written into a spool would otherwise sit in the page cache as dirty pages until the commit's
``fsync`` writes all of it at once, and then stay cached. Linux's ``sync_file_range`` (through libc: Python has no
binding) starts or waits for the write-back of one range of a file, without its metadata or its other ranges;
``posix_fadvise(POSIX_FADV_DONTNEED)`` then drops that range's pages, clean by then, from the cache, so the next read
of the range reads what the device holds.

Only clean pages are dropped: a range is waited for before it is dropped, because the kernel answers a drop that
finds pages still under write-back by draining the page lists of every CPU and trying again, which on a machine of
many cores costs more than the write. Where ``sync_file_range`` is missing (not Linux) :func:`start` does nothing and
says so, and :func:`wait` falls back to ``fdatasync`` of the whole file; where ``posix_fadvise`` is missing
:func:`drop` does nothing and :func:`can_drop` is False.
"""

from __future__ import annotations

import contextlib
import errno
import os
from typing import Any

_WRITE = 2  # SYNC_FILE_RANGE_WRITE: start the write-back of the range's dirty pages
_WAIT_ALL = 7  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER: and wait for all of it to be on the device
_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOTSUP)
_CALL: Any = None  # libc's sync_file_range once looked up; False where there is none or it is refused


def _call(fd: int, offset: int, length: int, flags: int) -> bool:
    """``sync_file_range``; False where it is missing or the file system refuses it (then never tried again), an
    OSError for a failed write-back (EIO, ENOSPC: what the commit must not hide)."""
    global _CALL
    if _CALL is None:
        try:
            import ctypes

            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes, fn.restype = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint], ctypes.c_int
            _CALL = fn
        except (OSError, AttributeError):
            _CALL = False
    if not _CALL or length <= 0:
        return bool(_CALL)
    if _CALL(fd, offset, length, flags) == 0:
        return True
    import ctypes

    err = ctypes.get_errno()
    if err in _UNSUPPORTED:
        _CALL = False
        return False
    raise OSError(err, f"writing a file's range to the device failed: {os.strerror(err)}")


def start(fd: int, offset: int, length: int) -> bool:
    """Start writing ``length`` bytes of ``fd`` from ``offset`` to the device, without waiting; False where this
    platform cannot (the caller then leaves it to the kernel, or to the fsync)."""
    return _call(fd, offset, length, _WRITE)


def wait(fd: int, offset: int, length: int) -> None:
    """Write ``length`` bytes of ``fd`` from ``offset`` to the device and wait until they are there (``fdatasync`` of
    the whole file where the range alone cannot be)."""
    if not _call(fd, offset, length, _WAIT_ALL):
        getattr(os, "fdatasync", os.fsync)(fd)


def can_drop() -> bool:
    """Whether :func:`drop` can drop pages on this platform."""
    return hasattr(os, "posix_fadvise")


def drop(fd: int, offset: int, length: int) -> None:
    """Drop the clean pages of ``length`` bytes of ``fd`` from ``offset`` from the page cache (best effort: a file
    system whose pages are the file, tmpfs, keeps them)."""
    if length > 0 and can_drop():
        with contextlib.suppress(OSError):
            os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
