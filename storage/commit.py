"""Write → verify → mark usable.

1. refuse a step that is already committed; move an abandoned partial of the same step aside;
2. write every file create-only (so nobody can overwrite a file of a generation another writer committed),
   computing size and sha256 while writing;
3. read every object back *from the store* and check size and sha256, then the caller's content check;
4. write ``COMPLETE.json`` last, create-only; a 412 may be our own write whose response was lost, so read
   the marker back and compare the attempt id before concluding we lost;
5. update the ``LATEST`` hint (best effort: discovery never needs it).
"""

from __future__ import annotations

import hashlib
import logging
import uuid

from storage import manifest as mf
from storage.errors import CommitConflictError, CorruptGenerationError
from storage.generations import Check, Ctx
from storage.quarantine import quarantine

log = logging.getLogger("trainproof.storage")
LATEST = "LATEST"


def commit_generation(
    ctx: Ctx, step: int, files: dict[str, bytes], *, contract: str, world: int, code_version: str,
    check: Check | None = None, digests: dict[str, str] | None = None, extra: dict | None = None,
) -> dict:
    """Commit ``files`` as generation ``step``; return its manifest.  Raises CommitConflictError when another
    writer committed this step, CorruptGenerationError when the read-back disagrees, and StoreError or a
    builtin OSError when the store fails; in every failure case nothing is marked usable."""
    if not files:
        raise ValueError("a generation needs at least one file")
    bad = [n for n in files if "/" in n or n in ("", ".", "..", mf.MARKER, "REASON")]
    if bad:
        raise ValueError(f"invalid file names for a generation: {bad}")
    name = mf.step_dir(step)
    attempt = uuid.uuid4().hex
    _clear_the_way(ctx, name)
    written = {fname: _write_file(ctx, name, fname, data) for fname, data in files.items()}
    _verify(ctx, name, written, files.keys(), check)
    manifest = mf.build(step=step, files=written, contract=contract, world=world, code_version=code_version,
                        attempt=attempt, digests=digests, extra=extra)
    _mark_usable(ctx, name, manifest)
    try:
        ctx.io("update LATEST", lambda: ctx.backend.write(ctx.path(LATEST), f"{name}\n".encode()))
    except OSError as exc:  # a hint only: discovery lists step-* and never needs it
        log.warning("committed %s but could not update the LATEST hint: %s", name, exc)
    return manifest


def _clear_the_way(ctx: Ctx, name: str) -> None:
    if ctx.io(f"check {name}", lambda: ctx.backend.exists(ctx.path(name, mf.MARKER))):
        raise CommitConflictError(f"{name} is already committed (by another writer or an earlier attempt); "
                                  "refusing to write it again")
    leftovers = ctx.io(f"list {name}", lambda: ctx.backend.listdir(ctx.path(name)))
    if leftovers:
        # A writer killed mid-save left these.  Move them aside (not delete): if they were a live concurrent
        # writer's after all, its verify or its manifest check will fail instead of silently mixing files.
        quarantine(ctx, name, f"abandoned partial generation ({len(leftovers)} objects, no {mf.MARKER}) "
                              "found when this step was written again")


def _write_file(ctx: Ctx, name: str, fname: str, data: bytes) -> tuple[int, str]:
    path = ctx.path(name, fname)
    try:
        return ctx.io(f"write {name}/{fname}", lambda: ctx.backend.write(path, data, create_only=True))
    except FileExistsError:
        # Either a retry after our own PUT landed with its response lost, or another writer.  Same bytes: ours.
        stored = ctx.io(f"read {name}/{fname}", lambda: ctx.backend.read(path))
        expected = hashlib.sha256(data).hexdigest()
        if hashlib.sha256(stored).hexdigest() == expected:
            return len(stored), expected
        raise CommitConflictError(f"{name}/{fname} was created by another writer while this one was committing "
                                  f"{name}; this writer stops") from None


def _verify(ctx: Ctx, name: str, written: dict, names, check: Check | None) -> None:
    for fname in names:
        size, sha = written[fname]
        data = ctx.io(f"verify {name}/{fname}", lambda fname=fname: ctx.backend.read(ctx.path(name, fname)))
        if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
            raise CorruptGenerationError(name, f"{fname} read back from the store differs from what was written "
                                               f"({len(data)} bytes vs {size}); not marking it usable")
        if check is not None:
            try:
                check(fname, data)
            except Exception as exc:
                raise CorruptGenerationError(name, f"{fname} failed the content check after writing: {exc}") from exc
        del data  # one file's bytes at a time


def _mark_usable(ctx: Ctx, name: str, manifest: dict) -> None:
    marker = ctx.path(name, mf.MARKER)
    raw = mf.dumps(manifest)
    try:
        ctx.io(f"commit {name}", lambda: ctx.backend.write(marker, raw, create_only=True))
        return
    except FileExistsError:
        pass
    # 412: maybe our own write, whose response was lost and which the retry then found.
    try:
        theirs = mf.parse(ctx.io(f"read {name}/{mf.MARKER}", lambda: ctx.backend.read(marker)), dir_name=name)
    except (mf.ManifestError, FileNotFoundError):
        theirs = {}
    if theirs.get("attempt") != manifest["attempt"]:
        raise CommitConflictError(f"{name} was committed by another writer (attempt {theirs.get('attempt', '?')}) "
                                  "while this one was writing; exactly one commit wins, this writer stops")
