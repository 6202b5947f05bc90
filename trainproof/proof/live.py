"""Live state against restored state: what a process had in memory at a cut equals what the next process restored.

Every other comparison of the verifier reads states back from the store. A checkpoint that saves a wrong value (a
GradScaler's growth tracker saved as 0, a counter the task saves stale) saves it wrong in every generation, the
continuous path's own too: stored states then agree with each other, and the trajectories only part much later (the
GradScaler's scale doubles after 2 000 steps in one run, never in the other). So at every cut the continuous path
records, from its live objects (trainproof.train.live: model, optimizer with its step counters, scheduler, GradScaler
with its growth tracker, every generator, the data position, progress, the task's ``state_dict()`` and its own
tensors and numbers), a fingerprint of every value the next step reads, and each resumed path records the same right
after restoring, before its first update (``train --variant '{"live_state_at": [...]}'``). The two must be equal
exactly, on any device (it is a copy). A difference fails ``live_vs_restored.<component>``, naming the first differing
key and the step; the resume without RNG restore (the protocol's negative control) must differ (its generators).

Task attributes (``task_attributes``) are compared on the keys both sides hold: an attribute one side built lazily
and the other not yet is not a difference; a value both hold that differs is (state outside the checkpoint).
"""

from __future__ import annotations

from typing import Any

from trainproof.proof.check import COMPARE, Check, Results, Resumed
from trainproof.proof.compare import Diff
from trainproof.proof.paths import PathResult
from trainproof.train.live import COMPONENTS

NAME = "live_vs_restored"
EVENT = "live_state"
LAZY = ("task_attributes",)
"""Components compared on the keys both records hold."""
CAUSE = ("the resumed process restored another value than the process that wrote the checkpoint had in memory: the "
         "trainer's checkpoint saves it wrongly or its restore loads it wrongly (the task's own state is not at "
         "fault here); stored states cannot show this, since every generation holds the same wrong value")
TASK_CAUSE = ("the resumed process's task object holds another value than the one the process that wrote the "
              "checkpoint had in memory: the task keeps it outside Task.state_dict(), or its state_dict() saves it "
              "stale (see docs/tasks.md, 'No hidden state on the task object')")
TASK = ("task_state", "task_attributes")
"""The components that are the task's own: a difference there is evidence against the task, elsewhere the trainer."""


def records(result: PathResult | None) -> dict[int, dict[str, dict[str, str]]]:
    """The ``live_state`` events a path printed, by step (the first of each step)."""
    out: dict[int, dict[str, dict[str, str]]] = {}
    for event in [] if result is None else result.events:
        if event.get("event") == EVENT and isinstance(event.get("components"), dict):
            out.setdefault(int(event["step"]), event["components"])
    return out


def compare_records(live: dict[str, dict[str, str]], restored: dict[str, dict[str, str]], *, path: str,
                    step: int) -> dict[str, Diff]:
    """Per component: keys on one side only are a structural problem (except for :data:`LAZY` components), a key
    whose fingerprints differ a difference naming it (the first, in the live record's order)."""
    out: dict[str, Diff] = {}
    for component in dict.fromkeys([*COMPONENTS, *live, *restored]):
        a, b = live.get(component) or {}, restored.get(component) or {}
        diff = out[component] = Diff()
        only = sorted(set(a) ^ set(b))
        if only and component not in LAZY:
            sides = f"{sorted(set(a) - set(b))[:4]} live only, {sorted(set(b) - set(a))[:4]} restored only"
            diff.problems.append(f"{component}: keys differ at step {step} ({path}: {sides})")
            diff.detail = diff.problems[0]
        for key in a:
            if key in b and a[key] != b[key]:
                diff.exceeded = True
                diff.max_abs = max(diff.max_abs, _numeric_gap(a[key], b[key]))
                diff.detail = diff.detail or (f"{component}.{key} differs at step {step} ({path}: live {a[key]} vs "
                                              f"restored {b[key]})")
        diff.first_step = step if not diff.within else None
    return out


def _numeric_gap(a: str, b: str) -> float:
    """|a - b| of two fingerprints of numbers (``int 5``, ``float32 3.0``), else 0."""
    try:
        return abs(float(a.split(" ", 1)[1]) - float(b.split(" ", 1)[1]))
    except (IndexError, ValueError):
        return 0.0


class LiveVsRestored(Check):
    """Each resumed path's record right after its restore against the continuous path's record at that step."""

    def __init__(self, *, steps: tuple[int, ...]) -> None:
        self.steps = steps
        self.diffs: dict[str, Diff] = {}
        self.negative: dict[str, Diff] = {}
        self.compared: list[dict[str, Any]] = []
        self.not_recorded: list[str] = []
        self.keys: dict[str, int] = {}

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Once every resumed path ran (``compare``): each one's record at its cut against the continuous path's."""
        if phase != COMPARE:
            return
        live = records(done.runs.get("continuous"))
        for r in sorted(done.resumed, key=lambda r: r.at):  # a difference's first_step is the earliest cut's
            on_task = self._compare_one(r, live, records(done.runs.get(r.name)))
            if on_task:
                done.task_evidence[r.name] = on_task

    def _compare_one(self, r: Resumed, live: dict[int, dict[str, dict[str, str]]],
                     restored: dict[int, dict[str, dict[str, str]]]) -> str | None:
        """Compare one path's record; the first difference on the task's own state (:data:`TASK`), if any."""
        if r.at not in restored:  # a resumed path of a check that does not ask for a record
            self.not_recorded.append(r.name)
            return None
        diffs = ({name: Diff(problems=[f"the continuous path recorded no live state at step {r.at}"])
                  for name in COMPONENTS} if r.at not in live else
                 compare_records(live[r.at], restored[r.at], path=r.name, step=r.at))
        into = self.negative if r.negative else self.diffs
        for name, diff in diffs.items():
            into.setdefault(name, Diff()).merge(diff, r.at)
        if not r.negative:
            self.keys = {name: len(keys) for name, keys in restored[r.at].items()}
        self.compared.append({"path": r.name, "step": r.at, "negative": r.negative,
                              "equal": all(d.within for d in diffs.values())})
        task = [diffs[n].detail for n in TASK if n in diffs and not diffs[n].within]
        return None if r.negative or not task else task[0]

    @property
    def passed(self) -> bool:
        """Some resumed path was compared, every one equal (False before the comparison)."""
        return bool(self.diffs) and all(d.within for d in self.diffs.values())

    @property
    def negative_detected(self) -> bool | None:
        """The resume without RNG restore differs (without a structural problem); None when it was not compared."""
        if not self.negative:
            return None
        return not any(d.problems for d in self.negative.values()) and any(not d.within for d in self.negative.values())

    def verdicts(self) -> dict[str, bool]:
        """``live_vs_restored_passed`` and ``live_vs_restored_negative_detected``."""
        return {f"{NAME}_passed": self.passed, f"{NAME}_negative_detected": bool(self.negative_detected)}

    def failing(self) -> list[str]:
        """``live_vs_restored.<component>`` of every difference; the negative control when it did not differ."""
        out = [f"{NAME}.{name}" for name, d in self.diffs.items() if not d.within]
        if not self.diffs:
            out.append(f"{NAME}: no resumed path recorded its restored state")
        if self.negative_detected is False:
            out.append(f"{NAME}.resume_without_rng: did not differ")
        return out

    def diagnosis(self) -> list[str]:
        """The first differing key of each failed component, and why it matters."""
        return [f"{NAME}: {d.detail}: {TASK_CAUSE if name in TASK else CAUSE}" for name, d in self.diffs.items()
                if not d.within]

    def sections(self) -> dict[str, Any]:
        """The ``live_vs_restored`` block: where the continuous path recorded, every comparison, the components and
        how many values each held."""
        return {NAME: {
            "recorded_at": list(self.steps), "components": self.keys,
            "empty": [name for name, n in self.keys.items() if n == 0],
            "compared": self.compared, "not_recorded": self.not_recorded,
            "mode": "exact (a restored state is a copy: every value bitwise equal, on any device)",
            "negative_control": {"path": "resume_without_rng", "detected": self.negative_detected,
                                 "differing": [n for n, d in self.negative.items() if not d.within]}}}

    def checks(self) -> dict[str, dict[str, Diff]]:
        """One column, ``live_vs_restored``: per component, merged over every resumed path."""
        return {NAME: self.diffs}
