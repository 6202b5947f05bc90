"""``COMPLETE.json``: the manifest whose presence, written last and create-only, makes a generation usable."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

from trainproof.storage import digest as dg
from trainproof.storage.limits import Limits, UntrustedJSONError, loads_untrusted, plain_name_problem

SCHEMA = "trainproof.generation/1"
MARKER = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step-([0-9]{8})\Z")  # \Z and [0-9]: no trailing newline, no non-ASCII digits
SHA256_HEX = re.compile(r"^[0-9a-f]{64}\Z")
"""A sha256 as the store writes it: 64 lower-case hex digits (a digest field, a shared object's name)."""
MAX_STEP = 99_999_999
MAX_WORLD = 1_000_000
MAX_TEXT = 256
# Names the store itself puts in a generation folder: a manifest may not claim them as data files.
RESERVED = (MARKER, "REASON")
SHARED_DIR = "shared"
"""Where a run keeps content-addressed objects that several generations reference (``<run>/shared/<sha256>``): a
manifest entry with ``"shared": true`` is stored there under its own digest, not in the generation's folder."""


class ManifestError(ValueError):
    """The manifest is malformed or disagrees with where it was found."""


def step_dir(step: int) -> str:
    """``step-%08d``, the name of a generation."""
    if step < 0 or step > MAX_STEP:
        raise ValueError(f"step must be in 0..{MAX_STEP}, got {step}")
    return f"step-{step:08d}"


def parse_step_dir(name: str) -> int | None:
    """The step of a ``step-%08d`` name, or None for anything else."""
    m = _STEP_DIR.match(name)
    return int(m.group(1)) if m else None


def attempt_object(fname: str, attempt: str) -> str:
    """The object name a writer uses when ``fname`` is taken: ``training_state.<attempt[:12]>.pt``."""
    stem, dot, ext = fname.rpartition(".")
    return f"{stem}.{attempt[:12]}.{ext}" if dot and stem else f"{fname}.{attempt[:12]}"


def object_name(fname: str, meta: dict) -> str:
    """Where a manifest entry's bytes are stored (the file's own name unless the writer had to use another)."""
    return meta.get("object", fname)


def location(name: str, fname: str, meta: dict) -> tuple[str, str]:
    """(folder, object) of a manifest entry's bytes: ``shared/<sha256>`` for a shared entry, else the generation's
    folder ``name`` and the entry's object name."""
    return (SHARED_DIR, meta["sha256"]) if meta.get("shared") else (name, object_name(fname, meta))


def shown(name: str, fname: str, meta: dict) -> str:
    """How a message names an entry's object: its name in the generation, or ``shared/<sha256 prefix>…``."""
    return f"{SHARED_DIR}/{meta['sha256'][:16]}… ({fname})" if meta.get("shared") else object_name(fname, meta)


def build(
    *, step: int, files: dict[str, tuple[int, str, str]], contract: str, world: int, code_version: str,
    attempt: str, digests: dict[str, str] | None = None, extra: dict | None = None,
    shared: dict[str, tuple[int, str]] | None = None,
) -> dict:
    """The manifest of a generation.  ``files``: name → (bytes, sha256, object name); a sha256 that is a
    :class:`trainproof.storage.digest.Digest` of several parts adds the entry's ``parts`` and ``part_bytes``.
    ``shared``: name → (bytes, sha256) of files stored once for the run under ``shared/`` (``"shared": true``).
    ``digests`` adds ``<key>_bytes``/``<key>_sha256`` for a named file (e.g. ``state`` → ``training_state.pt``)."""
    both = set(files) & set(shared or {})
    if both:
        raise ValueError(f"{sorted(both)[0]!r} is listed both as a file and as a shared object")
    entries = {name: {"bytes": size, **_digest_fields(sha), **({"object": obj} if obj != name else {})}
               for name, (size, sha, obj) in files.items()}
    entries.update({name: {"bytes": size, **_digest_fields(sha), "shared": True}
                    for name, (size, sha) in (shared or {}).items()})
    manifest = {
        "schema": SCHEMA,
        "step": step,
        "contract": contract,
        "world": world,
        "files": dict(sorted(entries.items())),
        "code_version": code_version,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "attempt": attempt,
    }
    for key, name in (digests or {}).items():
        if name not in files:
            raise ValueError(f"digest {key!r} names {name!r}, which is not among the generation's files")
        manifest[f"{key}_bytes"], manifest[f"{key}_sha256"] = files[name][0], str(files[name][1])
    if extra:
        manifest["extra"] = extra
    return manifest


def _digest_fields(sha: str) -> dict:
    return sha.entry() if isinstance(sha, dg.Digest) else {"sha256": str(sha)}


def dumps(manifest: dict) -> bytes:
    """The manifest's stored bytes (sorted keys, so equal manifests are equal bytes)."""
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def parse(raw: bytes, *, dir_name: str, limits: Limits | None = None) -> dict:
    """Parse and check a manifest found in folder ``dir_name``; raise ManifestError naming what is wrong.

    Defensive: whatever the bytes (huge, deeply nested, 5000-digit integers, NaN, wrong types, names with
    ``..`` or ``/``), the only exception is ManifestError, so discovery can classify instead of crashing."""
    limits = limits or Limits()
    try:
        manifest = loads_untrusted(raw, what=MARKER, max_bytes=limits.manifest_bytes)
    except UntrustedJSONError as exc:
        raise ManifestError(str(exc)) from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{MARKER} is not a JSON object")
    if manifest.get("schema") != SCHEMA:
        raise ManifestError(f"{MARKER} has schema {_short(manifest.get('schema'))}, expected {SCHEMA!r}")
    step = manifest.get("step")
    if not _is_int(step) or not 1 <= step <= MAX_STEP:
        raise ManifestError(f"{MARKER} step {_short(step)} is not an integer in 1..{MAX_STEP}")
    if parse_step_dir(dir_name) is not None and parse_step_dir(dir_name) != step:
        raise ManifestError(f"{MARKER} says step {step} but the folder is {dir_name}")
    for key, kind in (("contract", str), ("world", int), ("files", dict), ("attempt", str)):
        value = manifest.get(key)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ManifestError(f"{MARKER} field {key!r} is missing or not a {kind.__name__}")
    for key in ("contract", "attempt"):
        if not manifest[key] or len(manifest[key]) > MAX_TEXT:
            raise ManifestError(f"{MARKER} field {key!r} is empty or longer than {MAX_TEXT} characters")
    for key, kind in (("code_version", str), ("created_at", str), ("extra", dict)):
        if key in manifest and not isinstance(manifest[key], kind):
            raise ManifestError(f"{MARKER} field {key!r} is not a {kind.__name__}")
    if not 1 <= manifest["world"] <= MAX_WORLD:
        raise ManifestError(f"{MARKER} world {manifest['world']} is not in 1..{MAX_WORLD}")
    _check_files(manifest["files"], limits)
    for key, value in manifest.items():  # digests: <key>_bytes / <key>_sha256 (callers compare them)
        if key.endswith("_bytes") and not (_is_int(value) and 0 <= value <= limits.file_bytes):
            raise ManifestError(f"{MARKER} field {key!r} is not a size in 0..{limits.file_bytes}")
        if key.endswith("_sha256") and not (isinstance(value, str) and SHA256_HEX.match(value)):
            raise ManifestError(f"{MARKER} field {key!r} is not a sha256 hex digest")
    return manifest


def _check_files(files: dict, limits: Limits) -> None:
    if not files:
        raise ManifestError(f"{MARKER} lists no files")
    if len(files) > limits.files_per_generation:
        raise ManifestError(f"{MARKER} lists more than {limits.files_per_generation} files")
    objects = set()
    for name, meta in files.items():
        problem = name_problem(name)
        if problem:
            raise ManifestError(f"{MARKER} lists an invalid file name: {problem}")
        if not isinstance(meta, dict) or not _is_int(meta.get("bytes")) or not isinstance(meta.get("sha256"), str) \
                or not SHA256_HEX.match(meta["sha256"]):
            raise ManifestError(f"{MARKER} entry for {name!r} lacks an integer 'bytes' or a sha256 hex 'sha256'")
        if not 0 <= meta["bytes"] <= limits.file_bytes:
            raise ManifestError(f"{MARKER} entry for {name!r} claims {meta['bytes']} bytes, outside "
                                f"0..{limits.file_bytes} (Limits.file_bytes)")
        _check_parts(name, meta)
        if _shared(name, meta):
            continue
        obj = object_name(name, meta)
        problem = name_problem(obj)
        if problem:
            raise ManifestError(f"{MARKER} entry for {name!r} names an invalid object: {problem}")
        if obj in objects:
            raise ManifestError(f"{MARKER} lists object {obj!r} for two files")
        objects.add(obj)


def _shared(name: str, meta: dict) -> bool:
    """Whether the entry references a shared object (``"shared": true`` and no object name of its own)."""
    if "shared" not in meta:
        return False
    if meta["shared"] is not True or "object" in meta:
        raise ManifestError(f"{MARKER} entry for {name!r}: 'shared' must be true and name no object")
    return True


def _check_parts(name: str, meta: dict) -> None:
    """A file of several parts: its part size is sane, it lists exactly the parts its size needs (two or more),
    each a sha256, and they hash to its ``sha256`` (``trainproof.storage.digest``)."""
    if "parts" not in meta and "part_bytes" not in meta:
        return
    size, parts = meta.get("part_bytes"), meta.get("parts")
    if not _is_int(size) or not dg.MIN_PART_BYTES <= size <= dg.MAX_PART_BYTES:
        raise ManifestError(f"{MARKER} entry for {name!r} has 'part_bytes' {_short(size)}, not an integer in "
                            f"{dg.MIN_PART_BYTES}..{dg.MAX_PART_BYTES}")
    needed = -(-meta["bytes"] // size)
    if not isinstance(parts, list) or len(parts) != needed or needed < 2:
        count = len(parts) if isinstance(parts, list) else _short(parts)
        raise ManifestError(f"{MARKER} entry for {name!r} lists {count} parts; {meta['bytes']} bytes in parts of "
                            f"{size} are {needed} (a file of one part lists none)")
    if not all(isinstance(p, str) and SHA256_HEX.match(p) for p in parts):
        raise ManifestError(f"{MARKER} entry for {name!r} lists a part digest that is not a sha256 hex digest")
    if dg.root_of(parts) != meta["sha256"]:
        raise ManifestError(f"{MARKER} entry for {name!r}: its parts do not hash to its sha256")


def name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a generation's file or object name (None when it can): a plain name
    (``trainproof.storage.limits.plain_name_problem``) that is not one the store itself uses in a generation folder."""
    problem = plain_name_problem(name)
    if problem is None and name in RESERVED:
        problem = f"{name!r} is reserved"
    return problem


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _short(value: object) -> str:
    # A hostile manifest's values go into log lines: keep them short and printable.
    return repr(value)[:60]
