"""Checkpoints: *when* to save (:class:`SaveClock`) and *how* a save becomes usable (:class:`Checkpointer`).

A save is: serialise the state, hand the bytes to the generation store, which writes them under a new
``step-%08d`` name, reads every object back, checks size and sha256, runs our ``check`` on the stored
bytes (a real weights-only load), and only then writes ``COMPLETE.json`` create-only and moves the
LATEST hint. Retention runs after that commit, never before, and never deletes the newest generation.

With world > 1 a generation is ``training_state.pt`` (rank 0's view, its own part inline) plus one
``rank-%05d.pt`` per other rank, committed together in one ``COMPLETE.json``:

1. every rank >= 1 serialises its own part and verifies it (a real weights-only load), then sends it,
   with its sha256, to rank 0 (a gather over the gloo control group; a rank that failed sends its error);
2. rank 0 checks every part arrived intact, and commits all files at once through the store (write,
   read back, verify, then ``COMPLETE.json`` listing every file);
3. rank 0 shares the outcome; every rank raises if the commit failed, so all exit non-zero together.

A rank that dies or hangs makes the gather or the outcome broadcast fail (at once, or at the group's
timeout): no ``COMPLETE.json`` is written for that step unless every part had already reached rank 0.

Note: the parts travel to rank 0 because the store commits the files of one writer. That is fine for
per-rank RNG and data position (a few KB); sharded model or optimizer state (FSDP) would need each rank to
write and verify its own files and rank 0 to commit their digests, which the store cannot express yet.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

from job.dist import Collectives
from job.errors import TrainError
from job.progress import Reporter
from job.state import STATE_FILE, decode, decode_rank_part, encode, encode_rank_part, rank_file
from storage import GenerationStore
from storage.errors import CommitConflictError, StoreError

# Test-only hook (kept out of the CLI): seconds to sleep inside the store's verification step, i.e.
# after the state's bytes were written and read back but before COMPLETE.json. Lets the preemption
# tests deliver signals in the middle of a save.
SAVE_DELAY_ENV = "TRAINPROOF_TEST_SAVE_DELAY"


def sleep_for_test_hook(env_name: str) -> None:
    """Sleep as long as the test-only variable ``env_name`` says (no-op when unset)."""
    seconds = float(os.environ.get(env_name) or 0.0)
    if seconds > 0:
        time.sleep(seconds)  # a signal does not cut this short in effect: the handler only sets a flag


class SaveClock:
    """Step and/or wall-clock cadence of periodic checkpoints."""

    def __init__(self, every_steps: int = 0, every_seconds: float = 0.0, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self._clock = clock
        self._last_time = clock()

    def due(self, step: int) -> bool:
        """True when a periodic checkpoint is due right after optimizer step ``step``."""
        if self.every_steps and step % self.every_steps == 0:
            return True
        return bool(self.every_seconds) and self._clock() - self._last_time >= self.every_seconds

    def mark(self) -> None:
        """A checkpoint was just committed: restart the wall-clock interval."""
        self._last_time = self._clock()


class Checkpointer:
    """Commits training states as generations of one run in the store (rank 0 writes; see the module doc)."""

    def __init__(
        self, store: GenerationStore, *, contract: str, world: int, code_version: str, keep: int,
        reporter: Reporter, last_step: int = 0, sync: Collectives | None = None,
    ) -> None:
        self.store = store
        self.contract, self.world, self.code_version = contract, world, code_version
        self.keep = keep
        self.reporter = reporter
        self.sync = sync
        self.last_step = last_step
        """Step of the newest generation known committed (the resume point, then our own commits)."""
        self.records: list[dict[str, Any]] = []

    def commit(self, step: int, state: dict[str, Any] | None, *, extra: dict[str, Any],
               part: dict[str, Any] | None = None) -> dict[str, Any] | None:
        """Serialise and commit generation ``step``; then apply retention (rank 0).

        ``state``: the full training state (rank 0; ignored elsewhere). ``part``: this rank's own part
        (ranks >= 1 of a distributed run). Raises TrainError (exit 1) on every rank when the commit failed:
        nothing was marked usable, and the previous generation is still the resume point.
        """
        rank = self.sync.rank if self.sync else 0
        if self.world == 1:
            record = self._commit_files(step, {STATE_FILE: encode(state)}, extra)
        else:
            record = self._commit_world(step, state, part, extra, rank)
        self.last_step = step
        if rank == 0:
            self._apply_retention()
        return record

    def _commit_world(self, step: int, state: dict[str, Any] | None, part: dict[str, Any] | None,
                      extra: dict[str, Any], rank: int) -> dict[str, Any] | None:
        frame = self._own_part(step, part) if rank else b""
        frames = self.sync.gather_bytes(frame, f"gather the rank parts of step {step}")
        record, failure, raised = None, b"", None
        if rank == 0:
            try:
                record = self._commit_files(step, {STATE_FILE: encode(state), **self._parts(step, frames)}, extra)
            except Exception as exc:  # noqa: BLE001 - told to every rank, then re-raised here
                failure, raised = (str(exc) or type(exc).__name__).encode(), exc
        failure = self.sync.broadcast_bytes(failure, f"share the outcome of step {step}'s commit")
        if raised is not None:
            raise raised
        if failure:
            raise TrainError(f"step {step} was not committed by rank 0: {failure.decode(errors='replace')}")
        return record

    def _own_part(self, step: int, part: dict[str, Any] | None) -> bytes:
        """This rank's part, serialised and verified here: ``OK`` + sha256 + bytes, or ``ER`` + the error."""
        try:
            data = encode_rank_part(part or {}, step=step, world=self.world)
            decode_rank_part(data)  # the bytes rank 0 will store load back, weights-only
            sleep_for_test_hook(SAVE_DELAY_ENV)
            return b"OK" + hashlib.sha256(data).hexdigest().encode() + data
        except Exception as exc:  # noqa: BLE001 - reported to rank 0, which fails the whole generation
            return b"ER" + f"{type(exc).__name__}: {exc}".encode()

    @staticmethod
    def _parts(step: int, frames: list[bytes]) -> dict[str, bytes]:
        """Every other rank's file, refusing the generation when a part is missing or arrived damaged."""
        files = {}
        for r, frame in enumerate(frames[1:], start=1):
            body = frame[2:]
            if frame[:2] != b"OK":
                raise TrainError(f"rank {r} could not serialise its part of step {step}: "
                                 f"{body.decode(errors='replace')}")
            sha, data = body[:64].decode(), body[64:]
            if hashlib.sha256(data).hexdigest() != sha:
                raise TrainError(f"rank {r}'s part of step {step} arrived damaged ({len(data)} bytes)")
            files[rank_file(r)] = data
        return files

    def _commit_files(self, step: int, files: dict[str, bytes], extra: dict[str, Any]) -> dict[str, Any]:
        t0 = time.perf_counter()
        try:
            info = self.store.commit(
                step, files, contract=self.contract, world=self.world,
                code_version=self.code_version, check=self._check, extra=extra, digests={"state": STATE_FILE},
            )
        except CommitConflictError as exc:
            raise TrainError(
                f"step {step} was already committed by another writer ({exc}): two processes are "
                "training into the same --store; restart one to resume from the other's checkpoint"
            ) from None
        except StoreError as exc:
            raise TrainError(f"checkpoint of step {step} was not committed: {exc}") from None
        record = {"step": step, "generation": info.name, "bytes": sum(len(d) for d in files.values()),
                  "seconds": time.perf_counter() - t0}
        self.records.append(record)
        self.reporter.event("checkpoint", **record)
        return record

    def _check(self, name: str, stored: bytes) -> None:
        # The store hands us the bytes it read back: prove they load as a state, weights-only.
        if name == STATE_FILE:
            sleep_for_test_hook(SAVE_DELAY_ENV)
            decode(stored)
        else:
            decode_rank_part(stored)

    def _apply_retention(self) -> None:
        if not self.keep:
            return
        try:
            removed = self.store.apply_retention(self.keep)
        except (StoreError, OSError) as exc:
            # The new generation is committed; a failed cleanup costs storage, not work.
            self.reporter.warn(f"retention (--keep {self.keep}) failed, old generations left in place: {exc}")
            return
        if removed:
            self.reporter.event("retention", keep=self.keep, removed=[g.name for g in removed])
