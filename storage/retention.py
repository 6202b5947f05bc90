"""What to keep: a pure function of the list of generations, applied only after a commit.

Rules (each one a complaint about a peer tool, see DESIGN.md):
- keep the ``keep`` newest complete generations;
- never delete the newest complete generation, nor anything newer than it (a write may be in flight);
- collect partial generations older than the newest complete one once they are older than ``grace_seconds``;
- never touch corrupt (evidence: quarantine moves those aside) or foreign (another run's) generations;
- export bundles and quarantine live outside ``step-*`` and are never seen here.
"""

from __future__ import annotations

from storage.generations import COMPLETE, INCOMPLETE, GenerationInfo


def plan_retention(
    generations: list[GenerationInfo], *, keep: int, now: float, grace_seconds: float,
    protect: frozenset[int] | set[int] = frozenset(),
) -> list[GenerationInfo]:
    """The generations to delete, oldest first. ``protect``: steps of complete generations to keep anyway
    (the caller's reasons, e.g. the generation a resume started from, kept until an audit spans it)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 (the newest complete generation is never deleted), got {keep}")
    complete = sorted((g for g in generations if g.status == COMPLETE), key=lambda g: g.step)
    if not complete:
        return []
    newest = complete[-1].step
    kept = {g.step for g in complete[-keep:]}
    doomed = [g for g in complete if g.step not in kept and g.step not in protect and g.step < newest]
    doomed += [
        g for g in generations
        if g.status == INCOMPLETE and g.step < newest
        and g.mtime is not None and now - g.mtime > grace_seconds
    ]
    return sorted(doomed, key=lambda g: g.step)
