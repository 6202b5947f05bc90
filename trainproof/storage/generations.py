"""Discovery: what generations exist, which are usable, and verified loading.

A generation is usable because its ``COMPLETE.json`` exists and checks out (schema, step, contract, world,
every listed file present with the listed size, and, when loaded, the listed sha256) — never because its
folder exists.  Anything else is reported with the reason and skipped, never raised on, never deleted here.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable

from trainproof.storage import manifest as mf
from trainproof.storage import signing
from trainproof.storage.backend import (
    CHUNK,
    Backend,
    Entry,
    ListsTrees,
    ReadsIntoBuffers,
    hash_object,
    iter_listing,
    join,
    read_at_most,
    read_hashed,
    reads_in_parallel,
)
from trainproof.storage.digest import FileHasher, cores, hasher_for
from trainproof.storage.errors import CorruptGenerationError, ListingIncompleteError, not_a_file
from trainproof.storage.limits import Limits
from trainproof.storage.pieces import as_pieces
from trainproof.storage.spool import CONCURRENCY, PART_SIZE, Spool, download, hashed_parts, hashed_ranges, in_order

log = logging.getLogger("trainproof.storage")

COMPLETE, INCOMPLETE, CORRUPT, FOREIGN = "complete", "incomplete", "corrupt", "foreign"
PLAN = "plan.json"  # the run's identity (written by the job); its digest anchors a signed run's chain
Check = Callable[[str, "bytes | Spool"], None]
"""A caller's content check of one file: its bytes, or the :class:`Spool` holding them (large objects)."""


@dataclass(frozen=True)
class GenerationInfo:
    """One ``step-%08d`` folder and what discovery concluded about it."""

    step: int
    name: str
    status: str
    """complete | incomplete | corrupt | foreign"""
    reason: str = ""
    manifest: dict | None = None
    bytes: int = 0
    mtime: float | None = None
    """Newest modification time among its objects (seconds since the epoch), when the store reports one."""
    digest: str | None = None
    """sha256 of its COMPLETE.json bytes, set only when a signing key is configured and the manifest is signed,
    of this run (anchor) and in chain (``trainproof.storage.signing``): what a successor names as its predecessor."""


@dataclass(frozen=True)
class Loaded:
    """A generation whose every file was read back and verified: as bytes, or, for a spooled load, as
    :class:`Spool` files the caller maps and then deletes (:meth:`close`)."""

    info: GenerationInfo
    files: dict[str, "bytes | Spool"] = field(repr=False)

    def close(self) -> None:
        """Delete the spool files of a spooled load (tensors already mapped from them stay valid)."""
        for data in self.files.values():
            if isinstance(data, Spool):
                data.unlink()


@dataclass(frozen=True)
class Ctx:
    """What the discovery/commit/retention functions work on: a backend, a root, the retry wrapper, the caps."""

    backend: Backend
    root: str
    io: Callable  # io(what, fn) -> fn() with bounded retries
    limits: Limits = field(default_factory=Limits)
    keys: signing.Keyring | None = None
    """With keys, manifests are signed and chained when committed, and checked when discovered."""
    part_size: int = PART_SIZE
    """Bytes per ranged read of a large object (read-back verify and spooled loads)."""
    concurrency: int = CONCURRENCY
    """Ranged reads in flight at once."""
    stop: Callable[[], None] | None = None
    """Called before each ranged read of a spooled load; what it raises stops the load (a fetch ahead cancelled,
    ``trainproof.storage.ahead``)."""

    def read_range(self, path: str, start: int, end: int) -> bytes:
        """Bytes ``start:end`` of the object at ``path`` for a spooled load (``stop`` first)."""
        if self.stop is not None:
            self.stop()
        return self.backend.read_range(path, start, end)

    def transfer(self) -> dict[str, int]:
        """Part size and concurrency of ranged reads on this backend (parallel on S3, one chunk at a time on a
        local disk, where one thread reads and hashes and another writes the spool; a pure read-back is parallel
        everywhere, :meth:`hashed`)."""
        if reads_in_parallel(self.backend):
            return {"part_size": self.part_size, "concurrency": self.concurrency}
        return {"part_size": CHUNK, "concurrency": 1}

    def hashed(self, path: str, size: int, sink=None, hasher: FileHasher | None = None) -> tuple[int, str]:
        """(bytes seen, digest) of the object at ``path``, read as parallel ranges (``trainproof.storage.spool``): at
        most
        ``size + 1`` bytes, ``part_size × (concurrency + 1)`` in memory. ``hasher``: the entry's
        (``trainproof.storage.digest.hasher_for``); default, a new file's."""
        read = lambda a, b: self.backend.read_range(path, a, b)  # noqa: E731
        if size == 0:  # S3 refuses a ranged read of an empty object (416): one plain read
            return hash_object(self.backend, path, 0, hasher)
        if sink is None:  # a pure read-back: the digest's parts are hashed on the fetching threads
            # ... ``concurrency`` of them on every backend: on a local disk too, where they hash on every core and
            # keep the device's queue full (1 GiB read back from the test VM's disk: 0.6 s, against 1.0-1.2 s as one
            # chunk at a time, bench/RESULTS.md).
            return hashed_parts(read, size, hasher or FileHasher(), part_size=self.transfer()["part_size"],
                                concurrency=self.concurrency)
        return hashed_ranges(read, size, sink=sink, hasher=hasher, **self.transfer())

    def matches(self, path: str, source) -> bool:
        """Whether the object at ``path`` holds exactly the bytes of ``source`` (bytes-like or
        :class:`trainproof.storage.pieces.Pieces`), read back as parallel ranges and compared part by part (a memcmp,
        ~6x cheaper than hashing them again; the caller hashed ``source``). An object longer than ``source`` shows in
        the
        ``size + 1`` probe."""
        pieces, equal = as_pieces(source), [True]
        if pieces.nbytes == 0:
            return hash_object(self.backend, path, 0)[0] == 0

        def compare(offset: int, data: bytes) -> None:  # one copy of the range: bytes == bytes is a memcmp
            equal[0] = equal[0] and pieces.read(offset, offset + len(data)) == data

        read = lambda a, b: self.backend.read_range(path, a, b)  # noqa: E731
        seen, _ = hashed_ranges(read, pieces.nbytes, sink=compare, digest=False, **self.transfer())
        return equal[0] and seen == pieces.nbytes

    def path(self, *parts: str) -> str:
        return join(self.root, *parts)


@dataclass(frozen=True)
class Scan:
    """A scan's generations, and whether it stopped at ``Limits.scan_entries`` (then some were not seen)."""

    generations: list[GenerationInfo]
    truncated: bool = False


def anchor(ctx: Ctx) -> str | None:
    """sha256 of the ``plan.json`` bytes at the root (the run a signed generation belongs to), None without one."""
    try:
        raw = ctx.io("read plan.json", lambda: read_at_most(ctx.backend, ctx.path(PLAN), ctx.limits.manifest_bytes))
    except FileNotFoundError:
        return None
    except OSError as exc:
        if not not_a_file(exc):
            raise
        return "not-a-file"  # a symlink or pipe in its place: matches no signed generation's anchor
    return signing.digest(raw)


def inspect(ctx: Ctx, name: str, *, contract: str | None, world: int | None,
            entry: Entry | None = None, run_anchor: str | None | bool = False,
            listing: list[Entry] | None = None) -> GenerationInfo:
    """Classify one generation folder from its listing and manifest (no hashing).  ``entry`` is its entry in
    the root's listing when the caller has it; without one it is looked up (a symlink is never followed).
    ``listing``: the folder's children when the caller listed them already (a scan's one listing of the tree).
    With signing keys (``ctx.keys``): an unsigned, wrongly signed or another run's (``run_anchor``, read from
    the root when not given) manifest is foreign; the chain is checked by ``scan`` (it needs every generation)."""
    step = mf.parse_step_dir(name)
    assert step is not None, name
    if entry is None:
        entry = next((e for e in ctx.io(f"list {name}", lambda: ctx.backend.listdir(ctx.root, prefix=name))
                      if e.name == name), None)
    if entry is not None and (entry.is_special or not entry.is_dir):
        return GenerationInfo(step=step, name=name, status=FOREIGN, mtime=entry.mtime, reason=(
            "not a folder (a symlink or a special file): never followed, loaded or deleted"))
    cap = ctx.limits.scan_entries
    children = listing if listing is not None else ctx.io(
        f"list {name}", lambda: ctx.backend.listdir(ctx.path(name), limit=cap))
    entries = {e.name: e for e in children if not e.is_dir}
    size = sum(e.size for e in entries.values())
    mtimes = [e.mtime for e in entries.values() if e.mtime is not None]
    base: dict[str, Any] = dict(step=step, name=name, bytes=size, mtime=max(mtimes) if mtimes else None)
    if len(children) > cap:
        return GenerationInfo(status=CORRUPT, reason=f"holds more than {cap} objects (Limits.scan_entries)", **base)
    if mf.MARKER not in entries:
        return GenerationInfo(status=INCOMPLETE, reason=f"no {mf.MARKER}: partial or abandoned write", **base)
    if entries[mf.MARKER].is_special:
        return GenerationInfo(status=CORRUPT, reason=f"{mf.MARKER} is not a regular file", **base)
    if entries[mf.MARKER].size > ctx.limits.manifest_bytes:  # never read a huge "manifest"
        return GenerationInfo(status=CORRUPT, reason=(
            f"{mf.MARKER} is {entries[mf.MARKER].size} bytes, over "
            f"{ctx.limits.manifest_bytes} (Limits.manifest_bytes)"),
            **base)
    try:
        raw = ctx.io(f"read {name}/{mf.MARKER}",
                     lambda: read_at_most(ctx.backend, ctx.path(name, mf.MARKER), ctx.limits.manifest_bytes))
        manifest = mf.parse(raw, dir_name=name, limits=ctx.limits)
    except FileNotFoundError:  # deleted between listing and reading (retention, quarantine)
        return GenerationInfo(status=INCOMPLETE, reason=f"{mf.MARKER} vanished while reading", **base)
    except mf.ManifestError as exc:
        return GenerationInfo(status=CORRUPT, reason=str(exc), **base)
    except OSError as exc:
        if not not_a_file(exc):
            raise
        return GenerationInfo(status=CORRUPT, reason=f"{mf.MARKER} is not a regular file", **base)
    if ctx.keys is not None:
        problem = ctx.keys.problem(manifest)
        if problem is None:
            expected = anchor(ctx) if run_anchor is False else run_anchor
            if manifest.get("anchor") != expected:
                problem = "signed for another run (its anchor is not this run's plan.json)"
        if problem is not None:
            return GenerationInfo(status=FOREIGN, manifest=manifest, reason=problem, **base)
        base["digest"] = signing.digest(raw)
    if contract is not None and manifest["contract"] != contract:
        return GenerationInfo(status=FOREIGN, manifest=manifest, reason=(
            f"contract {manifest['contract'][:12]}… is not this run's {contract[:12]}…"), **base)
    if world is not None and manifest["world"] != world:
        return GenerationInfo(status=FOREIGN, manifest=manifest, reason=(
            f"written by world size {manifest['world']}, this run has {world}"), **base)
    for fname, meta in manifest["files"].items():
        if meta.get("shared"):
            continue  # outside the folder: verified when read (``_read_verified``, ``verify_hashes``)
        obj = mf.object_name(fname, meta)
        if obj not in entries:
            return GenerationInfo(status=CORRUPT, manifest=manifest, reason=f"{obj} is missing", **base)
        if entries[obj].is_special:
            return GenerationInfo(status=CORRUPT, manifest=manifest, reason=f"{obj} is not a regular file", **base)
        if entries[obj].size != meta["bytes"]:
            return GenerationInfo(status=CORRUPT, manifest=manifest, reason=(
                f"{obj} is {entries[obj].size} bytes, {mf.MARKER} says {meta['bytes']}"), **base)
    return GenerationInfo(status=COMPLETE, manifest=manifest, **base)


def scan_capped(ctx: Ctx, *, contract: str | None = None, world: int | None = None) -> Scan:
    """Every ``step-*`` generation under the root, ascending by step, from a fresh listing streamed so that only
    names of generations are kept (anything else a flood put under ``step-`` is dropped as it comes: memory is
    bounded by the generations, not by the listing). ListingIncompleteError when the listing and classification
    cannot be finished within ``Limits.scan_seconds``: nothing is decided from part of the run.

    On a store read in parallel (S3) the listing of the generations' files runs beside the listing of the
    generations, and their ``COMPLETE.json`` are read ``Ctx.concurrency`` at a time: a scan costs two round trips
    and a read per ``concurrency`` generations, not a read per generation after the other (a run keeping
    milestones scans at every resume and retention; 40 generations on Ceph RGW on loopback: 2.0 s one after the
    other, ``bench/bench_scan.py``)."""
    ends = time.monotonic() + ctx.limits.scan_seconds
    parallel = reads_in_parallel(ctx.backend)

    def in_time(what: str) -> None:
        if time.monotonic() > ends:
            raise ListingIncompleteError(
                f"{what} of {ctx.root} did not finish within {ctx.limits.scan_seconds:g} s (Limits.scan_seconds): "
                "is the run's prefix flooded with step-* objects? Nothing was decided from part of it")

    def listing() -> list[Entry]:
        kept = []
        for i, e in enumerate(iter_listing(ctx.backend, ctx.root, prefix="step-")):
            if i % 1024 == 0:
                in_time("the listing")
            if mf.parse_step_dir(e.name) is not None:
                kept.append(e)
        return kept

    if parallel:
        entries, trees = _both_listings(ctx, listing, in_time)
    else:
        entries, trees = ctx.io("list generations", listing), _listed_trees(ctx, in_time)
    entries.sort(key=lambda e: e.name)
    run_anchor = anchor(ctx) if ctx.keys is not None else False

    def classify(e: Entry) -> GenerationInfo:
        return inspect(ctx, e.name, contract=contract, world=world, entry=e, run_anchor=run_anchor,
                       listing=None if trees is None else trees.get(e.name, []))

    found = _classified(classify, entries, ctx.concurrency if parallel else 1, in_time)
    # Without a plan.json (an export folder) there is no run to chain: bundles are checked by signature alone.
    return Scan(_chained(found) if ctx.keys is not None and run_anchor is not None else found, False)


def _both_listings(ctx: Ctx, listing: Callable[[], list[Entry]], in_time: Callable[[str], None]
                   ) -> tuple[list[Entry], dict[str, list[Entry]] | None]:
    """``listing()`` (the generations) on this thread and :func:`_listed_trees` (their files) beside it, at once; a
    failure of the first stops the second at its next page instead of waiting for it to end."""
    abandoned = threading.Event()

    def tree_in_time(what: str) -> None:
        if abandoned.is_set():
            raise ListingIncompleteError(f"{what} of {ctx.root} was abandoned: the listing of the generations failed")
        in_time(what)

    with ThreadPoolExecutor(1, thread_name_prefix="trainproof-scan") as beside:
        trees = beside.submit(_listed_trees, ctx, tree_in_time)
        try:
            entries = ctx.io("list generations", listing)
        except BaseException:
            abandoned.set()
            raise
        return entries, trees.result()


def _classified(classify: Callable[[Entry], GenerationInfo], entries: list[Entry], workers: int,
                in_time: Callable[[str], None]) -> list[GenerationInfo]:
    """``classify`` of each entry, in the entries' order, ``workers`` at a time (one: on this thread)."""
    found = []
    if workers > 1 and len(entries) > 1:
        with closing(in_order(classify, entries, workers, "trainproof-scan")) as classified:
            for _, info in classified:
                in_time("classifying the generations")
                found.append(info)
        return found
    for e in entries:
        in_time("classifying the generations")
        found.append(classify(e))
    return found


def _listed_trees(ctx: Ctx, in_time: Callable[[str], None]) -> dict[str, list[Entry]] | None:
    """The children of each folder named like a generation from one listing of the tree, where the backend lists
    trees (``ListsTrees``: S3); None elsewhere (each folder is then listed by itself, as cheap on a local disk).
    A flood of small ``step-*`` folders then costs a page per thousand objects, not a request per folder; what
    is not in a generation's folder is dropped as it comes, and a folder stops at ``Limits.scan_entries`` + 1."""
    backend = ctx.backend
    if not isinstance(backend, ListsTrees):
        return None
    cap = ctx.limits.scan_entries

    def listing() -> dict[str, list[Entry]]:
        trees: dict[str, list[Entry]] = {}
        for i, (folder, child) in enumerate(backend.itertree(ctx.root, prefix="step-", cap=cap)):
            if i % 1024 == 0:
                in_time("the listing of the generations' files")
            if folder in trees or mf.parse_step_dir(folder) is not None:
                trees.setdefault(folder, []).append(child)
        return trees

    return ctx.io("list the generations' files", listing)


def _chained(found: list[GenerationInfo]) -> list[GenerationInfo]:
    """Apply the chain rule (``trainproof.storage.signing.chain``) over every signed generation of this run, whatever
    its contract, world or file status; one out of chain becomes foreign and loses its digest."""
    verdicts = signing.chain([(g.step, g.digest, g.manifest) for g in found if g.digest is not None])
    out = []
    for g in found:
        problem = verdicts.get(g.step) if g.digest is not None else None
        out.append(g if problem is None else
                   GenerationInfo(**{**g.__dict__, "status": FOREIGN, "reason": problem, "digest": None}))
    return out


def in_chain(ctx: Ctx, name: str, *, contract: str | None, world: int | None) -> GenerationInfo:
    """``inspect``, plus the chain rule when signing (which needs the whole scan)."""
    if ctx.keys is None:
        return inspect(ctx, name, contract=contract, world=world)
    for g in scan(ctx, contract=contract, world=world):
        if g.name == name:
            return g
    return inspect(ctx, name, contract=contract, world=world)  # not listed (missing, or beyond the scan cap)


def scan(ctx: Ctx, *, contract: str | None = None, world: int | None = None) -> list[GenerationInfo]:
    """``scan_capped``'s generations."""
    return scan_capped(ctx, contract=contract, world=world).generations


@contextmanager
def _missing_is_corrupt(name: str, fname: str):
    """A file listed in the manifest that is gone, or is no longer a regular file: the generation is corrupt."""
    try:
        yield
    except FileNotFoundError:
        raise CorruptGenerationError(name, f"{fname} is missing") from None
    except OSError as exc:
        if not not_a_file(exc):
            raise
        raise CorruptGenerationError(name, f"{fname} is not a regular file") from None


def _read_verified(ctx: Ctx, name: str, fname: str, meta: dict, fetch: Callable | None = None,
                   discard: Callable = lambda payload: None, attempts: int = 2):
    """The object of file ``fname``, read and checked against its manifest entry (size, sha256), re-read on a
    mismatch up to ``attempts`` reads in all (the default: once more). ``fetch(path, size, hasher) -> (payload, bytes
    seen, digest)``: default, the bytes in memory (never more than ``size + 1`` of them: an object swapped for a huge
    one is not read whole); ``discard(payload)`` drops a payload that did not match (a spool file)."""
    obj = mf.shown(name, fname, meta)
    what = obj if meta.get("shared") else fname
    path, size = ctx.path(*mf.location(name, fname, meta)), meta["bytes"]
    if fetch is None:
        fetch = lambda path, size, hasher: _fetch_in_memory(ctx, path, size, hasher)  # noqa: E731
    for attempt in range(1, max(1, attempts) + 1):  # a re-read: the first read may have hit a transient fault
        with _missing_is_corrupt(name, what):
            payload, seen, sha = ctx.io(f"read {name}/{obj}", lambda: fetch(path, size, hasher_for(meta)))
        if seen == size and sha == meta["sha256"]:
            return payload
        discard(payload)
        if attempt < attempts:
            log.warning("%s/%s did not match its manifest on first read; reading it again", name, what)
    if seen != size:
        shown = f"more than {size}" if seen > size else str(seen)
        raise CorruptGenerationError(name, f"{what} is {shown} bytes, {mf.MARKER} says {size}")
    raise CorruptGenerationError(name, f"{what} sha256 differs from {mf.MARKER} (changed or damaged after commit)")


def _fetch_in_memory(ctx: Ctx, path: str, size: int, hasher: FileHasher):
    """(bytes, bytes seen, digest) of the object at ``path``, expected to be ``size`` bytes. A small one is one
    streamed read; one of a part or more is read as parallel ranges, hashed in order, straight into a buffer
    allocated once at its manifest size (no growing buffer, no copy at the end); the probe byte past ``size``
    is counted, never stored."""
    if size < ctx.part_size:
        data, sha = read_hashed(ctx.backend, path, size, hasher)
        return data, len(data), sha
    buf = bytearray(size)

    def place(offset: int, data: bytes) -> None:
        n = max(0, min(len(data), size - offset))
        buf[offset:offset + n] = memoryview(data)[:n]

    seen, sha = ctx.hashed(path, size, sink=place, hasher=hasher)
    return buf, seen, sha


def read_parts(ctx: Ctx, info: GenerationInfo, fname: str, sink: Callable[[int, bytes], None],
               wanted: list[tuple[int, int]] | None = None) -> None:
    """Hand file ``fname`` of the complete generation ``info`` to ``sink(offset, data)``, in order, each piece
    only after it was verified. A file whose entry lists parts (``trainproof.storage.digest``) goes part by part: each
    part is read as one ranged read and hashed on a worker thread (so parts are hashed on several cores), checked
    against its own digest (read once more on a mismatch) and handed over; memory is the parts in flight, not
    the file. Any other file is read whole and verified first (``load``). ``wanted``: byte ranges ``[start, end)``
    the caller needs; parts that hold none of them are not read (a file without parts is read whole anyway).

    CorruptGenerationError names the part (or the file) that is missing, short, long or changed; by then the sink
    may have received the parts before it, but never a byte that was not verified. ``data`` is valid only during
    the call (a local folder's parts are read into buffers that are reused)."""
    if info.status != COMPLETE or info.manifest is None:
        raise CorruptGenerationError(info.name, info.reason or f"status {info.status}")
    meta = info.manifest["files"].get(fname)
    if meta is None:
        raise CorruptGenerationError(info.name, f"{fname!r} is not in {mf.MARKER}")
    if "parts" not in meta:
        sink(0, _read_verified(ctx, info.name, fname, meta))
        return
    name, obj, size, step = info.name, mf.shown(info.name, fname, meta), meta["bytes"], meta["part_bytes"]
    path, parts = ctx.path(*mf.location(name, fname, meta)), meta["parts"]
    spans = [(i, i * step, min((i + 1) * step, size) + (i == len(parts) - 1)) for i in range(len(parts))]
    if wanted is not None:
        spans = [s for s in spans if any(a < min(s[2], size) and b > s[1] for a, b in wanted if b > a)]

    workers = max(1, ctx.concurrency if reads_in_parallel(ctx.backend) else min(ctx.concurrency, cores()))
    into = ctx.backend.read_range_into if isinstance(ctx.backend, ReadsIntoBuffers) else None
    buffers: queue.SimpleQueue = queue.SimpleQueue()  # a local folder: parts read into reused buffers
    for _ in range(workers + 1 if into else 0):  # each worker's part, and the one the sink has
        buffers.put(bytearray(step + 1))

    def fetch(span, pooled: bool = True) -> tuple[bytes, str]:
        i, start, end = span

        def read_once() -> bytes:
            if into is None or not pooled:
                return ctx.backend.read_range(path, start, end)
            buf = buffers.get()
            try:
                view = memoryview(buf)
                return view[:into(path, start, view[:end - start])]
            except BaseException:
                buffers.put(buf)  # a failed read (retried, or raised) gives its buffer back
                raise

        with _missing_is_corrupt(name, fname):
            data = ctx.io(f"read {name}/{obj} part {i + 1}/{len(parts)}", read_once)
        return data, hashlib.sha256(memoryview(data)[: min(step, size - start)]).hexdigest()

    def release(data) -> None:
        if isinstance(data, memoryview):
            buffers.put(data.obj)

    with closing(in_order(fetch, spans, workers, "trainproof-part")) as reads:
        for (i, start, end), (data, sha) in reads:
            want = min(step, size - start)
            if len(data) == want and sha != parts[i]:  # a transient fault, or changed: read it once more
                log.warning("%s/%s part %d/%d did not match its manifest on first read; reading it again",
                            name, fname, i + 1, len(parts))
                release(data)
                data, sha = fetch((i, start, end), pooled=False)
            if len(data) < want:
                raise CorruptGenerationError(name, f"{fname} is {start + len(data)} bytes, {mf.MARKER} says {size}")
            if len(data) > want:
                raise CorruptGenerationError(name, f"{fname} is more than {size} bytes, {mf.MARKER} says {size}")
            if sha != parts[i]:
                raise CorruptGenerationError(name, f"{fname} part {i + 1}/{len(parts)} (bytes {start}..{start + want}) "
                                                   f"sha256 differs from {mf.MARKER} (changed or damaged after commit)")
            sink(start, data)
            release(data)
            del data


def verify_hashes(ctx: Ctx, info: GenerationInfo) -> str | None:
    """Re-verify a complete generation by streaming every file through sha256 (never holding one whole; a file
    of several parts part by part, ``read_parts``); None when every file has its manifest's size and sha256,
    else the reason it does not."""
    if info.status != COMPLETE or info.manifest is None:
        return info.reason or f"status {info.status}"
    for fname, meta in info.manifest["files"].items():
        obj, where = mf.shown(info.name, fname, meta), mf.location(info.name, fname, meta)
        if "parts" in meta:  # part by part, on several cores, each against its own digest
            try:
                read_parts(ctx, info, fname, lambda _offset, _data: None)
            except CorruptGenerationError as exc:
                return exc.reason
            continue
        try:
            size, sha = ctx.io(f"verify {info.name}/{obj}",
                               lambda where=where, meta=meta: ctx.hashed(ctx.path(*where), meta["bytes"],
                                                                         hasher=hasher_for(meta)))
        except FileNotFoundError:
            return f"{obj} is missing"
        except OSError as exc:
            if not not_a_file(exc):
                raise
            return f"{obj} is not a regular file"
        if size != meta["bytes"]:
            return f"{obj} is {'more than ' if size > meta['bytes'] else ''}{min(size, meta['bytes'])} bytes, " \
                   f"{mf.MARKER} says {meta['bytes']}"
        if sha != meta["sha256"]:
            return f"{obj} sha256 differs from {mf.MARKER}"
    return None

def load(ctx: Ctx, info: GenerationInfo, check: Check | None = None, names: list[str] | None = None, *,
         spool_dir: str | None = None, spool_from: int | None = None, attempts: int = 2) -> Loaded:
    """Read every file (or only ``names``) of a complete generation, verify size and sha256 (a file that does not
    match is read again, up to ``attempts`` reads), then run ``check(name, data)``; raise CorruptGenerationError
    naming the file and the fault.

    ``spool_dir``: files of ``spool_from`` bytes or more (default: the part size) are downloaded into spools in
    that folder (parallel ranged reads, each digest part hashed as it arrives) instead of into memory; the check and
    the caller get the :class:`Spool`, which the caller deletes with :meth:`Loaded.close`."""
    if info.status != COMPLETE or info.manifest is None:
        raise CorruptGenerationError(info.name, info.reason or f"status {info.status}")
    listed = info.manifest["files"]
    if names is not None and [n for n in names if n not in listed]:
        raise CorruptGenerationError(info.name, f"{[n for n in names if n not in listed][0]!r} is not in {mf.MARKER}")
    threshold = ctx.part_size if spool_from is None else spool_from
    files: dict = {}
    try:
        for fname, meta in (listed.items() if names is None else ((n, listed[n]) for n in names)):
            if spool_dir is not None and meta["bytes"] >= threshold:
                files[fname] = _spool_verified(ctx, info.name, fname, meta, spool_dir, attempts)
            else:
                files[fname] = _read_verified(ctx, info.name, fname, meta, attempts=attempts)
            _check(info.name, fname, files[fname], check)
    except BaseException:
        Loaded(info=info, files=files).close()
        raise
    return Loaded(info=info, files=files)


def checked(info: GenerationInfo, files: dict[str, "bytes | Spool"], check: Check | None) -> Loaded:
    """Generation ``info`` from ``files`` read and verified before it was asked for (``trainproof.storage.ahead``):
    ``check`` runs on each as :func:`load` runs it; CorruptGenerationError (every file deleted) when it refuses one."""
    try:
        for fname, data in files.items():
            _check(info.name, fname, data, check)
    except BaseException:
        Loaded(info=info, files=files).close()
        raise
    return Loaded(info=info, files=files)


def _check(name: str, fname: str, data: "bytes | Spool", check: Check | None) -> None:
    if check is not None:
        try:
            check(fname, data)
        except Exception as exc:  # the caller's check (e.g. torch.load) refusing the content
            raise CorruptGenerationError(name, f"{fname} failed the content check: {exc}") from exc


def _spool_verified(ctx: Ctx, name: str, fname: str, meta: dict, directory: str, attempts: int = 2) -> Spool:
    """``_read_verified`` into a spool: the object's bytes land in a local file, never whole in memory."""
    def fetch(path: str, size: int, hasher: FileHasher):
        return download(lambda a, b: ctx.read_range(path, a, b), size, directory, hasher=hasher,
                        **ctx.transfer())

    return _read_verified(ctx, name, fname, meta, fetch, discard=lambda spool: spool.unlink(), attempts=attempts)
