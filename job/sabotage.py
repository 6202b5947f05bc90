"""Test-only sabotage of the restore path: the resume bugs the verifier claims to catch, on demand.

``TRAINPROOF_TEST_SABOTAGE=name[,name...]`` in a training process's environment breaks its *resume* in one
of the ways users of other tools have met (PROTOCOL.md, DESIGN.md "Lessons"); a run that starts fresh is
never affected. There is deliberately no command-line option: this is a hook for tests (and for a person
who wants to see the verifier fail), never a way to train.

=====================  ==========================================================================
``skip_optimizer``     load the optimizer's hyper-parameters but not its state (Adam moments, step)
``rebuild_scheduler``  construct the scheduler again after loading it (the learning rate restarts)
``reseed_rng``         re-seed every generator with the run's seed instead of restoring them
``lose_cursor``        restart the epoch's permutation from its first sample (the data cursor is lost)
``repeat_batch``       step the cursor back one batch (the last batch before the save is trained twice)
``crash``              fail while restoring (the process exits 1)
=====================  ==========================================================================
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from job import rng

if TYPE_CHECKING:
    from job.run import Run

ENV = "TRAINPROOF_TEST_SABOTAGE"
KINDS = ("skip_optimizer", "rebuild_scheduler", "reseed_rng", "lose_cursor", "repeat_batch", "crash")


class SabotageCrash(RuntimeError):
    """The ``crash`` sabotage: a resume that fails outright."""


def active() -> frozenset[str]:
    """The sabotages asked for; an unknown name is refused (a typo must not pass for a clean run)."""
    names = frozenset(n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip())
    unknown = sorted(names - set(KINDS))
    if unknown:
        raise ValueError(f"{ENV}: unknown sabotage {unknown}; known: {', '.join(KINDS)}")
    return names


def state_to_restore(state: dict[str, Any]) -> dict[str, Any]:
    """Called first thing in ``restore_state``: the state to load instead of ``state`` (itself when off)."""
    kinds = active()
    if not kinds:
        return state
    print(f"warning: {ENV}={','.join(sorted(kinds))}: this resume is broken on purpose", file=sys.stderr, flush=True)
    if "crash" in kinds:
        raise SabotageCrash(f"{ENV}=crash: failing the restore on purpose")
    if "skip_optimizer" in kinds:
        # Only the hyper-parameters survive: the "continue" looks fine, the moments start from zero.
        state = {**state, "optimizer": {"state": {}, "param_groups": state["optimizer"]["param_groups"]}}
    return state


def after_restore(run: Run, state: dict[str, Any]) -> None:
    """Called last in ``restore_state``, after the generators were restored."""
    kinds = active()
    if "rebuild_scheduler" in kinds and run.scheduler is not None:
        # Constructing a scheduler resets the optimizer's learning rate to the schedule's start.
        run.scheduler = run.task.build_scheduler(run.optimizer)
    if "reseed_rng" in kinds:
        fresh = rng.seed_all(state["meta"]["seed"])  # Python, NumPy global, torch: re-seeded in place
        run.np_gen.bit_generator.state = fresh.bit_generator.state  # the sampler holds this very object
    if "lose_cursor" in kinds:
        run.sampler.cursor = 0
    if "repeat_batch" in kinds:
        batch = getattr(run, "global_batch", run.task.batch_size)  # all ranks' samples of one step
        run.sampler.cursor = max(0, run.sampler.cursor - batch)
