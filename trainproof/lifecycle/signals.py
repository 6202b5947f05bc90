"""Stopping early without losing work: signals and deadlines only *ask* the loop to stop.

Why a flag and nothing else: saving inside a signal handler hangs or corrupts (the handler can run in
the middle of a tensor copy or a half-written upload), and raising KeyboardInterrupt mid-save leaves a
partial generation. So the handlers record the request; the loop finishes the optimizer step in flight,
commits a checkpoint, and exits 75. A second signal during that save only sets the flag again.

Note: ``trainproof train`` installs the handlers first thing, before importing torch; a SIGTERM that
arrives earlier (while the interpreter and Typer start, a fraction of a second) ends the process the
default way, which loses nothing: no step was taken yet.
"""

from __future__ import annotations

import signal
import time
from datetime import datetime, timedelta, timezone
from types import FrameType
from typing import Any

from trainproof.errors import ConfigError
from trainproof.storage.durations import duration_seconds

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager: while active, SIGTERM/SIGINT set ``requested`` instead of ending the process."""

    def __init__(self) -> None:
        self.signals: list[str] = []
        self.notices: list[str] = []
        """Spot interruption notices (trainproof.lifecycle.spot): they stop the loop exactly like a signal."""
        self.first_at: float | None = None
        """``time.monotonic()`` of the first stop signal or notice: the platform's grace period runs from it."""
        self._previous: dict[int, Any] = {}

    @property
    def requested(self) -> bool:
        """True once any stop signal or spot notice arrived."""
        return bool(self.signals or self.notices)

    def notice(self, reason: str) -> None:
        """Ask the loop to stop because the machine is about to be reclaimed (called from the spot watcher's
        thread: a list append is atomic, and the loop only reads the flag at the step boundary)."""
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.notices.append(reason)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        # Only append (and note the time): no I/O, no locks, no exceptions. Everything else happens in the loop.
        if self.first_at is None:
            self.first_at = time.monotonic()
        self.signals.append(signal.Signals(signum).name)

    def __enter__(self) -> StopRequest:
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def is_duration(text: str) -> bool:
    """True for a relative ``--deadline`` (``90m``), False for an absolute time."""
    return duration_seconds(text) is not None


def parse_deadline(text: str, now: datetime | None = None) -> datetime:
    """Parse ``--deadline``: an absolute ISO-8601 time or a duration from now (``90s``, ``10m``, ``2h30m``).

    A naive ISO time is read in the machine's local zone (what the person typing it sees on the clock).
    Returns an aware datetime.
    """
    now = now or datetime.now(timezone.utc)
    seconds = duration_seconds(text)
    if seconds is not None:
        return now + timedelta(seconds=seconds)
    try:
        at = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(
            f"--deadline {text!r} is neither a duration (90s, 10m, 2h, 1h30m, 1d) nor an ISO time "
            "(2026-12-01T18:00:00Z)"
        ) from None
    return at if at.tzinfo else at.astimezone()


class Deadline:
    """Decides when to stop so that the final checkpoint still commits before ``at``.

    It stops *before* an optimizer step when the time left would not cover that step plus a save and the
    finishing work (export and its reload check, ``finish_s``, 0 unless the trainer sets it):
    ``step estimate + 1.5 x (save estimate + finish_s) + margin``. The save estimate is the longest save measured in
    this process. Note: until the first save is measured it is ``initial_save_s``, a guess; a periodic
    ``--checkpoint-every`` gives a real figure early.
    """

    def __init__(self, at: datetime | None, *, margin_s: float = 1.0, initial_save_s: float = 1.0) -> None:
        self.at = at
        self.margin_s = margin_s
        self.save_estimate_s = initial_save_s
        self.step_estimate_s = 0.0
        self.finish_s = 0.0
        self.finish_given_up = False
        """True when the finishing work did not fit even at the first check: then only the save is reserved."""
        self._checked = False
        self._measured_save = False

    def observe_step(self, seconds: float) -> None:
        """Record an optimizer step's duration (the estimate follows the slowest recent steps)."""
        self.step_estimate_s = max(seconds, 0.8 * self.step_estimate_s)

    def observe_save(self, seconds: float) -> None:
        """Record a checkpoint's duration (serialisation, upload, read-back verification, commit)."""
        self.save_estimate_s = seconds if not self._measured_save else max(self.save_estimate_s, seconds)
        self._measured_save = True

    def seconds_left(self) -> float | None:
        """Seconds until the deadline, or None without one."""
        if self.at is None:
            return None
        return (self.at - datetime.now(timezone.utc)).total_seconds()

    def too_close(self) -> bool:
        """True when another step and a save might not both fit before the deadline."""
        left = self.seconds_left()
        if left is None:
            return False
        need_save = self.step_estimate_s + 1.5 * self.save_estimate_s + self.margin_s
        if not self._checked and left < need_save + 1.5 * self.finish_s:
            # Too late for the export from the start (a restart close to the deadline): train on and commit;
            # stopping at once would waste the time left, and the export can be made later.
            self.finish_given_up = True
        self._checked = True
        return left < need_save + (0.0 if self.finish_given_up else 1.5 * self.finish_s)
