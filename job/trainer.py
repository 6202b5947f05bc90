"""``trainproof train``: resume from the newest usable generation, train, checkpoint, stop cleanly.

Read :meth:`Trainer.run` top to bottom: build, resume (generators restored last), loop until the target
or a stop request, commit, summarise. Exit codes: 0 target reached, 75 stopped early after committing
(run again to resume), 2 configuration/contract error, 1 anything else.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import torch

import job
from job.checkpoint import Checkpointer, SaveClock, sleep_for_test_hook
from job.config import TrainConfig
from job.contract import build_plan, ensure_plan
from job.data import epoch_plan
from job.errors import ConfigError, ContractError
from job.preempt import Deadline, StopRequest
from job.progress import Reporter, make_reporter
from job.run import Run, build_run, capture_state, restore_state, train_step
from job.state import STATE_FILE, Expected, check_consistency, decode, runtime_versions
from job.tasks import Task, load_task
from storage import COMPLETE, INCOMPLETE, GenerationStore, StoreOptions, open_store
from storage.errors import StoreConfigError, StoreError

WORLD = 1  # Note: single process for now; the distributed issue adds world > 1 (per-rank files).
EXIT_OK, EXIT_STOPPED = 0, 75
SUMMARY_FILE = "summary.json"
STEP_DELAY_ENV = "TRAINPROOF_TEST_STEP_DELAY"  # test-only: slows each step so signals land mid-run


def code_version() -> str:
    """The code identity recorded in every state and generation."""
    return f"trainproof {job.__version__}"


@dataclass(kw_only=True)
class Outcome:
    """How a ``train`` invocation ended."""

    exit_code: int
    """0, or 75 when stopped early after committing."""
    reason: str
    """``target``, ``signal`` or ``deadline``."""
    step: int
    """Step reached (and committed)."""
    target: int
    """Step aimed at."""


def train(cfg: TrainConfig, *, store: GenerationStore | None = None, stop: StopRequest | None = None,
          reporter: Reporter | None = None) -> Outcome:
    """Run one ``train`` invocation. Raises job.errors.TrainError subclasses on handled failures.

    ``store`` is the opened run (default: ``cfg.store`` with options from the environment). ``stop`` is an
    already-entered StopRequest (the CLI installs it before importing torch, so a SIGTERM during start-up
    is honoured too); without one, handlers are installed here.
    """
    with contextlib.nullcontext(stop) if stop is not None else StopRequest() as stop:
        task = load_task(cfg.task, cfg.task_config)
        device = resolve_device(cfg.device, task)
        configure_determinism(task, device)
        store = store or _open_store(cfg.store)
        plan = ensure_plan(store, build_plan(
            task=cfg.task, task_config=task.config(), data_identity=task.data_identity(), seed=cfg.seed,
            world=WORLD, objective=task.objective, code_version=code_version(),
        ))
        with reporter or make_reporter(cfg.log_format, log_every=cfg.log_every) as rep:
            return Trainer(cfg, task=task, device=device, store=store, plan=plan, reporter=rep, stop=stop).run()


class Trainer:
    """One process's training session over a run in the store."""

    def __init__(self, cfg: TrainConfig, *, task: Task, device: torch.device, store: GenerationStore,
                 plan: dict[str, Any], reporter: Reporter, stop: StopRequest) -> None:
        self.cfg, self.task, self.device, self.store, self.plan = cfg, task, device, store, plan
        self.reporter, self.stop = reporter, stop
        self.epoch_plan = epoch_plan(task.num_samples(), task.batch_size, WORLD)
        self.deadline = Deadline(cfg.deadline, margin_s=cfg.deadline_margin_s)
        self.clock = SaveClock(cfg.checkpoint_every, cfg.checkpoint_every_seconds)
        self.checkpointer = Checkpointer(store, contract=plan["contract"], world=WORLD, code_version=code_version(),
                                         keep=cfg.keep, reporter=reporter)
        self.started_at = datetime.now(timezone.utc)

    def run(self) -> Outcome:
        """Build, resume, train to the target or a stop request, commit, summarise."""
        run = build_run(self.task, self.device, self.cfg.seed)
        resumed_from = self._resume(run)  # generators are restored here, last, right before the loop
        target = self.cfg.target_step(run.step, self.task.default_steps)
        self.reporter.event("start", task=self.cfg.task, step=run.step, target=target, device=str(self.device),
                            contract=self.plan["contract"], store=self.store.url, epoch_plan=self.epoch_plan,
                            deadline=None if self.cfg.deadline is None else self.cfg.deadline.isoformat())
        self.reporter.begin(step=run.step, target=target)
        reason = self._loop(run, target)
        if run.step > self.checkpointer.last_step:  # the end, or the boundary after a stop request
            self._save(run)
        exit_code = EXIT_OK if run.step >= target else EXIT_STOPPED
        outcome = Outcome(exit_code=exit_code, reason=reason, step=run.step, target=target)
        self._write_summary(run, outcome, resumed_from)
        self.reporter.event("done" if exit_code == EXIT_OK else "stopped", step=run.step, target=target,
                            reason=reason, exit_code=exit_code, signals=self.stop.signals)
        return outcome

    def _loop(self, run: Run, target: int) -> str:
        """Optimizer steps until the target, checking for stop requests only at step boundaries."""
        while run.step < target:
            if self.stop.requested:
                return "signal"
            if self.deadline.too_close():
                return "deadline"
            t0 = time.perf_counter()
            record = train_step(run)
            sleep_for_test_hook(STEP_DELAY_ENV)
            self.deadline.observe_step(time.perf_counter() - t0)
            self.reporter.step(record, target=target)
            if self.clock.due(run.step):
                self._save(run)
        return "target"

    def _resume(self, run: Run) -> int | None:
        """Load the newest usable generation of this run into ``run``; None when starting fresh."""
        if self.cfg.resume == "never":
            self._refuse_existing_generations()
            return None
        decoded: dict[int, Any] = {}

        def check(name: str, data: bytes) -> None:
            if name == STATE_FILE:
                decoded.clear()  # hold at most one decoded candidate in memory
                decoded[id(data)] = (data, decode(data))  # keeps `data` alive, so its id stays unique

        loaded = self.store.load_latest(contract=self.plan["contract"], world=WORLD, check=check)
        if loaded is None:
            self._warn_if_unusable_generations()
            return None
        data = loaded.files[STATE_FILE]
        state = decoded[id(data)][1] if id(data) in decoded else decode(data)
        for warning in check_consistency(state, self._expected(loaded.info.step)) + self._device_warnings(state):
            self.reporter.warn(warning)
        restore_state(run, state, restore_rng=not self.cfg.omit_rng_restore)
        self.checkpointer.last_step = run.step
        self.reporter.event("resume", step=run.step, generation=loaded.info.name,
                            rng_restored=not self.cfg.omit_rng_restore)
        return run.step

    def _save(self, run: Run) -> None:
        self.reporter.event("checkpoint_begin", step=run.step)
        t0 = time.perf_counter()
        state = capture_state(run, self._meta(run))
        extra = {"task": self.cfg.task, "epoch": run.sampler.epoch, "loss": run.history.row(-1)["loss"],
                 "next_lr": run.lr()}
        self.checkpointer.commit(run.step, state, extra=extra)
        self.deadline.observe_save(time.perf_counter() - t0)
        self.clock.mark()

    def _meta(self, run: Run) -> dict[str, Any]:
        return {
            "contract": self.plan["contract"], "world": WORLD, "task": self.cfg.task,
            "task_config": self.task.config(), "seed": self.cfg.seed, "objective": self.task.objective,
            "data_identity": self.plan["data_identity"], "code_version": code_version(),
            "versions": runtime_versions(), "device": str(self.device), "amp": run.use_amp,
            "epoch_plan": self.epoch_plan, "trainer": self.cfg.recorded(),
        }

    def _expected(self, step: int) -> Expected:
        return Expected(contract=self.plan["contract"], world=WORLD, code_version=code_version(),
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
        scan = self.store.scan(contract=self.plan["contract"], world=WORLD)
        present = [g for g in scan if g.status != INCOMPLETE]
        if present:
            self.reporter.warn(f"{len(present)} generation(s) in {self.store.url} but none is usable by this "
                               "run: starting from step 0")

    def _write_summary(self, run: Run, outcome: Outcome, resumed_from: int | None) -> None:
        """Run-level ``summary.json`` (overwritten by each process; a failure costs no work)."""
        last = run.history.row(-1) if len(run.history) else {}
        saves = [r["seconds"] for r in self.checkpointer.records]
        summary = {
            "schema": "trainproof.summary/1", "status": "completed" if outcome.exit_code == 0 else "stopped",
            "reason": outcome.reason, "exit_code": outcome.exit_code, "task": self.cfg.task,
            "contract": self.plan["contract"], "step": run.step, "target": outcome.target,
            "resumed_from": resumed_from, "epoch": run.sampler.epoch, "last_loss": last.get("loss"),
            "next_lr": run.lr(), "checkpoints": self.checkpointer.records,
            "save_seconds_max": max(saves) if saves else None, "throughput": self.reporter.throughput(),
            "signals": self.stop.signals, "device": str(self.device), "code_version": code_version(),
            "started_at": self.started_at.isoformat(timespec="seconds"),
            "finished_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        }
        try:
            self.store.write_file(SUMMARY_FILE, json.dumps(summary, indent=2).encode() + b"\n")
        except (StoreError, OSError) as exc:
            self.reporter.warn(f"could not write {SUMMARY_FILE}: {exc}")


def resolve_device(choice: str, task: Task) -> torch.device:
    """``cpu``, ``cuda`` (refused when absent or unsupported by the task), or ``auto``."""
    if choice == "cuda":
        if not task.supports_cuda:
            raise ConfigError("this task runs on the CPU only (its results are defined on the CPU)")
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but no CUDA device is visible")
    if choice == "cuda" or (choice == "auto" and task.supports_cuda and torch.cuda.is_available()):
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
    torch.use_deterministic_algorithms(True, warn_only=device.type == "cuda")


def _open_store(url: str) -> GenerationStore:
    try:
        return open_store(url, StoreOptions.from_env())
    except StoreConfigError as exc:
        raise ConfigError(f"--store {url}: {exc}") from None
