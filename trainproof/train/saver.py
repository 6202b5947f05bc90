"""How a checkpoint is taken: one interface for the two ways, inline (``--sync-checkpoint``) or in the background.

The trainer asks the same questions of either (:class:`Saver`): is a save in flight, did one fail, wait for
it, hand over this step's capture. :class:`SyncSaver` commits inline, so nothing is ever in flight and
training is blocked for the whole commit; :class:`trainproof.train.async_save.BackgroundSaver` snapshots the capture
to host memory and commits on a thread. Both call ``on_committed(step)`` then ``on_saved(seconds)`` on the
training thread after a commit landed, and never after a failed one (a failed save never loses a history row).
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable, Protocol

from trainproof.train.async_save import BackgroundSaver
from trainproof.train.checkpoint import Capture, Checkpointer
from trainproof.train.progress import Reporter


class Saver(Protocol):
    """What the trainer asks of a way of saving."""

    mode: str
    """``async`` or ``sync``: recorded in the ``start`` event."""
    measured_s: list[float]
    """Measured time of every commit of this process that may be estimated from at a stop (empty inline: the
    final commit is then always tried)."""

    @property
    def in_flight(self) -> int | None:
        """Step of a save not yet collected, or None."""

    def poll(self) -> None:
        """At a step boundary: collect a finished save; raise if it failed."""

    def poll_failed(self) -> bool:
        """True when the save in flight finished and failed (left to :meth:`wait` to raise)."""

    def wait(self) -> float:
        """Block until no save is in flight; the seconds waited. Raises a failed save's error."""

    def save(self, capture: Capture, *, blocked_since: float) -> None:
        """Commit ``capture``; training is blocked from ``blocked_since`` (``time.perf_counter()``) until this
        returns (inline: the whole commit; in the background: the host snapshot)."""


class SyncSaver:
    """Commits inline on the training thread (``--sync-checkpoint``): never a save in flight."""

    mode = "sync"

    def __init__(self, checkpointer: Checkpointer, on_saved: Callable[[float], None],
                 on_committed: Callable[[int], None]) -> None:
        self.checkpointer, self.on_saved, self.on_committed = checkpointer, on_saved, on_committed
        self.measured_s: list[float] = []

    @property
    def in_flight(self) -> int | None:
        return None

    def poll(self) -> None:
        """Nothing runs in the background."""

    def poll_failed(self) -> bool:
        return False

    def wait(self) -> float:
        return 0.0

    def save(self, capture: Capture, *, blocked_since: float) -> None:
        self.checkpointer.commit(replace(capture, blocked_since=blocked_since))
        self.on_committed(capture.step)
        self.on_saved(time.perf_counter() - blocked_since)


def make_saver(checkpointer: Checkpointer, reporter: Reporter, *, background: bool,
               on_saved: Callable[[float], None], on_committed: Callable[[int], None]) -> Saver:
    """The way of saving a run uses: in the background (the default) or inline (``--sync-checkpoint``)."""
    if background:
        return BackgroundSaver(checkpointer, reporter, on_saved, on_committed)
    return SyncSaver(checkpointer, on_saved, on_committed)


def final_commit_skip(measured_s: list[float], *, since: float, grace_s: float) -> str | None:
    """Why the final commit after a stop request is skipped (None: commit it).

    It is tried when nothing was measured in this process, or when the longest measured commit (x 1.25, + 1 s)
    fits in what is left of ``--stop-grace`` (``grace_s``) since the first stop request (``since``, a
    ``time.monotonic()``): a commit cut off by SIGKILL would cost the work of the one in flight too."""
    if not measured_s:
        return None  # nothing measured in this process: try
    need = 1.25 * max(measured_s) + 1.0
    left = grace_s - (time.monotonic() - since)
    if need <= left:
        return None
    return f"a commit takes ~{max(measured_s):.1f} s, {max(left, 0.0):.1f} s of the {grace_s:g} s --stop-grace are left"
