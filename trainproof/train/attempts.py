"""Each training process leaves an attempt record in the run: what this rental hour bought.

``<run>/attempts/<started>-<id>.json`` (rank 0; a few KB) says when the process started, when it had restored and
began training, from which step, how many steps it trained and for how long, each commit's blocked time, and how it
ended (``done``, ``stopped`` with the reason, or nothing: killed). It is written as soon as the process has
agreed on the run (so one killed while it restores still shows), rewritten after each commit, every
``REFRESH_S`` seconds of training (so a SIGKILLed attempt still shows where it got to), and at the end, by a
background thread: the training thread never waits for it. With a signing key it is signed.

A record is reported (``trainproof report``, trainproof.lifecycle.goodput) and read by one thing a run does:
``--checkpoint-every auto`` plans its interval, within fixed bounds, from the interruptions the records show
(trainproof.lifecycle.autointerval). A failure to write one is one warning, never a reason to stop.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from datetime import datetime, timezone
from typing import Any

import trainproof
from trainproof.storage import GenerationStore
from trainproof.train.progress import Reporter

ATTEMPTS_DIR = "attempts"
SCHEMA = "trainproof.attempt/1"
REFRESH_S = 30.0
"""Longest a record lags behind training while steps run (a SIGKILL loses at most this much of what it says)."""
CLOSE_WAIT_S = 2.0
"""Longest the process's end waits for the record's last write."""
MAX_COMMITS = 200
"""Commits listed one by one in a record (the newest); totals cover all of them."""


def _iso(wall: float) -> str:
    return datetime.fromtimestamp(wall, timezone.utc).isoformat(timespec="milliseconds")


class AttemptRecorder(Reporter):
    """Another reporter's steps and events, summarised into this process's attempt record (see the module)."""

    def __init__(self, inner: Reporter, store: GenerationStore, *, refresh_s: float | None = None) -> None:
        super().__init__(log_every=inner.log_every)
        self.inner, self.store, self._run = inner, store.child(ATTEMPTS_DIR), store
        self._cleared = False
        self.refresh_s = REFRESH_S if refresh_s is None else refresh_s
        self._keys = store.options.signing
        # Wall and monotonic clocks of the process's start (trainproof imported: the interpreter's start-up before
        # it is a few tens of ms).
        offset = time.monotonic() - trainproof.IMPORTED_AT
        self._t0_wall, self._t0 = time.time() - offset, trainproof.IMPORTED_AT
        self.name = f"{datetime.fromtimestamp(self._t0_wall, timezone.utc):%Y%m%dT%H%M%S}-{uuid.uuid4().hex[:8]}.json"
        self.record: dict[str, Any] = {"schema": SCHEMA, "started_at": _iso(self._t0_wall), "resumed_from": None,
                                       "startup_s": None, "restore_s": None, "first_step": None, "last_step": None,
                                       "train_s": 0.0, "commits": 0, "blocked_s": 0.0, "committed_step": None,
                                       "recent_commits": [], "ended_at": None, "end": None, "reason": None,
                                       "exit_code": None, "finish_s": None,
                                       "step_times": {"clear_n": 0, "clear_s": 0.0, "commit_n": 0, "commit_s": 0.0}}
        self._lock = threading.Lock()
        self._dirty = threading.Event()
        self._closed = False
        self._began: float | None = None
        self._last_step_at: float | None = None
        self._step_from: float | None = None
        """Where the next step's duration starts: the previous step's end, or the end of a checkpoint's blocked time."""
        self._in_flight = 0
        """Commits begun and not yet landed (or failed): steps ending meanwhile ran beside a background commit."""
        self._touched = False
        """A commit landed (or failed) since the last step ended: the next step counts as beside a commit (what
        follows a commit, freeing its snapshot, the server finishing its writes and deletes, still slows it)."""
        self._skip_step = True
        """The next step's duration is not counted: the first (warm-up), or one a checkpoint began before whose
        blocked time has not ended (``checkpoint_snapshot`` times it from there; the blocked time is counted
        apart)."""
        self._last_write = time.monotonic()
        self._warned = False
        self._thread = threading.Thread(target=self._writer, name="trainproof-attempt", daemon=True)
        self._thread.start()
        self._dirty.set()  # at once: an attempt killed while it restores still leaves a record (an interruption)

    # -- Reporter ------------------------------------------------------------------------------------------------
    def begin(self, *, step: int, target: int) -> None:
        self.inner.begin(step=step, target=target)
        now = time.monotonic()
        with self._lock:
            self._began = now
            self.record.update(first_step=step + 1 if step < target else None, target=target)
            if self.record["startup_s"] is None:  # a fresh start (no resume event): all of it was start-up
                self.record.update(resumed_from=step, restore_s=0.0, startup_s=round(now - self._t0, 3))
        self._dirty.set()

    def step(self, record: dict[str, Any], *, target: int) -> None:
        self.inner.step(record, target=target)
        now = time.monotonic()
        with self._lock:
            self.record["last_step"] = record["step"]
            if self._step_from is not None and not self._skip_step:
                kind = "commit" if self._in_flight or self._touched else "clear"
                times = self.record["step_times"]
                times[f"{kind}_n"] += 1
                times[f"{kind}_s"] = round(times[f"{kind}_s"] + (now - self._step_from), 6)
            self._skip_step = self._touched = False
            self._last_step_at = self._step_from = now
            self._set_train_s()
        if now - self._last_write >= self.refresh_s:
            self._dirty.set()

    def throughput(self) -> dict[str, float]:
        return self.inner.throughput()

    def event(self, name: str, **fields: Any) -> None:
        self.inner.event(name, **fields)
        now = time.monotonic()
        with self._lock:
            if name == "resume":  # the process's start-up, then finding, verifying and restoring the state
                restore = _seconds(fields.get("restore_s"))
                self.record.update(resumed_from=_int(fields.get("step")), restore_s=round(restore, 3),
                                   startup_s=round(max(0.0, now - self._t0 - restore), 3))
            elif name == "checkpoint_begin":
                self._in_flight += 1
                self._skip_step = True  # the step ended before the blocked time began, the next one after it ends
                return
            elif name == "checkpoint_snapshot":  # training resumes: the next step is timed from here, as auto does
                self._step_from, self._skip_step = now, self._step_from is None
                return
            elif name in ("checkpoint", "checkpoint_failed"):
                self._in_flight = max(0, self._in_flight - 1)
                self._touched = True
                if name == "checkpoint_failed":
                    return
                self._checkpoint(fields)
            elif name in ("done", "stopped"):
                self._ended(name, fields, now)
            else:
                return
        self._dirty.set()

    def warn(self, message: str) -> None:
        self.inner.warn(message)

    def close(self) -> None:
        with self._lock:
            self._closed = True
        self._dirty.set()
        # The record's last write gets a moment, never the stop's grace: a store that hangs must not turn a
        # preemption's exit 75 into a SIGKILL (the record then shows the last commit instead of the end).
        self._thread.join(timeout=CLOSE_WAIT_S)
        self.inner.close()

    # -- the record ----------------------------------------------------------------------------------------------
    def _checkpoint(self, fields: dict[str, Any]) -> None:
        blocked = _seconds(fields.get("blocked_s"))
        r = self.record
        r["commits"] += 1
        r["blocked_s"] = round(r["blocked_s"] + blocked, 3)
        r["committed_step"] = _int(fields.get("step"))
        r["recent_commits"] = (r["recent_commits"] + [{"step": r["committed_step"], "blocked_s": round(blocked, 3),
                                                       "seconds": round(_seconds(fields.get("seconds")), 3)}])[
            -MAX_COMMITS:]
        self._set_train_s()

    def _ended(self, name: str, fields: dict[str, Any], now: float) -> None:
        r = self.record
        r.update(end=name, reason=str(fields.get("reason"))[:40], exit_code=_int(fields.get("exit_code")),
                 ended_at=_iso(self._t0_wall + (now - self._t0)))
        if fields.get("committed_step") is not None:
            r["committed_step"] = _int(fields.get("committed_step"))
        last = self._last_step_at or self._began
        r["finish_s"] = None if last is None else round(now - last, 3)

    def _set_train_s(self) -> None:
        """Seconds from the start of training to the last step, less the time checkpoints blocked it."""
        if self._began is not None and self._last_step_at is not None:
            self.record["train_s"] = round(max(0.0, self._last_step_at - self._began - self.record["blocked_s"]), 3)

    def _writer(self) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            with self._lock:
                closed = self._closed
                record = {**self.record, "updated_at": _iso(time.time()),
                          "recent_commits": list(self.record["recent_commits"])}
            self._write(record)
            if closed:
                return

    def _write(self, record: dict[str, Any]) -> None:
        self._last_write = time.monotonic()
        try:
            if not self._cleared:  # never through a link, into a FIFO or over a file someone put at attempts/
                self._cleared = True
                self._run.clear_for_folder(ATTEMPTS_DIR, "occupied the folder of the run's attempt records: not one")
            signed = self._keys.sign(record) if self._keys is not None else record
            self.store.write_file(self.name, (json.dumps(signed, indent=1) + "\n").encode())
        except Exception as exc:  # noqa: BLE001 - a record is only reported: never a reason to stop
            if not self._warned:
                self._warned = True
                self.inner.warn(f"the attempt record {ATTEMPTS_DIR}/{self.name} was not written ({exc}); "
                                "`trainproof report` will not see this process")


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0 else 0.0


def with_attempts(reporter: Reporter, store: GenerationStore) -> Reporter:
    """``reporter``, also leaving this process's attempt record in the run (rank 0)."""
    return AttemptRecorder(reporter, store)
