"""Checkpoints: how a save (:class:`Capture`) becomes usable (:class:`Checkpointer`); *when* is trainproof.train.saver.

A save is: serialise the state into a spool file (``trainproof.storage.spool``: ``torch.save`` streams it to local disk
while it is hashed, so no second in-memory copy of the state exists), hand it to the generation store, which
uploads it (parallel multipart parts read from the file) under a new
``step-%08d`` name, reads every object back, checks size and sha256, runs our ``check`` on the stored
bytes (a real weights-only load), and only then writes ``COMPLETE.json`` create-only and moves the
LATEST hint. Retention runs after that commit, never before, and never deletes the newest generation.

With world > 1 a generation is ``training_state.pt`` (rank 0's view, its own part inline) plus one
``rank-%05d.pt`` per other rank, committed together in one ``COMPLETE.json``:

1. every rank writes its own file into the generation and verifies it read back from the store
   (``store.write_part``: create-only write, size + sha256 of the stored bytes, a real weights-only load);
2. every rank >= 1 sends rank 0 only its entry (name, bytes, sha256, object) or its error, over the gloo
   control group; rank 0 writes ``training_state.pt`` the same way;
3. rank 0 commits the generation (``store.commit_parts``: every listed object must be in the store with its
   size, then ``COMPLETE.json`` create-only listing every rank's file) and shares the outcome; every rank
   raises if the commit failed, so all exit non-zero together.

A rank that dies or hangs makes the gather or the outcome broadcast fail (at once, or at the group's
timeout): no ``COMPLETE.json`` is written for that step unless every rank had already reported its file
written and verified.  Only digests travel between ranks, so the same protocol carries sharded state.

A sharded run (``--fsdp``, trainproof.train.fsdp) adds its model and optimizer shards to the same generation: first
every rank writes and verifies its shard file through DCP and rank 0 writes DCP's metadata
(``trainproof.train.sharded.write_sharded``; a rank that fails makes every rank fail here); rank 0 then commits those
entries with ``training_state.pt`` and the rank files in one ``COMPLETE.json`` (with the ``sharded`` section and
the metadata's digest).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from trainproof.errors import TrainError
from trainproof.format.shard_files import METADATA_FILE
from trainproof.format.state import (
    FROZEN_FILE,
    HISTORY_DIR,
    HISTORY_FILE,
    STATE_FILE,
    decode,
    decode_history,
    decode_rank_part,
    encode_frozen,
    encode_history,
    encode_live,
    encode_rank_part,
    encode_spool,
    rank_file,
)
from trainproof.storage import GenerationStore, KeepEvery, RetentionPolicy
from trainproof.storage.errors import CommitConflictError, StoreError
from trainproof.storage.spool import LiveSpool, Spool
from trainproof.train.dist import Collectives
from trainproof.train.frozen import fingerprint
from trainproof.train.progress import Reporter


@dataclass(kw_only=True)
class Capture:
    """What one rank commits for one step: the one argument of :meth:`Checkpointer.commit`."""

    step: int
    state: dict[str, Any] | None
    """Rank 0's full training state (None on other ranks, and once ``encoded``)."""
    extra: dict[str, Any]
    """The manifest's extra fields (task, epoch, loss, next learning rate, ...)."""
    part: dict[str, Any] | None = None
    """A rank >= 1's own part (its generators and data position)."""
    sharded: dict[str, Any] | None = None
    """This rank's shards of the model and optimizer (every rank of a sharded run; ``state`` then holds neither)."""
    encoded: Spool | None = None
    """Or rank 0's state serialised by the caller (``Checkpointer.encode``: on S3 a ``LiveSpool`` still being written,
    trainproof.train.async_save drops its own reference to the snapshot then), with ``history``
    (its ``history.pt``, state.encode_history); the spool is deleted once the commit is over, whatever its outcome."""
    history: bytes | None = None
    frozen: dict[str, Any] | None = None
    """Rank 0's frozen model entries (trainproof.train.frozen) to store as the run's shared ``frozen.pt``: only when
    their fingerprint (``frozen_mark``) is not the one already stored (snapshotted like the state then); else None
    and ``frozen_ref`` names the stored object."""
    frozen_mark: tuple | None = None
    frozen_ref: tuple | None = None
    """(fingerprint, bytes, sha256) of the stored frozen object this step's frozen entries are (decided at capture,
    on the training thread: a task writing into a frozen parameter after the capture cannot change it)."""
    blocked_s: float | None = None
    """How long training was blocked for this checkpoint, or ``blocked_since`` (a ``time.perf_counter()``) when it
    is blocked until the commit returns; recorded as the record's ``blocked_s`` (neither: the commit's seconds)."""
    blocked_since: float | None = None


class Checkpointer:
    """Commits training states as generations of one run in the store (rank 0 writes; see the module doc)."""

    def __init__(
        self, store: GenerationStore, *, contract: str, world: int, code_version: str, keep: int,
        reporter: Reporter, last_step: int = 0, sync: Collectives | None = None, spool_dir: str | None = None,
    ) -> None:
        self.store = store
        self.spool_dir = spool_dir
        """Where states are serialised before upload: on a folder store the run's own spool folder
        (``GenerationStore.spool_folder``: the spool is then linked in, not copied), else
        ``trainproof.storage.spool.spool_dir`` (TRAINPROOF_SPOOL_DIR or /tmp)."""
        self.contract, self.world, self.code_version = contract, world, code_version
        self.keep = keep
        self.reporter = reporter
        self.sync = sync
        self.last_step = last_step
        """Step of the newest generation known committed (the resume point, then our own commits)."""
        self.records: list[dict[str, Any]] = []
        self.protect: Callable[[list[Any]], frozenset[int]] | None = None
        """Which generations retention must keep besides the newest ones, given the run's complete generations
        (those around every restore point no audit has passed across: trainproof.format.protect). Called at each
        retention."""
        self.keep_every: KeepEvery | None = None
        """A sparse permanent series retention keeps besides the ``keep`` newest (``--keep-every``)."""
        self._stored_frozen: tuple[int, float] | None = None
        """(bytes, seconds) of the frozen entries the commit in progress stored (its record's ``shared_bytes``)."""
        self.frozen_ref: tuple[tuple, int, str] | None = None
        """(fingerprint, bytes, sha256) of the frozen entries stored in this run's shared objects (written or verified
        by this process), referenced as long as the fingerprint holds."""

    def commit(self, c: Capture) -> dict[str, Any] | None:
        """Serialise and commit generation ``c.step``, then apply retention (rank 0). Raises TrainError (exit 1) on
        every rank when it failed (or, on one rank, what serialising its state raised): nothing was marked usable,
        the previous generation is still the resume point."""
        rank, spool = (self.sync.rank if self.sync else 0), c.encoded
        try:
            own = c.history if c.encoded is not None else encode_history(c.state) if rank == 0 else None
            if self.world == 1 and c.sharded is None:
                record = self._commit_one(c, own)
            else:
                record = self._commit_world(c, rank, own)
        finally:
            if spool is not None:
                spool.unlink()
        if record is not None and self._stored_frozen is not None:  # this commit stored the frozen entries
            record["shared_bytes"], seconds = self._stored_frozen
            record["seconds"] += seconds
        self._stored_frozen = None
        if record is not None and own is not None:
            self._keep_history(c.step, own)
        if record is not None:
            blocked_s = c.blocked_s
            if blocked_s is None:
                blocked_s = record["seconds"] if c.blocked_since is None else time.perf_counter() - c.blocked_since
            record["blocked_s"] = blocked_s
            self.records.append(record)
            self.reporter.event("checkpoint", **record)
        self.last_step = c.step
        if rank == 0:
            self._apply_retention()
        return record

    def _commit_one(self, c: Capture, history: bytes | None) -> dict[str, Any]:
        """One rank's generation: the state's spool (``c.encoded``, or serialised here and deleted after) and its
        history rows. When the spool's serialisation failed while the store was uploading it, that failure is
        raised, as itself."""
        spool = c.encoded
        if spool is None:
            assert c.state is not None, "a capture holds its state until it is encoded"
            spool = self.encode(c.state)
        try:
            files: dict[str, Spool | bytes] = {STATE_FILE: spool}
            files.update({HISTORY_FILE: history} if history is not None else {})
            try:
                return self._commit_generation(c.step, files, c.extra, None, self._frozen(c))
            except BaseException:
                failure = _serialising_failure(spool)
                if failure is None:
                    raise
            raise failure  # out here, not in the handler: its own context (what torch.save met) stays as it was
        finally:
            if spool is not c.encoded:  # commit() deletes the one it was handed
                spool.unlink()

    @property
    def links_spools(self) -> bool:
        """Whether a spool becomes the stored file itself: made in a folder store's own spool folder, it is linked
        into its generation, so it is written behind (``SpoolWriter``'s ``write_behind``) and the commit's fsync
        finds little left to write."""
        return self.spool_dir is not None and not self.store.uploads_while_written

    def encode(self, state: dict[str, Any]) -> Spool:
        """``state`` serialised into a spool for :meth:`commit`: a :class:`LiveSpool` still being written by a thread of
        its own on a store that uploads it meanwhile (S3), or reads it back from its device meanwhile (a folder whose
        spool is linked in, written behind), so the commit runs beside the serialisation; elsewhere the finished
        spool. The caller leaves ``state`` unchanged until the commit returns."""
        if self.store.uploads_while_written:
            return encode_live(state, self.spool_dir)
        if self.links_spools and self.store.verifies_while_written:
            return encode_live(state, self.spool_dir, write_behind=True, keep_parts=True)
        return encode_spool(state, self.spool_dir, write_behind=self.links_spools)

    def _keep_history(self, step: int, rows: bytes) -> None:
        """With retention on, the generation's own history rows are committed again under ``<run>/history/`` (a
        generation of their own, a few KB, never deleted by retention): the whole run's per-step metrics outlive
        the generations retention deletes (trainproof.format.history reads them, chain-checked). Never fatal."""
        if not self.keep:
            return
        try:
            self.store.child(HISTORY_DIR).commit(step, {HISTORY_FILE: rows}, contract=self.contract, world=self.world,
                                                 code_version=self.code_version, check=self._check)
        except CommitConflictError:
            # This run kept the step already: an earlier attempt committed it, then the generation went (a rollback
            # to an older one, a quarantine) and the step was trained again, to the same rows.
            return
        except (StoreError, OSError) as exc:  # a planted name, a full bucket: the curve starts later, no more
            self.reporter.warn(f"the metrics of step {step} were not kept under {HISTORY_DIR}/ ({exc}): once "
                               "retention deletes that generation, the exported curve starts after it")

    def _commit_world(self, c: Capture, rank: int, history: bytes | None) -> dict[str, Any] | None:
        step, extra = c.step, c.extra
        shards: tuple[dict[str, list], dict] | None = None
        t0 = time.perf_counter()  # the record's seconds: the whole cross-rank commit, the shards' write included
        self._clear_step(step, rank)
        if c.sharded is not None:  # every rank; ShardedSaveError on every rank when one failed: nothing to commit
            from trainproof.train.sharded import write_sharded  # only sharded runs import DCP

            shards = write_sharded(self.store, step, c.sharded, process_group=self.sync.group)
        frame = self._write_own_part(step, c.part, rank) if rank else b""
        frames = self.sync.gather_bytes(frame, f"gather the rank parts of step {step}")
        record, failure = None, b""
        raised: BaseException | None = None
        if rank == 0:
            spool = None
            try:
                assert c.state is not None, "rank 0's capture holds the state"
                spool = self.encode(c.state)
                entries = self._rank_entries(step, frames)
                if shards is not None:
                    entries, extra = {**entries, **shards[0]}, {**extra, "sharded": shards[1]}
                rows = history if history is not None else encode_history(c.state)
                record = self._commit_generation(step, {STATE_FILE: spool, HISTORY_FILE: rows}, extra, entries,
                                                 self._frozen(c))
                record["seconds"] = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001 - told to every rank, then re-raised here
                raised = _serialising_failure(spool) or exc
                failure = (str(raised) or type(raised).__name__).encode()
            finally:
                if spool is not None:
                    spool.unlink()
        failure = self.sync.broadcast_bytes(failure, f"share the outcome of step {step}'s commit")
        if raised is not None:
            raise raised
        if failure:
            raise TrainError(f"step {step} was not committed by rank 0: {failure.decode(errors='replace')}")
        return record

    def _clear_step(self, step: int, rank: int) -> None:
        """Before any rank writes its part: rank 0 alone moves aside whatever occupies the step and is not this
        run's own (the ranks racing to move one occupant would fail each other), and tells every rank the outcome."""
        assert self.sync is not None, "a commit of several ranks has their collectives"
        failure = b""
        if rank == 0:
            try:
                self.store.clear_step(step, contract=self.contract, code_version=self.code_version)
            except Exception as exc:  # noqa: BLE001 - told to every rank (waiting in the broadcast), then raised
                failure = (str(exc) or type(exc).__name__).encode()
        failure = self.sync.broadcast_bytes(failure, f"clear the way for step {step}'s commit")
        if failure:
            raise TrainError(f"step {step} cannot be committed: {failure.decode(errors='replace')}")

    def _write_own_part(self, step: int, part: dict[str, Any] | None, rank: int) -> bytes:
        """Write and verify this rank's file in the store: ``OK`` + its JSON entry, or ``ER`` + the error."""
        try:
            data = encode_rank_part(part or {}, step=step, world=self.world)
            entry = self.store.write_part(step, {rank_file(rank): data}, check=self._check)
            return b"OK" + json.dumps(entry).encode()
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the whole generation
            return b"ER" + f"{type(exc).__name__}: {exc}".encode()

    @staticmethod
    def _rank_entries(step: int, frames: list[bytes]) -> dict[str, list]:
        """Every other rank's written-and-verified file entry, refusing the generation when one is missing."""
        entries: dict[str, list] = {}
        for r, frame in enumerate(frames[1:], start=1):
            body = frame[2:].decode(errors="replace")
            if frame[:2] != b"OK":
                raise TrainError(f"rank {r} could not write its part of step {step}: {body}")
            entries.update(json.loads(body))
        return entries

    def _frozen(self, c: Capture) -> dict[str, tuple[int, str]] | None:
        """The ``shared`` reference to ``c``'s frozen entries: the stored object the capture named, or ``c.frozen``
        serialised and stored (``put_shared``: reused when the store holds those bytes already)."""
        if c.frozen:
            t0 = time.perf_counter()
            spool = encode_frozen(c.frozen, self.spool_dir, write_behind=self.links_spools)
            try:
                size, sha = self.store.put_shared(spool)
            except (StoreError, OSError) as exc:
                raise TrainError(f"checkpoint of step {c.step} was not committed: its frozen model entries could not "
                                 f"be stored ({exc})") from None
            finally:
                spool.unlink()
            assert c.frozen_mark is not None, "frozen entries to store come with their fingerprint (frozen_capture)"
            self.frozen_ref = (c.frozen_mark, size, sha)
            self._stored_frozen = (size, time.perf_counter() - t0)
            return {FROZEN_FILE: (size, sha)}
        if c.frozen_ref is not None:
            return {FROZEN_FILE: (c.frozen_ref[1], c.frozen_ref[2])}
        return None

    def frozen_capture(self, frozen: dict[str, Any]) -> dict[str, Any]:
        """On the training thread, at capture: the ``Capture`` fields for this step's frozen entries: a reference to
        the stored object while their fingerprint holds, else the entries themselves to store."""
        if not frozen:
            return {}
        mark = fingerprint(frozen)
        if self.frozen_ref is not None and self.frozen_ref[0] == mark:
            return {"frozen_ref": self.frozen_ref}
        return {"frozen": frozen, "frozen_mark": mark}

    def _commit_generation(self, step: int, files: dict[str, Spool | bytes], extra: dict[str, Any],
                           rank_entries: dict[str, list] | None,
                           shared: dict[str, tuple[int, str]] | None = None) -> dict[str, Any]:
        """Commit ``files`` (rank 0's) plus, in a distributed run, the other ranks' already-written entries, and a
        reference to each ``shared`` object (the frozen model entries)."""
        t0 = time.perf_counter()
        digests = {"state": STATE_FILE, **({"dcp_metadata": METADATA_FILE} if "sharded" in extra else {})}
        common: dict[str, Any] = dict(contract=self.contract, world=self.world, code_version=self.code_version,
                                      extra=extra, digests=digests, shared=shared)
        try:
            if rank_entries is None:
                info = self.store.commit(step, files, check=self._check, **common)
            else:
                own = self.store.write_part(step, files, check=self._check)
                info = self.store.commit_parts(step, {**own, **rank_entries}, **common)
        except CommitConflictError as exc:
            raise TrainError(
                f"step {step} was already committed by another writer ({exc}): two processes are "
                "training into the same --store; restart one to resume from the other's checkpoint"
            ) from None
        except StoreError as exc:
            raise TrainError(f"checkpoint of step {step} was not committed: {exc}") from None
        # Recorded and reported by commit(), once it knows how long training was blocked.
        return {"step": step, "generation": info.name, "bytes": info.bytes, "seconds": time.perf_counter() - t0}

    def _check(self, name: str, stored: bytes | Spool) -> None:
        # The store hands us the bytes it read back, or the spool the read-back hash proved identical to the
        # stored object: prove they load as a state, weights-only (a spool is mapped, not read whole).
        if name == STATE_FILE:
            decode(stored)
        elif name == HISTORY_FILE:
            decode_history(stored)
        else:
            decode_rank_part(stored)

    def _apply_retention(self) -> None:
        if not self.keep:
            return
        shared: list[str] = []
        try:
            # Only this run's generations count (another contract's or world's never make ours "old"). The objects
            # under shared/ that only the deleted generations referenced go with them (RetentionPolicy.shared).
            removed = self.store.apply_retention(RetentionPolicy(keep=self.keep, contract=self.contract,
                                                                 world=self.world, protect_rule=self.protect,
                                                                 keep_every=self.keep_every, upto=self.last_step,
                                                                 partials_above_newest=True),
                                                 on_shared=shared.append)
        except (StoreError, OSError) as exc:
            # The new generation is committed; a failed cleanup costs storage, not work.
            self.reporter.warn(f"retention (--keep {self.keep}) failed, old generations left in place: {exc}")
            return
        if removed or shared:
            self.reporter.event("retention", keep=self.keep, removed=[g.name for g in removed],
                                **({"removed_shared": shared} if shared else {}))


def _serialising_failure(spool: Spool | None) -> BaseException | None:
    """When a commit failed: the failure of its spool's serialisation when that writer had failed (a
    :class:`LiveSpool` the store was uploading while it was written: its readers fail only once the writer has), so
    the caller raises what went wrong, not where it was read; else None. Never waits: deleting the spool stops a
    writer still running."""
    return spool.error if isinstance(spool, LiveSpool) else None
