"""The handful of domain exceptions of the store.

Everything else at the storage boundary is a builtin: ``FileNotFoundError``, ``FileExistsError``,
``PermissionError`` (what fsspec backends raise).  Callers map these to exit codes:
``StoreConfigError`` → 2 (retrying cannot help), the rest → 1.
"""

from __future__ import annotations

import errno


class StoreError(Exception):
    """Base class of every error the store raises on purpose."""


class StoreConfigError(StoreError):
    """The store cannot be used as configured: bad URL, missing bucket, rejected credentials,
    unreachable endpoint, or an endpoint that ignores create-only writes.  Retrying cannot help."""


class StoreUnavailableError(StoreError):
    """A transient fault outlasted the retry budget (attempts or total time)."""


class ListingIncompleteError(StoreError):
    """A listing of the run could not be finished within its budget (``Limits.scan_seconds``): nothing is decided
    from part of it (exit 1: a later attempt may finish it, or someone must clean the flood up)."""


class CommitConflictError(StoreError):
    """Another writer committed (or is writing) the same step: this writer lost and must not continue."""


class CorruptGenerationError(StoreError):
    """A generation's stored bytes disagree with its manifest (size, sha256, missing file, bad manifest)
    or fail the caller's content check.  The caller may fall back to an older generation."""

    def __init__(self, name: str, reason: str) -> None:
        super().__init__(f"{name}: {reason}")
        self.name = name
        self.reason = reason


def not_a_file(exc: OSError) -> bool:
    """Whether ``exc`` says a stored name is not a regular file: what the local backend raises for a symlink, a
    FIFO or a folder where a file was expected (planted, or swapped after a listing). Never a transient failure."""
    return exc.errno in (errno.ELOOP, errno.EINVAL, errno.EISDIR, errno.ENOTDIR)
