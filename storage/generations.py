"""Discovery: what generations exist, which are usable, and verified loading.

A generation is usable because its ``COMPLETE.json`` exists and checks out (schema, step, contract, world,
every listed file present with the listed size, and, when loaded, the listed sha256) — never because its
folder exists.  Anything else is reported with the reason and skipped, never raised on, never deleted here.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass, field
from typing import Callable

from storage import manifest as mf
from storage.backend import Backend, join
from storage.errors import CorruptGenerationError

log = logging.getLogger("trainproof.storage")

COMPLETE, INCOMPLETE, CORRUPT, FOREIGN = "complete", "incomplete", "corrupt", "foreign"
Check = Callable[[str, bytes], None]


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


@dataclass(frozen=True)
class Loaded:
    """A generation whose every file was read back and verified."""

    info: GenerationInfo
    files: dict[str, bytes] = field(repr=False)


@dataclass(frozen=True)
class Ctx:
    """What the discovery/commit/retention functions work on: a backend, a root, and the retry wrapper."""

    backend: Backend
    root: str
    io: Callable  # io(what, fn) -> fn() with bounded retries

    def path(self, *parts: str) -> str:
        return join(self.root, *parts)


def inspect(ctx: Ctx, name: str, *, contract: str | None, world: int | None) -> GenerationInfo:
    """Classify one generation folder from its listing and manifest (no hashing)."""
    step = mf.parse_step_dir(name)
    assert step is not None, name
    entries = {e.name: e for e in ctx.io(f"list {name}", lambda: ctx.backend.listdir(ctx.path(name))) if not e.is_dir}
    size = sum(e.size for e in entries.values())
    mtimes = [e.mtime for e in entries.values() if e.mtime is not None]
    base = dict(step=step, name=name, bytes=size, mtime=max(mtimes) if mtimes else None)
    if mf.MARKER not in entries:
        return GenerationInfo(status=INCOMPLETE, reason=f"no {mf.MARKER}: partial or abandoned write", **base)
    try:
        raw = ctx.io(f"read {name}/{mf.MARKER}", lambda: ctx.backend.read(ctx.path(name, mf.MARKER)))
        manifest = mf.parse(raw, dir_name=name)
    except FileNotFoundError:  # deleted between listing and reading (retention, quarantine)
        return GenerationInfo(status=INCOMPLETE, reason=f"{mf.MARKER} vanished while reading", **base)
    except mf.ManifestError as exc:
        return GenerationInfo(status=CORRUPT, reason=str(exc), **base)
    if contract is not None and manifest["contract"] != contract:
        return GenerationInfo(status=FOREIGN, manifest=manifest, reason=(
            f"contract {manifest['contract'][:12]}… is not this run's {contract[:12]}…"), **base)
    if world is not None and manifest["world"] != world:
        return GenerationInfo(status=FOREIGN, manifest=manifest, reason=(
            f"written by world size {manifest['world']}, this run has {world}"), **base)
    for fname, meta in manifest["files"].items():
        obj = mf.object_name(fname, meta)
        if obj not in entries:
            return GenerationInfo(status=CORRUPT, manifest=manifest, reason=f"{obj} is missing", **base)
        if entries[obj].size != meta["bytes"]:
            return GenerationInfo(status=CORRUPT, manifest=manifest, reason=(
                f"{obj} is {entries[obj].size} bytes, {mf.MARKER} says {meta['bytes']}"), **base)
    return GenerationInfo(status=COMPLETE, manifest=manifest, **base)


def scan(ctx: Ctx, *, contract: str | None = None, world: int | None = None) -> list[GenerationInfo]:
    """Every ``step-*`` generation under the root, ascending by step, from a fresh listing."""
    names = sorted(
        e.name for e in ctx.io("list generations", lambda: ctx.backend.listdir(ctx.root))
        if e.is_dir and mf.parse_step_dir(e.name) is not None
    )
    return [inspect(ctx, n, contract=contract, world=world) for n in names]


def _read_verified(ctx: Ctx, name: str, fname: str, meta: dict) -> bytes:
    fname = mf.object_name(fname, meta)
    path = ctx.path(name, fname)
    for attempt in (1, 2):  # one re-read: the first read may have hit a transient fault
        try:
            data = ctx.io(f"read {name}/{fname}", lambda: ctx.backend.read(path))
        except FileNotFoundError:
            raise CorruptGenerationError(name, f"{fname} is missing") from None
        if len(data) == meta["bytes"] and hashlib.sha256(data).hexdigest() == meta["sha256"]:
            return data
        if attempt == 1:
            log.warning("%s/%s did not match its manifest on first read; reading it again", name, fname)
    if len(data) != meta["bytes"]:
        raise CorruptGenerationError(name, f"{fname} is {len(data)} bytes, {mf.MARKER} says {meta['bytes']}")
    raise CorruptGenerationError(name, f"{fname} sha256 differs from {mf.MARKER} (changed or damaged after commit)")


def load(ctx: Ctx, info: GenerationInfo, check: Check | None = None) -> Loaded:
    """Read every file of a complete generation, verify size and sha256 (re-reading once on a mismatch),
    then run ``check(name, data)``; raise CorruptGenerationError naming the file and the fault."""
    if info.status != COMPLETE or info.manifest is None:
        raise CorruptGenerationError(info.name, info.reason or f"status {info.status}")
    files = {}
    for fname, meta in info.manifest["files"].items():
        files[fname] = _read_verified(ctx, info.name, fname, meta)
        if check is not None:
            try:
                check(fname, files[fname])
            except Exception as exc:  # the caller's check (e.g. torch.load) refusing the content
                raise CorruptGenerationError(info.name, f"{fname} failed the content check: {exc}") from exc
    return Loaded(info=info, files=files)
