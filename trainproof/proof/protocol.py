"""``trainproof verify``: the four-path resume-equivalence protocol of docs/protocol.md, in fresh processes.

Layout under ``<store>/verification/<id>/`` (or ``--workdir``)::

    continuous/          N updates from the initial state (the reference trajectory)
    cut/                 k updates, then save and stop
    resume/              cut's step-k generation, copied through the store, then N-k more updates
    resume_without_rng/  the same copy, resumed with ``--omit-rng-restore`` (the negative control)
    world_equivalence/   with --world W > 1: one_rank, w_ranks, per_rank_mean (see trainproof.proof.world)
    cuts/                extra cuts (epoch boundary, middle of a later epoch): resume_at_<c> (and cut_at_<c>),
                         see trainproof.proof.cuts
    objective/           the objective-equivalence runs (see trainproof.proof.objective)
    verification.json    verdicts, every check's max |diff| and tolerance, commands, versions, export
    verification.png     loss curves and parameter distance to the continuous path (with matplotlib)

Each path is a ``python -m trainproof train`` process; every result is reloaded from the store through a fresh
``open_store`` on the path's URL. The resume paths get the cut's generation as a *copy committed through
the store* (write -> verify -> mark usable), so ``train`` needs no special option, and run with ``--steps``
(additional updates): a path that silently started over would end at step N-k, not N, and be caught.

Checkpoint cadence: with ``--checkpoint-every 1`` (the default) the continuous and resumed paths commit every
step, so the full state is compared at every step after the cut and the plot shows a per-step parameter
distance; the cut path saves only at the cut, as the protocol says. Note: that is also what keeps a save that
disturbs the run visible (a continuous path that saved at step k like the cut would share the disturbance).

The protocol owns the four paths and the comparison of every resumed path with the continuous one; everything else
it proves (the extra cuts, world-size and objective equivalence) is a :class:`trainproof.proof.check.Check` in
``Protocol.checks``, whose runs start in the phases they name, beside the four paths, and from which the verdicts,
``failing_checks``, the diagnosis and the report are derived (``Protocol._checks`` is the list).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from trainproof.errors import ConfigError
from trainproof.format.contract import PLAN_FILE
from trainproof.format.state import History
from trainproof.proof.check import AFTER, AGAIN, REFERENCE, RESUMED, Check, Job, Resumed, Skipped
from trainproof.proof.clipping import FRACTION as CLIP_FRACTION
from trainproof.proof.clipping import ClipCheck
from trainproof.proof.compare import Diff, compare_all, compare_cut
from trainproof.proof.cuts import CutsCheck, plan_cuts, resume_checks
from trainproof.proof.diagnose import diagnose_path
from trainproof.proof.exercised import generators_drew, not_exercised, path_exercised
from trainproof.proof.objective import ObjectiveCheck
from trainproof.proof.paths import (
    Opener,
    PathResult,
    RunReader,
    VerificationIncomplete,
    absolute_url,
    load_generation,
    read_run_plan,
    require_success,
    run_processes,
    seed_run,
)
from trainproof.proof.reload import export_and_check
from trainproof.proof.report import REPORT_FILE, build_report, environment, plot_png
from trainproof.proof.settings import ProtocolSettings, default_tolerance, train_argv
from trainproof.proof.verification import VerificationRunner
from trainproof.proof.world import WorldEquivalence
from trainproof.storage import GenerationStore
from trainproof.tasks import Task, load_task
from trainproof.train.config import load_task_config
from trainproof.train.data import epoch_plan

log = logging.getLogger("trainproof.verify")
PATHS = ("continuous", "cut", "resume", "resume_without_rng")
COMPARED = ("cut", "resume", "resume_without_rng")
NEGATIVE = "resume_without_rng"
REUSED = ("continuous", "cut", NEGATIVE)
"""The paths ``--reuse-reference`` takes from the earlier verification (they do not depend on the resume tested)."""


def verification_base(opener: Opener, store: str, workdir: str | None) -> GenerationStore:
    """``<store>/verification`` or the ``--workdir`` store: where ``<id>/`` folders live."""
    return opener(workdir) if workdir else opener(store).child("verification")


def parameter_names(task: Task) -> frozenset[str]:
    """The model's parameter names (the rest of its state_dict are buffers), built without allocating."""
    with torch.device("meta"):
        return frozenset(name for name, _ in task.build_model().named_parameters())


def history_losses(state: dict[str, Any]) -> list[float]:
    """Per-step training losses recorded in a state."""
    return History.from_state_dict(state["history"]).column("loss")


class Protocol(VerificationRunner):
    """The four paths, their comparison, the checks (:attr:`checks`), and the export of the resumed result."""

    prunes_evidence = True
    """A passed protocol's generations are removed unless ``--keep-evidence`` (trainproof.proof.verification)."""

    def __init__(self, settings: ProtocolSettings, opener: Opener) -> None:
        self.s, self.opener = settings, opener
        self.task = load_task(settings.task, load_task_config(settings.config) if settings.config else {})
        if settings.tolerance is None:  # exact where the paths are bitwise by construction (the CPU)
            settings = replace(settings, tolerance=default_tolerance(self.task, settings.device))
        self.s = settings
        self.param_names = parameter_names(self.task)
        base = verification_base(opener, settings.store, settings.workdir)
        self.root = base.child(settings.vid)
        self.urls = {p: f"{absolute_url(self.root)}/{p}" for p in PATHS}
        self.reference = base.child(settings.reuse) if settings.reuse else None
        if self.reference is not None:
            self.urls.update({p: f"{absolute_url(self.reference)}/{p}" for p in REUSED})
        self.paths: dict[str, dict[str, Any]] = {}
        self.diffs: dict[str, dict[str, Diff]] = {p: {} for p in COMPARED}
        self.losses: dict[str, list[float]] = {}
        self.distances: dict[str, dict[int, float]] = {p: {} for p in COMPARED}
        self.meta: dict[str, Any] = {}
        self.export: dict[str, Any] | None = None
        self.results: dict[str, PathResult] = {}
        """Every process's result by name (the four paths' and the checks'): what each exercised."""
        self.drew: dict[str, bool] = {}
        self.task_state = False
        self.restore_failed: set[str] = set()
        """The protocol's resumed paths whose own restore self-check failed (a failed comparison; not read back)."""
        steps_per_epoch = epoch_plan(self.task.num_samples(), self.task.batch_size, settings.world)["steps"]
        extra_cuts, steps, self.random_cut = plan_cuts(protocol_cut=settings.cut, steps=settings.steps,
                                                       steps_per_epoch=steps_per_epoch, chosen=settings.cuts,
                                                       seed=settings.seed)
        if steps != settings.steps:  # a later cut (or the default three epochs) needs a longer continuous path
            if settings.reuse and settings.cuts is not None:  # the reused reference ran the defaults, or fails below
                raise ConfigError(f"the cuts {extra_cuts} need {steps} continuous steps; the reused reference "
                                  f"has {settings.steps}")
            self.s = settings = replace(settings, steps=steps)
        self.checks: list[Check] = self._checks(extra_cuts, steps_per_epoch)
        """Everything proved besides the four paths, in the order of their verdicts in verification.json."""

    def _checks(self, extra_cuts: list[int], steps_per_epoch: int) -> list[Check]:
        """The verification's checks (trainproof.proof.check): adding one is adding it here."""
        s, root = self.s, absolute_url(self.root)
        checks: list[Check] = [CutsCheck(settings=s, extra=extra_cuts, steps_per_epoch=steps_per_epoch, root_url=root,
                                         continuous_url=self.urls["continuous"], opener=self.opener,
                                         resume_url=self.urls["resume"], random_cut=self.random_cut)]
        if self.task.grad_clip and not s.reuse:  # clipping made to bite on runs of its own (trainproof.proof.clipping)
            checks.append(ClipCheck(settings=s, grad_clip=float(self.task.grad_clip), root_url=root,
                                    opener=self.opener, param_names=self.param_names, needed=self._clipping_missed))
        if s.world > 1:
            checks.append(WorldEquivalence(world=s.world, root_url=f"{root}/world_equivalence", seed=s.seed,
                                           device=s.device, store_args=s.store_args, opener=self.opener, fsdp=s.fsdp))
        if s.reuse or not s.objective:  # a reused reference's verification checked the objective already
            checks.append(Skipped("objective_equivalence", "reused reference" if s.reuse else "--no-objective-check"))
        else:
            checks.append(ObjectiveCheck(
                task=self.task, task_name=s.task, config=None if s.config is None else str(s.config), seed=s.seed,
                device=s.device, world=s.world, root_url=f"{root}/objective", store_args=s.store_args,
                opener=self.opener, fsdp=s.fsdp))
        return checks

    def _clipping_missed(self) -> float | None:
        """When no resumed path of the protocol clipped: a threshold that bites on the clipping check's runs, a
        fraction of the smallest gradient norm the continuous path measured; else None (trainproof.proof.clipping)."""
        resumed = [r for name, r in self.results.items() if name == "resume" or name.startswith("resume_at_")]
        if any(((path_exercised(r) or {}).get("clipping") or {}).get("active_steps") for r in resumed):
            return None
        norms = [float(e["grad_norm"]) for e in self.results["continuous"].events
                 if e.get("event") == "step" and isinstance(e.get("grad_norm"), (int, float))
                 and 0 < e["grad_norm"] < float("inf")] if "continuous" in self.results else []
        return CLIP_FRACTION * min(norms) if norms else None

    def run(self) -> None:
        """Run and compare every path and every check's runs; export when the comparisons passed.
        Raises VerificationIncomplete."""
        log.info("verification %s under %s", self.s.vid, absolute_url(self.root))
        self._timed("continuous and cut paths", lambda: self._phase(REFERENCE))
        self._timed("resumed paths", lambda: self._phase(RESUMED))
        self._timed("resumes of resumes (and the clipping check's runs)", lambda: self._phase(AGAIN),
                    unless_idle=True)
        self._timed("comparison (read back from the store)", self._compare)
        self._timed("checks' runs after the comparison", lambda: self._phase(AFTER), unless_idle=True)
        if self.s.export and self.comparisons_passed():
            self._timed("export and fresh-process reload check", self._export)

    @staticmethod
    def _timed(what: str, step: Callable[[], int | None], *, unless_idle: bool = False) -> None:
        """Run ``step`` and log how long it took (``unless_idle``: not when it says it started no process)."""
        t0 = time.monotonic()
        if step() != 0 or not unless_idle:
            log.info("%s: %.1f s", what, time.monotonic() - t0)

    def after_pass(self) -> None:
        """Nothing: what a passed protocol allows (pruning its evidence) is the tail's
        (trainproof.proof.verification)."""

    # -- the paths ------------------------------------------------------------------------------------
    def _phase(self, phase: str) -> int:
        """Start the protocol's paths and every check's runs of ``phase`` together; hand each its results.
        Returns how many processes ran."""
        with tempfile.TemporaryDirectory(prefix="trainproof-verify-") as tmp:
            own = self._jobs(phase)
            theirs = [(check, check.jobs(phase, Path(tmp))) for check in self.checks]
            jobs = own + [job for _, listed in theirs for job in listed]
            if len({name for name, _, _ in jobs}) != len(jobs):
                raise RuntimeError(f"two runs of the {phase} phase share a name: {[name for name, _, _ in jobs]}")
            results = run_processes(jobs, timeout=self.s.timeout, parallel=self.s.parallel) if jobs else []
        done = {r.name: r for r in results}
        self.results.update(done)
        mine = [done[name] for name, _, _ in own]
        self.paths.update({r.name: r.to_json() for r in mine})
        for check, listed in theirs:  # every run's entry first: a crash below still leaves them all in the report
            check.record(phase, [done[name] for name, _, _ in listed])
        self._collect(phase, mine)
        for check, listed in theirs:
            check.compare(phase, [done[name] for name, _, _ in listed])
        return len(jobs)

    def argv(self, path: str) -> list[str]:
        """The command line of one of the four paths."""
        s = self.s
        steps = {"continuous": s.steps, "cut": s.cut}.get(path, s.steps - s.cut)  # resumes: additional steps
        return train_argv(s, self.urls[path], steps=steps, every=0 if path == "cut" else s.checkpoint_every,
                          resume=path not in ("continuous", "cut"), negative=path == NEGATIVE)

    def _jobs(self, phase: str) -> list[Job]:
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

    def _collect(self, phase: str, results: list[PathResult]) -> None:
        """The four paths' results: each must have succeeded, each resume from the cut as intended (or failed its
        own restore self-check: a failed comparison, ``rng_restore``)."""
        if phase == REFERENCE:
            require_success(results)
        elif phase == RESUMED:
            checked = resume_checks(results, {r.name: self.s.cut for r in results}, negative=NEGATIVE)
            for name, diff in checked.items():
                self.diffs[name]["rng_restore"] = diff
            self.restore_failed = {name for name, diff in checked.items() if not diff.within}

    # -- reference reuse -------------------------------------------------------------------------------
    def _adopt_reference(self) -> None:
        """Reuse an earlier verification's continuous, cut and negative-control paths: same task, settings and seed,
        or refuse."""
        want = {"task": self.s.task, "task_config": self.task.config(), "seed": self.s.seed}
        earlier = self._earlier_paths()
        for p in REUSED:
            plan = read_run_plan(self.opener(self.urls[p]))
            got = {k: plan.get(k) for k in want}
            if got != want:
                raise ConfigError(f"--reuse-reference {self.s.reuse}: its {p} path ran another experiment "
                                  f"({sorted(k for k in want if got[k] != want[k])} differ)")
            self.paths[p] = {**earlier.get(p, {}), "store": self.urls[p], "reused_from": self.s.reuse}

    def _earlier_paths(self) -> dict[str, Any]:
        """The reused verification's path entries (its commands), when its report was uploaded."""
        try:
            report = json.loads(self.reference.read_file(REPORT_FILE))
        except (FileNotFoundError, ValueError):
            return {}
        return report.get("paths", {}) if isinstance(report, dict) else {}

    # -- comparison ---------------------------------------------------------------------------------------
    def _compare(self) -> None:
        """Every resumed path (the protocol's and the checks') against the continuous path, state by state, and the
        cut checkpoint against the continuous path's history prefix."""
        s = self.s
        resumed = [Resumed(p, self.urls[p], s.cut, self.diffs[p]) for p in ("resume", NEGATIVE)
                   if p not in self.restore_failed]
        resumed += [r for check in self.checks for r in check.resumed()]
        readers = {p: RunReader(p, url, self.opener) for p, url in (("continuous", self.urls["continuous"]),
                                                                     ("cut", self.urls["cut"]),
                                                                     *((r.name, r.url) for r in resumed))}
        cut_state = readers["cut"].state(s.cut)
        for p in (*(r.name for r in resumed), "continuous"):
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

    def _verdicts_of_paths(self) -> dict[str, bool]:
        """The four paths' verdicts (false for anything not compared yet)."""
        resume, cut, negative = (self.diffs[p] for p in ("resume", "cut", NEGATIVE))
        positive = bool(resume) and all(d.within for d in resume.values())
        cut_ok = bool(cut) and all(d.within for d in cut.values())
        diverged = (bool(negative) and not any(d.problems for d in negative.values())
                    and any(not d.within for d in negative.values()))
        return {"positive": positive, "negative_divergence_detected": diverged, "cut_checkpoint_ok": cut_ok}

    def comparisons_passed(self) -> bool:
        """Resume and cut within tolerance, the negative path diverged, and every check passed (its negative control,
        if it has one, detected)."""
        return all(self._verdicts_of_paths().values()) and all(check.ok() for check in self.checks)

    def verdicts(self) -> dict[str, Any]:
        """The verdicts of verification.json (false for anything not compared yet): the four paths', the export's,
        then each check's own keys."""
        export_ok = None if self.export is None else bool(self.export["reload_check"]["passed"])
        exported = export_ok is True or not self.s.export
        return {"all_checks_passed": self.comparisons_passed() and exported, **self._verdicts_of_paths(),
                "export_reload_ok": export_ok, **{k: v for check in self.checks for k, v in check.verdicts().items()}}

    def failing_checks(self) -> list[str]:
        """``path.check`` of every failed check (for the negative path: no divergence, or a structural problem),
        then the export's, then each check's (trainproof.proof.check)."""
        failing = [f"{p}.{n}" for p in ("cut", "resume") for n, d in self.diffs[p].items() if not d.within]
        negative = self.diffs[NEGATIVE]
        broken = [f"{NEGATIVE}.{n}" for n, d in negative.items() if d.problems]
        if negative and not broken and all(d.within for d in negative.values()):
            broken.append(f"{NEGATIVE}: did not diverge")
        failing += broken
        if self.export is not None and not self.export["reload_check"]["passed"]:
            failing.append("export.reload_check")
        return failing + [name for check in self.checks for name in check.failing()]

    def diagnosis(self) -> list[str]:
        """Likely causes of the failed checks (trainproof.proof.diagnose, and each check's own), for the reader."""
        out = diagnose_path("resume", self.diffs["resume"], self.s.cut + 1)
        return out + [line for check in self.checks for line in check.diagnosis()]

    # -- export -----------------------------------------------------------------------------------------
    def _export(self) -> None:
        self.export = export_and_check(self.opener(self.urls["resume"]), step=self.s.steps, task=self.s.task,
                                       store_args=self.s.store_args, timeout=self.s.timeout).to_json()

    # -- report -----------------------------------------------------------------------------------------
    def report(self, error: str | None = None) -> dict[str, Any]:
        """verification.json (partial, with ``error`` and every verdict false, when it could not complete)."""
        verdicts = self.verdicts()
        if error is not None:
            verdicts = {k: False if isinstance(v, bool) else v for k, v in verdicts.items()}
        negative = self.diffs[NEGATIVE]
        params = negative.get("parameters")
        extra = {"negative": {"diverging_checks": [n for n, d in negative.items() if not d.within],
                              "max_parameter_diff": None if params is None else params.max_abs},
                 "parameter_distance": {p: {str(k): v for k, v in d.items()} for p, d in self.distances.items()},
                 "losses": self.losses}
        for check in self.checks:
            extra.update(check.sections())
        extra["diagnosis"] = self.diagnosis()
        diffs = {**self.diffs, **{p: d for check in self.checks for p, d in check.checks().items()}}
        exercised = {name: e for name, r in self.results.items() if (e := path_exercised(r)) is not None}
        resumed = ["resume", *(r.name for check in self.checks for r in check.resumed())]
        missing = not_exercised(grad_clip=self.task.grad_clip, exercised=exercised, resumed=resumed, drew=self.drew,
                                task_state=self.task_state, cut=self.s.cut) if self.meta else []
        covered = {what: how for check in self.checks for what, how in check.covers().items()}
        for item in missing:  # what a check made active on runs of its own (trainproof.proof.clipping)
            if item["what"] in covered:
                item["covered_by"] = covered[item["what"]]
        extra |= {"exercised": exercised, "generators_drew": self.drew, "not_exercised": missing}
        report = build_report(
            kind="protocol", vid=self.s.vid, location=absolute_url(self.root), store=self.s.store, verdicts=verdicts,
            failing=self.failing_checks(), settings=self.s.to_json(), paths=self.paths, diffs=diffs,
            tol=self.s.tolerance, step_recovered=self.s.cut, env=environment(self.task, self.meta),
            export=self.export, extra=extra, error=error)
        vacuous = {m["check"] for m in missing if m["check"] in ("grad_scaler", "task_state")}
        for path, rows in report["checks"].items():
            for row in rows:
                if row["name"] in vacuous and path != "cut":
                    row["exercised"] = False  # compared, but nothing on this path could have differed
        return report

    def plot(self) -> bytes | None:
        """The PNG of loss curves and parameter distances (None without matplotlib or before the comparison)."""
        if not self.losses:
            return None
        return plot_png(self.losses, self.distances, f"{self.s.task}: {self.s.steps} steps, cut at {self.s.cut}")
