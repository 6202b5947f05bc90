"""The clipping check: for a task with ``grad_clip``, a resume compared on runs where clipping is sure to bite.

The protocol's paths train with the task's own threshold, which a short verification run may never reach: then a
resume that restores the clipping wrongly (another threshold after a resume, clipping only on resumed runs) passes
with every difference 0, and trainproof.proof.exercised can only report clipping as not exercised. So for a task with
``grad_clip`` the verifier makes the path active itself, on a pair of runs of its own (``<id>/clip/``), both with
``train --variant '{"grad_clip": T}'`` where ``T`` is :data:`FRACTION` of the smallest gradient norm the continuous path
measured
(recorded; the gradients of the same steps are no smaller, and every step's events say whether it clipped):

- ``clip_continuous``: ``cut + STEPS_AFTER`` steps from the initial state, committing every step (in the ``again``
  phase, beside the resume of a resume);
- ``clip_resume``: a fresh process resumed from a copy of ``clip_continuous``'s generation at the protocol's cut, run to
  the same end (in the ``after`` phase), compared with ``clip_continuous`` at every step after the cut, exactly like
  the protocol's resume (same tolerance, same checks).

Only when needed: the pair runs when no resumed path of the protocol clipped with the task's own threshold
(:func:`missed`, asked of the results so far once the resumed paths ran); otherwise clipping was exercised there and
the block says so. ``clip_passed`` is the verdict; a difference fails ``clip_resume.<check>``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainproof.proof.check import AFTER, AGAIN, Check, Job, Results
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


def missed(done: Results) -> float | None:
    """When no resumed path of the protocol clipped: a threshold that bites on the clipping check's runs, a fraction
    of the smallest gradient norm the continuous path measured; else None."""
    resumed = [r for name, r in done.runs.items() if name == "resume" or name.startswith("resume_at_")]
    if any(((path_exercised(r) or {}).get("clipping") or {}).get("active_steps") for r in resumed):
        return None
    norms = [float(e["grad_norm"]) for e in done.runs["continuous"].events
             if e.get("event") == "step" and isinstance(e.get("grad_norm"), (int, float))
             and 0 < e["grad_norm"] < float("inf")] if "continuous" in done.runs else []
    return FRACTION * min(norms) if norms else None


class ClipCheck(Check):
    """``clip_continuous`` and ``clip_resume`` under ``<id>/clip/`` (see the module docstring)."""

    def __init__(self, *, settings: ProtocolSettings, grad_clip: float, root_url: str, opener: Opener,
                 param_names: frozenset[str]) -> None:
        self.s, self.opener, self.param_names = settings, opener, param_names
        self.ran: bool | None = None
        """None until asked; False when the protocol's resumed paths clipped with the task's own threshold."""
        self.threshold: float | None = None
        self.task_clip = grad_clip
        self.end = settings.cut + STEPS_AFTER
        self.urls = {name: f"{root_url.rstrip('/')}/clip/{name}" for name in ("clip_continuous", "clip_resume")}
        self.paths: dict[str, dict[str, Any]] = {}
        self.exercised: dict[str, Any] = {}
        self.diffs: dict[str, Diff] = {}

    def _argv(self, name: str) -> list[str]:
        resume = name == "clip_resume"
        return train_argv(self.s, self.urls[name], steps=STEPS_AFTER if resume else self.end, every=1, resume=resume,
                          variant=Variant(grad_clip=self.threshold))

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """When :func:`missed`: ``clip_continuous`` in the ``again`` phase, ``clip_resume`` (seeded first) after."""
        if phase == AGAIN:
            self.threshold = missed(done)
            self.ran = self.threshold is not None
            name = "clip_continuous"
            return [(name, self.urls[name], self._argv(name))] if self.ran else []
        if phase != AFTER or not self.ran:
            return []
        seed_copy(self.opener(self.urls["clip_resume"]), self.opener(self.urls["clip_continuous"]), self.s.cut)
        return [("clip_resume", self.urls["clip_resume"], self._argv("clip_resume"))]

    def record(self, phase: str, results: list[PathResult]) -> None:
        for r in results:
            self.paths[r.name] = r.to_json()
            self.exercised[r.name] = path_exercised(r)

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Both runs must have run; the resumed one is compared with the continuous one at every step after the
        cut."""
        if phase == AGAIN:
            require_success(results)
            return
        if phase != AFTER or not results:
            return
        if resume_checks(results, {"clip_resume": self.s.cut}, {"clip_resume": self.diffs}):
            return
        ref, other = (RunReader(name, self.urls[name], self.opener) for name in ("clip_continuous", "clip_resume"))
        for step in range(self.s.cut + 1, self.end + 1):
            for name, diff in compare_states(ref.state(step), other.state(step),
                                             self.s.tolerance, self.param_names).items():
                self.diffs.setdefault(name, Diff()).merge(diff, step)

    @property
    def passed(self) -> bool:
        """Its resume equals its continuous run (True when it did not need to run)."""
        if self.ran is False:
            return True
        return bool(self.diffs) and all(d.within for d in self.diffs.values())

    def failing(self) -> list[str]:
        return [f"clip_resume.{n}" for n, d in self.diffs.items() if not d.within]

    def diagnosis(self) -> list[str]:
        return diagnose_path("clip_resume", self.diffs, self.s.cut + 1)

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
            "steps": self.end, "cut": self.s.cut, "exercised": self.exercised, "passed": self.passed,
            "paths": self.paths}}

    def covers(self) -> dict[str, str]:
        """``gradient clipping``, when its runs ran."""
        if not self.ran:
            return {}
        return {"gradient clipping": f"clip_resume: the clipping check resumed runs of its own with a threshold of "
                                     f"{self.threshold:g} (clip_passed)"}

    def checks(self) -> dict[str, dict[str, Diff]]:
        return {"clip_resume": self.diffs}
