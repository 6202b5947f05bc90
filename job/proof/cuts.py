"""Cuts that cover the data order: besides the protocol's cut, resume at an epoch boundary and in the middle
of a later epoch, each compared with the continuous path.

The protocol's cut (regression: step 5, cursor 20 of 24) lies in epoch 0. A resume bug that only shows once
the data order has moved on (a permutation re-derived from (seed, epoch) instead of restored is right in
epoch 0 only; an epoch counter restored off by one only matters at a boundary) passes a single mid-epoch-0
cut. So by default the verifier also resumes:

- at the **epoch boundary**: after the last step of epoch 0 (the next step must draw epoch 1's permutation
  from the restored data generator);
- in the **middle of a later epoch**: half an epoch into epoch 1 (the restored permutation is epoch 1's).

For ``regression`` (6 steps an epoch) that is steps 6 and 9, for ``tinylm``'s protocol corpus (5 steps an
epoch) steps 5 and 7: both inside the default continuous path (10 and 8 steps), so the defaults cost one
resumed process per extra cut and no longer continuous path. When a task's epoch is longer, the continuous
path is extended to one step past the last cut. ``verify --cuts 5,6,11`` chooses the cuts instead.

Each extra cut resumes from the continuous path's own generation at that step when the path committed
one (``--checkpoint-every`` divides it: the protocol already proves the cut checkpoint equals the continuous
state), otherwise from a ``cut_at_<c>`` process that trains to ``c``, saves and stops, like the protocol's
cut. Every resumed path runs in a fresh process, from a copy committed through the store.
"""

from __future__ import annotations

from job.errors import ConfigError


def default_cuts(steps_per_epoch: int) -> list[int]:
    """The epoch boundary and the middle of epoch 1 (only the boundary when an epoch is one step)."""
    cuts = [steps_per_epoch]
    if steps_per_epoch >= 2:
        cuts.append(steps_per_epoch + max(1, steps_per_epoch // 2))
    return cuts


def parse_cuts(text: str) -> list[int]:
    """``--cuts 5,6,11`` as sorted distinct steps (each >= 1); ConfigError (exit 2) otherwise."""
    try:
        cuts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--cuts must be comma-separated step numbers, e.g. 5,6,11 (got {text!r})") from None
    if not cuts or cuts[0] < 1:
        raise ConfigError(f"--cuts needs step numbers >= 1 (got {text!r})")
    return cuts


def plan_cuts(*, protocol_cut: int, steps: int, steps_per_epoch: int,
              chosen: list[int] | None) -> tuple[list[int], int]:
    """(extra cuts besides the protocol's, steps of the continuous path) for these settings.

    ``chosen``: the ``--cuts`` list (the protocol's cut in it is not repeated); None: :func:`default_cuts`.
    The continuous path is lengthened to one step past the last cut when it would end before it.
    """
    wanted = default_cuts(steps_per_epoch) if chosen is None else chosen
    extra = sorted(set(wanted) - {protocol_cut})
    return extra, max([steps, *(c + 1 for c in extra)])
