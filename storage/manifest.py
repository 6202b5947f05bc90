"""``COMPLETE.json``: the manifest whose presence, written last and create-only, makes a generation usable."""

from __future__ import annotations

import json
import re
from datetime import datetime, timezone

SCHEMA = "trainproof.generation/1"
MARKER = "COMPLETE.json"
_STEP_DIR = re.compile(r"^step-(\d{8})$")
_SHA = re.compile(r"^[0-9a-f]{64}$")


class ManifestError(ValueError):
    """The manifest is malformed or disagrees with where it was found."""


def step_dir(step: int) -> str:
    """``step-%08d``, the name of a generation."""
    if step < 0 or step > 99_999_999:
        raise ValueError(f"step must be in 0..99999999, got {step}")
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


def build(
    *, step: int, files: dict[str, tuple[int, str, str]], contract: str, world: int, code_version: str,
    attempt: str, digests: dict[str, str] | None = None, extra: dict | None = None,
) -> dict:
    """The manifest of a generation.  ``files``: name → (bytes, sha256).  ``digests`` adds
    ``<key>_bytes``/``<key>_sha256`` for a named file (e.g. ``state`` → ``training_state.pt``).
    ``files``: name → (bytes, sha256, object name)."""
    manifest = {
        "schema": SCHEMA,
        "step": step,
        "contract": contract,
        "world": world,
        "files": {name: {"bytes": size, "sha256": sha, **({"object": obj} if obj != name else {})}
                  for name, (size, sha, obj) in sorted(files.items())},
        "code_version": code_version,
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "attempt": attempt,
    }
    for key, name in (digests or {}).items():
        if name not in files:
            raise ValueError(f"digest {key!r} names {name!r}, which is not among the generation's files")
        manifest[f"{key}_bytes"], manifest[f"{key}_sha256"] = files[name][:2]
    if extra:
        manifest["extra"] = extra
    return manifest


def dumps(manifest: dict) -> bytes:
    return (json.dumps(manifest, indent=2, sort_keys=True) + "\n").encode()


def parse(raw: bytes, *, dir_name: str) -> dict:
    """Parse and check a manifest found in folder ``dir_name``; raise ManifestError naming what is wrong."""
    try:
        manifest = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{MARKER} is not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(manifest, dict):
        raise ManifestError(f"{MARKER} is not a JSON object")
    if manifest.get("schema") != SCHEMA:
        raise ManifestError(f"{MARKER} has schema {manifest.get('schema')!r}, expected {SCHEMA!r}")
    step = manifest.get("step")
    if not isinstance(step, int) or isinstance(step, bool) or step < 1:
        raise ManifestError(f"{MARKER} step {step!r} is not an integer >= 1")
    if parse_step_dir(dir_name) is not None and parse_step_dir(dir_name) != step:
        raise ManifestError(f"{MARKER} says step {step} but the folder is {dir_name}")
    for key, kind in (("contract", str), ("world", int), ("files", dict), ("attempt", str)):
        if not isinstance(manifest.get(key), kind):
            raise ManifestError(f"{MARKER} field {key!r} is missing or not a {kind.__name__}")
    if manifest["world"] < 1:
        raise ManifestError(f"{MARKER} world {manifest['world']} < 1")
    if not manifest["files"]:
        raise ManifestError(f"{MARKER} lists no files")
    for name, meta in manifest["files"].items():
        if "/" in name or name in ("", ".", "..", MARKER):
            raise ManifestError(f"{MARKER} lists an invalid file name {name!r}")
        if not isinstance(meta, dict) or not isinstance(meta.get("bytes"), int) or not _SHA.match(str(meta.get("sha256", ""))):
            raise ManifestError(f"{MARKER} entry for {name!r} lacks an integer 'bytes' or a sha256 hex 'sha256'")
        obj = object_name(name, meta)
        if not isinstance(obj, str) or "/" in obj or obj in ("", ".", "..", MARKER):
            raise ManifestError(f"{MARKER} entry for {name!r} names an invalid object {obj!r}")
    return manifest
