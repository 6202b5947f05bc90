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
``open_store`` on the path's URL.

The protocol runs the phases of :data:`trainproof.proof.check.PHASES`, folding over its list of checks (``_checks``, the
four paths first: :mod:`trainproof.proof.four_paths`), and derives the verdicts and the report from it.
"""

from __future__ import annotations

import logging
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from trainproof.errors import ConfigError
from trainproof.proof.budget import Plan, check_budget, plan_sizes, state_bytes
from trainproof.proof.check import AFTER, AGAIN, COMPARE, PHASES, REFERENCE, RESUMED, Check, Results, Skipped
from trainproof.proof.clipping import ClipCheck
from trainproof.proof.cuts import CutsCheck, again_step, plan_cuts
from trainproof.proof.exercised import not_exercised, path_exercised
from trainproof.proof.export_compare import ExportComparison
from trainproof.proof.four_paths import FourPaths
from trainproof.proof.live import NAME as LIVE
from trainproof.proof.live import LiveVsRestored
from trainproof.proof.objective import ObjectiveCheck
from trainproof.proof.objective import not_applicable as objective_not_applicable
from trainproof.proof.paths import Opener, absolute_url, run_processes
from trainproof.proof.report import build_report, environment, plot_png
from trainproof.proof.schedule_fit import declared_schedule, fit_to_schedule
from trainproof.proof.settings import ProtocolSettings, default_tolerance
from trainproof.proof.verification import VerificationRunner
from trainproof.proof.workers import WorkerCounts
from trainproof.proof.world import WorldEquivalence
from trainproof.proof.world_change import WorldChange
from trainproof.storage import GenerationStore
from trainproof.tasks import Task, load_task
from trainproof.tasks.base import first_samples
from trainproof.train.config import load_task_config
from trainproof.train.data import epoch_plan

log = logging.getLogger("trainproof.verify")
LOGGED = {REFERENCE: "continuous and cut paths", RESUMED: "resumed paths", AFTER: "checks' runs after the comparison",
          AGAIN: "resumes of resumes (and the clipping check's runs)", COMPARE: "comparison (read back from the store)"}
"""Each phase's time is logged as (``again``, ``after`` only when they started a process; the export by FourPaths)."""


def verification_base(opener: Opener, store: str, workdir: str | None) -> GenerationStore:
    """``<store>/verification`` or the ``--workdir`` store: where ``<id>/`` folders live."""
    return opener(workdir) if workdir else opener(store).child("verification")


def parameter_names(task: Task) -> tuple[frozenset[str], tuple[int, int]]:
    """The model's parameter names (the rest of its state_dict are buffers), a generation's estimated size and the
    bytes of its frozen parameters (trainproof.proof.budget.state_bytes), built without allocating."""
    with torch.device("meta"):
        model = task.build_model()
    return frozenset(name for name, _ in model.named_parameters()), state_bytes(model)


class Protocol(VerificationRunner):
    """The phases, folded over the checks (:attr:`checks`, the four paths first), and the report derived from them."""

    prunes_evidence = True
    """A passed protocol's generations are removed unless ``--keep-evidence`` (trainproof.proof.verification)."""

    def __init__(self, settings: ProtocolSettings, opener: Opener) -> None:
        self.s, self.opener = settings, opener
        self.task = load_task(settings.task, load_task_config(settings.config) if settings.config else {})
        settings = self._on_subset(settings)
        if settings.tolerance is None:  # exact where the paths are bitwise by construction (the CPU)
            settings = replace(settings, tolerance=default_tolerance(self.task, settings.device))
        self.s = settings
        self.param_names, self.sizes = parameter_names(self.task)
        base = verification_base(opener, settings.store, settings.workdir)
        self.root = base.child(settings.vid)
        self.done = Results()
        steps_per_epoch = epoch_plan(self.task.num_samples(), self.task.batch_size, settings.world)["steps"]
        extra_cuts, steps, self.random_cut = plan_cuts(protocol_cut=settings.cut, steps=settings.steps,
                                                       steps_per_epoch=steps_per_epoch, chosen=settings.cuts,
                                                       seed=settings.seed)
        if steps != settings.steps:  # a later cut (or the default three epochs) needs a longer continuous path
            if settings.reuse and settings.cuts is not None:  # the reused reference ran the defaults, or fails below
                raise ConfigError(f"the cuts {extra_cuts} need {steps} continuous steps; the reused reference "
                                  f"has {settings.steps}")
            self.s = settings = replace(settings, steps=steps)
        if not settings.reuse:  # a reused reference's paths are not trained again
            self.plan = Plan.of(steps=steps, cut=settings.cut, extra_cuts=extra_cuts, steps_per_epoch=steps_per_epoch,
                                every=settings.checkpoint_every,
                                **plan_sizes(*self.sizes, sharded=settings.fsdp or bool(self.task.fsdp)))
            log.info("%s", self.plan.line())
            check_budget(self.plan, max_steps=settings.budget_steps, max_gib=settings.budget_gib,
                         cuts_given=settings.cuts is not None, samples=self.task.num_samples(),
                         global_batch=self.task.batch_size * settings.world)
        if not settings.reuse:  # every cut: the continuous path records its live state there (trainproof.proof.live)
            again = again_step(settings) if settings.cuts is None else None
            self.s = settings = replace(settings, live_at=tuple(sorted({settings.cut, *extra_cuts,
                                                                        *([again] if again else [])})))
        self.four = FourPaths(settings=settings, opener=opener, task=self.task, param_names=self.param_names,
                              root=self.root, reference=base.child(settings.reuse) if settings.reuse else None)
        """The four paths: the first check, whose paths, export and environment the report's envelope holds."""
        self.workers = WorkerCounts(builds_batches=self.task.builds_batches, task_workers=self.task.num_workers)
        """Gives the resumed paths other data worker counts than the continuous path (trainproof.proof.workers)."""
        self.checks: list[Check] = self._checks(extra_cuts, steps_per_epoch) + self._varied()
        """Everything proved, the four paths first, in the order of their verdicts in verification.json."""

    def _on_subset(self, settings: ProtocolSettings) -> ProtocolSettings:
        """The settings with the samples every path trains on (``--samples``, else the task's ``verify_samples``; 0
        or the whole dataset: None; fewer when the task's schedule is shorter than the plan: trainproof.proof.
        schedule_fit), and :attr:`task` restricted to them, so the epoch plan below is the paths'."""
        total = self.task.num_samples()
        samples = settings.samples if settings.samples is not None else self.task.verify_samples
        settings = self._within_schedule(settings, samples or total)
        samples = settings.samples if settings.samples is not None else samples
        if not samples or samples == total:
            return replace(settings, samples=None)
        self.task = first_samples(self.task, samples)
        log.info("every path trains on the first %d of the task's %d samples", samples, total)
        return replace(settings, samples=samples)

    def _within_schedule(self, settings: ProtocolSettings, samples: int) -> ProtocolSettings:
        """The settings with steps, cut and samples within the task's schedule when it has an end (OneCycleLR)."""
        length, what = declared_schedule(self.task)
        if length is None:
            return settings
        fit = fit_to_schedule(length=length, what=what, steps=settings.steps, cut=settings.cut, cuts=settings.cuts,
                              samples=samples, global_batch=self.task.batch_size * settings.world, seed=settings.seed,
                              fixed=settings.fixed)
        if fit.why is None:
            return settings
        return replace(settings, steps=fit.steps, cut=fit.cut, samples=fit.samples, fitted=fit.why)

    def _checks(self, extra_cuts: list[int], steps_per_epoch: int) -> list[Check]:
        """The verification's checks (trainproof.proof.check): adding one is adding it here."""
        s, root, urls = self.s, absolute_url(self.root), self.four.urls
        checks: list[Check] = [self.four, CutsCheck(
            settings=s, extra=extra_cuts, steps_per_epoch=steps_per_epoch, root_url=root,
            continuous_url=urls["continuous"], opener=self.opener, resume_url=urls["resume"],
            random_cut=self.random_cut)]
        checks.append(LiveVsRestored(steps=s.live_at) if s.live_at else
                      Skipped(LIVE, "reused reference: its continuous path's live state was not recorded"))
        if self.task.grad_clip and not s.reuse:  # clipping made to bite on runs of its own (trainproof.proof.clipping)
            checks.append(ClipCheck(settings=s, grad_clip=float(self.task.grad_clip), root_url=root,
                                    opener=self.opener, param_names=self.param_names))
        if s.world > 1:
            checks.append(WorldEquivalence(world=s.world, root_url=f"{root}/world_equivalence", seed=s.seed,
                                           device=s.device, store_args=s.store_args, opener=self.opener, fsdp=s.fsdp))
        if s.reuse or not s.objective:  # a reused reference's verification checked the objective already
            checks.append(Skipped("objective_equivalence", "reused reference" if s.reuse else "--no-objective-check"))
        elif (inapplicable := objective_not_applicable(self.task, s.world)) is not None:  # BatchNorm, mixup
            checks.append(inapplicable)
        else:
            checks.append(ObjectiveCheck(
                task=self.task, task_name=s.task, config=None if s.config is None else str(s.config), seed=s.seed,
                device=s.device, world=s.world, root_url=f"{root}/objective", store_args=s.store_args,
                opener=self.opener, fsdp=s.fsdp))
        return checks

    def _varied(self) -> list[Check]:
        """What must not matter, varied (the data workers, the world size), and what a user gets, compared (the
        exports): after the other checks, so that the exports are compared once the four paths made theirs."""
        root = absolute_url(self.root)
        return [self.workers, WorldChange(settings=self.s, four=self.four, root_url=root, opener=self.opener),
                ExportComparison(four=self.four, root_url=root, opener=self.opener, steps=self.s.steps,
                                 task=self.s.task, tolerance=self.s.tolerance)]

    def run(self) -> None:
        """Every phase in order (:data:`trainproof.proof.check.PHASES`). Raises VerificationIncomplete."""
        log.info("verification %s under %s", self.s.vid, absolute_url(self.root))
        for phase in PHASES:
            t0 = time.monotonic()
            if self._phase(phase) or phase in (REFERENCE, RESUMED, COMPARE):
                log.info("%s: %.1f s", LOGGED[phase], time.monotonic() - t0)

    def after_pass(self) -> None:
        """Nothing: pruning a passed protocol's evidence is the tail's (trainproof.proof.verification)."""

    def _phase(self, phase: str) -> int:
        """Every check's runs of ``phase`` started together, handed to it with the results so far; how many ran."""
        with tempfile.TemporaryDirectory(prefix="trainproof-verify-") as tmp:
            listed = [(check, self.workers.vary(check.jobs(phase, Path(tmp), self.done))) for check in self.checks]
            jobs = [job for _, mine in listed for job in mine]
            if len({name for name, _, _ in jobs}) != len(jobs):
                raise RuntimeError(f"two runs of the {phase} phase share a name: {[name for name, _, _ in jobs]}")
            results = run_processes(jobs, timeout=self.s.timeout, parallel=self.s.parallel) if jobs else []
        self.done.runs.update({r.name: r for r in results})
        for check, mine in listed:  # every run's entry first: a crash below still leaves them all in the report
            check.record(phase, [self.done.runs[name] for name, _, _ in mine])
        for check, mine in listed:
            check.compare(phase, [self.done.runs[name] for name, _, _ in mine], self.done)
        self.done.resumed = [r for check in self.checks for r in check.resumed()]
        self.done.passed = self.comparisons_passed()
        return len(jobs)

    def comparisons_passed(self) -> bool:
        """Every check passed, its negative control (if any) detected: the four paths' too, and their export's."""
        return all(check.ok() for check in self.checks)

    def verdicts(self) -> dict[str, Any]:
        """The verdicts of verification.json (false for anything not compared yet): ``all_checks_passed``, then each
        check's own keys (the four paths' and the export's first)."""
        return {"all_checks_passed": self.comparisons_passed(),
                **{k: v for check in self.checks for k, v in check.verdicts().items()}}

    def failing_checks(self) -> list[str]:
        """Each check's failed checks (trainproof.proof.check), the four paths' and the export's first."""
        return [name for check in self.checks for name in check.failing()]

    def diagnosis(self) -> list[str]:
        """Likely causes of the failed checks (each check's own), for the reader."""
        return [line for check in self.checks for line in check.diagnosis()]

    def report(self, error: str | None = None) -> dict[str, Any]:
        """verification.json (partial, with ``error`` and every verdict None, when it could not complete)."""
        four = self.four
        extra: dict[str, Any] = {k: v for check in self.checks for k, v in check.sections().items()}
        extra["diagnosis"] = self.diagnosis()
        extra["findings"] = [finding for check in self.checks for finding in check.findings()]
        diffs = {p: d for check in self.checks for p, d in check.checks().items()}
        exercised = {name: e for name, r in self.done.runs.items() if (e := path_exercised(r)) is not None}
        resumed = [r.name for r in self.done.resumed if not r.negative]
        missing = not_exercised(grad_clip=self.task.grad_clip, exercised=exercised, resumed=resumed, drew=four.drew,
                                task_state=four.task_state, cut=self.s.cut) if four.meta else []
        covered = {what: how for check in self.checks for what, how in check.covers().items()}
        for item in missing:  # what a check made active on runs of its own (trainproof.proof.clipping)
            if item["what"] in covered:
                item["covered_by"] = covered[item["what"]]
        extra |= {"exercised": exercised, "generators_drew": four.drew, "not_exercised": missing}
        report = build_report(
            kind="protocol", vid=self.s.vid, location=absolute_url(self.root), store=self.s.store, diffs=diffs,
            verdicts=self.verdicts(), failing=self.failing_checks(), settings=self.s.to_json(), paths=four.paths,
            tol=self.s.tolerance, step_recovered=self.s.cut, env=environment(self.task, four.meta),
            export=four.export, extra=extra, error=error)
        vacuous = {m["check"] for m in missing if m["check"] in ("grad_scaler", "task_state")}
        for path, rows in report["checks"].items():
            for row in rows:
                if row["name"] in vacuous and path != "cut":
                    row["exercised"] = False  # compared, but nothing on this path could have differed
        return report

    def plot(self) -> bytes | None:
        """The PNG of loss curves and parameter distances (None without matplotlib or before the comparison)."""
        if not self.four.losses:
            return None
        return plot_png(self.four.losses, self.four.distances,
                        f"{self.s.task}: {self.s.steps} steps, cut at {self.s.cut}")
