"""``trainproof train``: resume from the newest usable generation, train, checkpoint, stop cleanly.

Read :meth:`Trainer.run` top to bottom: build, resume (generators restored last), loop until the target
or a stop request (signal, spot notice, deadline), commit, after a deadline export, summarise. Exit codes:
0 target reached, or deadline reached with a committed checkpoint and a reload-verified export; 75 stopped
early after committing (run again to resume); 2 configuration/contract error; 1 anything else.

Distributed (world > 1, one process per rank under trainproof's launcher or torchrun): every rank runs this
same code. Decisions that must be the same everywhere are agreed with one small all-reduce at each step
boundary: stop (a signal on *any* rank, or a deadline any rank sees too close), and save (a time-based
checkpoint due on any rank's clock). So all ranks stop after the same step, commit it once, and exit 75
together. Only rank 0 logs progress and writes plan.json, generations and summary.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Protocol

import torch

from job.train import dist
from job.format import identity
from job.train.async_save import BackgroundSaver
from job.train.checkpoint import Checkpointer, SaveClock
from job.train.config import TrainConfig
from job.format.contract import build_plan
from job.train.data import epoch_plan
from job.errors import ConfigError, ContractError, TrainError
from job.train.progress import Reporter, make_reporter
from job.format.protect import protected_steps
from job.train.resume import (agree_plan, check_transition, code_decision, load_agreed, quarantine_corrupt,
                              world_decision)
from job.train.run import RestoreCheckError, Run, build_run, capture_rank_part, capture_state, restore_state, train_step
from job.format.state import Expected, check_consistency, runtime_versions
from job.tasks import Task, load_task
from job.tasks.objective import ObjectiveCheckTask
from storage import COMPLETE, INCOMPLETE, GenerationStore, StoreOptions, open_store
from storage.errors import StoreConfigError, StoreError

EXIT_OK, EXIT_FAILURE, EXIT_STOPPED = 0, 1, 75
SUMMARY_FILE = "summary.json"


def code_version() -> str:
    """The code identity recorded in every state and generation (job.format.identity: version + source digest)."""
    return identity.code_version()


class StopFlags(Protocol):
    """Why the loop should stop at the next step boundary (job.lifecycle.signals.StopRequest fills it)."""

    signals: list[str]
    """Stop signals received (SIGTERM, SIGINT)."""
    notices: list[str]
    """Spot interruption notices received."""


class DeadlinePolicy(Protocol):
    """When to stop so that the final commit (and the finishing export) fit (job.lifecycle.signals.Deadline)."""

    save_estimate_s: float
    finish_s: float
    finish_given_up: bool

    def observe_step(self, seconds: float) -> None: ...
    def observe_save(self, seconds: float) -> None: ...
    def seconds_left(self) -> float | None: ...
    def too_close(self) -> bool: ...


class FinishWork(Protocol):
    """The export and its reload check after a deadline's final commit (job.lifecycle.finish.Finisher)."""

    def estimate_s(self, save_s: float) -> float: ...
    def export_and_check(self, store: GenerationStore, seconds_left: float | None, save_s: float) -> dict[str, Any]: ...


class NoStop:
    """Stop flags that never fire: an in-process caller that installs no signal handlers."""

    def __init__(self) -> None:
        self.signals: list[str] = []
        self.notices: list[str] = []


class NoDeadline:
    """No deadline: never too close, nothing to finish."""

    save_estimate_s = 0.0
    finish_s = 0.0
    finish_given_up = False

    def observe_step(self, seconds: float) -> None:
        """Nothing to estimate without a deadline."""

    def observe_save(self, seconds: float) -> None:
        """Nothing to estimate without a deadline."""

    def seconds_left(self) -> float | None:
        """No deadline: None."""
        return None

    def too_close(self) -> bool:
        """Never."""
        return False


@dataclass(kw_only=True)
class Outcome:
    """How a ``train`` invocation ended."""

    exit_code: int
    """0, or 75 when stopped early after committing."""
    reason: str
    """``target``, ``signal``, ``spot-notice`` or ``deadline``."""
    step: int
    """Step reached (committed, unless a stop left no time: see ``committed_step``)."""
    target: int
    """Step aimed at."""
    committed_step: int | None = None
    """Step of the last committed generation (below ``step`` when a stop left no time for the final commit)."""
    export: dict[str, Any] | None = None
    """After a deadline stop: the export and its reload check (``ok``, ``bundle``, or ``why`` not)."""


def train(cfg: TrainConfig, *, store: GenerationStore | None = None, stop: StopFlags | None = None,
          deadline: DeadlinePolicy | None = None, finisher: FinishWork | None = None,
          reporter: Reporter | None = None) -> Outcome:
    """Run one ``train`` invocation. Raises job.errors.TrainError subclasses on handled failures.

    ``store`` is the opened run (default: ``cfg.store`` with options from the environment). The run's
    lifecycle is handed in, never built here (``job.lifecycle`` sits above this package): ``stop`` holds
    the flags the signal handlers and spot watcher set (the CLI installs the handlers before importing
    torch, so a SIGTERM during start-up is honoured too); ``deadline`` decides when to stop for a deadline
    and ``finisher`` exports after it. Without them the run never stops early.
    """
    stop = stop if stop is not None else NoStop()
    env = dist.DistEnv.from_env()
    task = load_task(cfg.task, cfg.task_config)
    if cfg.objective_check:  # the verifier's objective-equivalence run (job.proof.objective)
        task = ObjectiveCheckTask(task, batch_size=cfg.batch_size, micro_batch_size=cfg.micro_batch_size)
    device = resolve_device(cfg.device, task, env)
    configure_determinism(task, device)
    # Before any collective: a refused epoch plan ends every rank with exit 2 at once, no rendezvous.
    plan_of_epoch = epoch_plan(task.num_samples(), task.batch_size, env.world)
    store = store or _open_store(cfg.store)
    fsdp = cfg.fsdp or task.fsdp
    with dist.session(env, device, cfg.dist_timeout_s, group_of_one=fsdp) as sync:
        plan = agree_plan(store, build_plan(
            task=cfg.task, task_config=task.config(), data_identity=task.data_identity(), seed=cfg.seed,
            world=env.world, objective=task.objective, code_version=code_version(), epoch_plan=plan_of_epoch,
            fsdp=fsdp,
        ), sync)
        rep = reporter or (make_reporter(cfg.log_format, log_every=cfg.log_every) if env.rank == 0
                           else RankReporter(env.rank))
        with rep:
            return Trainer(cfg, task=task, device=device, store=store, plan=plan, reporter=rep, stop=stop,
                           deadline=deadline, finisher=finisher, sync=sync, plan_of_epoch=plan_of_epoch).run()


class RankReporter(Reporter):
    """What ranks other than 0 show: nothing but their warnings, prefixed with the rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def warn(self, message: str) -> None:
        super().warn(f"rank {self.rank}: {message}")


class Trainer:
    """One process's training session over a run in the store (one rank of it when world > 1)."""

    def __init__(self, cfg: TrainConfig, *, task: Task, device: torch.device, store: GenerationStore,
                 plan: dict[str, Any], reporter: Reporter, stop: StopFlags, deadline: DeadlinePolicy | None = None,
                 finisher: FinishWork | None = None, sync: dist.Collectives | None = None,
                 plan_of_epoch: dict[str, Any] | None = None) -> None:
        self.cfg, self.task, self.device, self.store, self.plan = cfg, task, device, store, plan
        self.reporter, self.stop = reporter, stop
        self.sync = sync or dist.Collectives(dist.DistEnv())
        self.rank, self.world = self.sync.rank, self.sync.world
        self.epoch_plan = plan_of_epoch or epoch_plan(task.num_samples(), task.batch_size, self.world)
        self.deadline: DeadlinePolicy = deadline or NoDeadline()
        # A deadline also reserves the export and its reload check.
        self.finisher = finisher
        self._update_finish_estimate()
        self.fsdp = cfg.fsdp or task.fsdp
        """Sharded training (job.train.fsdp): sharded generations, written by every rank."""
        self.clock = SaveClock(cfg.checkpoint_every, cfg.checkpoint_every_seconds)
        # Commits run their collectives over the checkpoint group (job.train.dist), from whichever thread saves.
        self.checkpointer = Checkpointer(store, contract=plan["contract"], world=self.world, keep=cfg.keep,
                                         code_version=code_version(), reporter=reporter, sync=self.sync.saves)
        # Asynchronous checkpoints (job.train.async_save) unless --sync-checkpoint: one process or many, DDP or
        # sharded.
        self.saver = (BackgroundSaver(self.checkpointer, reporter, self._observe_background_save, self._committed)
                      if not cfg.sync_checkpoint else None)
        self._live: Run | None = None
        """The run being trained (its history drops the rows of each committed generation: :meth:`_committed`)."""
        self._stop_seen_at: float | None = None
        self.world_changes: list[dict[str, int]] = []
        self.code_changes: list[dict[str, Any]] = []
        """Code identities this run changed between (``--allow-code-change``), as ``{step, from, to}``."""
        self.resumed_from: int | None = None
        """Step of the generation this process restored (None: a fresh start); recorded in every generation."""
        self.ranks_signalled = 0
        """How many ranks had received a stop signal at the last agreement (the signal may be another rank's)."""
        self.started_at = datetime.now(timezone.utc)

    def run(self) -> Outcome:
        """Build, resume, train to the target or a stop request, commit, summarise."""
        run = build_run(self.task, self.device, self.cfg.seed, env=self.sync.env, sync=self.sync,
                        per_rank_mean=self.cfg.negative_control == "per-rank-mean",
                        microbatch_mean=self.cfg.negative_control == "mean-of-microbatch-means", fsdp=self.fsdp)
        self._live = run
        try:
            resumed_from = self._resume(run)  # generators are restored here, last, right before the loop
        except RestoreCheckError as exc:
            # Named for the verifier: a resume that fails its own check is a failed comparison, not a crash.
            self.reporter.event("restore_check_failed", check=exc.check, generators=exc.differing, detail=str(exc))
            raise
        self.resumed_from = resumed_from
        self.checkpointer.protect = protected_steps(self.store, resumed_from)  # retention runs on rank 0 only
        target = self.cfg.target_step(run.step, self.task.default_steps)
        self.reporter.event("start", task=self.cfg.task, step=run.step, target=target,
                            target_from=self.cfg.target_source(), seed=self.cfg.seed, device=str(self.device),
                            world=self.world, contract=self.plan["contract"], store=self.store.url,
                            epoch_plan=self.epoch_plan, world_changes=self.world_changes,
                            checkpoint="async" if self.saver else "sync", fsdp=self.fsdp,
                            deadline=None if self.cfg.deadline is None else self.cfg.deadline.isoformat(),
                            **({"deadline_reserve_s": round(self.deadline.finish_s, 3)} if self.finisher else {}))
        self.reporter.begin(step=run.step, target=target)
        left = self.deadline.seconds_left()
        past = left is not None and left <= 0 and self.finisher is not None
        try:
            reason = "deadline" if past else self._loop(run, target)
            committed = self._finish_saves(run, reason)  # the end, or the boundary after a stop request
        except BaseException:
            self._land_in_flight_save()
            raise
        finished = self._finish(run, unbounded=past) if reason == "deadline" else None
        exit_code = EXIT_OK if run.step >= target or (finished or {}).get("ok") else EXIT_STOPPED
        if past and exit_code != EXIT_OK:
            # Exit 75 would have a Job restart into the same past deadline forever: a counted failure instead.
            exit_code = EXIT_FAILURE
        outcome = Outcome(exit_code=exit_code, reason=reason, step=run.step, target=target, export=finished,
                          committed_step=committed)
        if self.rank == 0:
            self._write_summary(run, outcome, resumed_from)
        self.reporter.event("done" if exit_code == EXIT_OK else "stopped", step=run.step, target=target,
                            reason=reason, exit_code=exit_code, signals=self.stop.signals,
                            notices=self.stop.notices, ranks_signalled=self.ranks_signalled,
                            committed_step=committed, **({"export": finished} if finished else {}))
        return outcome

    def _loop(self, run: Run, target: int) -> str:
        """Optimizer steps until the target; stop requests and saves are decided only at step boundaries."""
        while run.step < target:
            if self.saver and self.world == 1:
                self.saver.poll()  # a background save that failed fails the run here, naming its step
            reason, save = self._agree(run, save=run.step > self._saved_through() and self.clock.due(run.step))
            if save:
                self._save(run)
                reason, _ = self._agree(run, save=False)  # a signal may have arrived during the save
            if reason:
                self._stop_seen_at = time.monotonic()
                return reason
            t0 = time.perf_counter()
            record = train_step(run)
            self.deadline.observe_step(time.perf_counter() - t0)
            self.reporter.step(record, target=target)
        return "target"

    def _agree(self, run: Run, *, save: bool) -> tuple[str | None, bool]:
        """(stop reason or None, whether to save now), the same on every rank.

        Each rank contributes its own view (a signal it received, its deadline estimate, its save clock);
        one all-reduce makes the union every rank's decision, so a SIGTERM delivered to a single rank
        stops all of them after the same step. Local when world is 1.
        """
        # With world > 1 a background save that failed is agreed here too (job.train.async_save): every rank
        # fails at this boundary, the one whose save thread saw it first and the others alike.
        save_failed = int(self.world > 1 and self.saver is not None and self.saver.poll_failed())
        flags = [int(bool(self.stop.signals)), int(bool(self.stop.notices)), int(self.deadline.too_close()), int(save),
                 save_failed]
        signal, notice, deadline, save_any, failed = self.sync.sum_ints(
            flags, f"agree whether to stop or save at step {run.step}")
        if failed:
            self._fail_with_save(failed)
        self.ranks_signalled = signal + notice
        reason = "signal" if signal else "spot-notice" if notice else "deadline" if deadline else None
        return reason, bool(save_any)

    def _fail_with_save(self, ranks: int) -> None:
        """``ranks`` ranks saw their background save fail: raise that failure here (a commit fails on every rank
        together, so this rank's save thread ends with it too), or a PeerError should it have succeeded here."""
        assert self.saver is not None
        step = self.saver.in_flight
        self.saver.wait()  # raises this rank's own failure of the same commit
        raise dist.PeerError(f"the background checkpoint of step {step} failed on {ranks} other rank(s) "
                             "(see their log lines); stopping this rank too")

    def _finish(self, run: Run, *, unbounded: bool = False) -> dict[str, Any]:
        """After a deadline's final commit: rank 0 exports and reload-checks; every rank learns whether it passed.

        ``unbounded``: the run's deadline had already passed when this process started (a restart after the
        rental's end, or a final commit whose export did not fit): nothing is trained, and the export is made
        without a time limit, since the machine is evidently still there."""
        result: dict[str, Any] = {"ok": False, "why": "not rank 0"}
        if self.rank == 0 and self.finisher is not None:
            self.reporter.event("export_begin", step=run.step, seconds_left=self.deadline.seconds_left())
            if unbounded:
                self.reporter.warn(f"the run's deadline {self.cfg.deadline} has passed: no more training; "
                                   f"exporting step {run.step} without a time limit")
            result = ({"ok": False, "why": "the export did not fit before the deadline from this process's start"}
                      if self.deadline.finish_given_up and not unbounded else
                      self.finisher.export_and_check(self.store, None if unbounded else self.deadline.seconds_left(),
                                                     self.deadline.save_estimate_s))
            if not result["ok"]:
                saved = f"checkpoint of step {run.step} committed" if run.step else "no step was taken"
                self.reporter.warn(f"deadline: {saved}, but no verified export ({result['why']}): exit 75; "
                                   "run again, or `trainproof export` later")
        ok, = self.sync.sum_ints([int(result["ok"])], "agree whether the deadline export passed")
        return {**result, "ok": bool(ok)} if self.rank == 0 else {"ok": bool(ok)}

    def _update_finish_estimate(self) -> None:
        if self.finisher is not None:
            self.deadline.finish_s = self.finisher.estimate_s(self.deadline.save_estimate_s)

    def _resume(self, run: Run) -> int | None:
        """Load the newest usable generation of this run into ``run`` on every rank; None when starting fresh."""
        if self.cfg.resume == "never":
            self.sync.on_rank0("check that the store holds no generation", self._refuse_existing_generations)
            self._decide_world(self.plan["world"], step=0, history=[], source=f"plan.json of {self.store.url}")
            return None
        # Without --allow-code-change a newer generation of other code is passed over for one of this build.
        below: int | None = None
        while True:
            found = load_agreed(self.store, self.plan["contract"], self.sync, below=below,
                                code_version=None if self.cfg.allow_code_change else code_version())
            if found is None and below is not None:
                # A failed sharded load may have copied verified parts of its files into the model and optimizer
                # before a later part failed: this process does not train a fresh run from those tensors.
                raise TrainError(f"every generation left to resume from had a corrupt shard file (quarantined, "
                                 f"the last step-{below:08d}); this process may hold part of one, so it does not "
                                 "start fresh: run it again to start from step 0")
            if found is None:
                self.sync.on_rank0("look for unusable generations", self._warn_if_unusable_generations)
                self._decide_world(self.plan["world"], step=0, history=[], source=f"plan.json of {self.store.url}")
                return None
            name, state = found
            step, saved_world = state["progress"]["step"], state["meta"]["world"]
            changed = self._decide_world(saved_world, step=step, history=state["meta"].get("world_changes", []),
                                         source=f"{name} was written by {saved_world} rank(s)")
            if changed:
                check_transition(state["ranks"][0]["data"], self.world, run.global_batch)
            saved_code = self._decide_code(state, step=step, source=name)
            # The generation's own step (its folder name), not the state's word for it: a state moved under a
            # newer name must be refused, never resumed from.
            expected = self._expected(int(name.rsplit("-", 1)[1]), saved_world, saved_code)
            for warning in check_consistency(state, expected) + self._device_warnings(state):
                self.reporter.warn(warning)
            if self._load_shards(run, state, name, changed):
                break
            below = int(name.rsplit("-", 1)[1])  # a corrupt shard: the next older generation (quarantined this one)
        restore_state(run, state, restore_rng=not self.cfg.omit_rng_restore, seed=self.cfg.seed,
                      rederive_at=step if changed else None)
        self.checkpointer.last_step = run.step
        self.reporter.event("resume", step=run.step, generation=name, rng_restored=not self.cfg.omit_rng_restore,
                            **({"world_change": self.world_changes[-1]} if changed else {}))
        return run.step

    def _load_shards(self, run: Run, state: dict[str, Any], name: str, changed: bool) -> bool:
        """A sharded run loads its model and optimizer from the generation's shards (every rank: only the chunks
        it needs; DCP reshards after an allowed world change) before the rest of the state is restored.

        False when a shard file's bytes disagree with the manifest (every rank learns it from DCP): rank 0
        quarantines the generation with a warning and the caller falls back to the next older one, as for a
        corrupt training state. Any other failure raises."""
        saved = bool(state["meta"].get("fsdp"))
        if saved != self.fsdp:  # plan.json refuses this first; a generation must agree too
            raise ContractError(f"{name} was written by a {'sharded (--fsdp)' if saved else 'replicated (DDP)'} run "
                                f"and this run trains {'sharded' if self.fsdp else 'replicated'}: resume it "
                                f"{'with' if saved else 'without'} --fsdp")
        if not self.fsdp:
            return True
        from job.train.fsdp import load_generation
        from job.train.sharded import ShardedLoadError

        step = int(name.rsplit("-", 1)[1])
        try:
            load_generation(run.model, run.optimizer, self.store, step, world=self.world,
                            contract=self.plan["contract"], allow_world_change=changed)
        except ShardedLoadError as exc:
            if not exc.corrupt:
                raise
            if self.rank == 0:
                quarantine_corrupt(self.store, step, str(exc))
            return False
        return True

    def _decide_world(self, saved_world: int, *, step: int, history: list[dict[str, int]], source: str) -> bool:
        """Record the run's world changes; refuse (exit 2) a change not allowed. True when this start changes it."""
        self.world_changes = world_decision(saved_world=saved_world, world=self.world, step=step, source=source,
                                            allow=self.cfg.allow_world_change, history=history)
        if saved_world != self.world and self.rank == 0:
            self.reporter.warn(f"world size changes from {saved_world} to {self.world} at step {step} "
                               "(--allow-world-change): this run is no longer bitwise comparable with one that "
                               "kept its world size")
        return saved_world != self.world

    def _decide_code(self, state: dict[str, Any], *, step: int, source: str) -> str:
        """Refuse (exit 2) a resume under other code unless ``--allow-code-change``; record an allowed change.

        Returns the code identity the state must carry (the saved one when the change is allowed)."""
        saved = state["meta"].get("code_version")
        self.code_changes = code_decision(saved=saved, now=code_version(), step=step, source=source,
                                          allow=self.cfg.allow_code_change,
                                          history=state["meta"].get("code_changes", []))
        if saved != code_version() and self.rank == 0:
            self.reporter.warn(f"code changes from {saved} to {code_version()} at step {step} (--allow-code-change): "
                               "an audit replaying across this step runs the new code")
        return saved

    def _save(self, run: Run) -> None:
        """Commit this step on every rank (job.train.checkpoint's protocol when world > 1 or sharded): in the
        background from a host-memory snapshot of what this rank commits (job.train.async_save), or inline with
        ``--sync-checkpoint``."""
        t0 = time.perf_counter()
        if self.saver:
            previous = self.saver.in_flight
            waited = self.saver.wait()  # at most one save in flight; raises if the previous one failed
            if previous is not None and waited >= 0.001:
                self.reporter.event("checkpoint_wait", step=run.step, waiting_for=previous, seconds=waited)
        self.reporter.event("checkpoint_begin", step=run.step)
        state = capture_state(run, self._meta(run)) if self.rank == 0 else None
        extra = {"task": self.cfg.task, "epoch": run.sampler.epoch, "loss": run.history.last_row["loss"],
                 "next_lr": run.lr(), "world": self.world, "resumed_from": self.resumed_from,
                 "code_changes": self.code_changes}
        part = capture_rank_part(run) if self.rank else None
        shards = None
        if self.fsdp:
            from job.train.fsdp import sharded_state

            shards = sharded_state(run.model, run.optimizer)  # this rank's shards (DTensors), nothing gathered
        if self.saver:
            self.saver.submit(run.step, state, extra=extra, blocked_s=time.perf_counter() - t0, part=part,
                              sharded=shards)
        else:
            self.checkpointer.commit(run.step, state, extra=extra, part=part, blocked_since=t0, sharded=shards)
            self._committed(run.step)
            self._observe_save(time.perf_counter() - t0)
        self.clock.mark()

    def _committed(self, step: int) -> None:
        """Generation ``step`` is committed (on every rank): its history rows live in the store now, so the run's
        history keeps only the later ones and the next generation holds the rows since this one. Called only
        after a commit landed: after a failed or skipped save the rows stay for the next generation."""
        if self._live is not None:
            self._live.history.committed(step)

    def _saved_through(self) -> int:
        """The newest step committed or being committed in the background."""
        pending = self.saver.in_flight if self.saver else None
        return max(self.checkpointer.last_step, pending or 0)

    def _observe_save(self, seconds: float) -> None:
        self.deadline.observe_save(seconds)
        self._update_finish_estimate()

    def _observe_background_save(self, seconds: float) -> None:
        # The deadline reserve uses the background commit's own measured time (serialise → COMPLETE.json).
        self._observe_save(seconds)

    def _finish_saves(self, run: Run, reason: str) -> int:
        """After the loop: land the save in flight, then commit the final step when it is new and fits.

        After a signal or spot notice with asynchronous checkpoints, the final step is committed only when the
        longest measured background commit (x 1.25, + 1 s) fits in what is left of ``--stop-grace`` since the
        first stop request; otherwise the in-flight commit is the resume point and the run exits 75 from it.
        A run that has committed nothing yet always tries. Returns the step of the last commit.
        """
        if self.saver:
            self.saver.wait()
        if run.step > self.checkpointer.last_step:
            why_not = self._final_commit_does_not_fit(reason)
            skip, = self.sync.sum_ints([int(why_not is not None)], f"agree whether to commit step {run.step}")
            if skip and why_not is None:  # every rank commits, or none: another rank's estimate says it won't fit
                why_not = f"{skip} other rank(s) estimate the final commit does not fit in --stop-grace"
            if why_not:
                last = self.checkpointer.last_step
                self.reporter.warn(f"stopped at step {run.step}; the last commit is step {last}; {run.step - last} "
                                   f"step(s) will be redone ({why_not})")
                self.reporter.event("checkpoint_skipped", step=run.step, committed_step=last, why=why_not)
                return last
            self._save(run)
            if self.saver:
                self.saver.wait()
        return self.checkpointer.last_step

    def _final_commit_does_not_fit(self, reason: str) -> str | None:
        """Why the final commit is skipped after a stop request (None: commit it)."""
        if not self.saver or reason not in ("signal", "spot-notice") or not self.checkpointer.last_step:
            return None
        if not self.saver.measured_s:
            return None  # nothing measured in this process: try
        need = 1.25 * max(self.saver.measured_s) + 1.0
        since = getattr(self.stop, "first_at", None) or self._stop_seen_at or time.monotonic()
        left = self.cfg.stop_grace_s - (time.monotonic() - since)
        if need <= left:
            return None
        return (f"a commit takes ~{max(self.saver.measured_s):.1f} s, {max(left, 0.0):.1f} s of the "
                f"{self.cfg.stop_grace_s:g} s --stop-grace are left")

    def _land_in_flight_save(self) -> None:
        """On a failure of the training thread: let the commit in flight land (its work is good), then go on failing."""
        if self.saver and self.saver.in_flight is not None:
            try:
                self.saver.wait()
            except Exception as exc:  # noqa: BLE001 - the original failure is the one reported
                self.reporter.warn(str(exc))

    def _meta(self, run: Run) -> dict[str, Any]:
        return {
            "contract": self.plan["contract"], "world": self.world, "world_changes": self.world_changes,
            "task": self.cfg.task, "task_config": self.task.config(), "seed": self.cfg.seed,
            "objective": self.task.objective, "data_identity": self.plan["data_identity"],
            "code_version": code_version(), "code_changes": self.code_changes,
            "versions": runtime_versions(), "device": str(self.device),
            "amp": run.use_amp, "epoch_plan": self.epoch_plan, **({"fsdp": True} if self.fsdp else {}),
            # Per invocation, like the trainer's settings: the step this process restored (None: a fresh start).
            "trainer": {**self.cfg.recorded(), "resumed_from": self.resumed_from},
        }

    def _expected(self, step: int, world: int, code: str | None = None) -> Expected:
        return Expected(contract=self.plan["contract"], world=world, code_version=code or code_version(),
                        data_identity=self.plan["data_identity"], step=step)

    def _device_warnings(self, state: dict[str, Any]) -> list[str]:
        saved = state["meta"].get("device")
        if saved == str(self.device):
            return []
        return [f"the state was written on {saved}, this process trains on {self.device}: the resume is valid "
                "but not bitwise equal (other kernels, and AMP only on CUDA)"]

    def _refuse_existing_generations(self) -> None:
        complete = [g for g in self.store.scan() if g.status == COMPLETE]
        if complete:
            raise ContractError(
                f"--resume never, but {self.store.url} already holds {len(complete)} complete generation(s) "
                f"(newest step {complete[-1].step}); use a new --store, or --resume auto to continue"
            )

    def _warn_if_unusable_generations(self) -> None:
        scan = self.store.scan(contract=self.plan["contract"])
        present = [g for g in scan if g.status != INCOMPLETE]
        if present:
            self.reporter.warn(f"{len(present)} generation(s) in {self.store.url} but none is usable by this "
                               "run: starting from step 0")

    def _write_summary(self, run: Run, outcome: Outcome, resumed_from: int | None) -> None:
        """Run-level ``summary.json`` (overwritten by each process; a failure costs no work)."""
        last = run.history.last_row or {}
        saves = [r["seconds"] for r in self.checkpointer.records]
        summary = {
            "schema": "trainproof.summary/1", "status": "completed" if outcome.exit_code == 0 else "stopped",
            "reason": outcome.reason, "exit_code": outcome.exit_code, "task": self.cfg.task,
            "contract": self.plan["contract"], "step": run.step, "target": outcome.target,
            "committed_step": outcome.committed_step,
            "resumed_from": resumed_from, "epoch": run.sampler.epoch, "last_loss": last.get("loss"),
            "next_lr": run.lr(), "checkpoints": self.checkpointer.records,
            "save_seconds_max": max(saves) if saves else None, "throughput": self.reporter.throughput(),
            "signals": self.stop.signals, "notices": self.stop.notices, "export": outcome.export, "device": str(self.device), "code_version": code_version(),
            "ranks_signalled": self.ranks_signalled, "world": self.world, "world_changes": self.world_changes,
            "bitwise_comparable": not self.world_changes, "code_changes": self.code_changes,
            "started_at": self.started_at.isoformat(timespec="seconds"),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        try:
            self.store.write_file(SUMMARY_FILE, json.dumps(summary, indent=2).encode() + b"\n")
        except (StoreError, OSError) as exc:
            self.reporter.warn(f"could not write {SUMMARY_FILE}: {exc}")


def resolve_device(choice: str, task: Task, env: dist.DistEnv | None = None) -> torch.device:
    """``cpu``, ``cuda`` (refused when absent or unsupported by the task), or ``auto``.

    A distributed rank takes the GPU of its ``LOCAL_RANK``.
    """
    if choice == "cuda":
        if not task.supports_cuda:
            raise ConfigError("this task runs on the CPU only (its results are defined on the CPU)")
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but no CUDA device is visible")
    if choice == "cuda" or (choice == "auto" and task.supports_cuda and torch.cuda.is_available()):
        if env is not None and env.world > 1:
            if env.local_rank >= torch.cuda.device_count():
                raise ConfigError(f"LOCAL_RANK {env.local_rank} but only {torch.cuda.device_count()} GPU(s) "
                                  "are visible: start at most one rank per GPU on each node")
            torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def configure_determinism(task: Task, device: torch.device) -> None:
    """Deterministic kernels; a fixed CPU thread count when the task asks for one.

    Note: on CUDA some kernels (e.g. attention backward) have no deterministic implementation, so
    CUDA runs only warn; exact bitwise resume is claimed and tested on the CPU.
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must precede the first cuBLAS call
        torch.backends.cudnn.benchmark = False
    elif task.cpu_threads:
        torch.set_num_threads(task.cpu_threads)
    use_deterministic_algorithms(warn_only=device.type == "cuda")


def use_deterministic_algorithms(*, warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms(True)`` without its import of ``torch._inductor`` (which pulls in
    dynamo: 1.5 s of every process start on a small CPU, paid by every resume). The two things it does are done
    here: the kernels' flag, and inductor's ``deterministic`` setting — through its environment variable when
    inductor is not imported yet (it reads the variable on import), on the config when it is."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:  # another torch: the public call
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        return
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        config.deterministic = True
    else:
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    setter(True, warn_only=warn_only)


def _open_store(url: str) -> GenerationStore:
    try:
        return open_store(url, StoreOptions.from_env())
    except StoreConfigError as exc:
        raise ConfigError(f"--store {url}: {exc}") from None
