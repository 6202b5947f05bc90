"""``GenerationStore``: the facade the job uses, and ``open_store(url)``."""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Iterator
from urllib.parse import urlparse

from trainproof.storage import manifest as mf
from trainproof.storage.ahead import FetchAhead, files_to_read
from trainproof.storage.backend import (
    FsspecBackend,
    LocalBackend,
    UploadsWhileWritten,
    VerifiesWhileWritten,
    join,
    read_at_most,
)
from trainproof.storage.commit import LATEST, clear_way, commit_generation, mark_usable, put_shared, write_part
from trainproof.storage.digest import Digest, FileHasher, of_parts
from trainproof.storage.errors import CorruptGenerationError, StoreConfigError, StoreError
from trainproof.storage.generations import (
    COMPLETE,
    CORRUPT,
    Check,
    Ctx,
    GenerationInfo,
    Loaded,
    checked,
    in_chain,
    load,
    read_parts,
    scan,
    verify_hashes,
)
from trainproof.storage.limits import loads_untrusted, plain_name_problem, redact_url
from trainproof.storage.options import StoreOptions
from trainproof.storage.quarantine import clear_for_folder, list_quarantined, move_aside, quarantine
from trainproof.storage.retention import DEFAULT_GRACE_SECONDS, RetentionPolicy, apply_retention
from trainproof.storage.retry import RetryStats, retry_or_unavailable
from trainproof.storage.spool import SPOOL_PREFIX, Spool, download

log = logging.getLogger("trainproof.storage")
SPOOL_FOLDER = ".spool"
"""Where a folder store's writer spools its states (GenerationStore.spool_folder), on the run's own file system."""
__all__ = ["GenerationStore", "open_store", "DEFAULT_GRACE_SECONDS"]


class GenerationStore:
    """Generations of one run under ``url``.  Thread-safe: it holds a backend (one client) and no buffers,
    so a commit can run on a background thread while training continues."""

    def __init__(self, backend, root: str, url: str, options: StoreOptions, *, _prepare: Callable | None = None,
                 _stats: RetryStats | None = None, _shared: bool = False) -> None:
        self.backend, self.root, self.url, self.options = backend, root, url, options
        self.stats = _stats or RetryStats()
        self._prepare = _prepare
        self._prepared = _prepare is None
        self._shared = _shared  # an S3 store
        self._lock = threading.Lock()
        self._soon: threading.Thread | None = None
        self._soon_lock = threading.Lock()
        self._prepare_error: BaseException | None = None
        """What preparing beside the caller (:meth:`prepare_soon`) raised, for the first write to raise."""
        self._ctx = Ctx(backend=backend, root=root, io=self._io, limits=options.limits, keys=options.signing,
                        part_size=options.part_size, concurrency=options.concurrency)
        self._ahead: FetchAhead | None = None
        self._ahead_lock = threading.Lock()
        self.fetched_ahead: str | None = None
        """The generation whose files a load took from :meth:`fetch_ahead` (None: none did)."""

    def __repr__(self) -> str:
        return f"GenerationStore({redact_url(self.url)!r})"

    @property
    def local_folder(self) -> str | None:
        """The run's folder on this machine (a folder store), else None (an object store, memory)."""
        return self.root if isinstance(self.backend, LocalBackend) else None

    @property
    def shared(self) -> bool:
        """Whether others may write here too (an object store), as opposed to a folder or memory of this machine."""
        return self._shared

    # -- plumbing ---------------------------------------------------------------------------------------
    def _io(self, what: str, fn: Callable):
        return retry_or_unavailable(self.options.retry, what, fn, self.stats, where=f" on {redact_url(self.url)}")

    def _before_write(self) -> None:
        # Probing and sweeping write to the store, so read-only users (ls, audit) never trigger them.
        with self._lock:
            if (failed := self._prepare_error) is not None:
                self._prepare_error = None  # raised once: a later write prepares again
                raise failed
            self._prepare_locked()

    def _prepare_locked(self) -> None:
        """Prepare the store unless it is (the caller holds ``_lock``)."""
        if not self._prepared:
            self._prepare(self)
            self._prepared = True

    def prepare_soon(self) -> None:
        """Start preparing the store for writing now, on a thread of its own, for a caller that will write (a
        trainer) and has set-up to do meanwhile: on S3 the create-only probe and the sweep of stale multipart
        uploads, 8-9 round trips one after the other that the first write otherwise makes first. That write waits
        for them and raises what they raised. Nothing for a store already prepared, or not shared (a folder)."""
        with self._soon_lock:  # not self._lock, which the preparation holds while it runs
            if self._prepared or self._soon is not None or not self._shared:
                return  # (a folder's preparation creates the run's folder: a start refused later leaves none)
            # Not a daemon: a start refused later (a bad --task) exits once the probe has deleted its objects.
            self._soon = threading.Thread(target=self._prepare_beside, name="trainproof-prepare")
            self._soon.start()

    def _prepare_beside(self) -> None:
        with self._lock:  # a write arriving meanwhile waits, then finds the store prepared or the error to raise
            try:
                self._prepare_locked()
            except BaseException as exc:
                self._prepare_error = exc

    def child(self, relpath: str) -> "GenerationStore":
        """A store rooted at ``<run>/<relpath>`` sharing this one's client and checks."""
        relpath = relpath.strip("/")
        if not relpath or ".." in relpath.split("/"):
            raise ValueError(f"invalid child path {relpath!r}")
        child = GenerationStore(self.backend, join(self.root, relpath), f"{self.url.rstrip('/')}/{relpath}",
                                self.options, _stats=self.stats)
        child._prepared, child._shared = True, self._shared
        if not self._prepared:  # share the one-time preparation
            child._prepared, child._prepare = False, lambda _c: self._before_write()
        return child

    def fetch_ahead(self, contract: Callable[[], str | None], *, spool_dir: str, spool_from: int | None = None,
                    skip: Callable[[str], bool] | None = None) -> None:
        """Start downloading the newest complete generation of the contract ``contract()`` names (called on that
        thread; None: nothing to fetch) now, on a thread of its own, for a caller that will load it (a trainer's
        resume) and has set-up to do meanwhile. The next :meth:`usable` or :meth:`load` takes it when it reaches that
        generation, complete, with the same manifest, the same files (``skip``) and spool settings; otherwise it is
        cancelled and deleted (``trainproof.storage.ahead``), as by :meth:`discard_ahead`. Read-only; a failure is
        met again by the load itself."""
        with self._ahead_lock:
            if self._ahead is None:
                self._ahead = FetchAhead(self._ctx, contract=contract, spool_dir=spool_dir, spool_from=spool_from,
                                         skip=skip)

    def discard_ahead(self) -> None:
        """Cancel a fetch ahead no load took (the caller is done loading) and delete its files (a download still
        running deletes its partial file at its next read; at the latest, the process's exit waits for it:
        ``trainproof.storage.ahead.wind_up``)."""
        with self._ahead_lock:
            ahead, self._ahead = self._ahead, None
        if ahead is not None:
            ahead.discard()

    def _load(self, info: GenerationInfo, check: Check | None, names: list[str] | None, *, spool_dir: str | None,
              spool_from: int | None) -> Loaded:
        """Generation ``info`` read and verified (``trainproof.storage.generations.load``), or taken from the fetch
        ahead when that fetched it (the first load after :meth:`fetch_ahead` takes it or cancels it)."""
        with self._ahead_lock:
            ahead, self._ahead = self._ahead, None
        fetched = None if ahead is None else ahead.take(info, names, spool_dir=spool_dir, spool_from=spool_from)
        if fetched is None:
            return load(self._ctx, info, check, names, spool_dir=spool_dir, spool_from=spool_from)
        self.fetched_ahead = info.name
        return checked(info, fetched.files, check)

    # -- generations ------------------------------------------------------------------------------------
    def commit(self, step: int, files: dict[str, bytes], *, contract: str, world: int, code_version: str,
               check: Check | None = None, extra: dict | None = None, digests: dict[str, str] | None = None,
               retention: RetentionPolicy | None = None,
               shared: dict[str, tuple[int, str]] | None = None) -> GenerationInfo:
        """Write → verify (read back from the store) → mark usable generation ``step``; then, when ``retention`` is
        given, apply it (to this generation's contract unless it names one).  ``shared``: files of the generation
        already stored once for the run (:meth:`put_shared`: name → its (bytes, sha256)), referenced, not written.
        See ``trainproof.storage.commit`` for the guarantees."""
        self._before_write()
        manifest = commit_generation(self._ctx, step, files, contract=contract, world=world, code_version=code_version,
                                     check=check, digests=digests, extra=extra, shared=shared)
        return self._committed(step, manifest, retention)

    def put_shared(self, data: Spool) -> tuple[int, str]:
        """Store ``data`` once for the run, content-addressed (``shared/<sha256>``), verified read back; its (bytes,
        sha256) for the ``shared`` argument of :meth:`commit`/:meth:`commit_parts`. Retention deletes such an object
        only once no generation left references it (``RetentionPolicy.shared``)."""
        self._before_write()
        return put_shared(self._ctx, data)

    def _committed(self, step: int, manifest: dict, retention: RetentionPolicy | None) -> GenerationInfo:
        info = GenerationInfo(step=step, name=mf.step_dir(step), status=COMPLETE, manifest=manifest,
                              bytes=sum(m["bytes"] for m in manifest["files"].values() if not m.get("shared")),
                              mtime=time.time())  # what the generation holds itself (a shared object is the run's)
        if retention is not None:  # only this run's contract counts: a stranger's generation is never "the newest"
            self.apply_retention(retention if retention.contract else replace(retention, contract=manifest["contract"]))
        return info

    def write_part(self, step: int, files: dict[str, Any], *, check: Check | None = None) -> dict[str, list]:
        """Write and verify part of generation ``step`` (e.g. one rank's files) without marking it usable. A file is
        bytes, :class:`trainproof.storage.pieces.Pieces` (buffers written back to back, never joined; unchanged until
        this returns) or a :class:`trainproof.storage.spool.Spool`.
        Returns the entries (name → [bytes, sha256, object, parts]) to hand to ``commit_parts``, JSON-serialisable
        so they can travel to the committing process (``parts``: the part digests of a file of several parts,
        ``trainproof.storage.digest``, else {})."""
        self._before_write()
        return {k: [size, str(sha), obj, _parts(sha)]
                for k, (size, sha, obj) in write_part(self._ctx, step, files, check=check).items()}

    def clear_step(self, step: int, *, contract: str, code_version: str) -> None:
        """Clear the way for generation ``step`` before several writers write its parts (one per rank): whatever
        occupies it and cannot be this run's own (a file, a link, a folder of the wrong shape, another run's,
        contract's or build's generation) is moved to quarantine, once, by the one writer that calls this; then the
        parts are written past nothing. CommitConflictError when this run's own writer committed the step."""
        self._before_write()
        clear_way(self._ctx, mf.step_dir(step), contract, code_version)

    def commit_parts(self, step: int, entries: dict[str, list], *, contract: str, world: int, code_version: str,
                     extra: dict | None = None, digests: dict[str, str] | None = None,
                     retention: RetentionPolicy | None = None,
                     shared: dict[str, tuple[int, str]] | None = None) -> GenerationInfo:
        """Mark generation ``step`` usable from the entries that ``write_part`` returned (possibly in several
        processes) and the ``shared`` objects it references (:meth:`put_shared`): every listed object must be in the
        store with its size; then COMPLETE.json, create-only."""
        self._before_write()
        written = {k: (int(v[0]), _digest(k, v), str(v[2])) for k, v in entries.items()}
        manifest = mark_usable(self._ctx, step, written, contract=contract, world=world, code_version=code_version,
                               digests=digests, extra=extra, shared=shared)
        return self._committed(step, manifest, retention)

    def scan(self, *, contract: str | None = None, world: int | None = None) -> list[GenerationInfo]:
        """Every generation, ascending, classified complete / incomplete / corrupt / foreign (no hashing); never
        raises on what it finds, keeps only names of generations from the listing (a flood of other ``step-*``
        names costs time, not memory), and raises ListingIncompleteError rather than return part of the run when
        it cannot finish within ``Limits.scan_seconds``."""
        return scan(self._ctx, contract=contract, world=world)

    def load(self, step: int, check: Check | None = None, *, contract: str | None = None,
             world: int | None = None, spool_dir: str | None = None, spool_from: int | None = None,
             skip: Callable[[str], bool] | None = None) -> Loaded:
        """Generation ``step``, every file read (never more than its manifest's size) and verified;
        CorruptGenerationError if it is not usable. ``spool_dir``: large files are downloaded into spool files
        there instead of memory (``trainproof.storage.generations.load``); the caller deletes them with
        ``Loaded.close()``.
        ``skip``: files (by name) not to read here, e.g. shards that each process reads and verifies itself."""
        info = in_chain(self._ctx, mf.step_dir(step), contract=contract, world=world)
        return self._load(info, check, files_to_read(info, skip), spool_dir=spool_dir, spool_from=spool_from)

    def generation(self, step: int, *, contract: str | None = None, world: int | None = None) -> GenerationInfo:
        """What discovery says about generation ``step`` (no hashing): its status and, when usable, its manifest."""
        return in_chain(self._ctx, mf.step_dir(step), contract=contract, world=world)

    def load_files(self, info: GenerationInfo, names: list[str], check: Check | None = None) -> Loaded:
        """Only ``names`` of the complete generation ``info`` (as ``generation`` returned it: that manifest, read
        once, vouches for every file), each read and verified like ``load``; CorruptGenerationError otherwise."""
        return load(self._ctx, info, check, names=list(names))

    def read_parts(self, info: GenerationInfo, fname: str, sink: Callable[[int, bytes], None],
                   wanted: list[tuple[int, int]] | None = None) -> None:
        """File ``fname`` of the complete generation ``info`` handed to ``sink(offset, data)`` in order, a verified
        part at a time when its entry lists parts (only the parts holding a ``wanted`` byte range, when given),
        else whole after verification (``trainproof.storage.generations``); CorruptGenerationError naming the part that
        does not match."""
        read_parts(self._ctx, info, fname, sink, wanted)

    def verify(self, step: int, *, contract: str | None = None, world: int | None = None) -> str | None:
        """Re-read generation ``step`` streaming every file through sha256 (never a whole file in memory):
        None when it is complete and every file matches its manifest, else why not (for ``ls --verify``)."""
        return verify_hashes(self._ctx, in_chain(self._ctx, mf.step_dir(step), contract=contract, world=world))

    def load_latest(self, *, contract: str | None = None, world: int | None = None, check: Check | None = None,
                    quarantine: bool = True, spool_dir: str | None = None, spool_from: int | None = None,
                    skip: Callable[[str], bool] | None = None) -> Loaded | None:
        """The newest usable generation, or None (the first of :meth:`usable`, which says what is skipped)."""
        return next(self.usable(contract=contract, world=world, check=check, quarantine=quarantine,
                                spool_dir=spool_dir, spool_from=spool_from, skip=skip), None)

    def usable(self, *, contract: str | None = None, world: int | None = None, check: Check | None = None,
               quarantine: bool = True, spool_dir: str | None = None, spool_from: int | None = None,
               skip: Callable[[str], bool] | None = None) -> Iterator[Loaded]:
        """Every usable generation, newest first, each read and verified only when reached (one listing). Those
        that are partial, corrupt or foreign are skipped with one warning line each; corrupt ones are moved to
        quarantine when ``quarantine`` (a read-only caller such as an audit passes False).
        ``spool_dir``/``spool_from``/``skip``: as for :meth:`load`."""
        for info in reversed(self.scan(contract=contract, world=world)):
            if info.status == COMPLETE:
                try:
                    loaded = self._load(info, check, files_to_read(info, skip), spool_dir=spool_dir,
                                        spool_from=spool_from)
                except CorruptGenerationError as exc:
                    info = GenerationInfo(**{**info.__dict__, "status": CORRUPT, "reason": exc.reason})
                else:
                    yield loaded
                    continue
            self._skip(info, quarantine)

    def _skip(self, info: GenerationInfo, do_quarantine: bool) -> None:
        log.warning("skipping %s (%s): %s", info.name, info.status, info.reason)
        if info.status == CORRUPT and do_quarantine:
            self._before_write()
            try:
                quarantine(self._ctx, info.name, info.reason)
            except (OSError, StoreError) as exc:
                log.warning("could not quarantine %s (%s); it stays in place and keeps being skipped", info.name, exc)

    def quarantine(self, step: int, reason: str) -> str:
        """Move generation ``step`` aside with a REASON file (evidence kept); its step can be committed again."""
        self._before_write()
        return quarantine(self._ctx, mf.step_dir(step), reason)

    def clear_for_folder(self, name: str, reason: str) -> bool:
        """Where the run keeps a folder at ``name``: move aside what occupies it without being one (a file, a link, a
        FIFO), so the folder is never written through; whether something was moved."""
        self._before_write()
        return clear_for_folder(self._ctx, name, reason)

    def move_aside(self, name: str, reason: str) -> str:
        """Move what occupies the run-level name ``name`` (a folder, a link, a FIFO where the run keeps a file) into
        quarantine with a REASON file, the entry itself, so the run can write its file there; the folder's name."""
        self._before_write()
        return move_aside(self._ctx, name, reason)

    def quarantined(self) -> list[tuple[str, str]]:
        """(folder, reason) of every quarantined generation."""
        return list_quarantined(self._ctx)

    def apply_retention(self, policy: RetentionPolicy, *, dry_run: bool = False,
                        on_shared: Callable[[str], None] | None = None) -> list[GenerationInfo]:
        """Delete what ``plan_retention`` selects under ``policy`` (never the newest complete generation of its
        contract and world, nor anything newer; never foreign, corrupt or symlinked ones), after re-verifying the
        newest kept generation's sha256s; return what was (or, with ``dry_run``, would be) deleted. Then the objects
        under ``shared/`` no generation left references, as ``policy.shared`` says, each named to ``on_shared``."""
        return apply_retention(self._ctx, policy, dry_run=dry_run, before_write=self._before_write,
                               on_shared=on_shared)

    def latest_hint(self) -> str | None:
        """What ``LATEST`` says (a hint only) when it names a generation (``step-%08d``), else None."""
        try:
            raw = self.read_file(LATEST, max_bytes=self.options.limits.small_json_bytes)
        except OSError:  # missing, or (on a folder) a symlink or a pipe in its place: no hint
            return None
        text = raw.decode("utf-8", "replace").strip() if len(raw) <= self.options.limits.small_json_bytes else ""
        if mf.parse_step_dir(text) is None:  # a hint only: anything else (junk, a huge file) is no hint
            if text or raw:
                log.warning("ignoring the LATEST hint of %s: it does not name a generation", redact_url(self.url))
            return None
        return text

    # -- run-level files (plan.json, summary.json, verification.json) -----------------------------------
    def write_file(self, name: str, data: bytes, *, create_only: bool = False) -> None:
        """Write a run-level file; FileExistsError when ``create_only`` and it exists."""
        self._before_write()
        path = join(self.root, name)
        self._io(f"write {name}", lambda: self.backend.write(path, data, create_only=create_only))

    def read_file(self, name: str, *, max_bytes: int | None = None) -> bytes:
        """A run-level file's bytes; FileNotFoundError when missing.  With ``max_bytes``, never more than
        ``max_bytes + 1`` bytes are read (a longer result means the file is too big)."""
        path = join(self.root, name)
        if max_bytes is None:
            return self._io(f"read {name}", lambda: self.backend.read(path))
        return self._io(f"read {name}", lambda: read_at_most(self.backend, path, max_bytes))

    def download_file(self, name: str, *, max_bytes: int | None = None, directory: str | None = None) -> Spool:
        """A file under the store's root (a plain name) fetched into a new local spool file (``directory``, default
        ``trainproof.storage.spool.spool_dir()``) in parallel ranged reads, hashed as it arrives: the spool's ``sha256``
        is the
        *plain* sha256 of the bytes read (what ``sha256sum`` prints), for the caller to compare with what it
        expects. FileNotFoundError when there is no such file; ValueError when it is larger than ``max_bytes``
        (default ``Limits.file_bytes``) or changed size while being read. The caller deletes the spool."""
        problem = plain_name_problem(name)
        if problem:
            raise ValueError(f"cannot download {name!r}: {problem}")
        cap = self.options.limits.file_bytes if max_bytes is None else max_bytes
        listed = self._io(f"list {name}", lambda: self.backend.listdir(self.root, prefix=name))
        found = [e for e in listed if e.name == name and not e.is_dir and not e.is_special]
        if not found:
            raise FileNotFoundError(f"{redact_url(self.url)}/{name} does not exist")
        size = found[0].size
        if size > cap:
            raise ValueError(f"{redact_url(self.url)}/{name} is {size} bytes, more than the {cap} allowed")
        path = join(self.root, name)
        read = lambda start, end: self.backend.read_range(path, start, end)  # noqa: E731

        def fetch() -> Spool:
            spool, seen, sha = download(read, size, directory, part_size=self.options.part_size,
                                        concurrency=self.options.concurrency, hasher=FileHasher.plain())
            if seen != size:
                spool.unlink()
                raise ValueError(f"{redact_url(self.url)}/{name} changed size while it was read "
                                 f"({size} bytes listed, {seen} read)")
            return spool
        return self._io(f"download {name}", fetch)

    def read_json(self, name: str, *, max_bytes: int | None = None) -> object:
        """A run-level JSON file (plan.json, summary.json…), parsed defensively (``trainproof.storage.limits``):
        ValueError when it is too big (default ``Limits.manifest_bytes``), not JSON, too deep, or holds NaN or a huge
        integer; FileNotFoundError when missing."""
        cap = self.options.limits.manifest_bytes if max_bytes is None else max_bytes
        return loads_untrusted(self.read_file(name, max_bytes=cap), what=name, max_bytes=cap)

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of a run-level object (fewer when it ends sooner), retried like every read;
        FileNotFoundError when missing. What ``trainproof.storage.objects`` reads verified parts with."""
        path = join(self.root, name)
        return self._io(f"read {name} bytes {start}..{end}", lambda: self.backend.read_range(path, start, end))

    def exists(self, name: str) -> bool:
        return self._io(f"check {name}", lambda: self.backend.exists(join(self.root, name)))

    # -- folders of run-level data (verification/<id>/...) ------------------------------------------------
    def list_dir(self, relpath: str = "", *, limit: int | None = None) -> list:
        """Direct children (``trainproof.storage.backend.Entry``: name, size, is_dir, mtime) of ``<run>/<relpath>``,
        fresh; with ``limit``, at most ``limit + 1`` (the rest is not listed)."""
        path = join(self.root, relpath.strip("/")) if relpath.strip("/") else self.root
        return self._io(f"list {relpath or '.'}", lambda: self.backend.listdir(path, limit=limit))

    def entries(self, name: str) -> list:
        """The run-level entries named ``name`` (``Entry``; on S3 an object and a folder may share a name), fresh:
        whether a name the run keeps a folder at is one, or a file, a link or a FIFO someone put there."""
        return [e for e in self._io(f"list {name}", lambda: self.backend.listdir(self.root, prefix=name))
                if e.name == name]

    @property
    def uploads_while_written(self) -> bool:
        """Whether a :class:`trainproof.storage.spool.LiveSpool` handed to :meth:`commit` is uploaded while it is
        written (S3), so a writer should start the commit as soon as it starts serialising; elsewhere the commit
        waits for the finished spool, and the writer gains nothing by it."""
        return isinstance(self.backend, UploadsWhileWritten) and self.backend.uploads_while_written is True

    @property
    def verifies_while_written(self) -> bool:
        """Whether a :class:`trainproof.storage.spool.LiveSpool` made in :meth:`spool_folder` and handed to
        :meth:`commit` is read back from the device while it is written (a folder), so the commit's verification
        runs beside the serialisation."""
        return isinstance(self.backend, VerifiesWhileWritten)

    def spool_folder(self) -> str | None:
        """A folder on the run's own file system for the writer's spools (a folder store; None for an object
        store): a spool made there is linked into its generation instead of copied, so a commit writes the state
        once. What occupies the name (a file, a link, a FIFO) is moved aside first; spools a killed writer left
        there are deleted (call it once, in the run's one writer, before its first save). None, with a warning, when
        no folder can be had there."""
        if self.local_folder is None:
            return None
        self._before_write()
        path = join(self.root, SPOOL_FOLDER)
        try:
            self.clear_for_folder(SPOOL_FOLDER, "not a folder, where the run's writer keeps its spools")
            os.makedirs(path, exist_ok=True)
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                raise OSError(errno.ENOTDIR, "not a folder")
            for entry in os.scandir(path):
                if entry.name.startswith(SPOOL_PREFIX) and entry.is_file(follow_symlinks=False):
                    log.info("deleting %s/%s, a spool a writer that ended left", SPOOL_FOLDER, entry.name)
                    os.unlink(entry.path)
        except (OSError, StoreError) as exc:
            log.warning("cannot use %s in the run's folder for spools (%s): states are spooled to the temp folder "
                        "and copied", SPOOL_FOLDER, exc)
            return None
        return path

    def delete_tree(self, relpath: str) -> None:
        """Delete ``<run>/<relpath>`` and everything under it (a generation loses its COMPLETE.json first, so an
        interrupted delete leaves it incomplete, never complete and partial). Never the run's root."""
        relpath = relpath.strip("/")
        if not relpath or ".." in relpath.split("/"):
            raise ValueError(f"invalid path to delete {relpath!r}")
        self._before_write()
        path = join(self.root, relpath)
        self._io(f"delete {relpath}/{mf.MARKER}", lambda: self.backend.delete(join(path, mf.MARKER)))
        self._io(f"delete {relpath}", lambda: self.backend.delete_tree(path))


# ---------------------------------------------------------------------------------------------------------
def _parts(sha: str) -> dict:
    entry = sha.entry() if isinstance(sha, Digest) else {}
    return {k: entry[k] for k in ("parts", "part_bytes") if k in entry}


def _digest(name: str, entry: list) -> str:
    """The digest of a ``write_part`` entry, with its parts; refuses an entry whose parts do not make its sha256."""
    extra = entry[3] if len(entry) > 3 and isinstance(entry[3], dict) else {}
    if not extra.get("parts"):
        return str(entry[1])
    digest = of_parts(list(extra["parts"]), int(extra["part_bytes"]))
    if digest != entry[1]:
        raise ValueError(f"the entry of {name!r} lists parts that do not hash to its sha256")
    return digest


def open_store(url: str, options: StoreOptions | None = None) -> GenerationStore:
    """Open the run at ``url``: ``s3://bucket/prefix/run``, ``file:///abs/path``, a plain path, ``memory://name``.

    For S3 this checks the bucket and credentials now (StoreConfigError, one clear line) and, before the
    first write, probes that the endpoint honours create-only writes and sweeps stale multipart uploads.
    """
    if not url or not url.strip():
        raise StoreConfigError("empty --store URL: pass s3://bucket/prefix/run, file:///path, a folder, or memory://name")
    problem = url_problem(url)
    if problem:
        raise StoreConfigError(f"the store URL {redact_url(url)} {problem}")
    options = options or StoreOptions.from_env()
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt"):
        root = _local_root(url, parsed)
        if os.path.exists(root) and not os.path.isdir(root):
            raise StoreConfigError(f"--store {redact_url(url)} is a file, not a folder")
        _refuse_file_ancestor(url, root)
        return GenerationStore(LocalBackend(), root, url, options, _prepare=lambda _store: _writable_folder(url, root))
    if scheme == "memory":
        from fsspec.implementations.memory import MemoryFileSystem
        root = "/" + (parsed.netloc + parsed.path).strip("/")
        return GenerationStore(FsspecBackend(MemoryFileSystem()), root, url, options)
    if scheme in ("s3", "s3a"):
        return _open_s3(url, parsed, options)
    raise StoreConfigError(f"unsupported store URL scheme {scheme!r} in {redact_url(url)}: "
                           "use s3://, file://, a folder, or memory://")


SCHEMES = ("s3", "s3a", "file", "memory")
"""The URL schemes a store can be opened at; anything else with ``://`` is refused."""
# A word followed by ':' or '//' but not '://' (``s3//bucket``, ``s3:/bucket``, ``s3:bucket``, ``gs//b``): a URL
# whose scheme separator was mistyped. Left alone, it is a relative folder (``./s3/bucket``) or an S3 URL without
# a bucket, and a run would write somewhere its operator does not look (and lose it with the machine).
_MISTYPED = re.compile(r"^(?:(s3a?|s3n|gs|gcs|az|abfss?|adl|file|memory|https?|hdfs|hf|oss|r2)//"
                       r"|([A-Za-z][A-Za-z0-9+.-]*):/?(?!/))", re.I)
_USE = "s3://bucket/prefix, file:///abs/path, a folder, or memory://name"
_OTHER = {
    "gs": "for Google Cloud Storage use its S3 API: s3://bucket/prefix with --endpoint-url "
          "https://storage.googleapis.com and HMAC keys in AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY",
    "http": "an S3 server's address goes in --endpoint-url (or AWS_ENDPOINT_URL), the store in s3://bucket/prefix",
}
_OTHER["gcs"], _OTHER["https"] = _OTHER["gs"], _OTHER["http"]


def url_problem(url: str) -> str | None:
    """Why ``url`` cannot name a store, as the end of a one-line error naming what was probably meant; None when
    it can. A plain path (``runs/demo``, ``./s3/x``, ``/abs``) stays plain."""
    mistyped = _MISTYPED.match(url)
    if mistyped and not (os.name == "nt" and len(mistyped.group(0)) <= 3):  # ``C:/x``: a drive letter on Windows
        scheme = (mistyped.group(1) or mistyped.group(2)).lower()
        rest = url[mistyped.end():].lstrip("/:")
        if scheme not in SCHEMES:
            return f"looks like a URL ({scheme}:): for a folder of that name write ./{url}, else use {_USE}"
        meant = f"file:///{rest}" if scheme == "file" else f"{scheme}://{rest}"
        return f"looks like a URL with a mistyped '://': did you mean {meant}? (a folder of that name: ./{url})"
    parsed = urlparse(url)
    scheme = parsed.scheme.lower()
    if "://" in url and scheme not in SCHEMES:
        return f"has an unsupported store URL scheme, {scheme}://: {_OTHER.get(scheme, 'use ' + _USE)}"
    if scheme == "file" and parsed.netloc not in ("", "localhost"):
        return (f"names the host {parsed.netloc!r} (a file URL's path starts after the third slash): did you mean "
                f"file:///{parsed.netloc}{parsed.path} or the folder {parsed.netloc}{parsed.path}?")
    return None


def _refuse_file_ancestor(url: str, root: str) -> None:
    """A folder under a *file* can never be created: say so now (exit 2), not after every write's retries."""
    parent = os.path.dirname(root)
    while parent and not os.path.exists(parent) and parent != os.path.dirname(parent):
        parent = os.path.dirname(parent)
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise StoreConfigError(f"--store {redact_url(url)}: {parent} is a file, so no folder can be made under it; "
                               "choose a path under a folder")


def create_store(url: str, options: StoreOptions | None = None) -> tuple[GenerationStore, bool]:
    """Make what ``url`` names when it does not exist (an S3 bucket, a folder), then check it as a run will use it:
    listed, and written (the create-only probe on S3). (the store, whether a bucket or folder was made);
    StoreConfigError naming what is wrong."""
    options = options or StoreOptions.from_env()
    problem = url_problem(url) if url and url.strip() else "is empty"
    parsed, made = urlparse(url), False
    if not problem and parsed.scheme.lower() in ("s3", "s3a"):
        from trainproof.storage.s3 import S3Backend

        bucket, _ = _s3_location(url, parsed, options)
        stats = RetryStats()
        backend = S3Backend(options, stats)
        made = retry_or_unavailable(options.retry, f"create bucket {bucket}", lambda: backend.create_bucket(bucket),
                                    stats)
    elif not problem and parsed.scheme.lower() in ("", "file"):
        made = not os.path.exists(_local_root(url, parsed))
    store = open_store(url, options)  # refuses what ``problem`` names, with its own message
    store._before_write()
    return store, made


def _writable_folder(url: str, root: str) -> None:
    """Before the first write to a folder store: a folder that cannot be made or written (a read-only mount, no
    permission) is one line naming it (exit 2: retrying cannot help), not an OSError from a temporary file's
    name (exit 1, which a Job controller would retry forever). Readers (ls, audit) never get here."""
    try:
        os.makedirs(root, exist_ok=True)
        if not os.access(root, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), root)
    except OSError as exc:
        why = exc.strerror or type(exc).__name__
        raise StoreConfigError(f"--store {redact_url(url)}: the folder {exc.filename or root} cannot be written "
                               f"({why}): use a writable folder (or mount it read-write)") from None


def endpoint_problem(url: str) -> str | None:
    """Why ``url`` cannot be an S3 endpoint (None when it can): http or https, a host, a valid port, and nothing
    else (credentials belong in the AWS variables, and a query string or fragment would be printed in logs)."""
    try:
        parsed = urlparse(url)
        port = parsed.port
    except ValueError as exc:
        return f"is malformed ({exc})"
    if parsed.scheme.lower() not in ("http", "https"):
        return "is not http:// or https://"
    if parsed.username is not None or parsed.password is not None or "@" in parsed.netloc:
        return "holds credentials, which are not supported (use AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
    if not parsed.hostname:
        return "names no host"
    if parsed.query or parsed.fragment or parsed.params:
        return "has a query string or fragment"
    if port == 0:
        return "has port 0"
    return None


def _s3_location(url: str, parsed, options: StoreOptions) -> tuple[str, str]:
    """(bucket, prefix) of an s3:// store URL; StoreConfigError for what cannot work (no request is made)."""
    bucket, prefix = parsed.netloc, parsed.path.strip("/")
    # Credentials in the URL would end up in logs and process listings: refuse them.  A bucket name never holds
    # '@' or ':'; a ':' there is "KEY:SECRET" whose secret held a '/' (which ended the authority early).
    if "@" in bucket or ":" in bucket:
        raise StoreConfigError(f"credentials in the store URL {redact_url(url)} are not supported: use "
                               "AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE or an IAM role")
    if not bucket:
        raise StoreConfigError(f"no bucket in {redact_url(url)}: use s3://bucket/prefix/run")
    if parsed.query or parsed.fragment or parsed.params:  # it would be dropped, and printed in every log line
        raise StoreConfigError(f"the store URL {redact_url(url)} has a query string or fragment: "
                               "use s3://bucket/prefix/run")
    if options.endpoint_url:
        problem = endpoint_problem(options.endpoint_url)
        if problem:
            raise StoreConfigError(f"the S3 endpoint URL {redact_url(options.endpoint_url)} {problem}: pass "
                                   "http(s)://host[:port] in --endpoint-url or AWS_ENDPOINT_URL")
    return bucket, prefix


def _local_root(url: str, parsed) -> str:
    """The folder a plain path or file:// URL names, absolute."""
    return os.path.abspath(os.path.expanduser(parsed.path if parsed.scheme.lower() == "file" else url))


def _open_s3(url: str, parsed, options: StoreOptions) -> GenerationStore:
    from trainproof.storage.s3 import S3Backend

    bucket, prefix = _s3_location(url, parsed, options)
    stats = RetryStats()
    backend = S3Backend(options, stats)
    # The whole retry budget (docs/storage.md: 6 attempts, 120 s): a MinIO pod still starting is exactly this case, and
    # giving up sooner would fail a Job attempt that waiting would have saved.
    retry_or_unavailable(options.retry, f"check bucket {bucket}", lambda: backend.check_access(bucket, prefix), stats)
    root = join(bucket, prefix) if prefix else bucket

    def prepare(store: GenerationStore) -> None:
        if options.create_only == "private":
            return  # nobody else writes here: no probe object, no sweep (see StoreOptions.create_only)
        probe = join(root, ".trainproof-probe")
        if not store._io("probe create-only writes", lambda: backend.probe_create_only(probe)):
            where = redact_url(options.endpoint_url) if options.endpoint_url else "AWS S3"
            if options.create_only == "require":
                raise StoreConfigError(
                    f"the S3 endpoint {where} ignores If-None-Match: * (create-only writes), so two writers could "
                    "both commit one step; upgrade the server, or accept the risk with TRAINPROOF_S3_CREATE_ONLY=weak")
            log.warning("the S3 endpoint %s ignores create-only writes; "
                        "continuing in weak mode (one writer only!)", where)
        if options.sweep_multipart_older_than is not None and prefix:
            older = options.sweep_multipart_older_than
            store._io("sweep multipart uploads", lambda: backend.sweep_multipart(bucket, prefix, older))

    return GenerationStore(backend, root, url, options, _prepare=prepare, _stats=stats, _shared=True)


__all__ = ["GenerationStore", "create_store", "open_store"]
