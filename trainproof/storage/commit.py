"""Write → verify → mark usable.

Two phases, so that several writers (one per rank) can each write and verify their own files
(``write_part``) and one of them commits the whole generation (``mark_usable``); ``commit_generation`` is both.

1. refuse a step that this run (or a writer that cannot be told from it) already committed; a generation there that
   cannot be this run's (foreign with a key, another contract, a manifest that does not parse) is moved to quarantine;
2. write every file create-only, computing size and sha256 while writing.  Nobody ever overwrites or deletes
   an object of a generation being written: when a name is taken (left by a writer killed mid-save, or a
   concurrent writer), this writer uses ``<stem>.<attempt>.<ext>`` instead and the manifest records it as the
   file's ``object``.  So a concurrent or abandoned writer can never change the bytes a manifest vouches for;
3. read every object back *from the store* and check it, then the caller's content check.  A file given as
   bytes (or as :class:`trainproof.storage.pieces.Pieces`, buffers written back to back) is read back as parallel ranged
   reads compared with those bytes (whose sha256 the write computed: the stored bytes are the hashed ones,
   without hashing them twice); a :class:`trainproof.storage.spool.Spool` is never held in memory: it is uploaded from
   its local file, read back as parallel ranged reads hashed in order, and the content check reads the spool (bytes
   the hash just proved identical to the stored ones). A spool still being written, handed to a folder, is read back
   from the device part by part while it is written (``VerifiesWhileWritten``), and is not read a second time;
4. with a signing key, chain and sign the manifest (``trainproof.storage.signing``); write ``COMPLETE.json`` last,
   create-only; a 412 may be our own write whose response was lost, so read the marker back and compare the
   attempt id before concluding we lost;
5. update the ``LATEST`` hint (best effort: discovery never needs it).
"""

from __future__ import annotations

import logging
import uuid
from typing import Callable

from trainproof.storage import digest as dg
from trainproof.storage import manifest as mf
from trainproof.storage.backend import VerifiesWhileWritten, join, read_at_most
from trainproof.storage.errors import (
    CommitConflictError,
    CorruptGenerationError,
    StoreConfigError,
    StoreError,
    not_a_file,
)
from trainproof.storage.generations import CORRUPT, FOREIGN, INCOMPLETE, Check, Ctx, anchor, in_chain, scan
from trainproof.storage.limits import safe
from trainproof.storage.pieces import nbytes
from trainproof.storage.quarantine import clear_for_folder, move_aside, quarantine
from trainproof.storage.spool import LiveSpool, Spool

Data = "bytes | Pieces | Spool"

log = logging.getLogger("trainproof.storage")
LATEST = "LATEST"


def commit_generation(
    ctx: Ctx, step: int, files: dict[str, Data], *, contract: str, world: int, code_version: str,
    check: Check | None = None, digests: dict[str, str] | None = None, extra: dict | None = None,
    shared: dict[str, tuple[int, str]] | None = None,
) -> dict:
    """Commit ``files`` (and a reference to each ``shared`` object, :func:`put_shared`) as generation ``step``; return
    its manifest.  Raises CommitConflictError when another
    writer committed this step, CorruptGenerationError when the read-back disagrees, and StoreError or a
    builtin OSError when the store fails; in every failure case nothing is marked usable."""
    attempt = uuid.uuid4().hex
    written = write_part(ctx, step, files, check=check, attempt=attempt, contract=contract, code_version=code_version)
    return mark_usable(ctx, step, written, contract=contract, world=world, code_version=code_version,
                       attempt=attempt, digests=digests, extra=extra, shared=shared)


def write_part(ctx: Ctx, step: int, files: dict[str, Data], *, check: Check | None = None,
               attempt: str | None = None, contract: str | None = None,
               code_version: str | None = None) -> dict[str, tuple[int, str, str]]:
    """Phase 1 (any number of writers, e.g. one per rank): write ``files`` into generation ``step`` create-only
    and verify them read back from the store.  Returns name → (bytes, sha256, object) for ``mark_usable``.
    ``contract``/``code_version``: the writer's; a generation at ``step`` of another contract or build is moved
    to quarantine rather than refused (see :func:`clear_way`)."""
    if not files:
        raise ValueError("a generation needs at least one file")
    bad = {n: mf.name_problem(n) for n in files if mf.name_problem(n)}
    if bad:
        raise ValueError(f"invalid file names for a generation: {bad}")
    name = mf.step_dir(step)
    attempt = attempt or uuid.uuid4().hex
    clear_way(ctx, name, contract, code_version)
    written: dict[str, tuple[int, str, str]] = {}
    verified: set[str] = set()  # objects the backend read back from its device while they were written
    for fname, data in files.items():
        done = _write_verified(ctx, name, fname, data) if isinstance(data, LiveSpool) else None
        if done is not None:
            verified.add(fname)
        written[fname] = done or _write_file(ctx, name, fname, data, attempt)
    _verify(ctx, name, written, check, files, verified)
    return written


def mark_usable(
    ctx: Ctx, step: int, written: dict[str, tuple[int, str, str]], *, contract: str, world: int,
    code_version: str, attempt: str | None = None, digests: dict[str, str] | None = None, extra: dict | None = None,
    shared: dict[str, tuple[int, str]] | None = None,
) -> dict:
    """Phase 2 (one writer): check every listed object is in the store with its listed size (``shared``: name →
    (bytes, sha256) of objects :func:`put_shared` stored, under ``shared/``), then write ``COMPLETE.json`` create-only
    and move the ``LATEST`` hint.  Returns the manifest."""
    name = mf.step_dir(step)
    sizes = _sizes(ctx, name)
    for fname, (size, _sha, obj) in written.items():
        if sizes.get(obj) != size:
            raise CorruptGenerationError(name, f"{obj} is not in the store with {size} bytes "
                                               f"(found {sizes.get(obj)}); not marking it usable")
    for fname, (size, sha) in (shared or {}).items():
        found = _shared_size(ctx, str(sha))
        if found != size:
            raise CorruptGenerationError(name, f"{mf.SHARED_DIR}/{sha} ({fname}) is not in the store with {size} "
                                               f"bytes (found {found}); not marking it usable")
    manifest = mf.build(step=step, files=written, contract=contract, world=world, code_version=code_version,
                        attempt=attempt or uuid.uuid4().hex, digests=digests, extra=extra, shared=shared)
    if ctx.keys is not None:
        manifest = _signed(ctx, step, manifest)
    _mark_usable(ctx, name, manifest)
    try:
        ctx.io("update LATEST", lambda: ctx.backend.write(ctx.path(LATEST), f"{name}\n".encode()))
    except OSError as exc:  # a hint only: discovery lists step-* and never needs it
        log.warning("committed %s but could not update the LATEST hint: %s", name, exc)
    return manifest


def put_shared(ctx: Ctx, data: Spool) -> tuple[int, str]:
    """Store ``data`` once for the run, content-addressed, as ``shared/<sha256>``, verified read back; (bytes,
    sha256) for a manifest's ``shared`` entry. Already there with those bytes (an earlier process's): reused after
    hashing it, never uploaded again. Something else under that name (planted, damaged) is moved to quarantine and
    the object written."""
    sha = data.sha256
    path = join(ctx.path(mf.SHARED_DIR), str(sha))
    clear_for_folder(ctx, mf.SHARED_DIR, "not a folder, where the run keeps its shared objects")
    there = _shared_entries(ctx, str(sha))
    if there:
        if all(not e.is_dir and not e.is_special for e in there) and _holds(ctx, path, data):
            return data.size, sha
        log.warning("%s/%s holds other bytes than its name says (planted or damaged): moving it aside",
                    mf.SHARED_DIR, sha)
        move_aside(ctx, f"{mf.SHARED_DIR}/{sha}", "not the object its name says (planted or damaged)",
                   label=f"{mf.SHARED_DIR}-{str(sha)[:16]}")
    try:
        size, got = ctx.io(f"write {mf.SHARED_DIR}/{sha}", lambda: ctx.backend.write(path, data, create_only=True))
        _same_as_source(mf.SHARED_DIR, str(sha), (size, got), (data.size, sha))
    except FileExistsError:
        pass  # a writer got there in between (or our own re-sent write): the read-back decides
    if not _holds(ctx, path, data):
        raise CorruptGenerationError(mf.SHARED_DIR, f"{sha} read back from the store differs from what was written")
    return data.size, sha


def _holds(ctx: Ctx, path: str, data: Spool) -> bool:
    """Whether the object at ``path`` is ``data``'s bytes (size and digest, read back in parallel ranges)."""
    sha = data.sha256
    hasher = dg.FileHasher(sha.part_bytes) if isinstance(sha, dg.Digest) and sha.part_bytes else None
    try:
        got = ctx.io(f"verify {mf.SHARED_DIR}/{sha}", lambda: ctx.hashed(path, data.size, hasher=hasher))
    except FileNotFoundError:
        return False
    except OSError as exc:
        if not_a_file(exc):  # a link or a FIFO in its place
            return False
        raise
    return got == (data.size, sha)


def _shared_entries(ctx: Ctx, sha: str) -> list:
    """The entries named ``sha`` under ``shared/`` (a fresh listing)."""
    listing = ctx.io(f"list {mf.SHARED_DIR}", lambda: ctx.backend.listdir(ctx.path(mf.SHARED_DIR), prefix=sha))
    return [e for e in listing if e.name == sha]


def _shared_size(ctx: Ctx, sha: str) -> int | None:
    return next((e.size for e in _shared_entries(ctx, sha) if not e.is_dir and not e.is_special), None)


def _signed(ctx: Ctx, step: int, manifest: dict) -> dict:
    """``manifest`` chained (this run's anchor; the newest in-chain generation below ``step`` as predecessor,
    whatever its contract or world: the chain is the run's) and signed (``trainproof.storage.signing``)."""
    run_anchor = anchor(ctx)
    # No plan.json at the root (an export folder): bundles are signed but form no chain, since they may be
    # committed in any step order (``export --step 5`` after step 10).
    below = [g for g in scan(ctx) if g.digest is not None and g.step < step] if run_anchor is not None else []
    chained = {**manifest, "anchor": run_anchor, "predecessor": below[-1].digest if below else None,
               "predecessor_step": below[-1].step if below else None}
    return ctx.keys.sign(chained)


def clear_way(ctx: Ctx, name: str, contract: str | None = None, code_version: str | None = None) -> None:
    """Clear the way for committing ``name``: whatever occupies it and cannot be this run's goes to quarantine;
    CommitConflictError when a writer of this run (this build) committed it already."""
    if not _clear_occupants(ctx, name):
        return
    if ctx.keys is None and contract is None:
        raise CommitConflictError(f"{name} is already committed (by another writer or an earlier attempt); "
                                  "refusing to write it again")
    # Is the occupant this run's own? Only then did another writer win the step. One that cannot be (with a key:
    # unsigned, wrongly signed, another run's or out of chain; any: another contract or build, a manifest that does
    # not parse) is moved aside with its evidence, and this commit proceeds: nothing stored can block a run.
    info = in_chain(ctx, name, contract=contract, world=None)
    if info.status == INCOMPLETE:
        return  # its COMPLETE.json went away meanwhile (retention, quarantine)
    reason = info.reason
    if info.status not in (FOREIGN, CORRUPT):
        built_by = (info.manifest or {}).get("code_version")
        if code_version is None or built_by == code_version:
            raise CommitConflictError(f"{name} is already committed (by another writer of this run or an earlier "
                                      "attempt); refusing to write it again")
        # Another build's generation at a step this build commits: a resume never takes it (it was passed over for
        # an older generation of this build, or planted), so it can only be in the way.
        reason = f"written by another build ({safe(built_by, 80)}; this is {code_version})"
    log.warning("%s is occupied by a generation that is not this run's (%s): moving it to quarantine", name, reason)
    try:
        quarantine(ctx, name, f"occupied the step this run commits: {reason}")
    except (OSError, StoreError) as exc:
        if ctx.io(f"check {name}", lambda: ctx.backend.exists(ctx.path(name, mf.MARKER))):
            raise CommitConflictError(f"{name} is occupied by a generation that is not this run's ({reason}) "
                                      f"and could not be moved to quarantine: {exc}") from None


def _clear_occupants(ctx: Ctx, name: str) -> bool:
    """Move aside what occupies ``name`` without being a generation folder; whether a ``COMPLETE.json`` file is
    left there (a committed generation, whose owner the caller decides)."""
    here = [e for e in ctx.io("list generations", lambda: ctx.backend.listdir(ctx.root, prefix=name)) if e.name == name]
    for entry in (e for e in here if not e.is_dir or e.is_special):
        # Not this run's: a file, a FIFO, a symlink (writing through it would write, and later delete, outside the
        # run), an object named like the folder. Moved aside, never followed: nothing stored blocks a commit.
        what = "a symlink or a special file" if entry.is_special else "a file"
        _or_conflict(lambda: move_aside(ctx, name, f"occupied the step this run commits: {what}, not a generation "
                                                   "folder"), f"{name} exists and is not a folder ({what})")
    marker = [e for e in ctx.io(f"list {name}", lambda: ctx.backend.listdir(ctx.path(name), prefix=mf.MARKER))
              if e.name == mf.MARKER]
    if any(e.is_dir or e.is_special for e in marker):
        # A folder, link or FIFO where the marker goes: no writer of this run made it, and it would fail the
        # commit's create-only marker write. The step's folder goes to quarantine whole (a partial write of ours
        # in it is rewritten anyway).
        _or_conflict(lambda: quarantine(ctx, name, f"occupied the step this run commits: its {mf.MARKER} is not a "
                                                   "file"), f"{name}/{mf.MARKER} is not a file")
        return False
    return bool(marker)


def _or_conflict(move: Callable[[], object], what: str) -> None:
    """``move()``; CommitConflictError naming ``what`` when the store refuses it (nothing is written through)."""
    try:
        move()
    except (OSError, StoreError) as exc:
        raise CommitConflictError(f"{what} and could not be moved to quarantine: {exc}; refusing to write "
                                  "through it") from None


def _write_file(ctx: Ctx, name: str, fname: str, data: Data, attempt: str) -> tuple[int, str, str]:
    """Write one file create-only; return (bytes, sha256, object name)."""
    path = ctx.path(name, fname)
    spooled = isinstance(data, Spool)
    try:
        size, sha = ctx.io(f"write {name}/{fname}", lambda: ctx.backend.write(path, data, create_only=True))
        if spooled:
            _same_as_source(name, fname, (size, sha), (data.size, data.sha256))
        return size, sha, fname
    except FileExistsError:
        pass
    # Taken: our own PUT whose response was lost (the re-send got 412), a killed writer's leftover, or a
    # concurrent writer.  Identical bytes are ours to claim; anything else stays untouched beside our copy.
    # (Bytes are hashed here only: the backend hashed them while writing on the common path.)
    length, expected = (data.size, data.sha256) if spooled else (nbytes(data), dg.digest_bytes(data))
    if _same_object(ctx, name, fname, length, expected):
        return length, expected, fname
    obj = mf.attempt_object(fname, attempt)
    log.warning("%s/%s already exists without a %s (left by a killed or concurrent writer); "
                "writing this attempt's copy %s beside it", name, fname, mf.MARKER, obj)
    try:
        size, sha = ctx.io(f"write {name}/{obj}",
                           lambda: ctx.backend.write(ctx.path(name, obj), data, create_only=True))
        if spooled:
            _same_as_source(name, obj, (size, sha), (length, expected))
    except FileExistsError:  # the attempt id is ours alone: a 412 here is our own re-sent PUT
        size, sha = length, expected  # _verify reads it back before anything is marked usable
    return size, sha, obj


def _write_verified(ctx: Ctx, name: str, fname: str, data: LiveSpool) -> tuple[int, str, str] | None:
    """A spool still being written, published under its own name with its read-back from the device done while it
    was written (:class:`trainproof.storage.backend.VerifiesWhileWritten`), for :func:`_verify` not to read it
    again; None when the backend cannot (or the name is taken): :func:`_write_file` follows."""
    backend = ctx.backend
    if not isinstance(backend, VerifiesWhileWritten):
        return None
    try:
        got = ctx.io(f"write {name}/{fname}", lambda: backend.write_verified(
            ctx.path(name, fname), data, create_only=True, concurrency=ctx.concurrency))
    except FileExistsError:
        return None  # taken: the ordinary path finds out by whom
    if got is None:
        return None
    _read_back_as_written(name, fname, got, (data.size, data.sha256))
    return got[0], got[1], fname


def _read_back_as_written(name: str, obj: str, got: tuple[int, str], written: tuple[int, str]) -> None:
    """CorruptGenerationError unless the (bytes, digest) read back are those written (bytes -1: other bytes)."""
    if got != written:
        seen = f"{got[0]} bytes" if got[0] >= 0 else "other bytes"
        raise CorruptGenerationError(name, f"{obj} read back from the store differs from what was written "
                                           f"({seen} vs {written[0]}); not marking it usable")


def _same_as_source(name: str, obj: str, sent: tuple[int, str], source: tuple[int, str]) -> None:
    """A spool's file must still hold the bytes hashed when it was written (nothing changed it under us)."""
    if sent != source:
        raise CorruptGenerationError(name, f"{obj}: the bytes sent ({sent[0]}) differ from the serialised ones "
                                           f"({source[0]}); the local spool file changed while uploading")


def _same_object(ctx: Ctx, name: str, fname: str, size: int, sha: str) -> bool:
    if _sizes(ctx, name).get(fname) != size:  # cheap test first: a leftover of another size is never read
        return False
    stored = ctx.io(f"read {name}/{fname}", lambda: ctx.hashed(ctx.path(name, fname), size))
    return stored == (size, sha)


def _sizes(ctx: Ctx, name: str) -> dict[str, int]:
    """Size of every regular object in generation ``name`` (a symlink or pipe counts as absent)."""
    listing = ctx.io(f"list {name}", lambda: ctx.backend.listdir(ctx.path(name), limit=ctx.limits.scan_entries))
    return {e.name: e.size for e in listing if not e.is_dir and not e.is_special}


def _verify(ctx: Ctx, name: str, written: dict, check: Check | None, files: dict[str, Data],
            verified: set[str]) -> None:
    sizes = _sizes(ctx, name)
    for fname, (size, sha, obj) in written.items():
        if obj in sizes and sizes[obj] != size:  # the listing's size first: a wrong-sized object is not read
            raise CorruptGenerationError(name, f"{obj} is {sizes[obj]} bytes in the store, {size} were written; "
                                               "not marking it usable")
        path = ctx.path(name, obj)
        data = files[fname]
        try:
            if fname in verified:  # read back from the device while it was written (_write_verified)
                got = (size, sha)
            elif isinstance(data, Spool):
                # Hash it as parallel ranged reads: never more than the parts in flight in memory.  A spool's
                # content check then reads the spool, whose bytes this hash proves identical to the stored ones.
                got = ctx.io(f"verify {name}/{obj}", lambda: ctx.hashed(path, size))
            else:
                # In memory: read back as parallel ranges and compared with the source (whose sha256 the write
                # computed), so the stored bytes are the hashed ones; the content check then reads the source.
                same = nbytes(data) == size and ctx.io(f"verify {name}/{obj}", lambda d=data: ctx.matches(path, d))
                got = (size, sha) if same else (-1, "")
        except FileNotFoundError:
            raise CommitConflictError(f"{name}/{obj} vanished right after it was written (another process is "
                                      "deleting this run's files?); not marking it usable") from None
        _read_back_as_written(name, obj, got, (size, sha))
        # The manifest records the digest read back: the one verified, with its part list (a spool handed in with
        # only the root as a plain string would otherwise be listed without its parts, and fail every read).
        written[fname] = (size, got[1], obj)
        if check is not None:
            try:
                check(fname, data)
            except Exception as exc:
                raise CorruptGenerationError(name, f"{fname} failed the content check after writing: {exc}") from exc
        del data  # one file's bytes at a time


def _mark_usable(ctx: Ctx, name: str, manifest: dict) -> None:
    marker = ctx.path(name, mf.MARKER)
    raw = mf.dumps(manifest)
    if len(raw) > ctx.limits.manifest_bytes:  # every reader would refuse it: never commit what cannot be resumed
        raise StoreConfigError(
            f"{name}/{mf.MARKER} would be {len(raw)} bytes, over the {ctx.limits.manifest_bytes} a reader accepts "
            f"(Limits.manifest_bytes): too many files or parts; set {dg.PART_ENV} above "
            f"{dg.default_part_bytes() / 2**20:g} (MiB per hashed part) or write fewer files. Not marking it usable")
    try:
        ctx.io(f"commit {name}", lambda: ctx.backend.write(marker, raw, create_only=True))
        return
    except FileExistsError:
        pass
    # 412: maybe our own write, whose response was lost and which the retry then found.
    try:
        raw = ctx.io(f"read {name}/{mf.MARKER}", lambda: read_at_most(ctx.backend, marker, ctx.limits.manifest_bytes))
        theirs = mf.parse(raw, dir_name=name, limits=ctx.limits)
    except (mf.ManifestError, FileNotFoundError):
        theirs = {}
    if theirs.get("attempt") != manifest["attempt"]:
        raise CommitConflictError(f"{name} was committed by another writer (attempt {theirs.get('attempt', '?')}) "
                                  "while this one was writing; exactly one commit wins, this writer stops")
