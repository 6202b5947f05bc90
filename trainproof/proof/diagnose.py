"""What a failed resume comparison most likely means, in words a task's author can act on.

The checks name *what* differs; this module says *why it probably does*, from the pattern of failures of one
resumed path, and whom the evidence points at. The task is blamed only when its own state differs: its checkpointed
state (``task_state``), or the attributes the live comparison (trainproof.proof.live) found differing between the
task object the continuous process had in memory and the one the resumed process restored (``task_evidence``). A
resume that consumed the same samples with the same learning rates, left every trainer generator and the task's state
where the continuous path had them, and still computed other losses then kept state outside the checkpoint on the
task object (:data:`HIDDEN_STATE`); without such evidence the trainer's resume is at fault (:data:`TRAINER_STATE`).
A resumed process that restored as intended and then crashed at a step the continuous path trained (``finished``) is
a resume failure of the trainer too (:data:`CRASHED`).
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
TRAINER_STATE = ("the trainer's resume: the task's own state (Task.state_dict(), and its attributes compared live) is "
                 "equal on both paths, so something the trainer sets up for a step was not restored as the "
                 "uninterrupted process had it (for instance the data workers' seeds, autocast or precision, an "
                 "optimizer parameter group's defaults, the model's train/eval mode): a bug in the resume code, not "
                 "in the task")
CRASHED = ("the trainer's resume code, not the task or the store: the resumed process restored as intended, then "
           "crashed at a step the uninterrupted process trained without error, so what it restored or rebuilt "
           "({component}) is not what the uninterrupted process had")
RNG_RESTORE = ("the resume's own self-check failed: a restored generator does not reproduce the next draw recorded "
               "at save time, so a generator was restored from the wrong state or re-seeded after the restore")


FIRST_ORDER = ("rng_restore", "optimizer_counters", "scheduler", "next_lr", "learning_rates", "rng_next_draws",
               "rng_states", "data_position", "sample_ids", "task_state", "progress", "grad_scaler", "configuration",
               "optimizer", "buffers", "losses", "parameters", "finished")
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
    if name == "finished":
        return f"{crashed_component(detail)} (named by the crash)"
    return f"{name} ({where})" if where else name


CRASH_WORDS = (("the data pipeline", ("data pipeline", "lookahead", "sample", "batch", "cursor", "permutation")),
               ("the learning-rate scheduler", ("scheduler", "total steps", "tried to step", "learning rate", " lr")),
               ("the GradScaler", ("scaler",)),
               ("the optimizer's state", ("optimizer", "exp_avg", "param_group", "momentum")),
               ("a random generator", ("generator", "rng", "seed")))
"""What a crash's error names, in words: the component the resumed process failed in, by the first words found."""


def crashed_component(detail: str) -> str:
    """The state component a resumed process that crashed after its restore failed in, from its error (``finished``'s
    detail): the first of :data:`CRASH_WORDS` it names, else the resumed process."""
    text = f" {detail.split('): ', 1)[-1].lower()}"
    return next((what for what, words in CRASH_WORDS if any(w in text for w in words)), "the resumed process")


def diagnose_path(path: str, diffs: dict[str, Any], first_resumed_step: int,
                  task_evidence: str | None = None) -> list[str]:
    """What differs first, then the likely cause of one resumed path's failures (``diffs``: check name ->
    compare.Diff): the task's only when its own state differs (``task_state``, or ``task_evidence``: what the live
    comparison found differing on the task object), the trainer's otherwise."""
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
    if "finished" in failed and not task_evidence and "task_state" not in failed and first is not None:
        what = component(first[0], diffs[first[0]].detail).split(" (", 1)[0]
        out.append(f"{path}: {CRASHED.format(component=what)}")
    trajectory = failed & set(TRAJECTORY)
    optimizer_counters = "optimizer" in failed and "step counters" in component("optimizer", diffs["optimizer"].detail)
    if trajectory and not failed & set(BOOKKEEPING) and not optimizer_counters:
        firsts = min((diffs[n].first_step for n in trajectory if diffs[n].first_step is not None), default=None)
        when = f"from step {firsts} on" if firsts is not None else "after the cut"
        same = "the same samples, learning rates, trainer generators and task state"
        cause = f"{HIDDEN_STATE}. Evidence on the task: {task_evidence}" if task_evidence else TRAINER_STATE
        out.append(f"{path}: the resumed path had {same} as the continuous path but its "
                   f"{'/'.join(sorted(trajectory))} differ {when} (the first resumed step is {first_resumed_step}). "
                   f"Likely cause: {cause}")
    return out
