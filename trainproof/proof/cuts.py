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

:class:`CutsCheck` is the extra cuts as a :class:`trainproof.proof.check.Check`: its ``cut_at_<c>`` processes start with
the protocol's reference paths, its ``resume_at_<c>`` paths with the protocol's resumed ones, and the four paths'
comparison (trainproof.proof.four_paths) compares them with the continuous path in the same pass (each continuous state
read once).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from trainproof.errors import ConfigError
from trainproof.proof.check import AGAIN, REFERENCE, RESUMED, Check, Job, Results, Resumed
from trainproof.proof.compare import Diff
from trainproof.proof.diagnose import diagnose_path
from trainproof.proof.paths import Opener, PathResult, VerificationIncomplete, require_success, seed_copy
from trainproof.proof.settings import ProtocolSettings, live_steps, train_argv

EPOCHS = 3
"""Epochs the default continuous path covers at least."""


def default_cuts(steps_per_epoch: int, epochs: int = EPOCHS) -> list[int]:
    """Every epoch boundary and the middle of every later epoch of ``epochs`` epochs (epoch 0's inside is the
    protocol's own cut; only the boundaries when an epoch is one step)."""
    cuts = []
    for k in range(1, epochs):
        cuts.append(k * steps_per_epoch)
        if steps_per_epoch >= 2:
            cuts.append(k * steps_per_epoch + max(1, steps_per_epoch // 2))
    return cuts


def random_cut(seed: int, steps: int, taken: set[int]) -> int | None:
    """One step in ``1 .. steps - 1`` not already a cut, drawn from a generator seeded with the verification's seed
    (recorded: ``verify --cuts`` with that step replays it); None when every step is a cut already."""
    free = [c for c in range(1, steps) if c not in taken]
    return random.Random(f"trainproof.random-cut/{seed}").choice(free) if free else None


def parse_cuts(text: str) -> list[int]:
    """``--cuts 5,6,11`` as sorted distinct steps (each >= 1); ConfigError (exit 2) otherwise."""
    try:
        cuts = sorted({int(part) for part in text.split(",") if part.strip()})
    except ValueError:
        raise ConfigError(f"--cuts must be comma-separated step numbers, e.g. 5,6,11 (got {text!r})") from None
    if not cuts or cuts[0] < 1:
        raise ConfigError(f"--cuts needs step numbers >= 1 (got {text!r})")
    return cuts


def plan_cuts(*, protocol_cut: int, steps: int, steps_per_epoch: int, chosen: list[int] | None,
              seed: int = 0) -> tuple[list[int], int, dict[str, int] | None]:
    """(extra cuts besides the protocol's, steps of the continuous path, the seeded random cut or None).

    ``chosen``: the ``--cuts`` list (the protocol's cut in it is not repeated), exactly those. None: the continuous path
    covers :data:`EPOCHS` epochs, and the cuts are :func:`default_cuts` plus one :func:`random_cut` seeded by ``seed``.
    The continuous path is lengthened to one step past the last cut when it would end before it."""
    if chosen is not None:
        extra = sorted(set(chosen) - {protocol_cut})
        return extra, max([steps, *(c + 1 for c in extra)]), None
    steps = max(steps, EPOCHS * steps_per_epoch)
    wanted = {c for c in default_cuts(steps_per_epoch) if c < steps} - {protocol_cut}
    drawn = random_cut(seed, steps, wanted | {protocol_cut})
    extra = sorted(wanted | ({drawn} if drawn is not None else set()))
    return extra, max([steps, *(c + 1 for c in extra)]), None if drawn is None else {"step": drawn, "seed": seed}


def resume_checks(results: list[PathResult], at: dict[str, int], into: dict[str, dict[str, Diff]],
                  negative: str | None = None) -> set[str]:
    """The resumed paths' own restore self-check, recorded as each one's ``rng_restore`` difference in ``into[name]``;
    the names of those whose self-check failed.

    A resume whose restore self-check failed is a failed comparison (the path names the check), not a verification
    that could not complete; so is a resumed process that restored as intended and then crashed at a step the
    continuous path trained (:func:`crash_after_resume`: ``finished``, a resume failure, exit 1). Raises
    VerificationIncomplete for a path that failed otherwise (a timeout, a signal, the trainer's own one-line error: the
    store, the data, the options), or that did not resume from its cut ``at[name]`` as intended (with the RNG restore,
    except the negative control ``negative``, which gets no entry unless its process reported a failed self-check)."""
    failed = {r.name: event for r in results if r.code != 0 and (event := r.event("restore_check_failed"))}
    crashed = {r.name: detail for r in results if r.name not in failed
               and (detail := crash_after_resume(r, at[r.name], rng_restored=r.name != negative))}
    require_success([r for r in results if r.name not in failed and r.name not in crashed])
    for r in results:
        if r.name in failed:
            event = failed[r.name]
            into[r.name]["rng_restore"] = Diff(exceeded=True, first_step=at[r.name] + 1, detail=str(
                event.get("detail") or f"generators {event.get('generators')} failed the restore self-check"))
            continue
        event = r.event("resume") or {}
        if r.name in crashed and not event:  # crashed while restoring: nothing after it to compare
            into[r.name]["finished"] = Diff(exceeded=True, first_step=crashed[r.name][0], detail=crashed[r.name][1])
            continue
        if event.get("step") != at[r.name] or event.get("rng_restored") != (r.name != negative):
            raise VerificationIncomplete(f"path {r.name!r} did not resume from step {at[r.name]} as intended "
                                         f"(its resume event: {event or 'none'})")
        if r.name in crashed:
            into[r.name]["finished"] = Diff(exceeded=True, first_step=crashed[r.name][0], detail=crashed[r.name][1])
        if r.name != negative:
            into[r.name]["rng_restore"] = Diff()  # the resume's own self-check passed (the path ran on)
    return set(failed)


BOX = "│╭╰─┃┏┗━"
"""The characters a rich traceback's frame boxes start their lines with."""


def crash_after_resume(r: PathResult, at: int, *, rng_restored: bool = True) -> tuple[int, str] | None:
    """(step, detail) when resumed path ``r`` crashed (exit 1 with an unhandled exception, not the trainer's own
    ``trainproof: error:`` line) while restoring step ``at``, or after restoring it as intended at a step the
    continuous path trained without error: a failure that occurs only on a resumed path, so a resume failure. None
    otherwise (it did not fail, failed before it started, timed out, was killed, or failed for a reason the trainer
    names: the store, the data, the options; those leave the verification incomplete)."""
    event = r.event("resume") or {}
    restoring = not event  # failed before its resume event: while finding, verifying or restoring the generation
    if r.code != 1 or not restoring and (event.get("step") != at or event.get("rng_restored") != rng_restored):
        return None
    lines = [line for line in r.error.splitlines()  # not the box-drawn frames of a rich traceback
             if line.strip() and line.strip()[0] not in BOX and any(c.isalnum() for c in line)]
    if not lines or any(line.startswith("trainproof: error:") for line in lines):
        return None
    if restoring:  # seeded with the generation the continuous path wrote and went on from: the restore failed
        return at + 1, (f"the resumed process crashed while restoring step {at} (the continuous path wrote that "
                        f"generation and trained on from it): {' '.join(' '.join(lines).split())}")
    trained = [int(e["step"]) for e in r.events if e.get("event") == "step" and isinstance(e.get("step"), int)]
    step = max(trained, default=at) + 1
    return step, (f"the resumed process crashed at step {step} (resumed from step {at}; the continuous path "
                  f"trained that step): {' '.join(' '.join(lines).split())}")


def again_step(s: ProtocolSettings) -> int | None:
    """The step of the resume of a resume: one the protocol's resume path commits, after its cut and before the
    end, near the middle (None when it commits none there)."""
    every = s.checkpoint_every
    candidates = [x for x in range(s.cut + 1, s.steps) if every and x % every == 0]
    middle = (s.cut + s.steps) // 2
    return min(candidates, key=lambda x: (abs(x - middle), x)) if candidates else None


class CutsCheck(Check):
    """Resume at every extra cut (``resume_at_<c>`` under ``<id>/cuts/``) and compare with the continuous path."""

    def __init__(self, *, settings: ProtocolSettings, extra: list[int], steps_per_epoch: int, root_url: str,
                 continuous_url: str, opener: Opener, resume_url: str | None = None,
                 random_cut: dict[str, int] | None = None) -> None:
        self.s, self.extra, self.steps_per_epoch, self.opener = settings, extra, steps_per_epoch, opener
        self.random_cut = random_cut
        self.resume_url = resume_url
        """The protocol's resume path: a process that resumed; the resume of a resume starts from its generation."""
        self.again = self._again_step() if resume_url is not None and settings.cuts is None else None
        """The step of the resume of a resume (default cuts only), or None."""
        self.again_skipped: str | None = None
        self.continuous_url = continuous_url
        """The continuous path's run (a reused reference's with ``--reuse-reference``): the reference, and the source
        of every cut it committed."""
        self.urls = {name: f"{root_url.rstrip('/')}/cuts/{name}"
                     for c in extra for name in (f"resume_at_{c}", f"cut_at_{c}")}
        self.paths: dict[str, dict[str, Any]] = {}
        self.diffs: dict[str, dict[str, Diff]] = {f"resume_at_{c}": {} for c in extra}
        if self.again is not None:
            self.urls[self.again_name] = f"{root_url.rstrip('/')}/cuts/{self.again_name}"
            self.diffs[self.again_name] = {}
        self.restore_failed: set[str] = set()
        self.task_evidence: dict[str, str] = {}
        """Per resumed path, the task's own state the live comparison found differing (Results.task_evidence)."""

    @property
    def again_name(self) -> str:
        return f"resume_of_resume_at_{self.again}"

    def _again_step(self) -> int | None:
        """A step the protocol's resume path commits, after its cut and before the end, near the middle."""
        return again_step(self.s)

    def continuous_has(self, step: int) -> bool:
        """Whether the continuous path commits generation ``step`` (then an extra cut resumes from it)."""
        every = self.s.checkpoint_every
        return step == self.s.steps or bool(every and step % every == 0)

    def argv(self, c: int, *, resume: bool) -> list[str]:
        """The command line of an extra cut's own cut process (``resume=False``) or of its resumed path."""
        name = f"resume_at_{c}" if resume else f"cut_at_{c}"
        return train_argv(self.s, self.urls[name], steps=self.s.steps - c if resume else c,
                          every=self.s.checkpoint_every if resume else 0, resume=resume,
                          live=live_steps(self.s, resumed_at=c) if resume else None)

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """``cut_at_<c>`` with the reference paths (cuts the continuous path does not commit); ``resume_at_<c>`` with
        the resumed ones, each seeded first with a copy of generation c, committed through the store."""
        if phase == REFERENCE:
            return [(f"cut_at_{c}", self.urls[f"cut_at_{c}"], self.argv(c, resume=False))
                    for c in self.extra if not self.continuous_has(c)]
        if phase == AGAIN:
            return self._again_jobs()
        if phase != RESUMED:
            return []
        for c in self.extra:  # from the continuous path's own generation c, or from cut_at_<c>
            source = self.opener(self.continuous_url if self.continuous_has(c) else self.urls[f"cut_at_{c}"])
            seed_copy(self.opener(self.urls[f"resume_at_{c}"]), source, c)
        return [(f"resume_at_{c}", self.urls[f"resume_at_{c}"], self.argv(c, resume=True)) for c in self.extra]

    def _again_jobs(self) -> list[Job]:
        """The resume of a resume: seeded with a copy of the generation the protocol's resume path (a process that had
        itself resumed) committed at :attr:`again`, then run to the end in a fresh process."""
        if self.again is None:
            return []
        source = self.opener(self.resume_url)
        if self.again not in {g.step for g in source.scan() if g.status == "complete"}:
            self.again_skipped = f"the resume path committed no generation at step {self.again}"
            self.diffs.pop(self.again_name, None)
            return []
        seed_copy(self.opener(self.urls[self.again_name]), source, self.again)
        argv = train_argv(self.s, self.urls[self.again_name], steps=self.s.steps - self.again,
                          every=self.s.checkpoint_every, resume=True, live=live_steps(self.s, resumed_at=self.again))
        return [(self.again_name, self.urls[self.again_name], argv)]

    def record(self, phase: str, results: list[PathResult]) -> None:
        """Its runs' entries, in the ``cuts`` block."""
        self.paths.update({r.name: r.to_json() for r in results})

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Every run must have succeeded, every resume from its cut with the RNG restore (or failed its self-check:
        a failed comparison)."""
        self.task_evidence = done.task_evidence  # filled by the live comparison, read by the diagnosis
        if phase == REFERENCE:
            require_success(results)
        elif phase in (RESUMED, AGAIN):  # resume_at_<c>, resume_of_resume_at_<c>: resumed from step c
            self.restore_failed |= resume_checks(results, {r.name: int(r.name.rsplit("_", 1)[1]) for r in results},
                                                 self.diffs)

    def resumed(self) -> list[Resumed]:
        """Every ``resume_at_<c>`` whose own restore self-check passed, compared after step c."""
        out = [Resumed(name, self.urls[name], c, self.diffs[name])
               for c in self.extra if (name := f"resume_at_{c}") not in self.restore_failed]
        if self.again is not None and self.again_name in self.diffs and self.again_name not in self.restore_failed:
            out.append(Resumed(self.again_name, self.urls[self.again_name], self.again, self.diffs[self.again_name]))
        return out

    def _passed_at(self, c: int, name: str | None = None) -> bool:
        diffs = self.diffs[name or f"resume_at_{c}"]
        return bool(diffs) and all(d.within for d in diffs.values())

    @property
    def passed(self) -> bool:
        """Every extra cut's resume, and the resume of a resume, equals the continuous path (True when there is
        neither)."""
        again = self.again is None or self.again_name not in self.diffs or self._passed_at(0, self.again_name)
        return all(self._passed_at(c) for c in self.extra) and again

    def failing(self) -> list[str]:
        """``resume_at_<c>.<check>`` of every difference."""
        return [f"{p}.{n}" for p, diffs in self.diffs.items() for n, d in diffs.items() if not d.within]

    def diagnosis(self) -> list[str]:
        """Each failed cut's likely cause (trainproof.proof.diagnose)."""
        at = {f"resume_at_{c}": c for c in self.extra} | ({self.again_name: self.again} if self.again is not None
                                                          and self.again_name in self.diffs else {})
        return [line for p, c in at.items()
                for line in diagnose_path(p, self.diffs[p], c + 1, self.task_evidence.get(p))]

    def verdicts(self) -> dict[str, bool]:
        """``cuts_passed``."""
        return {"cuts_passed": self.passed}

    def sections(self) -> dict[str, Any]:
        """The ``cuts`` block: every cut resumed at, and where each extra one came from."""
        s = self.s
        return {"cuts": {
            "protocol_cut": s.cut, "extra": self.extra, "all": sorted({s.cut, *self.extra}),
            "chosen": "--cuts" if s.cuts is not None else (f"default: every epoch boundary and the middle of every "
                                                           f"later epoch of {EPOCHS} epochs, one seeded random step, "
                                                           f"a resume of a resume"),
            "random_cut": None if self.random_cut is None else {
                **self.random_cut,
                "replay": f"verify --cuts {self.random_cut['step']} --seed {self.random_cut['seed']}"},
            "resume_of_resume": None if self.again is None else {
                "at": self.again, "from": "the protocol's resume path's generation (written by a resumed process)",
                "path": self.again_name, "skipped": self.again_skipped,
                "passed": None if self.again_name not in self.diffs else self._passed_at(0, self.again_name)},
            "steps": s.steps, "steps_per_epoch": self.steps_per_epoch,
            "resumed_from": {str(c): ("continuous path's generation" if self.continuous_has(c) else f"cut_at_{c}")
                             for c in self.extra},
            "passed": {str(c): self._passed_at(c) for c in self.extra}, "paths": self.paths}}

    def checks(self) -> dict[str, dict[str, Diff]]:
        """Each ``resume_at_<c>``'s rows, as the protocol's resumed paths have them."""
        return self.diffs
