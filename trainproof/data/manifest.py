"""``dataset.json``: the manifest of a sharded dataset in a bucket, written last, create-only, by ``trainproof data
pack``; a dataset exists because its manifest does (a packing that stopped half-way left only shard objects).

Two kinds of datasets, both cut into shard objects of about the same size:

- ``records``: every sample is one fixed-size record, ``shape`` elements of ``dtype`` (token windows of a language
  model: ``[context + 1]`` token ids). Sample ``k`` of a shard is bytes ``k * record_bytes`` onwards;
- ``samples``: samples of any size, each a 1-D array of ``dtype`` (a document's tokens, an encoded image as
  ``|u1`` bytes). A shard holds its samples back to back, then an index: ``samples + 1`` little-endian int64
  offsets (the first 0, the last where the index starts), at ``index_offset``.

Each shard entry carries its size, its sha256 and the sha256 of each of its parts (``trainproof.storage.objects``: a
reader verifies a part before using a byte of it). The dataset's identity (:func:`identity`, a task's ``data_identity``)
is the sha256 of what defines the data: kind, dtype, shape, sample counts and every shard's sha256, but not the
shards' names, the time or the source, so packing the same data again gives the same identity.

Everything is read from a bucket anyone with a leaked token may write to: :func:`parse` checks every field and
refuses anything else with a ValueError naming it (the reader turns it into one line, exit 2).
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from trainproof.storage.limits import Limits, UntrustedJSONError, loads_untrusted
from trainproof.storage.objects import ObjectEntry, parse_entry

DATASET_FILE = "dataset.json"
SCHEMA = "trainproof.dataset/1"
KINDS = ("records", "samples")
MANIFEST_BYTES = 64 * 2**20
"""Largest manifest read (about 70 bytes a part: 1 TiB in 1 MiB parts is ~75 MiB, in 4 MiB parts ~19 MiB)."""
MAX_SHARDS = 1_000_000
MAX_SAMPLES = 2**40
MAX_RECORD_BYTES = 64 * 2**20
MAX_PART_BYTES = 16 * 2**20
"""Largest part a manifest may ask a reader to fetch for one sample (memory: a few of them per reading process)."""
MAX_SHARD_SAMPLES = 2**23
"""Most samples of one ``samples`` shard: its index (8 bytes a sample, read whole) stays under 64 MiB."""
_DTYPE = re.compile(r"^(\|u1|\|i1|\|b1|<[iu][248]|<f[248])\Z")
INDEX_DTYPE = np.dtype("<i8")


@dataclass(frozen=True)
class Shard:
    """One shard object: its entry (name, size, digests) and what it holds."""

    entry: ObjectEntry
    samples: int
    index_offset: int | None = None
    """``samples`` datasets: where the offsets table starts (None for ``records``)."""


@dataclass(frozen=True)
class Manifest:
    """A parsed ``dataset.json``."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    """``records``: every record's shape; ``samples``: ``()`` (each sample is 1-D, of its own length)."""
    samples: int
    shards: tuple[Shard, ...]
    source: dict = field(default_factory=dict)
    """What ``data pack`` was given (informational, outside the identity)."""

    @property
    def record_bytes(self) -> int:
        """Bytes of one record (``records`` datasets)."""
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize

    @property
    def bytes(self) -> int:
        return sum(s.entry.size for s in self.shards)

    def identity(self) -> str:
        """sha256 hex of what defines the data (see the module docstring): the run contract's ``data_identity``."""
        defined = {"schema": SCHEMA, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
                   "samples": self.samples,
                   "shards": [[s.entry.size, s.entry.sha256, s.samples, s.index_offset] for s in self.shards]}
        return hashlib.sha256(json.dumps(defined, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    def to_json(self) -> bytes:
        shards = [{**s.entry.meta(), "samples": s.samples,
                   **({} if s.index_offset is None else {"index_offset": s.index_offset})} for s in self.shards]
        body = {"schema": SCHEMA, "kind": self.kind, "dtype": self.dtype, "shape": list(self.shape),
                "samples": self.samples, "shards": shards, "source": self.source, "identity": self.identity()}
        return (json.dumps(body, indent=1, sort_keys=True) + "\n").encode()


def parse(raw: bytes, *, limits: Limits | None = None) -> Manifest:
    """Check and parse a manifest read from the store; ValueError naming what is wrong."""
    limits = limits or Limits()
    try:
        doc = loads_untrusted(raw, what=DATASET_FILE, max_bytes=MANIFEST_BYTES)
    except UntrustedJSONError as exc:
        raise ValueError(str(exc)) from None
    if not isinstance(doc, dict) or doc.get("schema") != SCHEMA:
        raise ValueError(f"{DATASET_FILE} is not a {SCHEMA} manifest")
    kind, dtype, shape, samples = doc.get("kind"), doc.get("dtype"), doc.get("shape"), doc.get("samples")
    if kind not in KINDS:
        raise ValueError(f"{DATASET_FILE}: kind {str(kind)[:40]!r} is not one of {KINDS}")
    if not isinstance(dtype, str) or not _DTYPE.match(dtype):
        raise ValueError(f"{DATASET_FILE}: dtype {str(dtype)[:40]!r} is not a plain numeric dtype (e.g. '<u2')")
    _check_shape(kind, shape, dtype)
    if not _is_int(samples) or not 1 <= samples <= MAX_SAMPLES:
        raise ValueError(f"{DATASET_FILE}: samples is not a count in 1..{MAX_SAMPLES}")
    shards = doc.get("shards")
    if not isinstance(shards, list) or not 1 <= len(shards) <= MAX_SHARDS:
        raise ValueError(f"{DATASET_FILE}: shards is not a list of 1..{MAX_SHARDS} entries")
    source = doc.get("source", {})
    manifest = Manifest(kind=kind, dtype=dtype, shape=tuple(shape), samples=samples,
                        shards=tuple(_shard(s, kind, limits) for s in shards),
                        source=source if isinstance(source, dict) else {})
    _check_totals(manifest)
    if doc.get("identity") not in (None, manifest.identity()):
        raise ValueError(f"{DATASET_FILE}: its recorded identity is not the digest of what it lists")
    return manifest


def _check_shape(kind: str, shape: Any, dtype: str) -> None:
    if kind == "samples":
        if shape != []:
            raise ValueError(f"{DATASET_FILE}: a samples dataset has shape [] (each sample is 1-D)")
        return
    if not isinstance(shape, list) or not 1 <= len(shape) <= 8 or not all(_is_int(d) and d >= 1 for d in shape):
        raise ValueError(f"{DATASET_FILE}: shape is not a list of 1..8 positive sizes")
    if int(np.prod(shape, dtype=object)) * np.dtype(dtype).itemsize > MAX_RECORD_BYTES:
        raise ValueError(f"{DATASET_FILE}: a record of shape {shape} is larger than {MAX_RECORD_BYTES} bytes")


def _shard(meta: Any, kind: str, limits: Limits) -> Shard:
    entry = parse_entry(meta, max_bytes=limits.file_bytes)
    if entry.part_bytes > MAX_PART_BYTES:
        raise ValueError(f"{DATASET_FILE}: shard {entry.name!r} has parts of {entry.part_bytes} bytes, more than "
                         f"{MAX_PART_BYTES}")
    samples, offset = meta.get("samples"), meta.get("index_offset")
    if not _is_int(samples) or not 1 <= samples <= MAX_SAMPLES:
        raise ValueError(f"{DATASET_FILE}: shard {entry.name!r} holds no sample count in 1..{MAX_SAMPLES}")
    if kind == "records":
        if offset is not None:
            raise ValueError(f"{DATASET_FILE}: shard {entry.name!r} of a records dataset has an index")
        return Shard(entry=entry, samples=samples)
    if samples > MAX_SHARD_SAMPLES:
        raise ValueError(f"{DATASET_FILE}: shard {entry.name!r} holds more than {MAX_SHARD_SAMPLES} samples")
    if not _is_int(offset) or offset + INDEX_DTYPE.itemsize * (samples + 1) != entry.size or offset < 0:
        raise ValueError(f"{DATASET_FILE}: shard {entry.name!r}: index_offset does not leave room for exactly "
                         f"{samples + 1} offsets at its end")
    return Shard(entry=entry, samples=samples, index_offset=offset)


def _check_totals(manifest: Manifest) -> None:
    names = [s.entry.name for s in manifest.shards]
    if len(set(names)) != len(names) or DATASET_FILE in names:
        raise ValueError(f"{DATASET_FILE} lists a shard name twice (or its own name)")
    if sum(s.samples for s in manifest.shards) != manifest.samples:
        raise ValueError(f"{DATASET_FILE}: the shards' sample counts do not add up to samples={manifest.samples}")
    if manifest.kind == "records":
        for s in manifest.shards:
            if s.entry.size != s.samples * manifest.record_bytes:
                raise ValueError(f"{DATASET_FILE}: shard {s.entry.name!r} is {s.entry.size} bytes, not "
                                 f"{s.samples} records of {manifest.record_bytes}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
