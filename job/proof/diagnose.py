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


def diagnose_path(path: str, diffs: dict[str, Any], first_resumed_step: int) -> list[str]:
    """Likely causes of one resumed path's failures (``diffs``: check name -> compare.Diff)."""
    failed = {name for name, d in diffs.items() if not d.within}
    if not failed:
        return []
    if "rng_restore" in failed:
        return [f"{path}: {RNG_RESTORE}"]
    trajectory = failed & set(TRAJECTORY)
    if trajectory and not failed & set(BOOKKEEPING):
        first = min((diffs[n].first_step for n in trajectory if diffs[n].first_step is not None), default=None)
        when = f"from step {first} on" if first is not None else "after the cut"
        same = "the same samples, learning rates, trainer generators and task state"
        return [f"{path}: the resumed path had {same} as the continuous path but its "
                f"{'/'.join(sorted(trajectory))} differ {when} (the first resumed step is {first_resumed_step}). "
                f"Likely cause: {HIDDEN_STATE}"]
    return []
