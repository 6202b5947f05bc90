"""Checkpoints: *when* to save (:class:`SaveClock`) and *how* a save becomes usable (:class:`Checkpointer`).

A save is: serialise the state, hand the bytes to the generation store, which writes them under a new
``step-%08d`` name, reads every object back, checks size and sha256, runs our ``check`` on the stored
bytes (a real weights-only load), and only then writes ``COMPLETE.json`` create-only and moves the
LATEST hint. Retention runs after that commit, never before, and never deletes the newest generation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from job.errors import TrainError
from job.progress import Reporter
from job.state import STATE_FILE, decode, encode
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
    """Commits training states as generations of one run in the store."""

    def __init__(
        self, store: GenerationStore, *, contract: str, world: int, code_version: str, keep: int,
        reporter: Reporter, last_step: int = 0,
    ) -> None:
        self.store = store
        self.contract, self.world, self.code_version = contract, world, code_version
        self.keep = keep
        self.reporter = reporter
        self.last_step = last_step
        """Step of the newest generation known committed (the resume point, then our own commits)."""
        self.records: list[dict[str, Any]] = []

    def commit(self, step: int, state: dict[str, Any], *, extra: dict[str, Any]) -> dict[str, Any]:
        """Serialise and commit ``state`` as generation ``step``; then apply retention.

        Raises TrainError (exit 1) when the commit fails: nothing was marked usable, and the previous
        generation is still the resume point.
        """
        t0 = time.perf_counter()
        data = encode(state)
        try:
            info = self.store.commit(
                step, {STATE_FILE: data}, contract=self.contract, world=self.world,
                code_version=self.code_version, check=self._check, extra=extra, digests={"state": STATE_FILE},
            )
        except CommitConflictError as exc:
            raise TrainError(
                f"step {step} was already committed by another writer ({exc}): two processes are "
                "training into the same --store; restart one to resume from the other's checkpoint"
            ) from None
        except StoreError as exc:
            raise TrainError(f"checkpoint of step {step} was not committed: {exc}") from None
        record = {"step": step, "generation": info.name, "bytes": len(data), "seconds": time.perf_counter() - t0}
        self.records.append(record)
        self.last_step = step
        self.reporter.event("checkpoint", **record)
        self._apply_retention()
        return record

    def _check(self, name: str, stored: bytes) -> None:
        # The store hands us the bytes it read back: prove they load as a state, weights-only.
        sleep_for_test_hook(SAVE_DELAY_ENV)
        if name == STATE_FILE:
            decode(stored)

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
