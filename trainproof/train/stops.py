"""What the loop is handed by its caller, never builds: the stop flags, the deadline policy, the finishing work, the
auto checkpoint interval.

``trainproof.lifecycle`` sits above this package (it installs signal handlers, watches for spot notices, plans the
deadline's export), so the loop only sees these small protocols; an in-process caller that installs nothing
gets :class:`NoStop` and :class:`NoDeadline`.
"""

from __future__ import annotations

from typing import Any, Protocol

from trainproof.storage import GenerationStore


class StopFlags(Protocol):
    """Why the loop should stop at the next step boundary (trainproof.lifecycle.signals.StopRequest fills it)."""

    signals: list[str]
    """Stop signals received (SIGTERM, SIGINT)."""
    notices: list[str]
    """Spot interruption notices received."""


class DeadlinePolicy(Protocol):
    """When to stop so that the final commit (and the finishing export) fit (trainproof.lifecycle.signals.Deadline)."""

    save_estimate_s: float
    finish_s: float
    finish_given_up: bool

    def observe_step(self, seconds: float) -> None: ...
    def observe_save(self, seconds: float) -> None: ...
    def seconds_left(self) -> float | None: ...
    def too_close(self) -> bool: ...


class IntervalPolicy(Protocol):
    """``--checkpoint-every auto``: the seconds between commits, re-planned after each commit from what the run
    measures (trainproof.lifecycle.autointerval.AutoInterval)."""

    interval_s: float

    def observe_step(self, seconds: float, *, beside_commit: bool, after_commit: bool = False) -> None: ...
    def observe_commit(self, blocked_s: float, commit_s: float) -> None: ...
    def change(self) -> dict[str, Any] | None: ...


class FinishWork(Protocol):
    """The export and its reload check after a deadline's final commit (trainproof.lifecycle.finish.Finisher)."""

    def estimate_s(self, save_s: float) -> float: ...
    def export_and_check(self, store: GenerationStore, seconds_left: float | None, save_s: float,
                         step: int | None = None) -> dict[str, Any]: ...


class NoStop:
    """Stop flags that never fire: an in-process caller that installs no signal handlers."""

    def __init__(self) -> None:
        self.signals: list[str] = []
        self.notices: list[str] = []


class NoDeadline:
    """No deadline: never too close, nothing to finish."""

    save_estimate_s = 0.0
    finish_s = 0.0
    finish_given_up = False

    def observe_step(self, seconds: float) -> None:
        """Nothing to estimate without a deadline."""

    def observe_save(self, seconds: float) -> None:
        """Nothing to estimate without a deadline."""

    def seconds_left(self) -> float | None:
        """No deadline: None."""
        return None

    def too_close(self) -> bool:
        """Never."""
        return False
