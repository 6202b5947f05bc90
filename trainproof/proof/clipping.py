"""The clipping check: for a task with ``grad_clip``, a resume and a resume of a resume compared on runs where clipping
is sure to bite.

The protocol's paths train with the task's own threshold, which a short verification run may never reach: then a
resume that restores the clipping wrongly (another threshold after a resume, clipping only on resumed runs) passes
with every difference 0, and trainproof.proof.exercised can only report clipping as not exercised. So for a task with
``grad_clip`` the verifier makes the path active itself, on runs of its own (``<id>/clip/``), each with
``train --variant '{"grad_clip": T}'`` where ``T`` is :data:`FRACTION` of the smallest gradient norm the continuous path
measured (recorded; the gradients of the same steps are no smaller, and every step's events say whether it clipped):

- ``clip_continuous``: ``cut + STEPS_AFTER`` steps from the initial state, committing every step (with the resumed
  paths);
- ``clip_resume``: a fresh process resumed from a copy of ``clip_continuous``'s generation at the protocol's cut, run to
  the same end (with the resumes of resumes);
- ``clip_resume_again``: a fresh process resumed from a copy of the generation ``clip_resume`` (a process that had
  itself resumed) committed :data:`AGAIN_AFTER` step after the cut, run to the same end (after the comparison): a
  restore that clips wrongly only when the state it restores was written by a resumed process differs here only.

Both resumed runs are compared with ``clip_continuous`` at every step after their cut, exactly like the protocol's
resume (same tolerance, same checks). Clipping counts as covered (:meth:`ClipCheck.covers`) only when both clipped.

Only when needed: the runs run when the continuous path clipped on no step after the protocol's cut with the task's own
threshold (:func:`missed`; those steps are the ones the resumed paths train again); otherwise clipping was exercised on
the protocol's resumed paths and the block says so. ``clip_passed`` is the verdict; a difference fails
``clip_resume.<check>`` or ``clip_resume_again.<check>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainproof.proof.check import AFTER, AGAIN, RESUMED, Check, Job, Results
from trainproof.proof.compare import Diff, compare_states
from trainproof.proof.cuts import resume_checks
from trainproof.proof.diagnose import diagnose_path
from trainproof.proof.exercised import path_exercised
from trainproof.proof.paths import Opener, PathResult, RunReader, require_success, seed_copy
from trainproof.proof.settings import ProtocolSettings, train_argv
from trainproof.train.variant import Variant

FRACTION = 0.5
"""The clip runs' threshold, as a fraction of the smallest gradient norm of the continuous path."""
STEPS_AFTER = 3
"""Steps the clip runs train after the protocol's cut."""
AGAIN_AFTER = 1
"""Steps after the cut at which ``clip_resume_again`` resumes from ``clip_resume``'s generation."""
RESUMED_RUNS = ("clip_resume", "clip_resume_again")


def missed(done: Results, cut: int) -> float | None:
    """When the continuous path clipped on no step after ``cut`` (the steps the protocol's resumed paths train again):
    a threshold that bites on the clipping check's runs, a fraction of the smallest gradient norm the continuous path
    measured; else None."""
    steps = [e for e in done.runs["continuous"].events if e.get("event") == "step"] if "continuous" in done.runs else []
    if any(e.get("clipped") for e in steps if int(e.get("step", 0)) > cut):
        return None
    norms = [float(e["grad_norm"]) for e in steps
             if isinstance(e.get("grad_norm"), (int, float)) and 0 < e["grad_norm"] < float("inf")]
    return FRACTION * min(norms) if norms else None


class ClipCheck(Check):
    """``clip_continuous``, ``clip_resume`` and ``clip_resume_again`` under ``<id>/clip/`` (see the module
    docstring)."""

    def __init__(self, *, settings: ProtocolSettings, grad_clip: float, root_url: str, opener: Opener,
                 param_names: frozenset[str]) -> None:
        self.s, self.opener, self.param_names = settings, opener, param_names
        self.ran: bool | None = None
        """None until asked; False when the protocol's resumed paths clipped with the task's own threshold."""
        self.threshold: float | None = None
        self.task_clip = grad_clip
        self.end = settings.cut + STEPS_AFTER
        self.at = {"clip_resume": settings.cut, "clip_resume_again": settings.cut + AGAIN_AFTER}
        """The step each resumed run resumes from."""
        self.urls = {name: f"{root_url.rstrip('/')}/clip/{name}" for name in ("clip_continuous", *RESUMED_RUNS)}
        self.paths: dict[str, dict[str, Any]] = {}
        self.exercised: dict[str, Any] = {}
        self.diffs: dict[str, dict[str, Diff]] = {name: {} for name in RESUMED_RUNS}
        self.resumed_ok = False
        """``clip_resume`` ran to its end (its generations seed ``clip_resume_again``)."""

    def _argv(self, name: str) -> list[str]:
        resume = name in self.at
        return train_argv(self.s, self.urls[name], steps=self.end - self.at[name] if resume else self.end, every=1,
                          resume=resume, variant=Variant(grad_clip=self.threshold))

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """When :func:`missed`: ``clip_continuous`` with the resumed paths, ``clip_resume`` (seeded first) with the
        resumes of resumes, ``clip_resume_again`` (seeded from ``clip_resume``) after the comparison."""
        if phase == RESUMED:
            self.threshold = missed(done, self.s.cut)
            self.ran = self.threshold is not None
            name = "clip_continuous"
        elif phase == AGAIN and self.ran or phase == AFTER and self.ran and self.resumed_ok:
            name = "clip_resume" if phase == AGAIN else "clip_resume_again"
            source = "clip_continuous" if phase == AGAIN else "clip_resume"
            seed_copy(self.opener(self.urls[name]), self.opener(self.urls[source]), self.at[name])
        else:
            return []
        return [(name, self.urls[name], self._argv(name))] if self.ran else []

    def record(self, phase: str, results: list[PathResult]) -> None:
        for r in results:
            self.paths[r.name] = r.to_json()
            self.exercised[r.name] = path_exercised(r)

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Every run must have run; each resumed one is compared with the continuous one at every step after its
        cut."""
        if phase == RESUMED:
            require_success(results)
            return
        if phase not in (AGAIN, AFTER) or not results:
            return
        (name,) = [r.name for r in results]
        self.resumed_ok = self.resumed_ok or (name == "clip_resume" and results[0].code == 0)
        if resume_checks(results, {name: self.at[name]}, self.diffs):
            return
        ref, other = (RunReader(n, self.urls[n], self.opener) for n in ("clip_continuous", name))
        for step in (x for x in range(self.at[name] + 1, self.end + 1) if x in other.steps or "finished" not in
                     self.diffs[name]):  # a run that crashed after its restore: the steps it committed
            for check, diff in compare_states(ref.state(step), other.state(step),
                                              self.s.tolerance, self.param_names).items():
                self.diffs[name].setdefault(check, Diff()).merge(diff, step)

    @property
    def passed(self) -> bool:
        """Its resume and its resume of a resume equal its continuous run (True when it did not need to run)."""
        if self.ran is False:
            return True
        return all(diffs and all(d.within for d in diffs.values()) for diffs in self.diffs.values())

    def failing(self) -> list[str]:
        return [f"{p}.{n}" for p, diffs in self.diffs.items() for n, d in diffs.items() if not d.within]

    def diagnosis(self) -> list[str]:
        return [line for p, diffs in self.diffs.items() for line in diagnose_path(p, diffs, self.at[p] + 1)]

    def verdicts(self) -> dict[str, bool]:
        return {} if self.ran is False else {"clip_passed": self.passed}

    def sections(self) -> dict[str, Any]:
        if self.ran is False:
            return {"clipping": {"task_grad_clip": self.task_clip, "ran": False,
                                 "why": "the protocol's resumed paths clipped with the task's own threshold"}}
        return {"clipping": {
            "ran": self.ran, "task_grad_clip": self.task_clip, "threshold": self.threshold, "fraction": FRACTION,
            "why": "the task's threshold may never bite in a short verification: these runs clip on every step whose "
                   "gradient norm exceeds the threshold, so a resume that restores clipping wrongly differs",
            "steps": self.end, "cut": self.s.cut, "resume_of_resume_at": self.at["clip_resume_again"],
            "exercised": self.exercised, "clipped_on": self.clipped_on(), "passed": self.passed, "paths": self.paths}}

    def clipped_on(self) -> list[str]:
        """The resumed runs that clipped on at least one step (what the check exercised)."""
        return [name for name in RESUMED_RUNS
                if ((self.exercised.get(name) or {}).get("clipping") or {}).get("active_steps")]

    def covers(self) -> dict[str, str]:
        """``gradient clipping``, when its resume and its resume of a resume both clipped: a coverage claimed only
        where it was exercised."""
        if not self.ran or self.clipped_on() != list(RESUMED_RUNS):
            return {}
        return {"gradient clipping": f"clip_resume, clip_resume_again: the clipping check resumed runs of its own, and "
                                     f"a resume of a resume, with a threshold of {self.threshold:g} (clip_passed)"}

    def checks(self) -> dict[str, dict[str, Diff]]:
        return self.diffs
