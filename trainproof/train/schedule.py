"""How the trainer steps a task's learning-rate scheduler, and how long a schedule may run.

- A scheduler stepped without an argument (``StepLR``, ``LambdaLR``, ``OneCycleLR`` ...) steps once after every
  optimizer step.
- A scheduler stepped on a metric (``ReduceLROnPlateau``: :func:`takes_metric`) steps after every
  ``Task.scheduler_every``-th optimizer step on the metric ``Task.scheduler_metric`` names: :data:`TRAIN_LOSS`, the
  step's mean training loss over every micro-batch and rank (the value the history records, already the same on every
  rank), or one of the task's evaluation metrics (``Task.evaluate_metrics``), evaluated then on rank 0's model and
  sent to every rank. So every rank, and every path of a verification, steps on the same number; the scheduler's
  own ``state_dict`` (best value, bad-step count, cooldown) is checkpointed and restored like any other.
- A schedule of fixed length (``OneCycleLR``'s ``total_steps``) cannot step past its end: :func:`schedule_length` is
  the optimizer steps it allows, and :func:`check_length` refuses, before the first step, a run whose target lies
  beyond it.
"""

from __future__ import annotations

from typing import Any

import torch

from trainproof.errors import ConfigError

TRAIN_LOSS = "train_loss"
"""``Task.scheduler_metric``'s default: the step's mean training loss (the objective the step minimised)."""


def takes_metric(scheduler: Any) -> bool:
    """Whether ``scheduler.step`` needs a metric (``ReduceLROnPlateau`` and its subclasses)."""
    return isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau)


def schedule_length(scheduler: Any) -> int | None:
    """The optimizer steps ``scheduler`` allows (``OneCycleLR``: its ``total_steps``, each step after one optimizer
    step; a ``SequentialLR``: the first member that would step past its end within its span, at its milestone + its
    length; a ``ChainedScheduler``: its shortest member's), or None for a schedule without an end."""
    sched = torch.optim.lr_scheduler
    total = getattr(scheduler, "total_steps", None)
    if isinstance(scheduler, sched.OneCycleLR) and isinstance(total, int):
        return total
    inner = getattr(scheduler, "_schedulers", None)
    if not isinstance(inner, (list, tuple)) or not inner:
        return None
    if isinstance(scheduler, sched.SequentialLR):
        # Member i runs from its milestone (the first from 0) until the next one; one of fixed length L that would
        # step past it within its span ends the whole schedule at its start + L.
        milestones = getattr(scheduler, "_milestones", None)
        if not isinstance(milestones, (list, tuple)) or len(milestones) != len(inner) - 1:
            return None
        starts, ends = [0, *map(int, milestones)], [*map(int, milestones), None]
        for member, start, end in zip(inner, starts, ends):
            length = schedule_length(member)
            if length is not None and (end is None or start + length + 2 <= end):
                return start + length
        return None
    if isinstance(scheduler, sched.ChainedScheduler):  # all step together: the shortest ends the chain
        lengths = [n for n in (schedule_length(s) for s in inner) if n is not None]
        return min(lengths) if lengths else None
    return None


def describe(scheduler: Any) -> str:
    """``the task's OneCycleLR (total_steps=10)``: the schedule named, with its length."""
    return f"the task's {type(scheduler).__name__} (total_steps={schedule_length(scheduler)})"


def check_length(scheduler: Any, *, start: int, target: int, source: str) -> None:
    """ConfigError (exit 2), before the first step, when training from ``start`` to ``target`` would step ``scheduler``
    past its end; ``source``: where the target came from (``--max-steps``, ``--steps``, the task's default)."""
    length = schedule_length(scheduler)
    if length is None or target <= length:
        return
    raise ConfigError(f"{describe(scheduler)} is {length} steps long, but this run would train to step {target} "
                      f"({source}; it is at step {start}): train at most {length} steps in all (--max-steps "
                      f"{length}) or build the schedule for the run's length ("
                      + (f"total_steps={target})" if isinstance(scheduler, torch.optim.lr_scheduler.OneCycleLR)
                         else f"{target} steps)"))


def check_cadence(task: Any, scheduler: Any) -> None:
    """ConfigError (exit 2) when a metric-stepped scheduler's ``scheduler_every`` or ``scheduler_metric`` is not a
    value the trainer can use."""
    if not takes_metric(scheduler):
        return
    every, name = getattr(task, "scheduler_every", 1), getattr(task, "scheduler_metric", TRAIN_LOSS)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ConfigError(f"the task's scheduler_every must be a whole number of optimizer steps >= 1 (got {every!r})")
    if not isinstance(name, str) or not name:
        raise ConfigError(f"the task's scheduler_metric must be {TRAIN_LOSS!r} or the name of one of its evaluation "
                          f"metrics (got {name!r})")


def step_scheduler(run: Any, loss: float) -> None:
    """Advance ``run``'s scheduler after optimizer step ``run.step`` (already counted), whose mean training loss over
    every rank is ``loss``."""
    scheduler = run.scheduler
    if scheduler is None:
        return
    if not takes_metric(scheduler):
        scheduler.step()
    elif run.step % run.task.scheduler_every == 0:
        scheduler.step(metric(run, loss))


def metric(run: Any, loss: float) -> float:
    """The value of the task's ``scheduler_metric`` now, the same on every rank."""
    name = run.task.scheduler_metric
    if name == TRAIN_LOSS:
        return loss  # summed over the ranks: every rank holds the same number
    try:
        metrics = run.task.evaluate_metrics(run.model)  # every rank evaluates (a sharded model needs them all)
    except NotImplementedError:
        raise ConfigError(f"the task's scheduler_metric is {name!r}, but the task has no evaluate(model) to compute "
                          f"it: implement evaluate/evaluate_metrics, or step the scheduler on {TRAIN_LOSS!r}") from None
    if name not in metrics:
        raise ConfigError(f"the task's scheduler_metric {name!r} is neither {TRAIN_LOSS!r} nor one of its evaluation "
                          f"metrics {sorted(metrics)}")
    value = float(metrics[name]) if run.env.rank == 0 else 0.0
    return run.sync.sum_float(value, "agree on the scheduler's metric")  # rank 0's value, on every rank
