"""The protocol's first check: the four paths of docs/protocol.md (continuous, cut, resume, and the resume without RNG
restore: the negative control), the comparison of every resumed path (:attr:`trainproof.proof.check.Results.resumed`)
with the continuous one, state by state, and the export once every check passed.

The resume paths get the cut's generation as a *copy committed through the store* (write -> verify -> mark usable) and
run with ``--steps`` (additional updates): a path that silently started over would end at step N-k, not N. With
``--checkpoint-every 1`` (the default) the continuous and resumed paths commit every step, so the full state is compared
at every step after the cut; the cut path saves only at the cut, as the protocol says (a continuous path that saved at
step k like the cut would share a disturbance the save caused).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from trainproof.errors import ConfigError
from trainproof.format.contract import PLAN_FILE, absolute_url, read_run_plan
from trainproof.format.state import History
from trainproof.proof.check import COMPARE, EXPORT, REFERENCE, RESUMED, Check, Job, Results, Resumed
from trainproof.proof.compare import Diff, compare_all, compare_cut
from trainproof.proof.cuts import resume_checks
from trainproof.proof.diagnose import diagnose_path
from trainproof.proof.exercised import generators_drew
from trainproof.proof.paths import (
    Opener,
    PathResult,
    RunReader,
    VerificationIncomplete,
    load_generation,
    require_success,
    seed_run,
)
from trainproof.proof.reload import export_and_check
from trainproof.proof.report import REPORT_FILE
from trainproof.proof.settings import ProtocolSettings, live_steps, train_argv
from trainproof.storage import GenerationStore
from trainproof.tasks import Task

log = logging.getLogger("trainproof.verify")
PATHS = ("continuous", "cut", "resume", "resume_without_rng")
COMPARED = ("cut", "resume", "resume_without_rng")
NEGATIVE = "resume_without_rng"
REUSED = ("continuous", "cut", NEGATIVE)
"""The paths ``--reuse-reference`` takes from the earlier verification (they do not depend on the resume tested)."""


def history_losses(state: dict[str, Any]) -> list[float]:
    """Per-step training losses recorded in a state."""
    return History.from_state_dict(state["history"]).column("loss")


class FourPaths(Check):
    """The four paths under ``<id>/`` (a reused reference's under its own id), their comparison and the export."""

    def __init__(self, *, settings: ProtocolSettings, opener: Opener, task: Task, param_names: frozenset[str],
                 root: GenerationStore, reference: GenerationStore | None) -> None:
        self.s, self.opener, self.task, self.param_names = settings, opener, task, param_names
        self.reference = reference
        self.urls = {p: f"{absolute_url(root)}/{p}" for p in PATHS}
        if reference is not None:
            self.urls.update({p: f"{absolute_url(reference)}/{p}" for p in REUSED})
        self.paths: dict[str, dict[str, Any]] = {}
        self.diffs: dict[str, dict[str, Diff]] = {p: {} for p in COMPARED}
        self.losses: dict[str, list[float]] = {}
        self.distances: dict[str, dict[int, float]] = {p: {} for p in COMPARED}
        self.meta: dict[str, Any] = {}
        self.export: dict[str, Any] | None = None
        self.drew: dict[str, bool] = {}
        self.task_state = False
        self.restore_failed: set[str] = set()
        self.task_evidence: dict[str, str] = {}
        """Per resumed path, the task's own state the live comparison found differing (Results.task_evidence)."""
        """The resumed paths whose own restore self-check failed (a failed comparison; not read back)."""

    def argv(self, path: str) -> list[str]:
        """The command line of one of the four paths."""
        s = self.s
        steps = {"continuous": s.steps, "cut": s.cut}.get(path, s.steps - s.cut)  # resumes: additional steps
        live = None if path == "cut" else live_steps(s, resumed_at=None if path == "continuous" else s.cut)
        return train_argv(s, self.urls[path], steps=steps, every=0 if path == "cut" else s.checkpoint_every,
                          resume=path not in ("continuous", "cut"), negative=path == NEGATIVE, live=live)

    def jobs(self, phase: str, scratch: Path, done: Results) -> list[Job]:
        """The continuous and cut paths (or the reused reference's, adopted), then the resumed ones, each seeded with
        a copy of the cut's generation."""
        if phase == REFERENCE:
            if self.s.reuse:
                self._adopt_reference()
                return []
            return [(p, self.urls[p], self.argv(p)) for p in ("continuous", "cut")]
        if phase != RESUMED:
            return []
        resumed = ("resume",) if self.s.reuse else ("resume", NEGATIVE)  # a reused reference brings its negative
        cut_store = self.opener(self.urls["cut"])
        plan, loaded = cut_store.read_file(PLAN_FILE), load_generation(cut_store, self.s.cut)
        try:  # large files in spools, deleted once copied
            for p in resumed:
                seed_run(self.opener(self.urls[p]), plan, loaded, lineage=cut_store)
        finally:
            loaded.close()
        return [(p, self.urls[p], self.argv(p)) for p in resumed]

    def record(self, phase: str, results: list[PathResult]) -> None:
        self.paths.update({r.name: r.to_json() for r in results})

    def compare(self, phase: str, results: list[PathResult], done: Results) -> None:
        """Each path must have succeeded, each resume from the cut as intended (or failed its own restore self-check:
        a failed comparison, ``rng_restore``); then the comparison, then the export when every check passed."""
        self.task_evidence = done.task_evidence  # filled by the live comparison, read by the diagnosis
        if phase == REFERENCE:
            require_success(results)
        elif phase == RESUMED:
            self.restore_failed = resume_checks(results, {r.name: self.s.cut for r in results}, self.diffs, NEGATIVE)
        elif phase == COMPARE:
            self._compare(done.resumed)
        elif phase == EXPORT and self.s.export and done.passed:
            t0 = time.monotonic()
            self.export = export_and_check(self.opener(self.urls["resume"]), step=self.s.steps, task=self.s.task,
                                           store_args=self.s.store_args, timeout=self.s.timeout).to_json()
            log.info("%s: %.1f s", "export and fresh-process reload check", time.monotonic() - t0)

    def resumed(self) -> list[Resumed]:
        """The resume and the negative control (unless their restore self-check failed)."""
        return [Resumed(p, self.urls[p], self.s.cut, self.diffs[p], negative=p == NEGATIVE)
                for p in ("resume", NEGATIVE) if p not in self.restore_failed]

    def _adopt_reference(self) -> None:
        """Reuse an earlier verification's continuous, cut and negative-control paths: same task, settings and seed,
        or refuse."""
        want = {"task": self.s.task, "task_config": self.task.config(), "seed": self.s.seed}
        try:  # the reused verification's path entries (its commands), when its report was uploaded
            earlier = json.loads(self.reference.read_file(REPORT_FILE)).get("paths", {})
        except (FileNotFoundError, ValueError, AttributeError):
            earlier = {}
        for p in REUSED:
            plan = read_run_plan(self.opener(self.urls[p]))
            got = {k: plan.get(k) for k in want}
            if got != want:
                raise ConfigError(f"--reuse-reference {self.s.reuse}: its {p} path ran another experiment "
                                  f"({sorted(k for k in want if got[k] != want[k])} differ)")
            self.paths[p] = {**earlier.get(p, {}), "store": self.urls[p], "reused_from": self.s.reuse}

    def _compare(self, resumed: list[Resumed]) -> None:
        """Every resumed path (the protocol's and the checks') against the continuous path, state by state, and the
        cut checkpoint against the continuous path's history prefix."""
        s = self.s
        readers = {p: RunReader(p, url, self.opener) for p, url in (("continuous", self.urls["continuous"]),
                                                                     ("cut", self.urls["cut"]),
                                                                     *((r.name, r.url) for r in resumed))}
        cut_state = readers["cut"].state(s.cut)
        crashed = {r.name for r in resumed if "finished" in r.diffs}  # compared on the steps it committed
        for p in (*(r.name for r in resumed if r.name not in crashed), "continuous"):
            if s.steps not in readers[p].steps:
                raise VerificationIncomplete(f"path {p!r} committed no generation at step {s.steps} ({readers[p].url})")
        final = self._compare_steps(readers, cut_state, resumed)
        for name, diff in compare_cut(cut_state, final, s.cut, s.tolerance).items():
            self.diffs["cut"].setdefault(name, Diff()).merge(diff, s.cut)
        self.losses["continuous"], self.losses["cut"] = history_losses(final), history_losses(cut_state)
        self.meta = final["meta"]

    def _compare_steps(self, readers: dict[str, RunReader], cut_state: dict[str, Any],
                       resumed: list[Resumed]) -> dict[str, Any]:
        """Each continuous state read once and compared with every path that holds that step; the final state."""
        s, final = self.s, None
        into = {"cut": self.diffs["cut"], **{r.name: r.diffs for r in resumed}}
        steps = readers["continuous"].steps
        first_rng = None
        for i, step in enumerate(steps, 1):
            t0 = time.monotonic()
            ref = readers["continuous"].state(step)
            if first_rng is None:
                first_rng = {"ranks": ref.get("ranks")}
            others = {"cut": cut_state} if step == s.cut else {}
            others |= {r.name: readers[r.name].state(step) for r in resumed
                       if step > r.at and step in readers[r.name].steps}
            # A sharded run's model and optimizer are compared a group of entries at a time, each of the continuous
            # path's groups read once for every path (trainproof.proof.compare): memory is a group, not four states.
            for p, (diffs, distance) in compare_all(ref, others, s.tolerance, self.param_names).items():
                for name, diff in diffs.items():
                    into[p].setdefault(name, Diff()).merge(diff, step)
                if distance is not None and p in self.distances:
                    self.distances[p][step] = distance
                if step == s.steps and p in PATHS and p != "cut":
                    self.losses[p] = history_losses(others[p])
            if step == s.steps:
                final = ref
                self.drew = generators_drew(first_rng, ref) if first_rng is not None and step != steps[0] else {}
                self.task_state = bool(ref.get("task_state"))
            took = time.monotonic() - t0
            if others:  # a large state takes a while to read back: say where the comparison is (a toy one: debug)
                log.log(logging.INFO if took >= 1 else logging.DEBUG, "compared step %d (%d of %d) with %s: %.1f s",
                        step, i, len(steps), ", ".join(others), took)
        return final

    @property
    def passed(self) -> bool:
        """Resume and cut within tolerance, and the export's reload check passed unless it did not run (yet)."""
        return all(v is not False for k, v in self.verdicts().items() if k != "negative_divergence_detected")

    @property
    def negative_detected(self) -> bool:
        """The resume without RNG restore diverged, without a structural problem."""
        negative = self.diffs[NEGATIVE]
        return (bool(negative) and not any(d.problems for d in negative.values())
                and any(not d.within for d in negative.values()))

    def verdicts(self) -> dict[str, Any]:
        """The four paths' verdicts (false for anything not compared yet) and the export's (None before it ran)."""
        resume, cut = self.diffs["resume"], self.diffs["cut"]
        return {"positive": bool(resume) and all(d.within for d in resume.values()),
                "negative_divergence_detected": self.negative_detected,
                "cut_checkpoint_ok": bool(cut) and all(d.within for d in cut.values()),
                "export_reload_ok": None if self.export is None else bool(self.export["reload_check"]["passed"])}

    def failing(self) -> list[str]:
        """``path.check`` of every failed check (for the negative path: no divergence, or a structural problem),
        then the export's."""
        failing = [f"{p}.{n}" for p in ("cut", "resume") for n, d in self.diffs[p].items() if not d.within]
        negative = self.diffs[NEGATIVE]
        broken = [f"{NEGATIVE}.{n}" for n, d in negative.items() if d.problems]
        if negative and not broken and all(d.within for d in negative.values()):
            broken.append(f"{NEGATIVE}: did not diverge")
        exported = self.export is None or self.export["reload_check"]["passed"]
        return failing + broken + ([] if exported else ["export.reload_check"])

    def diagnosis(self) -> list[str]:
        return diagnose_path("resume", self.diffs["resume"], self.s.cut + 1, self.task_evidence.get("resume"))

    def sections(self) -> dict[str, Any]:
        """The negative control's summary, the parameter distances and the loss curves."""
        negative = self.diffs[NEGATIVE]
        params = negative.get("parameters")
        return {"negative": {"diverging_checks": [n for n, d in negative.items() if not d.within],
                             "max_parameter_diff": None if params is None else params.max_abs},
                "parameter_distance": {p: {str(k): v for k, v in d.items()} for p, d in self.distances.items()},
                "losses": self.losses}

    def checks(self) -> dict[str, dict[str, Diff]]:
        return self.diffs
