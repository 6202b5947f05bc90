"""Sharded generations: ``torch.distributed.checkpoint`` (DCP) writing into and reading from the generation store.

A sharded generation ``step-%08d`` holds one ``shard-%05d.distcp`` per rank (the raw bytes of that rank's chunks
of sharded tensors), ``values-%05d.distcp`` from the ranks DCP gave plain tensors or values to write (replicated
and small: raw tensor bytes, and ``torch.save``d plain values), DCP's metadata as ``dcp.metadata``, and one
``COMPLETE.json`` listing all of them with their size and sha256. No rank ever holds more than its own chunks.

Saving (:func:`save_sharded`, every rank; DCP's protocol, :class:`GenerationWriter` its storage):

1. DCP plans which rank writes which chunk (replicated values once, by the lowest rank);
2. every rank hands its chunks to ``store.write_part`` as the file's list of buffers, unjoined
   (``trainproof.storage.pieces``: a contiguous host tensor's own memory, else a host copy of that chunk; create-only
   write, read back from the store, size + sha256), then sends rank 0 only its entry (name, bytes, sha256, object)
   inside DCP's own write results, over the process group;
3. rank 0 writes ``dcp.metadata`` the same way and commits the generation (``store.commit_parts``: every listed
   object must be in the store with its size, then ``COMPLETE.json`` create-only). DCP shares the outcome, so
   every rank raises :class:`ShardedSaveError` when any rank failed or died: no ``COMPLETE.json``, and the
   previous generation stays the resume point.

Loading (:func:`load_sharded`, every rank; :class:`GenerationReader`): the manifest is read once; the metadata
is read and verified against it (size, sha256) *before* it is unpickled, and then only by an unpickler that
admits DCP's own metadata classes and nothing else (DCP's ``FileSystemReader`` uses a bare ``pickle.load``).
Each rank then reads only the shard files its read plan names, each verified against the manifest before a
single byte is used; tensors are taken straight from the verified bytes (no ``torch.load``), and non-tensor
values must load with ``torch.load(weights_only=True)`` before DCP's planner sees them. DCP reshards: a
generation saved by W ranks loads into any other world when the caller allows it (``allow_world_change``).
"""

from __future__ import annotations

import io
import math
import pickle
import warnings
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.futures import Future

from trainproof.errors import ConfigError, TrainError
from trainproof.format.shard_files import METADATA_FILE, is_sharded_file, shard_file, values_file  # noqa: F401 (re-exported)
from trainproof.storage import GenerationInfo, GenerationStore, RetentionPolicy
from trainproof.storage.errors import StoreError
from trainproof.storage.pieces import Pieces

FORMAT = "trainproof.dcp/1"
ALIGN = 64  # every chunk starts at a multiple of this in its shard file (any dtype can view it in place)
_ENTRY = "__trainproof_entry__"  # the write result that carries a rank's file entry to rank 0


class ShardedSaveError(TrainError):
    """A sharded generation was not committed (exit 1): a rank failed or died; the previous one still stands."""


class ShardedLoadError(TrainError):
    """A sharded generation could not be loaded (exit 1): it is not usable, or its bytes disagree with its
    manifest (``corrupt`` is then True and the caller may fall back to an older generation)."""

    def __init__(self, message: str, corrupt: bool = False) -> None:
        super().__init__(message)
        self.corrupt = corrupt

    def __reduce__(self):  # DCP pickles a rank's exception to rank 0: keep both fields
        return (type(self), (str(self), self.corrupt))


# -- saving ------------------------------------------------------------------------------------------------
class GenerationWriter(StorageWriter):
    """DCP storage writer: one verified file per rank in generation ``step``; rank 0 commits (module doc)."""

    def __init__(self, store: GenerationStore, step: int, *, contract: str, world: int, code_version: str,
                 extra: dict | None = None, retention: RetentionPolicy | None = None,
                 defer_commit: bool = False) -> None:
        super().__init__()
        self.store, self.step = store, step
        self.contract, self.world, self.code_version = contract, world, code_version
        self.extra, self.retention = dict(extra or {}), retention
        self.defer_commit = defer_commit
        """Write every file (the metadata too) but leave the commit to the caller (:func:`write_sharded`)."""
        self.rank = 0
        self.committed: GenerationInfo | None = None
        """The committed generation (rank 0, after a successful save)."""
        self.written: tuple[dict[str, list], dict] | None = None
        """With ``defer_commit``, on rank 0 after a successful write: (every file's entry, the manifest's
        ``sharded`` section)."""

    def reset(self, checkpoint_id=None) -> None:
        self.committed = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False  # never picked by DCP from a path: only ever passed explicitly

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.rank = int(kwargs.get("rank") or 0)
        if not kwargs.get("use_collectives", True):
            raise ShardedSaveError("a sharded generation needs DCP's collectives (rank 0 commits every rank's file)")

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return [replace(plan, storage_data=shard_file(r)) for r, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        try:
            results = self._write(plan, planner)
        except TrainError:
            raise
        except Exception as exc:  # noqa: BLE001 - travels to rank 0 pickled: a plain message, not the object
            raise ShardedSaveError(f"rank {self.rank} could not write its shard of step {self.step}: "
                                   f"{type(exc).__name__}: {exc}") from exc
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        # Chunks of sharded tensors go into this rank's shard file; plain tensors and values (replicated, small:
        # an optimizer's step, its param groups) into a separate values file, so that a rank loading them never
        # has to read another rank's shard file.
        shard = plan.storage_data if isinstance(plan.storage_data, str) else shard_file(self.rank)
        files: dict[str, list] = {shard: [], values_file(self.rank): []}
        for item in plan.items:
            files[shard if item.type == WriteItemType.SHARD else values_file(self.rank)].append(item)
        results, entries = [], {}
        for fname, items in files.items():
            if items or fname == shard:  # every rank writes its shard file, empty or not
                entries.update(self._write_file(fname, items, planner, results))
        results.append(WriteResult(index=MetadataIndex(f"{_ENTRY}{self.rank}"), size_in_bytes=0, storage_data=entries))
        return results

    def _write_file(self, fname: str, items: list, planner: SavePlanner, results: list) -> dict[str, list]:
        blobs = {i: planner.resolve_data(item).getbuffer() for i, item in enumerate(items)
                 if item.type == WriteItemType.BYTE_IO}  # small pickled values, resolved first
        layout, end = [], 0
        for i, item in enumerate(items):
            size = len(blobs[i]) if i in blobs else \
                _nbytes(item.tensor_data.chunk.sizes, item.tensor_data.properties.dtype)
            layout.append((end, size))
            end = _aligned(end + size)
        # The file as the list of its buffers, handed to the store unjoined (trainproof.storage.pieces): each chunk's
        # own memory when it is a contiguous host tensor (the live state of a synchronous save on the CPU, or a
        # background save's snapshot), else a host copy of that one chunk. Nothing changes them until the store
        # has written and read back the file: a synchronous save blocks training, a snapshot is this save's own.
        buffers, at = [], 0
        for i, item in enumerate(items):
            offset, size = layout[i]
            buffers.append(bytes(offset - at))  # alignment padding: < ALIGN zero bytes
            if i in blobs:
                buffers.append(blobs.pop(i))
            elif size:
                buffers.append(_host_bytes(self._resolve(planner, item, size)))
            at = offset + size
            results.append(WriteResult(index=item.index, size_in_bytes=size, storage_data=(fname, offset, size)))
        buffers.append(bytes(end - at))
        return self.store.write_part(self.step, {fname: Pieces(buffers)})

    @staticmethod
    def _resolve(planner: SavePlanner, item, size: int) -> torch.Tensor:
        tensor = planner.resolve_data(item)
        if _nbytes(tensor.shape, tensor.dtype) != size:
            raise ShardedSaveError(f"{item.index.fqn}: the planner resolved {tuple(tensor.shape)} "
                                   f"{tensor.dtype}, the plan says {tuple(item.tensor_data.chunk.sizes)}")
        return tensor

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        try:
            self._commit(metadata, results)
        except TrainError:
            raise
        except Exception as exc:  # noqa: BLE001 - see write_data
            raise ShardedSaveError(f"step {self.step} was not committed: {type(exc).__name__}: {exc}") from exc

    def _commit(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        entries, storage = {}, {}
        for rank_results in results:
            for wr in rank_results:
                if wr.index.fqn.startswith(_ENTRY):
                    entries.update(wr.storage_data)
                else:
                    storage[wr.index] = wr.storage_data
        shards = sorted(n for n in entries if n.startswith("shard-"))
        if len(shards) != len(results):
            raise ShardedSaveError(f"{len(results)} ranks saved but {len(shards)} shard files were reported")
        metadata.storage_data = storage
        metadata.storage_meta = None  # nothing host-specific in the generation
        raw = pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL)
        entries.update(self.store.write_part(self.step, {METADATA_FILE: raw}, check=lambda _n, b: _unpickle(b)))
        section = {"format": FORMAT, "metadata": METADATA_FILE, "shards": shards, "dcp_version": metadata.version}
        if self.defer_commit:
            self.written = (entries, section)
            return
        extra = {**self.extra, "sharded": section}
        self.committed = self.store.commit_parts(
            self.step, entries, contract=self.contract, world=self.world, code_version=self.code_version,
            extra=extra, digests={"dcp_metadata": METADATA_FILE}, retention=self.retention)


def save_sharded(store: GenerationStore, step: int, state_dict: dict[str, Any], *, contract: str, world: int,
                 code_version: str, extra: dict | None = None, retention: RetentionPolicy | None = None,
                 process_group=None) -> GenerationInfo | None:
    """Save ``state_dict`` (e.g. ``{"model": ..., "optim": ...}`` from ``get_state_dict``: DTensors, tensors,
    plain values) as sharded generation ``step``, on every rank. Returns the committed generation on rank 0,
    None elsewhere; raises ShardedSaveError on every rank when it was not committed. The tensors must not change
    until it returns (their own memory is written and read back)."""
    import torch.distributed.checkpoint as dcp

    writer = GenerationWriter(store, step, contract=contract, world=world, code_version=code_version,
                              extra=extra, retention=retention)
    try:
        dcp.save(state_dict, storage_writer=writer, process_group=process_group)
    except CheckpointException as exc:
        raise ShardedSaveError(f"step {step} was not committed: {_failures(exc)}") from None
    except (RuntimeError, ValueError) as exc:  # a collective failed: a rank died or stopped responding
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ShardedSaveError(f"step {step} was not committed: a collective failed (a rank died, failed or "
                               f"stopped responding): {first}") from None
    return writer.committed


def write_sharded(store: GenerationStore, step: int, state_dict: dict[str, Any],
                  process_group=None) -> tuple[dict[str, list], dict] | None:
    """Like :func:`save_sharded` but without the commit: every rank writes and verifies its files of generation
    ``step`` and rank 0 writes ``dcp.metadata``; rank 0 gets (every file's entry, the manifest's ``sharded``
    section) to commit together with files of its own (``Checkpointer``: the training state and the rank files,
    in one ``COMPLETE.json``), None elsewhere. ShardedSaveError on every rank when any rank failed."""
    import torch.distributed.checkpoint as dcp

    writer = GenerationWriter(store, step, contract="", world=0, code_version="", defer_commit=True)
    try:
        dcp.save(state_dict, storage_writer=writer, process_group=process_group)
    except CheckpointException as exc:
        raise ShardedSaveError(f"the shards of step {step} were not written: {_failures(exc)}") from None
    except (RuntimeError, ValueError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ShardedSaveError(f"the shards of step {step} were not written: a collective failed (a rank died, "
                               f"failed or stopped responding): {first}") from None
    return writer.written


# -- loading -----------------------------------------------------------------------------------------------
class GenerationReader(StorageReader):
    """DCP storage reader over one committed sharded generation (module doc): verified before it is used."""

    def __init__(self, store: GenerationStore, step: int, *, contract: str | None = None) -> None:
        super().__init__()
        self.store, self.step, self.contract = store, step, contract
        self.info: GenerationInfo | None = None
        self.storage_data: dict = {}
        self.chunks: dict[tuple[str, tuple[int, ...]], tuple[torch.dtype, tuple[int, ...]]] = {}
        self.metadata: Metadata | None = None
        self.files_read: list[str] = []
        """Shard files this rank read (tests and the bench check that a rank reads only what it needs)."""
        self.bytes_read = 0
        """Bytes of them it read (a file with parts: only the parts holding the byte ranges it needs)."""

    def reset(self, checkpoint_id=None) -> None:
        self.files_read, self.bytes_read = [], 0

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False

    def generation(self) -> GenerationInfo:
        """The generation's manifest, read once: every file is verified against this one."""
        if self.info is None:
            info = self.store.generation(self.step, contract=self.contract)
            if info.status != "complete" or info.manifest is None:
                raise ShardedLoadError(f"{info.name} is not usable ({info.status}): {info.reason}")
            sharded = (info.manifest.get("extra") or {}).get("sharded")
            if not isinstance(sharded, dict) or sharded.get("format") != FORMAT \
                    or METADATA_FILE not in info.manifest["files"]:
                raise ShardedLoadError(f"{info.name} is not a sharded generation ({FORMAT})")
            self.info = info
        return self.info

    def read_metadata(self) -> Metadata:
        if self.metadata is not None:
            return self.metadata
        info = self.generation()
        raw = self._read(METADATA_FILE)
        try:
            metadata = _unpickle(raw)
        except Exception as exc:  # noqa: BLE001
            raise ShardedLoadError(f"{info.name}/{METADATA_FILE} is not DCP metadata: {exc}", corrupt=True) from None
        self._check(metadata, info)
        self.metadata = metadata
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data
        self.chunks = {(fqn, tuple(c.offsets)): (md.properties.dtype, tuple(c.sizes))
                       for fqn, md in metadata.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)
                       for c in md.chunks}

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        per_file: dict[str, list] = {}
        for req in plan.items:
            per_file.setdefault(self.storage_data[req.storage_index][0], []).append(req)
        info = self.generation()
        for fname, reqs in sorted(per_file.items()):
            # Verified before any byte is used: part by part when the file lists parts (each part copied into
            # its tensors and dropped), else the whole file first (trainproof.storage.generations.read_parts).
            assembler = _Assembler(self, planner, fname, reqs)
            try:
                self.store.read_parts(info, fname, self._counted(assembler.take), wanted=assembler.wanted())
            except StoreError as exc:  # CorruptGenerationError: size or sha256 differ from the manifest, or missing
                raise ShardedLoadError(f"{exc}; refusing to load it", corrupt=True) from None
            assembler.check_done()
            self.files_read.append(fname)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _counted(self, sink):
        def take(offset: int, data) -> None:
            self.bytes_read += len(data)
            sink(offset, data)
        return take

    def _read(self, fname: str) -> bytes:
        info = self.generation()
        try:
            return self.store.load_files(info, [fname]).files[fname]
        except StoreError as exc:  # CorruptGenerationError: size or sha256 differ from the manifest, or missing
            raise ShardedLoadError(f"{exc}; refusing to load it", corrupt=True) from None

    def _check(self, metadata: Metadata, info: GenerationInfo) -> None:
        """Every chunk the metadata places must lie inside a shard file the manifest lists."""
        files = info.manifest["files"]
        if not isinstance(metadata.storage_data, dict):
            raise ShardedLoadError(f"{info.name}/{METADATA_FILE} has no chunk locations", corrupt=True)
        for index, where in metadata.storage_data.items():
            ok = (isinstance(where, tuple) and len(where) == 3 and isinstance(where[0], str) and where[0] in files
                  and where[0] != METADATA_FILE and all(isinstance(v, int) and v >= 0 for v in where[1:])
                  and where[1] + where[2] <= files[where[0]]["bytes"])
            if not ok:
                raise ShardedLoadError(f"{info.name}/{METADATA_FILE} places {getattr(index, 'fqn', index)!r} "
                                       f"outside the generation's files: {str(where)[:80]}", corrupt=True)
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                for c in md.chunks:
                    where = metadata.storage_data.get(MetadataIndex(fqn, c.offsets))
                    if where is None or where[2] != _nbytes(c.sizes, md.properties.dtype):
                        raise ShardedLoadError(f"{info.name}/{METADATA_FILE}: chunk {tuple(c.offsets)} of {fqn!r} "
                                               "has no place of its size", corrupt=True)


def load_sharded(store: GenerationStore, step: int, state_dict: dict[str, Any], *, world: int,
                 contract: str | None = None, allow_world_change: bool = False,
                 process_group=None, planner=None, no_dist: bool = False,
                 reader: GenerationReader | None = None) -> GenerationInfo:
    """Load sharded generation ``step`` into ``state_dict`` in place (every rank; DCP reshards to this world).

    ConfigError (exit 2) when the generation was saved by another world size and ``allow_world_change`` is
    not given; ShardedLoadError on every rank when it cannot be loaded (``corrupt`` when its bytes disagree
    with its manifest: the caller may fall back to an older generation). ``planner``, ``no_dist``: DCP's (one
    process reading a whole generation without a process group: trainproof.train.fsdp ``full_state``); ``reader``:
    one already set up for ``step`` (its verified metadata is reused)."""
    import torch.distributed.checkpoint as dcp

    reader = reader or GenerationReader(store, step, contract=contract)
    saved = reader.generation().manifest["world"]
    if saved != world and not allow_world_change:
        raise ConfigError(f"{reader.generation().name} was saved by {saved} ranks and this run has {world}; "
                          "pass --allow-world-change to reshard it")
    reader.read_metadata()  # here, so that a bad one raises its own error (inside DCP it becomes "metadata is None")
    try:
        with warnings.catch_warnings():  # no_dist: "assuming the intent is to load in a single process" (it is)
            if no_dist:
                warnings.simplefilter("ignore", UserWarning)
            dcp.load(state_dict, storage_reader=reader, process_group=process_group, planner=planner, no_dist=no_dist)
    except CheckpointException as exc:
        errors = [f[0] for f in exc.failures.values() if isinstance(f[0], ShardedLoadError)]
        raise ShardedLoadError(f"step {step} could not be loaded: {_failures(exc)}",
                               corrupt=any(e.corrupt for e in errors)) from None
    except (RuntimeError, ValueError) as exc:  # a collective failed: a rank died or stopped responding
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise ShardedLoadError(f"step {step} could not be loaded: a collective failed: {first}") from None
    return reader.generation()


@dataclass
class _Request:
    """One read request of a file being assembled: the bytes ``[lo, hi)`` of the file it needs, its stored chunk
    ``[start, stop)``, and (once opened) where the bytes go: the target's own bytes or a staging buffer of the
    chunk, and how many arrived."""
    lo: int
    hi: int
    start: int
    stop: int
    req: Any
    dest: Any = None
    target: torch.Tensor | None = None
    filled: int = 0

    @property
    def complete(self) -> bool:
        return self.filled == self.hi - self.lo


class _Assembler:
    """The read requests of one file, served from its verified pieces as they arrive in order (``take``).

    A request that wants a whole stored chunk of a CPU tensor of the same dtype is copied straight into its
    target, piece by piece; any other (a resharded sub-block, a device tensor, another dtype, a plain value) is
    gathered into a buffer of its own chunk's size and used when complete. So a load holds a part of the file and
    at most the chunks that span it, never the file. ``wanted`` is the byte ranges the requests need: a sub-block
    needs only the span from its first to its last element, so a rank that reshards skips the parts outside."""

    def __init__(self, reader: GenerationReader, planner: LoadPlanner, fname: str, reqs: list) -> None:
        self.reader, self.planner, self.fname = reader, planner, fname
        queue = []
        for req in reqs:
            _f, offset, size = reader.storage_data[req.storage_index]
            queue.append(_Request(*self._needed(req, offset, size), offset, offset + size, req))
        self.queue = sorted(queue, key=lambda r: r.lo)
        self.next = 0
        self.active: list[_Request] = []

    def _chunk(self, req) -> tuple[torch.dtype, list[int]]:
        """The dtype and shape of the stored chunk ``req`` reads from."""
        return self.reader.chunks[(req.storage_index.fqn, tuple(req.storage_index.offset))]

    def _needed(self, req, offset: int, size: int) -> tuple[int, int]:
        """The bytes of the file ``req`` needs: from its first to its last element."""
        if req.type == LoadItemType.BYTE_IO:
            return offset, offset + size
        dtype, shape = self._chunk(req)
        if any(length == 0 for length in req.lengths):
            return offset, offset  # an empty sub-block needs nothing
        if not shape:
            return offset, offset + size  # a scalar
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        first = sum(o * st for o, st in zip(req.storage_offsets, strides))
        last = sum((o + n - 1) * st for o, n, st in zip(req.storage_offsets, req.lengths, strides))
        element = torch._utils._element_size(dtype)
        return offset + first * element, offset + (last + 1) * element

    def wanted(self) -> list[tuple[int, int]]:
        """The byte ranges of the file the requests need."""
        return [(r.lo, r.hi) for r in self.queue if r.hi > r.lo]

    def take(self, offset: int, data) -> None:
        end = offset + len(data)
        view = memoryview(data)
        while self.next < len(self.queue) and self.queue[self.next].lo < end:
            self.active.append(self._open(self.queue[self.next]))
            self.next += 1
        for r in self.active:
            lo, hi = max(r.lo, offset), min(r.hi, end)
            if lo < hi:
                r.dest[lo - r.start:hi - r.start] = view[lo - offset:hi - offset]
                r.filled += hi - lo
        done = [r for r in self.active if r.complete]
        self.active = [r for r in self.active if not r.complete]
        for r in done:
            self._finish(r)

    def _open(self, r: _Request) -> _Request:
        """Give ``r`` its destination: the target's own bytes when it wants a whole chunk of a host tensor that
        can take them as they are, else a staging buffer of the chunk."""
        if r.req.type != LoadItemType.BYTE_IO:
            dtype, shape = self._chunk(r.req)
            whole = all(o == 0 for o in r.req.storage_offsets) and tuple(r.req.lengths) == tuple(shape)
            r.target = self.planner.resolve_tensor(r.req).detach()
            t = r.target
            if whole and t.device.type == "cpu" and t.dtype == dtype and t.is_contiguous() \
                    and tuple(t.size()) == tuple(shape) and t.numel():
                r.dest = t.view(-1).view(torch.uint8).numpy().data
                return r
        r.dest = bytearray(r.stop - r.start if r.hi > r.lo else 0)
        return r

    def _finish(self, r: _Request) -> None:
        req, dest, target = r.req, r.dest, r.target
        if req.type == LoadItemType.BYTE_IO:
            blob = bytes(dest)
            try:  # only plain values: refuse anything that needs more than the weights-only loader
                torch.load(io.BytesIO(blob), weights_only=True)
            except Exception as exc:  # noqa: BLE001
                raise ShardedLoadError(f"{self.reader.generation().name}/{self.fname}: the value of "
                                       f"{req.storage_index.fqn!r} is not a plain value: {exc}") from None
            self.planner.load_bytes(req, io.BytesIO(blob))
            return
        if isinstance(dest, bytearray):  # gathered: view it as the stored chunk, narrow it to the request
            dtype, shape = self._chunk(req)
            stored = _view(dest, dtype, 0, shape) if dest else torch.empty(tuple(shape), dtype=dtype)
            for dim, (begin, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                stored = stored.narrow(dim, begin, length)
            if target.size() != stored.size():
                raise ShardedLoadError(f"{req.storage_index.fqn}: the plan wants {tuple(target.size())}, "
                                       f"the generation holds {tuple(stored.size())}")
            target.copy_(stored)
        self.planner.commit_tensor(req, target)

    def check_done(self) -> None:
        """Every request was served (the file was as long as the metadata placed it: checked before reading)."""
        while self.next < len(self.queue) and self.queue[self.next].lo == self.queue[self.next].hi:
            self._finish(self._open(self.queue[self.next]))  # nothing to read: an empty chunk or sub-block
            self.next += 1
        if self.active or self.next < len(self.queue):
            left = (self.active[0] if self.active else self.queue[self.next]).req.storage_index.fqn
            raise ShardedLoadError(f"{self.reader.generation().name}/{self.fname} ended before {left!r} was read",
                                   corrupt=True)


# -- helpers -----------------------------------------------------------------------------------------------
def _failures(exc) -> str:
    """One line per failed rank of a DCP CheckpointException: its own message, not DCP's traceback dump."""
    parts = []
    for rank, failure in sorted(exc.failures.items()):
        err = failure[0] if isinstance(failure, tuple) and failure else failure
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        parts.append(f"rank {rank}: {text}")
    return "; ".join(parts)


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch._utils._element_size(dtype)


def _host_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of ``tensor`` in row-major order: its own memory when it is a contiguous host tensor, else a
    contiguous host copy of this one chunk (a conjugate or negative view is materialised first: its memory does not
    hold the values)."""
    flat = tensor.detach().resolve_conj().resolve_neg()
    if flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.to("cpu").contiguous()
    return memoryview(flat.reshape(-1).view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")


def _view(buf, dtype: torch.dtype, offset: int, shape) -> torch.Tensor:
    """A tensor of ``shape`` over ``buf[offset:]`` (no copy)."""
    count = math.prod(shape)
    if count == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    with warnings.catch_warnings():  # a read-only buffer (verified bytes) is only ever read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype, count=count, offset=offset).view(tuple(shape))


_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)
_METADATA_CLASSES = {"Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                     "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"}


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata classes, ``torch.Size`` and torch's dtype/layout constants (and the lookup of a layout
    by name); nothing else."""

    def find_class(self, module: str, name: str):
        if module == dcp_metadata.__name__ and name in _METADATA_CLASSES:
            return getattr(dcp_metadata, name)
        if module == "torch" and name == "Size":
            return torch.Size
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES):
            return getattr(torch, name)
        if module == "torch.serialization" and name == "_get_layout":  # how a torch.layout pickles: a lookup by name
            from torch.serialization import _get_layout
            return _get_layout
        if module == "collections" and name == "OrderedDict":
            import collections
            return collections.OrderedDict
        raise pickle.UnpicklingError(f"DCP metadata may not name {module}.{name}")


def _unpickle(raw: bytes) -> Metadata:
    metadata = _MetadataUnpickler(io.BytesIO(raw)).load()
    if not isinstance(metadata, Metadata):
        raise pickle.UnpicklingError(f"not DCP metadata but a {type(metadata).__name__}")
    return metadata


__all__ = ["GenerationWriter", "GenerationReader", "save_sharded", "write_sharded", "load_sharded", "is_sharded_file",
           "shard_file", "METADATA_FILE", "ShardedSaveError", "ShardedLoadError", "values_file"]
