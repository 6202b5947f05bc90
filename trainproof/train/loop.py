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
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

from trainproof.errors import ConfigError, DataError, TrainError
from trainproof.format.contract import build_plan
from trainproof.format.identity import code_version
from trainproof.format.layout import Layout
from trainproof.format.protect import restore_protection
from trainproof.format.state import runtime_versions
from trainproof.storage import GenerationStore, StoreOptions, open_store
from trainproof.storage.errors import StoreConfigError, StoreError
from trainproof.tasks import Task, load_task
from trainproof.train import dist
from trainproof.train.attempts import with_attempts
from trainproof.train.checkpoint import Capture
from trainproof.train.config import TrainConfig
from trainproof.train.data import epoch_plan
from trainproof.train.device import configure_determinism, resolve_device
from trainproof.train.discover import agree_plan
from trainproof.train.frozen import frozen_keys, restored_frozen_ref, split_frozen
from trainproof.train.live import live_state
from trainproof.train.pipeline import (
    check_workers,
    next_step_micro_batches,
    open_batches,
    pipeline_record,
    worker_failure,
)
from trainproof.train.progress import Reporter, make_reporter
from trainproof.train.resume import Resumed, ResumeOptions, resume
from trainproof.train.run import Run, build_run, capture_rank_part, capture_state, train_step
from trainproof.train.saver import Saving
from trainproof.train.schedule import check_length
from trainproof.train.stops import DeadlinePolicy, FinishWork, IntervalPolicy, NoDeadline, NoStop, StopFlags
from trainproof.train.tensorboard import with_tensorboard

EXIT_OK, EXIT_FAILURE, EXIT_STOPPED = 0, 1, 75
SUMMARY_FILE = "summary.json"


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
          reporter: Reporter | None = None, interval: IntervalPolicy | None = None) -> Outcome:
    """Run one ``train`` invocation. Raises trainproof.errors.TrainError subclasses on handled failures.

    ``store`` is the opened run (default: ``cfg.store`` with options from the environment). The run's
    lifecycle is handed in, never built here (``trainproof.lifecycle`` sits above this package): ``stop`` holds
    the flags the signal handlers and spot watcher set (the CLI installs the handlers before importing
    torch, so a SIGTERM during start-up is honoured too); ``deadline`` decides when to stop for a deadline
    and ``finisher`` exports after it. Without them the run never stops early. ``interval`` plans the seconds
    between commits of ``--checkpoint-every auto``.
    """
    stop = stop if stop is not None else NoStop()
    env = dist.DistEnv.from_env()
    task = load_task(cfg.task, cfg.task_config)
    task = cfg.variant.apply(task)  # a verifier's mode of the task (trainproof.train.variant); else unchanged
    check_workers(task, task.num_workers if cfg.data_workers is None else cfg.data_workers)
    device = resolve_device(cfg.device, task, env)
    configure_determinism(task, device)
    # Before any collective: a refused epoch plan ends every rank with exit 2 at once, no rendezvous.
    plan_of_epoch = epoch_plan(task.num_samples(), task.batch_size, env.world)
    layout = Layout.choose(world=env.world, fsdp=cfg.fsdp or task.fsdp)  # chosen once, here
    store = store or _open_store(cfg.store)
    if env.rank == 0:  # its first write is plan.json: on S3 the store's probe runs beside the set-up until then
        store.prepare_soon()
    with dist.session(env, device, cfg.dist_timeout_s, group_of_one=layout.sharded) as sync:
        plan = agree_plan(store, build_plan(
            task=cfg.task, task_config=task.config(), data_identity=task.data_identity(), seed=cfg.seed,
            world=env.world, objective=task.objective, code_version=code_version(), epoch_plan=plan_of_epoch,
            layout=layout, precision=task.precision, init=[p.declared for p in task.pretrained()],
            data_pipeline=pipeline_record(task),
        ), sync)
        rep = reporter or (with_attempts(with_tensorboard(make_reporter(cfg.log_format, log_every=cfg.log_every),
                                                          cfg.tensorboard, store.local_folder), store)
                           if env.rank == 0 else RankReporter(env.rank))
        with rep:
            return Trainer(cfg, task=task, device=device, store=store, plan=plan, reporter=rep, stop=stop,
                           deadline=deadline, finisher=finisher, sync=sync, plan_of_epoch=plan_of_epoch,
                           layout=layout, interval=interval).run()


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
                 plan_of_epoch: dict[str, Any] | None = None, layout: Layout | None = None,
                 interval: IntervalPolicy | None = None) -> None:
        self.cfg, self.task, self.device, self.store, self.plan = cfg, task, device, store, plan
        self.reporter, self.stop = reporter, stop
        self.sync = sync or dist.Collectives(dist.DistEnv())
        self.rank, self.world = self.sync.rank, self.sync.world
        self.layout = layout or Layout.choose(world=self.world, fsdp=cfg.fsdp or task.fsdp)
        self.epoch_plan = plan_of_epoch or epoch_plan(task.num_samples(), task.batch_size, self.world)
        self.deadline: DeadlinePolicy = deadline or NoDeadline()
        self.finisher = finisher
        self._observe_save()  # no commit measured yet: the deadline's reserve from its estimates
        self.saving = Saving(cfg, store, contract=plan["contract"], sync=self.sync, reporter=reporter,
                             on_saved=self._observe_save, on_committed=self._committed, interval=interval)
        self._live: Run | None = None
        """The run being trained (its history drops the rows of each committed generation: :meth:`_committed`)."""
        self._stop_seen_at: float | None = None
        self._bad_data: TrainError | None = None
        """The failure building the next step's micro-batches met (a damaged shard), found before the step began."""
        self.resumed = Resumed()
        """Where this process continued from (None: a fresh start), its world and code changes."""
        self.ranks_signalled = 0
        """How many ranks had received a stop signal at the last agreement (the signal may be another rank's)."""
        self.started_at = datetime.now(timezone.utc)

    def run(self) -> Outcome:
        """Build, resume, train to the target or a stop request, commit, summarise."""
        run = build_run(self.task, self.device, self.cfg.seed, env=self.sync.env, sync=self.sync,
                        per_rank_mean=self.cfg.variant.negative_control == "per-rank-mean",
                        microbatch_mean=self.cfg.variant.negative_control == "mean-of-microbatch-means",
                        layout=self.layout)
        self._live = run
        self.resumed = resume(run, store=self.store, plan=self.plan, sync=self.sync, reporter=self.reporter,
                              options=self._resume_options())  # generators are restored there, last
        self.saving.checkpointer.last_step = run.step
        # retention (rank 0 only) keeps what the audit needs around every restore point not yet audited
        self.saving.checkpointer.protect = restore_protection(self.store, self.resumed.step, self.cfg.keep)
        self.saving.checkpointer.keep_every = self.cfg.keep_every_rule()  # and a sparse permanent series
        if self.rank == 0 and self.resumed.step is not None and run.parallel.inline_state:
            # The frozen entries just restored are the shared object the generation references: referenced again,
            # not serialised and stored once more by this process's first commit.
            self.saving.checkpointer.frozen_ref = restored_frozen_ref(
                self.store, self.resumed.step, split_frozen(run.model.state_dict(), frozen_keys(run.model)))
        target = self.cfg.target_step(run.step, self.task.default_steps)
        # A schedule the run would step past its end (OneCycleLR): one line now, not a traceback at its end.
        check_length(run.scheduler, start=run.step, target=target, source=self.cfg.target_source())
        self._report_start(run, target)
        if run.step >= target and self.rank == 0:  # a target total already reached: say so, not a silent exit 0
            self.reporter.warn(f"nothing to train: the run is at step {run.step}, "
                               f"{'past' if run.step > target else 'at'} its target of {target} steps in all "
                               "(--max-steps is a total; --steps N trains N more)")
        left = self.deadline.seconds_left()
        past = left is not None and left <= 0 and self.finisher is not None
        try:
            if not past:
                run.batches = self._open_batches(run)
            self.saving.clock.mark()  # the interval counts from training's start, not from before the restore
            reason = "deadline" if past else self._loop(run, target)
            self._close_batches(run)  # before the final commit: what the workers prefetched is never saved
            committed = self.saving.finish(run.step, reason, stop=self.stop, stop_seen_at=self._stop_seen_at,
                                           capture=lambda: self._capture(run))  # the end, or after a stop request
            if reason == "data":
                raise self._data_failure(run, committed)
        except BaseException as exc:
            self._close_batches(run)
            self.saving.abandon()
            failure = worker_failure(exc)  # a dead data worker: one line, not DataLoader's traceback
            if failure is None:
                raise
            raise failure from None
        finished = self._finish(run, unbounded=past) if reason == "deadline" else None
        exit_code = EXIT_OK if run.step >= target or (finished or {}).get("ok") else EXIT_STOPPED
        if past and exit_code != EXIT_OK:
            # Exit 75 would have a Job restart into the same past deadline forever: a counted failure instead.
            exit_code = EXIT_FAILURE
        outcome = Outcome(exit_code=exit_code, reason=reason, step=run.step, target=target, export=finished,
                          committed_step=committed)
        if self.rank == 0:
            self._write_summary(run, outcome)
        self.reporter.event("done" if exit_code == EXIT_OK else "stopped", step=run.step, target=target,
                            reason=reason, exit_code=exit_code, signals=self.stop.signals,
                            notices=self.stop.notices, ranks_signalled=self.ranks_signalled,
                            committed_step=committed, **({"export": finished} if finished else {}))
        return outcome

    def _loop(self, run: Run, target: int) -> str:
        """Optimizer steps until the target; stop requests and saves are decided only at step boundaries."""
        while run.step < target:
            self._record_live(run)
            built_s = self._check_data(run)
            reason, save = self._agree(run, save=self.saving.due(run.step))
            if save:
                self.saving.save(run.step, lambda: self._capture(run))
                reason, _ = self._agree(run, save=False)  # a signal may have arrived during the save
            if reason:
                self._stop_seen_at = time.monotonic()
                return reason
            t0 = time.perf_counter()
            record = train_step(run)
            self.deadline.observe_step(time.perf_counter() - t0 + built_s)
            self.reporter.step(record, target=target)
        return "target"

    def _record_live(self, run: Run) -> None:
        """The verifier's ``live_vs_restored`` check (``--variant`` ``live_state_at``): at a listed step boundary,
        before anything of the next step, print what the live objects hold (trainproof.train.live); a resumed
        process's first boundary is right after its restore."""
        at = self.cfg.variant.live_state_at
        if at and run.step in at and self.rank == 0:
            self.reporter.event("live_state", step=run.step, components=live_state(run))

    def _check_data(self, run: Run) -> float:
        """Build this rank's micro-batches of the next step now, before the step takes any: a failure (a damaged
        shard) is then found while the state is still the last step's, which :meth:`_agree` has every rank commit.
        The seconds it took (part of the step's time, for the deadline)."""
        t0 = time.perf_counter()
        if self._bad_data is None and run.batches is not None:
            count = next_step_micro_batches(run.sampler, run.global_batch, self.world, self.rank,
                                            self.task.micro_batch_size)
            self._bad_data = run.batches.check_next(count)
        return time.perf_counter() - t0

    def _data_failure(self, run: Run, committed: int | None) -> TrainError:
        """The failure to end with after the step reached was committed: this rank's own (its message and exit
        code), or, when another rank met it, a DataError saying so."""
        if not committed:
            then = "no step is committed yet; a retry starts the run again"
        elif committed == run.step:
            then = f"step {committed} (reached before it) is committed; a retry resumes from it"
        else:
            then = f"the last committed step is {committed}; a retry resumes from it"
        if self._bad_data is None:
            return DataError(f"another rank's data for step {run.step + 1} could not be read (its line names it); "
                             f"{then}")
        return type(self._bad_data)(f"{self._bad_data}; {then}")

    def _workers(self) -> tuple[int, int]:
        """(data workers, prefetch depth): this invocation's options, else the task's defaults."""
        c = self.cfg
        return (self.task.num_workers if c.data_workers is None else c.data_workers,
                self.task.prefetch if c.prefetch is None else c.prefetch)

    def _open_batches(self, run: Run) -> Any:
        """The micro-batches of the steps from run.step + 1 on (trainproof.train.pipeline), from the restored
        position."""
        workers, prefetch = self._workers()
        return open_batches(self.task, run.sampler, seed=self.cfg.seed, first=run.step + 1,
                            world=self.world, rank=self.rank, workers=workers, prefetch=prefetch,
                            pin_memory=self.device.type == "cuda")

    def _close_batches(self, run: Run) -> None:
        """Stop the data workers (once); their prefetched batches are dropped, the position is what was consumed."""
        batches, run.batches = run.batches, None
        if batches is not None and getattr(batches, "workers", 0):
            seconds = batches.close()
            self.reporter.event("data_workers_stopped", step=run.step, workers=batches.workers,
                                seconds=round(seconds, 3), left_running=batches.left_running)
        elif batches is not None:
            batches.close()

    def _resume_options(self) -> ResumeOptions:
        c = self.cfg
        return ResumeOptions(mode=c.resume, seed=c.seed, allow_world_change=c.allow_world_change,
                             allow_code_change=c.allow_code_change, restore_rng=not c.omit_rng_restore)

    def _report_start(self, run: Run, target: int) -> None:
        self.reporter.event("start", task=self.cfg.task, step=run.step, target=target,
                            target_from=self.cfg.target_source(), seed=self.cfg.seed, device=str(self.device),
                            world=self.world, contract=self.plan["contract"], store=self.store.url,
                            epoch_plan=self.epoch_plan, world_changes=self.resumed.world_changes,
                            checkpoint=self.saving.saver.mode, fsdp=self.layout.sharded, layout=self.layout.name,
                            data_workers=self._workers()[0] if self.task.builds_batches else None,
                            deadline=None if self.cfg.deadline is None else self.cfg.deadline.isoformat(),
                            **({"deadline_reserve_s": round(self.deadline.finish_s, 3)} if self.finisher else {}))
        self.reporter.begin(step=run.step, target=target)

    def _agree(self, run: Run, *, save: bool) -> tuple[str | None, bool]:
        """(stop reason or None, whether to save now), the same on every rank.

        Each rank contributes its own view (a signal it received, its deadline estimate, its save clock);
        one all-reduce makes the union every rank's decision, so a SIGTERM delivered to a single rank
        stops all of them after the same step. Local when world is 1.
        """
        save_failed = int(self.saving.failed())  # world > 1: a background save that failed is agreed here too
        flags = [int(bool(self.stop.signals)), int(bool(self.stop.notices)), int(self.deadline.too_close()), int(save),
                 save_failed, int(self._bad_data is not None)]
        signal, notice, deadline, save_any, failed, bad_data = self.sync.sum_ints(
            flags, f"agree whether to stop or save at step {run.step}")
        if failed:
            self.saving.fail(failed)
        self.ranks_signalled = signal + notice
        reason = ("signal" if signal else "spot-notice" if notice else "deadline" if deadline else
                  "data" if bad_data else None)
        return reason, bool(save_any)

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
                                                     self.deadline.save_estimate_s, step=run.step or None))
            if not result["ok"]:
                saved = f"checkpoint of step {run.step} committed" if run.step else "no step was taken"
                self.reporter.warn(f"deadline: {saved}, but no verified export ({result['why']}): exit 75; "
                                   "run again, or `trainproof export` later")
        ok, = self.sync.sum_ints([int(result["ok"])], "agree whether the deadline export passed")
        return {**result, "ok": bool(ok)} if self.rank == 0 else {"ok": bool(ok)}

    def _capture(self, run: Run) -> Capture:
        """What this rank commits of this step: rank 0 the state, the others their part; when sharded, its shards."""
        extra = {"task": self.cfg.task, "epoch": run.sampler.epoch, "loss": run.history.last_row["loss"],
                 "next_lr": run.lr(), "world": self.world, "resumed_from": self.resumed.step,
                 "code_changes": self.resumed.code_changes}
        if self.saving.checkpointer.keep_every is not None:  # the rule `ls` and `gc` read back
            extra["keep_every"] = str(self.saving.checkpointer.keep_every)
        state = capture_state(run, self._meta(run)) if self.rank == 0 else None
        frozen: dict[str, Any] = {}
        if state is not None and run.parallel.inline_state:  # sharded: the frozen parameters stay in the shards
            found = split_frozen(state["model"], frozen_keys(run.model))
            if found:
                state["meta"] = {**state["meta"], "frozen": {"keys": sorted(found)}}
                frozen = self.saving.checkpointer.frozen_capture(found)
        return Capture(step=run.step, extra=extra, state=state, **frozen,
                       part=capture_rank_part(run) if self.rank else None,
                       sharded=run.parallel.capture(run.model, run.optimizer))

    def _committed(self, step: int) -> None:
        """Generation ``step`` landed (on every rank): its history rows live in the store now, so the run's history
        keeps only the later ones (after a failed or skipped save the rows stay for the next generation)."""
        if self._live is not None:
            self._live.history.committed(step)

    def _observe_save(self, seconds: float | None = None) -> None:
        """A deadline reserves each commit's measured time (serialise → COMPLETE.json), the export and its check."""
        if seconds is not None:
            self.deadline.observe_save(seconds)
        if self.finisher is not None:
            self.deadline.finish_s = self.finisher.estimate_s(self.deadline.save_estimate_s)

    def _meta(self, run: Run) -> dict[str, Any]:
        return {
            "contract": self.plan["contract"], "world": self.world, "world_changes": self.resumed.world_changes,
            "task": self.cfg.task, "task_config": self.task.config(), "seed": self.cfg.seed,
            "objective": self.task.objective, "data_identity": self.plan["data_identity"],
            "code_version": code_version(), "code_changes": self.resumed.code_changes,
            "versions": runtime_versions(), "device": str(self.device),
            "amp": run.use_amp, "autocast": None if run.autocast is None else str(run.autocast).removeprefix("torch."),
            "epoch_plan": self.epoch_plan, **self.layout.record(),
            # Per invocation, like the trainer's settings: the step this process restored (None: a fresh start).
            "trainer": {**self.cfg.recorded(), "resumed_from": self.resumed.step},
        }

    def _write_summary(self, run: Run, outcome: Outcome) -> None:
        """Run-level ``summary.json`` (overwritten by each process; a failure costs no work)."""
        last = run.history.last_row or {}
        saves = [r["seconds"] for r in self.saving.checkpointer.records]
        summary = {
            "schema": "trainproof.summary/1", "status": "completed" if outcome.exit_code == 0 else "stopped",
            "reason": outcome.reason, "exit_code": outcome.exit_code, "task": self.cfg.task,
            "contract": self.plan["contract"], "step": run.step, "target": outcome.target,
            "committed_step": outcome.committed_step,
            "resumed_from": self.resumed.step, "epoch": run.sampler.epoch, "last_loss": last.get("loss"),
            "next_lr": run.lr(), "checkpoints": self.saving.checkpointer.records,
            "save_seconds_max": max(saves) if saves else None, "throughput": self.reporter.throughput(),
            "signals": self.stop.signals, "notices": self.stop.notices, "export": outcome.export,
            "device": str(self.device), "code_version": code_version(),
            "ranks_signalled": self.ranks_signalled, "world": self.world, "world_changes": self.resumed.world_changes,
            "bitwise_comparable": not self.resumed.world_changes, "code_changes": self.resumed.code_changes,
            "started_at": self.started_at.isoformat(timespec="seconds"),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        try:
            self.store.write_file(SUMMARY_FILE, json.dumps(summary, indent=2).encode() + b"\n")
        except (StoreError, OSError) as exc:
            self.reporter.warn(f"could not write {SUMMARY_FILE}: {exc}")


def _open_store(url: str) -> GenerationStore:
    try:
        return open_store(url, StoreOptions.from_env())
    except StoreConfigError as exc:
        raise ConfigError(f"--store {url}: {exc}") from None
