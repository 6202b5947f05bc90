"""Packing a dataset into a bucket (or a folder): shards written and read back, then ``dataset.json``, last.

Every shard is written create-only under a name no other packing uses (``shard-00000-<attempt>.bin``), read back
from the store part by part and compared with what was written (``trainproof.storage.objects.write_verified``); only
then is
``dataset.json`` written, create-only: two packings into one place cannot both succeed, and a packing that stops
half-way leaves shard objects but no dataset (pack again; the leftovers are never read).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any, Iterable

import numpy as np

from trainproof.data.manifest import (
    DATASET_FILE,
    INDEX_DTYPE,
    MAX_PART_BYTES,
    MAX_RECORD_BYTES,
    MAX_SHARD_SAMPLES,
    Manifest,
    Shard,
)
from trainproof.errors import ConfigError, DataError
from trainproof.storage import GenerationStore, StoreOptions, open_store
from trainproof.storage.errors import StoreConfigError
from trainproof.storage.objects import MIN_OBJECT_PART, write_verified

SHARD_BYTES = 64 * 2**20
"""Default shard size: large enough that a bucket holds few objects, small enough to write and re-read quickly."""
PART_BYTES = 2**20
"""Default part (the unit a reader fetches and verifies): 1 MiB, so a random sample costs one small ranged read."""


@dataclass(frozen=True)
class Packed:
    """What a packing wrote."""

    url: str
    manifest: Manifest

    @property
    def identity(self) -> str:
        return self.manifest.identity()


def open_dataset_store(url: str, options: StoreOptions | None = None) -> GenerationStore:
    """The store at a dataset's URL (the checkpoints' credentials and endpoint settings); ConfigError naming it."""
    try:
        return open_store(url, options or StoreOptions.from_env())
    except StoreConfigError as exc:
        raise ConfigError(f"dataset {url}: {exc}") from None


class _Packer:
    def __init__(self, url: str, *, kind: str, dtype: np.dtype, shape: tuple[int, ...], shard_bytes: int,
                 part_bytes: int, source: dict[str, Any] | None, options: StoreOptions | None) -> None:
        if not MIN_OBJECT_PART <= part_bytes <= MAX_PART_BYTES:
            raise ConfigError(f"part size {part_bytes} bytes is outside {MIN_OBJECT_PART}..{MAX_PART_BYTES}")
        if shard_bytes < part_bytes:
            raise ConfigError(f"shard size {shard_bytes} bytes is smaller than the part size {part_bytes}")
        self.url, self.kind, self.dtype, self.shape = url, kind, np.dtype(dtype).newbyteorder("<"), shape
        self.shard_bytes, self.part_bytes, self.source = shard_bytes, part_bytes, dict(source or {})
        self.store = open_dataset_store(url, options)
        if self.store.exists(DATASET_FILE):  # fail before writing gigabytes, not at the end
            raise ConfigError(f"{url} already holds a dataset ({DATASET_FILE}); pack into a new location")
        self.attempt = uuid.uuid4().hex[:8]
        self.shards: list[Shard] = []
        self._chunks: list[bytes] = []
        self._offsets: list[int] = [0]  # where each sample of the shard being filled starts (and the end)

    def add(self, samples: np.ndarray, *, count: int = 1) -> None:
        """Append ``count`` samples held back to back in ``samples`` (a whole shard's records at once, or one
        sample of any size), starting a new shard first when they would not fit the one being filled."""
        data = np.ascontiguousarray(samples, dtype=self.dtype).tobytes()
        full = len(self._offsets) - 1 + count > MAX_SHARD_SAMPLES and self.kind == "samples"
        if len(self._offsets) > 1 and (self._offsets[-1] + len(data) > self.shard_bytes or full):
            self._flush()
        each = len(data) // count
        self._chunks.append(data)
        self._offsets.extend(self._offsets[-1] + each * (k + 1) for k in range(count))

    def _flush(self) -> None:
        samples = len(self._offsets) - 1
        if not samples:
            return
        filled = self._offsets[-1]
        index = np.asarray(self._offsets, dtype=INDEX_DTYPE).tobytes() if self.kind == "samples" else b""
        name = f"shard-{len(self.shards):05d}-{self.attempt}.bin"
        entry = write_verified(self.store, name, b"".join(self._chunks) + index, part_bytes=self.part_bytes)
        self.shards.append(Shard(entry=entry, samples=samples, index_offset=filled if self.kind == "samples" else None))
        self._chunks, self._offsets = [], [0]

    def finish(self) -> Packed:
        self._flush()
        if not self.shards:
            raise ConfigError("nothing to pack: the input holds no samples")
        manifest = Manifest(kind=self.kind, dtype=self.dtype.str, shape=self.shape,
                            samples=sum(s.samples for s in self.shards), shards=tuple(self.shards), source=self.source)
        try:
            self.store.write_file(DATASET_FILE, manifest.to_json(), create_only=True)
        except FileExistsError:
            raise DataError(f"{self.url}: another packing wrote {DATASET_FILE} first; this one's shards "
                            f"(*-{self.attempt}.bin) are unused") from None
        return Packed(url=self.url, manifest=manifest)


def pack_records(url: str, records: np.ndarray, *, shard_bytes: int = SHARD_BYTES, part_bytes: int = PART_BYTES,
                 source: dict[str, Any] | None = None, options: StoreOptions | None = None) -> Packed:
    """Pack ``records`` (an array of shape ``(N, *record_shape)``, e.g. a memory-mapped ``.npy``) as a ``records``
    dataset at ``url``: sample ``i`` is ``records[i]``."""
    records = np.asarray(records)
    if records.ndim < 2 or records.shape[0] < 1:
        raise ConfigError(f"records must be an array of shape (N, ...) with N >= 1, got {records.shape}")
    dtype = _dtype(records.dtype)
    shape = tuple(int(d) for d in records.shape[1:])
    if int(np.prod(shape)) * dtype.itemsize > MAX_RECORD_BYTES:
        raise ConfigError(f"a record of shape {shape} is larger than {MAX_RECORD_BYTES} bytes")
    packer = _Packer(url, kind="records", dtype=dtype, shape=shape, shard_bytes=shard_bytes, part_bytes=part_bytes,
                     source=source, options=options)
    per_shard = max(1, shard_bytes // (int(np.prod(shape)) * dtype.itemsize))
    for start in range(0, len(records), per_shard):
        block = records[start : start + per_shard]  # a memory-mapped input is read one shard at a time
        packer.add(block, count=len(block))
    return packer.finish()


def token_windows(tokens: np.ndarray, context: int) -> np.ndarray:
    """Records of ``context + 1`` tokens from a 1-D token stream, one every ``context`` tokens (window ``i``'s inputs
    are its first ``context`` tokens, its targets the last ``context``: every token but the first is a target once).
    A view: nothing is copied."""
    tokens = np.asarray(tokens)
    if tokens.ndim != 1 or context < 1:
        raise ConfigError(f"token windows need a 1-D token array and context >= 1 (got {tokens.shape}, {context})")
    count = (len(tokens) - 1) // context
    if count < 1:
        raise ConfigError(f"{len(tokens)} tokens are fewer than context + 1 = {context + 1}")
    step = tokens.strides[0]
    return np.lib.stride_tricks.as_strided(tokens, shape=(count, context + 1), strides=(context * step, step),
                                           writeable=False)


def pack_samples(url: str, samples: Iterable[Any], *, dtype: str | np.dtype = "|u1", shard_bytes: int = SHARD_BYTES,
                 part_bytes: int = PART_BYTES, source: dict[str, Any] | None = None,
                 options: StoreOptions | None = None) -> Packed:
    """Pack samples of any size (1-D arrays of ``dtype``, or ``bytes`` for ``|u1``) as a ``samples`` dataset."""
    packer = _Packer(url, kind="samples", dtype=_dtype(np.dtype(dtype)), shape=(), shard_bytes=shard_bytes,
                     part_bytes=part_bytes, source=source, options=options)
    for sample in samples:
        array = np.frombuffer(sample, dtype=np.uint8) if isinstance(sample, (bytes, bytearray)) else np.asarray(sample)
        if array.ndim != 1:
            raise ConfigError(f"a sample of a samples dataset is 1-D, got shape {array.shape}")
        packer.add(array)
    return packer.finish()


def _dtype(dtype: np.dtype) -> np.dtype:
    if dtype.kind not in "biuf" or dtype.itemsize not in (1, 2, 4, 8) or (dtype.kind == "f" and dtype.itemsize == 1):
        raise ConfigError(f"dtype {dtype} cannot be packed: use a plain integer, bool or float dtype")
    return dtype.newbyteorder("<") if dtype.itemsize > 1 else dtype
