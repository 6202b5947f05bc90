"""``trainproof verify``: the four-path resume-equivalence protocol of docs/protocol.md, in fresh processes.

Layout under ``<store>/verification/<id>/`` (or ``--workdir``)::

    continuous/          N updates from the initial state (the reference trajectory)
    cut/                 k updates, then save and stop
    resume/              cut's step-k generation, copied through the store, then N-k more updates
    resume_without_rng/  the same copy, resumed with ``--omit-rng-restore`` (the negative control)
    world_equivalence/   with --world W > 1: one_rank, w_ranks, per_rank_mean (see job.proof.world)
    cuts/                extra cuts (epoch boundary, middle of a later epoch): resume_at_<c> (and cut_at_<c>),
                         see job.proof.cuts
    objective/           the objective-equivalence runs (see job.proof.objective)
    verification.json    verdicts, every check's max |diff| and tolerance, commands, versions, export
    verification.png     loss curves and parameter distance to the continuous path (with matplotlib)

Each path is a ``python -m job train`` process; every result is reloaded from the store through a fresh
``open_store`` on the path's URL. The resume paths get the cut's generation as a *copy committed through
the store* (write -> verify -> mark usable), so ``train`` needs no special option, and run with ``--steps``
(additional updates): a path that silently started over would end at step N-k, not N, and be caught.

Checkpoint cadence: with ``--checkpoint-every 1`` (the default) the continuous and resumed paths commit every
step, so the full state is compared at every step after the cut and the plot shows a per-step parameter
distance; the cut path saves only at the cut, as the protocol says. Note: that is also what keeps a save that
disturbs the run visible (a continuous path that saved at step k like the cut would share the disturbance).
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import torch

from job.proof.compare import Diff, Tolerance, compare_all, compare_cut
from job.proof.cuts import plan_cuts
from job.proof.diagnose import diagnose_path
from job.proof.objective import ObjectiveCheck
from job.train.data import epoch_plan
from job.train.config import load_task_config
from job.format.contract import PLAN_FILE
from job.errors import ConfigError
from job.format.state import History
from job.tasks import Task, load_task
from job.proof.reload import export_and_check
from job.proof.paths import (Opener, RunReader, VerificationIncomplete, absolute_url, job_argv,
                             load_generation, new_id, read_run_plan, require_success, run_processes, seed_run)
from job.proof.report import REPORT_FILE, build_report, environment, plot_png
from job.proof.world import WorldEquivalence
from storage import GenerationStore

log = logging.getLogger("trainproof.verify")
PATHS = ("continuous", "cut", "resume", "resume_without_rng")
COMPARED = ("cut", "resume", "resume_without_rng")
NEGATIVE = "resume_without_rng"
REUSED = ("continuous", "cut", NEGATIVE)
"""The paths ``--reuse-reference`` takes from the earlier verification (they do not depend on the resume tested)."""
DEFAULT_SCHEDULE = {"regression": (10, 5), "tinylm": (8, 3)}
"""(steps, cut) per built-in task: regression is the fixture of docs/protocol.md (the cut mid-epoch at cursor 20 of 24,
10 updates crossing into a second epoch); tinylm's default corpus has 5 steps an epoch, so a cut at 3 is
mid-epoch and 8 updates cross into the second epoch."""


@dataclass(kw_only=True)
class ProtocolSettings:
    """One ``verify`` invocation (protocol mode). Validation raises ConfigError (exit 2)."""

    store: str
    """The run location; the verification writes under ``<store>/verification/<id>/``."""
    task: str = "regression"
    config: Path | None = None
    """Task settings file, passed to every path as ``--config``."""
    steps: int = 10
    cut: int = 5
    seed: int = 1234
    tolerance: Tolerance = field(default_factory=Tolerance)
    device: str = "auto"
    checkpoint_every: int = 1
    """Commit cadence of the continuous and resumed paths (0: only their final state)."""
    workdir: str | None = None
    """Where ``<id>/`` goes instead of ``<store>/verification``."""
    vid: str = field(default_factory=new_id)
    reuse: str | None = None
    """Id of an earlier verification whose continuous, cut and negative-control paths are reused (read back,
    re-checked): a verification of another resume of the same experiment runs only its resumed paths."""
    timeout: float = 7200.0
    """Seconds each process may run."""
    parallel: bool = True
    """Run independent paths concurrently (each uses the task's own thread count)."""
    store_args: list[str] = field(default_factory=list)
    """``--endpoint-url`` / ``--region`` / ``--path-style`` as given to verify, passed on to every process."""
    export: bool = True
    world: int = 1
    """Ranks of every path (> 1: ``train --nproc-per-node W``, gloo on the CPU), plus the world-size equivalence."""
    fsdp: bool = False
    """Every path trains sharded (``train --fsdp``); their states are read whole from the shards (job.train.fsdp)."""
    cuts: list[int] | None = None
    """Every cut to resume at (``--cuts``); None: the protocol's cut, the epoch boundary and the middle of epoch 1
    (job.proof.cuts). Recorded in verification.json's ``cuts`` block, not in ``settings``."""
    objective: bool = True
    """Run the objective-equivalence check (job.proof.objective); skipped when reusing a reference."""

    def __post_init__(self) -> None:
        if not 1 <= self.cut < self.steps:
            raise ConfigError(f"need 1 <= --cut < --steps (got cut {self.cut}, steps {self.steps})")
        if self.checkpoint_every < 0 or self.timeout <= 0:
            raise ConfigError("--checkpoint-every must be >= 0 and --timeout > 0")
        if self.world < 1:
            raise ConfigError(f"--world must be >= 1 (got {self.world})")
        if urlparse(self.store).scheme == "memory" or (self.workdir or "").startswith("memory:"):
            raise ConfigError("verify runs every path as a separate process: memory:// stores are private to "
                              "one process; use a folder or s3://")

    def to_json(self) -> dict[str, Any]:
        """The settings block of verification.json."""
        return {"task": self.task, "config": None if self.config is None else str(self.config), "steps": self.steps,
                "cut": self.cut, "seed": self.seed, "atol": self.tolerance.atol, "rtol": self.tolerance.rtol,
                "device": self.device, "checkpoint_every": self.checkpoint_every, "reused_reference": self.reuse,
                "world": self.world, "fsdp": self.fsdp, "objective_check": self.objective}


def default_schedule(task: str) -> tuple[int, int]:
    """(steps, cut) for ``task`` when the command line does not say."""
    return DEFAULT_SCHEDULE.get(task, (10, 5))


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


class Protocol:
    """The four paths, their comparison, and the export of the resumed result."""

    def __init__(self, settings: ProtocolSettings, opener: Opener) -> None:
        self.s, self.opener = settings, opener
        self.task = load_task(settings.task, load_task_config(settings.config) if settings.config else {})
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
        self.world_check: WorldEquivalence | None = None
        self.steps_per_epoch = epoch_plan(self.task.num_samples(), self.task.batch_size, settings.world)["steps"]
        self.extra_cuts, steps = plan_cuts(protocol_cut=settings.cut, steps=settings.steps,
                                           steps_per_epoch=self.steps_per_epoch, chosen=settings.cuts)
        if steps != settings.steps:  # a later cut needs a longer continuous path
            if settings.reuse:
                raise ConfigError(f"the cuts {self.extra_cuts} need {steps} continuous steps; the reused reference "
                                  f"has {settings.steps}")
            self.s = settings = replace(settings, steps=steps)
        self.cut_urls = {name: f"{absolute_url(self.root)}/cuts/{name}"
                         for c in self.extra_cuts for name in (f"resume_at_{c}", f"cut_at_{c}")}
        self.cut_paths: dict[str, dict[str, Any]] = {}
        self.diffs.update({f"resume_at_{c}": {} for c in self.extra_cuts})
        self.restore_failures: dict[str, dict[str, Any]] = {}
        self.objective = None if (settings.reuse or not settings.objective) else ObjectiveCheck(
            task=self.task, task_name=settings.task, config=None if settings.config is None else str(settings.config),
            seed=settings.seed, device=settings.device, world=settings.world,
            root_url=f"{absolute_url(self.root)}/objective", store_args=settings.store_args, fsdp=settings.fsdp)

    def run(self) -> None:
        """Run and compare every path; export when the comparisons passed. Raises VerificationIncomplete."""
        log.info("verification %s under %s", self.s.vid, absolute_url(self.root))
        for what, phase in (("continuous and cut paths", self._reference), ("resumed paths", self._resumes),
                            ("comparison (read back from the store)", self._compare)):
            t0 = time.monotonic()
            phase()
            log.info("%s: %.1f s", what, time.monotonic() - t0)
        if self.s.world > 1:
            t0 = time.monotonic()
            self._world_equivalence()
            log.info("world-size equivalence (%d ranks vs 1): %.1f s", self.s.world, time.monotonic() - t0)
        if self.s.export and self.comparisons_passed():
            t0 = time.monotonic()
            self._export()
            log.info("export and fresh-process reload check: %.1f s", time.monotonic() - t0)

    # -- the paths ------------------------------------------------------------------------------------
    def train_argv(self, path: str) -> list[str]:
        """The command line of one path."""
        s = self.s
        every = 0 if path == "cut" else s.checkpoint_every
        steps = {"continuous": s.steps, "cut": s.cut}.get(path, s.steps - s.cut)  # resumes: additional steps
        args = ["--task", s.task, *(["--config", str(s.config)] if s.config else []), "--seed", str(s.seed),
                "--steps", str(steps), "--checkpoint-every", str(every), "--checkpoint-every-seconds", "0",
                "--keep", "0", "--resume", "never" if path in ("continuous", "cut") else "auto",
                "--device", s.device, "--log-format", "json", *s.store_args]
        if s.world > 1:
            args = ["--nproc-per-node", str(s.world), *args]
        args += ["--fsdp"] if s.fsdp else []
        negative = ["--omit-rng-restore"] if path == NEGATIVE else []
        return job_argv("train", "--store", self.urls[path], *args, *negative)

    def _reference(self) -> None:
        """The continuous and cut paths, the extra cuts' own cut processes and the objective runs, concurrently."""
        jobs = [] if self.s.reuse else [(n, self.urls[n], self.train_argv(n)) for n in ("continuous", "cut")]
        if self.s.reuse:
            self._adopt_reference()
        jobs += [(f"cut_at_{c}", self.cut_urls[f"cut_at_{c}"], self.cut_argv(c, resume=False))
                 for c in self.extra_cuts if not self._continuous_has(c)]
        jobs += self.objective.jobs() if self.objective else []
        results = run_processes(jobs, timeout=self.s.timeout, parallel=self.s.parallel) if jobs else []
        self.paths.update({r.name: r.to_json() for r in results if r.name in PATHS})
        self.cut_paths.update({r.name: r.to_json() for r in results if r.name.startswith("cut_at_")})
        require_success([r for r in results if not r.name.startswith("objective/")])
        if self.objective is not None:
            self.objective.compare([r for r in results if r.name.startswith("objective/")], self.opener)

    def _continuous_has(self, step: int) -> bool:
        """Whether the continuous path commits generation ``step`` (then an extra cut resumes from it)."""
        every = self.s.checkpoint_every
        return step == self.s.steps or bool(every and step % every == 0)

    def cut_argv(self, c: int, *, resume: bool) -> list[str]:
        """The command line of an extra cut's own cut process (``resume=False``) or of its resumed path."""
        s = self.s
        name = f"resume_at_{c}" if resume else f"cut_at_{c}"
        args = ["--task", s.task, *(["--config", str(s.config)] if s.config else []), "--seed", str(s.seed),
                "--steps", str(s.steps - c if resume else c),
                "--checkpoint-every", str(s.checkpoint_every if resume else 0), "--checkpoint-every-seconds", "0",
                "--keep", "0", "--resume", "auto" if resume else "never", "--device", s.device, "--log-format", "json",
                *s.store_args]
        if s.world > 1:
            args = ["--nproc-per-node", str(s.world), *args]
        args += ["--fsdp"] if s.fsdp else []
        return job_argv("train", "--store", self.cut_urls[name], *args)

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

    def _resumes(self) -> None:
        cut_store = self.opener(self.urls["cut"])
        resumed = ("resume",) if self.s.reuse else ("resume", NEGATIVE)  # a reused reference brings its negative
        plan, loaded = cut_store.read_file(PLAN_FILE), load_generation(cut_store, self.s.cut)
        try:  # large files in spools, deleted once copied
            for p in resumed:
                seed_run(self.opener(self.urls[p]), plan, loaded, lineage=cut_store)
        finally:
            loaded.close()
        for c in self.extra_cuts:  # from the continuous path's own generation c, or from cut_at_<c>
            source = self.opener(self.urls["continuous"] if self._continuous_has(c) else self.cut_urls[f"cut_at_{c}"])
            loaded = load_generation(source, c)
            try:
                seed_run(self.opener(self.cut_urls[f"resume_at_{c}"]), source.read_file(PLAN_FILE), loaded,
                         lineage=source)
            finally:
                loaded.close()
        jobs = [(p, self.urls[p], self.train_argv(p)) for p in resumed]
        jobs += [(f"resume_at_{c}", self.cut_urls[f"resume_at_{c}"], self.cut_argv(c, resume=True))
                 for c in self.extra_cuts]
        results = run_processes(jobs, timeout=self.s.timeout, parallel=self.s.parallel)
        self.paths.update({r.name: r.to_json() for r in results if r.name in PATHS})
        self.cut_paths.update({r.name: r.to_json() for r in results if r.name not in PATHS})
        for r in results:
            # A resume whose own restore self-check failed is a failed comparison (the path names the check),
            # not a verification that could not complete.
            failed = r.event("restore_check_failed")
            if r.code != 0 and failed:
                self.restore_failures[r.name] = failed
        require_success([r for r in results if r.name not in self.restore_failures])
        for r in results:
            if r.name in self.restore_failures:
                continue
            at = self.s.cut if r.name in PATHS else int(r.name.rsplit("_", 1)[1])
            event = r.event("resume") or {}
            if event.get("step") != at or event.get("rng_restored") != (r.name != NEGATIVE):
                raise VerificationIncomplete(f"path {r.name!r} did not resume from step {at} as intended "
                                             f"(its resume event: {event or 'none'})")

    def _world_equivalence(self) -> None:
        with tempfile.TemporaryDirectory(prefix="trainproof-verify-") as tmp:
            self.world_check = WorldEquivalence(
                world=self.s.world, root_url=f"{absolute_url(self.root)}/world_equivalence", workdir=Path(tmp),
                seed=self.s.seed, device=self.s.device, timeout=self.s.timeout, parallel=self.s.parallel,
                store_args=self.s.store_args, opener=self.opener, fsdp=self.s.fsdp)
            self.world_check.run()

    # -- comparison ---------------------------------------------------------------------------------------
    def _compare(self) -> None:
        s, final = self.s, None
        resumed = {p: s.cut for p in ("resume", NEGATIVE)} | {f"resume_at_{c}": c for c in self.extra_cuts}
        for name, event in self.restore_failures.items():
            self.diffs[name]["rng_restore"] = Diff(exceeded=True, first_step=resumed[name] + 1, detail=str(
                event.get("detail") or f"generators {event.get('generators')} failed the restore self-check"))
        resumed = {p: at for p, at in resumed.items() if p not in self.restore_failures}
        urls = {**self.urls, **self.cut_urls}
        readers = {p: RunReader(p, urls[p], self.opener) for p in ("continuous", "cut", *resumed)}
        cut_state = readers["cut"].state(s.cut)
        for p in (*resumed, "continuous"):
            if s.steps not in readers[p].steps:
                raise VerificationIncomplete(f"path {p!r} committed no generation at step {s.steps} ({readers[p].url})")
        for p in resumed:
            if p != NEGATIVE:
                self.diffs[p]["rng_restore"] = Diff()  # the resume's own self-check passed (the path ran on)
        steps = readers["continuous"].steps
        for i, step in enumerate(steps, 1):
            t0 = time.monotonic()
            ref = readers["continuous"].state(step)
            others = {"cut": cut_state} if step == s.cut else {}
            others |= {p: readers[p].state(step) for p, at in resumed.items() if step > at and step in readers[p].steps}
            # A sharded run's model and optimizer are compared a group of entries at a time, each of the continuous
            # path's groups read once for every path (job.proof.compare): memory is a group, not four states.
            for p, (diffs, distance) in compare_all(ref, others, s.tolerance, self.param_names).items():
                for name, diff in diffs.items():
                    self.diffs[p].setdefault(name, Diff()).merge(diff, step)
                if distance is not None and p in self.distances:
                    self.distances[p][step] = distance
                if step == s.steps and p in PATHS and p != "cut":
                    self.losses[p] = history_losses(others[p])
            if step == s.steps:
                final = ref
            took = time.monotonic() - t0
            if others:  # a large state takes a while to read back: say where the comparison is (a toy one: debug)
                log.log(logging.INFO if took >= 1 else logging.DEBUG, "compared step %d (%d of %d) with %s: %.1f s",
                        step, i, len(steps), ", ".join(others), took)
        for name, diff in compare_cut(cut_state, final, s.cut, s.tolerance).items():
            self.diffs["cut"].setdefault(name, Diff()).merge(diff, s.cut)
        self.losses["continuous"], self.losses["cut"] = history_losses(final), history_losses(cut_state)
        self.meta = final["meta"]

    def comparisons_passed(self) -> bool:
        """Resume and cut within tolerance, and the negative path diverged."""
        v = self.verdicts()
        world = self.s.world == 1 or (v["world_equivalence_passed"] and v["world_negative_detected"])
        objective = self.objective is None or (v["objective_equivalence_passed"] and v["objective_negative_detected"])
        return (v["positive"] and v["cut_checkpoint_ok"] and v["negative_divergence_detected"] and world
                and v["cuts_passed"] and objective)

    def verdicts(self) -> dict[str, Any]:
        """The verdicts of verification.json (false for anything not compared yet)."""
        resume, cut, negative = (self.diffs[p] for p in ("resume", "cut", NEGATIVE))
        positive = bool(resume) and all(d.within for d in resume.values())
        cut_ok = bool(cut) and all(d.within for d in cut.values())
        diverged = (bool(negative) and not any(d.problems for d in negative.values())
                    and any(not d.within for d in negative.values()))
        export_ok = None if self.export is None else bool(self.export["reload_check"]["passed"])
        exported = export_ok is True or not self.s.export
        w = self.world_check
        world = {} if self.s.world == 1 else {
            "world_equivalence_passed": w is not None and w.passed,
            "world_negative_detected": w is not None and w.negative_detected}
        world_ok = all(world.values())
        extra = [self.diffs[f"resume_at_{c}"] for c in self.extra_cuts]
        cuts_ok = all(bool(d) and all(x.within for x in d.values()) for d in extra)
        o = self.objective
        objective = {} if o is None else {"objective_equivalence_passed": o.passed,
                                          "objective_negative_detected": o.negative_detected}
        objective_ok = all(objective.values())
        return {"all_checks_passed": (positive and cut_ok and diverged and exported and world_ok and cuts_ok
                                      and objective_ok),
                "positive": positive, "negative_divergence_detected": diverged,
                "cut_checkpoint_ok": cut_ok, "export_reload_ok": export_ok, "cuts_passed": cuts_ok,
                **world, **objective}

    def failing_checks(self) -> list[str]:
        """``path.check`` of every failed check (for the negative path: no divergence, or a structural problem)."""
        failing = [f"{p}.{n}" for p in ("cut", "resume", *(f"resume_at_{c}" for c in self.extra_cuts))
                   for n, d in self.diffs[p].items() if not d.within]
        negative = self.diffs[NEGATIVE]
        broken = [f"{NEGATIVE}.{n}" for n, d in negative.items() if d.problems]
        if negative and not broken and all(d.within for d in negative.values()):
            broken.append(f"{NEGATIVE}: did not diverge")
        failing += broken
        if self.export is not None and not self.export["reload_check"]["passed"]:
            failing.append("export.reload_check")
        if self.world_check is not None:
            failing += self.world_check.failing()
        if self.objective is not None:
            failing += self.objective.failing()
        return failing

    def diagnosis(self) -> list[str]:
        """Likely causes of the failed checks (job.proof.diagnose, job.proof.objective), for the reader."""
        out = diagnose_path("resume", self.diffs["resume"], self.s.cut + 1)
        for c in self.extra_cuts:
            out += diagnose_path(f"resume_at_{c}", self.diffs[f"resume_at_{c}"], c + 1)
        return out + (self.objective.diagnosis() if self.objective is not None else [])

    def cuts_json(self) -> dict[str, Any]:
        """The ``cuts`` block of verification.json: every cut resumed at, and where each extra one came from."""
        return {"protocol_cut": self.s.cut, "extra": self.extra_cuts, "all": sorted({self.s.cut, *self.extra_cuts}),
                "chosen": "--cuts" if self.s.cuts is not None else "default (epoch boundary, middle of epoch 1)",
                "steps": self.s.steps, "steps_per_epoch": self.steps_per_epoch,
                "resumed_from": {str(c): ("continuous path's generation" if self._continuous_has(c)
                                          else f"cut_at_{c}") for c in self.extra_cuts},
                "passed": {str(c): bool(self.diffs[f"resume_at_{c}"])
                           and all(d.within for d in self.diffs[f"resume_at_{c}"].values()) for c in self.extra_cuts},
                "paths": self.cut_paths}

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
        if self.s.world > 1:
            extra["world_equivalence"] = None if self.world_check is None else self.world_check.to_json()
        extra["cuts"] = self.cuts_json()
        extra["objective_equivalence"] = (self.objective.to_json() if self.objective is not None else
                                          {"skipped": "reused reference" if self.s.reuse else "--no-objective-check"})
        extra["diagnosis"] = self.diagnosis()
        return build_report(
            kind="protocol", vid=self.s.vid, location=absolute_url(self.root), store=self.s.store, verdicts=verdicts,
            failing=self.failing_checks(), settings=self.s.to_json(), paths=self.paths, diffs=self.diffs,
            tol=self.s.tolerance, step_recovered=self.s.cut, env=environment(self.task, self.meta),
            export=self.export, extra=extra, error=error)

    def plot(self) -> bytes | None:
        """The PNG of loss curves and parameter distances (None without matplotlib or before the comparison)."""
        if not self.losses:
            return None
        return plot_png(self.losses, self.distances, f"{self.s.task}: {self.s.steps} steps, cut at {self.s.cut}")
