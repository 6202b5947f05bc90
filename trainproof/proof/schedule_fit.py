"""Verify's paths within the task's schedule: a ``OneCycleLR`` of ``total_steps`` cannot be stepped past its end.

Without ``--cuts`` the continuous path covers three epochs (trainproof.proof.cuts), the protocol's own ``--steps`` at
least. A task whose schedule is shorter (a ``OneCycleLR`` sized to the task's own ``default_steps``) would crash every
path that trains past it. So, when the task's schedule has an end (trainproof.train.schedule ``schedule_length``) and
the plan passes it, :func:`fit_to_schedule` shortens the plan to fit: the protocol's steps to the schedule's length
(its cut to the middle), and the samples every path trains on to three epochs within it (the first
``steps_per_epoch * global batch`` samples, as ``verify --samples`` would; recorded as ``settings.samples``). When
the command line fixed the lengths (``--steps``, ``--cut``, ``--cuts``, ``--samples``) and they do not fit, or the
schedule is shorter than three steps, the plan is refused with one line (exit 2) naming the schedule's length and
what to give instead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch

from trainproof.errors import ConfigError
from trainproof.proof.cuts import EPOCHS, plan_cuts
from trainproof.train.schedule import describe, schedule_length

log = logging.getLogger("trainproof.verify")


def declared_schedule(task: Any) -> tuple[int | None, str]:
    """(optimizer steps the task's scheduler allows, its description), or (None, "") for a schedule without an end.
    Built on the meta device (no memory, no initialisation drawn); a task whose optimizer or scheduler cannot be built
    there is taken as having no end: each path's trainer still refuses, with one line, to step past it."""
    with torch.device("meta"):
        try:
            scheduler = task.build_scheduler(task.build_optimizer(task.build_model()))
        except Exception:  # best effort, for the plan only: each path's trainer still checks the length itself
            return None, ""
    length = schedule_length(scheduler)
    return length, ("" if length is None else describe(scheduler))


@dataclass(frozen=True, kw_only=True)
class Fit:
    """The protocol's lengths within the schedule."""

    steps: int
    cut: int
    samples: int
    """Samples every path trains on (the task's first this many)."""
    why: str | None
    """What was shortened and why (None: the plan fitted as it was)."""


def fit_to_schedule(*, length: int, what: str, steps: int, cut: int, cuts: list[int] | None, samples: int,
                    global_batch: int, seed: int, fixed: tuple[str, ...]) -> Fit:
    """The protocol's (steps, cut, samples) shortened so that no path trains past ``length`` optimizer steps;
    ConfigError (exit 2) when the command line ``fixed`` them, or the schedule is too short to cross :data:`EPOCHS`
    epochs."""
    needed = _needed(steps, cut, cuts, samples, global_batch, seed)
    if needed <= length:
        return Fit(steps=steps, cut=cut, samples=samples, why=None)
    per_epoch = length // EPOCHS
    if fixed or per_epoch < 1:
        raise ConfigError(_refusal(length, what, needed, per_epoch, global_batch, fixed))
    steps = min(steps, length)
    cut = max(1, min(cut, steps // 2))
    samples = min(samples, per_epoch * global_batch)
    fitted = _needed(steps, cut, cuts, samples, global_batch, seed)
    if fitted > length:  # cannot happen for the default cuts; a guard, not a path
        raise ConfigError(f"{what} is {length} steps long; verify could not fit its paths into it ({fitted} steps)")
    why = (f"{what} is {length} steps long: every path trains on the first {samples} samples (epochs of "
           f"{math.ceil(samples / global_batch)} steps, {EPOCHS} of them within the schedule), {steps} steps, cut "
           f"at {cut}")
    log.info("%s", why)
    return Fit(steps=steps, cut=cut, samples=samples, why=why)


def _refusal(length: int, what: str, needed: int, per_epoch: int, global_batch: int, fixed: tuple[str, ...]) -> str:
    head = (f"{what} is {length} steps long, but this verification's continuous path would train {needed} steps "
            f"(no path may step the schedule past its end)")
    if per_epoch < 1:
        return (f"{head}: the default cuts cross {EPOCHS} epochs of at least one step; give --steps {length} and "
                f"--cuts within it, or build the schedule for at least {EPOCHS} steps")
    return (f"{head}; {', '.join(fixed)} fixed the paths' lengths: drop them and verify fits its paths into the "
            f"schedule, or give --steps {length} or less with --cuts within it and --samples "
            f"{per_epoch * global_batch} (epochs of {per_epoch} steps)")


def _needed(steps: int, cut: int, cuts: list[int] | None, samples: int, global_batch: int, seed: int) -> int:
    """Steps of the continuous path (the longest) for this plan."""
    return plan_cuts(protocol_cut=cut, steps=steps, steps_per_epoch=math.ceil(samples / global_batch),
                     chosen=cuts, seed=seed)[1]
