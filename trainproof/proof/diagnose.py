"""What a failed resume comparison most likely means, in words a task's author can act on.

The checks name *what* differs; this module says *why it probably does*, from the pattern of failures of one
resumed path. The telling pattern is a resume that consumed the same samples with the same learning rates
and left every trainer generator and the task's own checkpointed state exactly where the continuous path had
them, and still computed other losses: whatever changed lives outside the checkpoint (a private generator
created when the task was built, a counter or a cache on the task object).
"""

from __future__ import annotations

from typing import Any

BOOKKEEPING = ("sample_ids", "learning_rates", "scheduler", "next_lr", "progress", "data_position",
               "rng_next_draws", "rng_states", "task_state")
"""What the trainer restores itself: equal on both paths means the trainer's part of the resume worked."""
TRAJECTORY = ("losses", "parameters", "buffers", "optimizer")
HIDDEN_STATE = ("state not captured by the checkpoint: the task keeps state outside it (a private generator "
                "created when the task is built, e.g. np.random.default_rng(...) or torch.Generator() on the task, "
                "or a counter, cache or curriculum stage on the task object), which a resumed process starts over. "
                "Draw randomness from the trainer's generators (ctx.np_rng, random, torch) or checkpoint the state "
                "with Task.state_dict()/load_state_dict() (see docs/tasks.md, 'No hidden state on the task object')")
RNG_RESTORE = ("the resume's own self-check failed: a restored generator does not reproduce the next draw recorded "
               "at save time, so a generator was restored from the wrong state or re-seeded after the restore")


FIRST_ORDER = ("rng_restore", "optimizer_counters", "scheduler", "next_lr", "learning_rates", "rng_next_draws",
               "rng_states", "data_position", "sample_ids", "task_state", "progress", "grad_scaler", "configuration",
               "optimizer", "buffers", "losses", "parameters")
"""Of the checks that fail first at the same step, the one named: restored state before what it drives (an optimizer's
step counter, the scheduler or a generator before the learning rate in the optimizer's groups, the moments, the losses
and parameters they change). ``optimizer_counters``: the optimizer check when its first difference is a step count."""


def first_difference(diffs: dict[str, Any]) -> tuple[str, int | None] | None:
    """(check, step) of the state component that differs first: the earliest step, then :data:`FIRST_ORDER`."""
    failed = [name for name, d in diffs.items() if not d.within]
    if not failed:
        return None
    order = {name: i for i, name in enumerate(FIRST_ORDER)}

    def rank(n: str) -> tuple[int, int]:
        key = "optimizer_counters" if n == "optimizer" and _counters(diffs[n].detail) else n
        return (diffs[n].first_step if diffs[n].first_step is not None else 1 << 62, order.get(key, len(order)))

    name = min(failed, key=rank)
    return name, diffs[name].first_step


def _counters(detail: str) -> bool:
    """Whether an optimizer check's first difference is a step count (``optimizer.state.0.step``)."""
    where = detail.split(":", 1)[0]
    return where.startswith("optimizer.state") and where.rsplit(".", 1)[-1] == "step"


def component(name: str, detail: str) -> str:
    """The state component a failed check's first difference lies in, in words."""
    where = detail.split(":", 1)[0]
    if name == "optimizer":
        if _counters(detail):
            return f"the optimizer's step counters ({where})"
        return f"the optimizer's state ({where or 'moments'})"
    if name in ("scheduler", "next_lr", "learning_rates"):
        return f"the learning-rate scheduler ({where or name})"
    if name in ("rng_next_draws", "rng_states"):
        generator = next((g for g in ("python", "numpy_global", "numpy", "torch_cuda", "torch", "cuda")
                          if f".{g}" in where or f"'{g}'" in where), None)
        return f"a random generator ({generator or where or name})"
    if name in ("data_position", "sample_ids"):
        return f"the data position ({where or name})"
    if name == "task_state":
        return f"the task's own state ({where or name})"
    return f"{name} ({where})" if where else name


def diagnose_path(path: str, diffs: dict[str, Any], first_resumed_step: int) -> list[str]:
    """What differs first, then the likely cause of one resumed path's failures (``diffs``: check name ->
    compare.Diff)."""
    failed = {name for name, d in diffs.items() if not d.within}
    if not failed:
        return []
    if "rng_restore" in failed:
        return [f"{path}: {RNG_RESTORE}"]
    first = first_difference(diffs)
    out = []
    if first is not None:
        name, step = first
        when = f"at step {step}" if step is not None else "after the cut"
        out.append(f"{path}: first difference {when} (the first resumed step is {first_resumed_step}): "
                   f"{component(name, diffs[name].detail)}, check {path}.{name}: {diffs[name].detail}")
    trajectory = failed & set(TRAJECTORY)
    optimizer_counters = "optimizer" in failed and "step counters" in component("optimizer", diffs["optimizer"].detail)
    if trajectory and not failed & set(BOOKKEEPING) and not optimizer_counters:
        firsts = min((diffs[n].first_step for n in trajectory if diffs[n].first_step is not None), default=None)
        when = f"from step {firsts} on" if firsts is not None else "after the cut"
        same = "the same samples, learning rates, trainer generators and task state"
        out.append(f"{path}: the resumed path had {same} as the continuous path but its "
                   f"{'/'.join(sorted(trajectory))} differ {when} (the first resumed step is {first_resumed_step}). "
                   f"Likely cause: {HIDDEN_STATE}")
    return out
