"""The live training objects of one run, one optimizer step, and state capture/restore.

Order matters and is the protocol's (PROTOCOL.md):

1. seed the generators, build model, optimizer and scheduler (the scheduler is constructed *before*
   ``optimizer.load_state_dict``: constructing it afterwards would overwrite the restored learning rate);
2. load model, scheduler and optimizer states, GradScaler, data position, history, progress;
3. restore the random generators LAST, right before training continues, and prove the restore by
   re-observing the next draws recorded at save time.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from job import rng
from job.data import EpochSampler
from job.errors import ConfigError, StateError
from job.state import STATE_SCHEMA, History
from job.tasks.base import Task, TaskContext


@dataclass(kw_only=True)
class Run:
    """Everything that changes while training, in one place."""

    task: Task
    device: torch.device
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler | None
    scaler: torch.amp.GradScaler
    sampler: EpochSampler
    np_gen: np.random.Generator
    use_amp: bool
    history: History = field(default_factory=History)
    step: int = 0
    samples_seen: int = 0
    targets_seen: int = 0

    @property
    def cuda(self) -> bool:
        """Whether CUDA generators are in play."""
        return self.device.type == "cuda"

    def lr(self) -> float:
        """Learning rate the next optimizer step will apply (first parameter group)."""
        return float(self.optimizer.param_groups[0]["lr"])


def build_run(task: Task, device: torch.device, seed: int) -> Run:
    """Seed every generator, then build model, optimizer, scheduler, scaler and sampler, in that order."""
    np_gen = rng.seed_all(seed)
    model = task.build_model().to(device=device, dtype=task.dtype)
    model.train()
    optimizer = task.build_optimizer(model)
    scheduler = task.build_scheduler(optimizer)
    use_amp = task.use_amp(device)
    scaler = torch.amp.GradScaler(device.type, enabled=use_amp)
    sampler = EpochSampler(task.num_samples(), np_gen)
    return Run(task=task, device=device, model=model, optimizer=optimizer, scheduler=scheduler,
               scaler=scaler, sampler=sampler, np_gen=np_gen, use_amp=use_amp)


def train_step(run: Run) -> dict[str, Any]:
    """One optimizer step over the next batch, accumulated over its micro-batches.

    The loss is the global mean over the step's real targets: each micro-batch's *sum* of target
    losses is divided by the target count of the whole step, so micro-batches of different sizes (the
    epoch's tail, variable-length sequences) weigh exactly what their targets weigh.
    """
    t0 = time.perf_counter()
    task = run.task
    ids = run.sampler.next_ids(task.batch_size)
    chunks = [ids[i : i + task.micro_batch_size] for i in range(0, len(ids), task.micro_batch_size)]
    # Note: a distributed run all-reduces this count (one integer) before the first backward.
    count = sum(task.count_targets(c) for c in chunks)
    if count < 1:
        raise ConfigError(f"the task counts no targets in the samples of step {run.step + 1}: {ids[:8]}...")
    lr = run.lr()
    run.optimizer.zero_grad(set_to_none=True)
    loss_total = torch.zeros((), dtype=torch.float64, device=run.device)
    ctx = TaskContext(np_rng=run.np_gen, device=run.device)
    for chunk in chunks:
        batch = task.make_batch(chunk, ctx)
        with _autocast(run):
            loss_sum = task.loss_sum(run.model, batch)
        run.scaler.scale(loss_sum / count).backward()
        loss_total += loss_sum.detach().to(torch.float64)
    _optimizer_update(run)
    run.step += 1
    run.samples_seen += len(ids)
    run.targets_seen += count
    loss = float(loss_total / count)
    run.history.append(step=run.step, epoch=run.sampler.epoch, loss=loss, lr=lr, targets=count, sample_ids=ids)
    return {"step": run.step, "epoch": run.sampler.epoch, "loss": loss, "lr": lr, "samples": len(ids),
            "targets": count, "step_seconds": time.perf_counter() - t0}


def _autocast(run: Run) -> contextlib.AbstractContextManager[Any]:
    if not run.use_amp:
        return contextlib.nullcontext()
    return torch.autocast(device_type=run.device.type, dtype=torch.float16)


def _optimizer_update(run: Run) -> None:
    """Unscale and clip (when asked), step through the GradScaler, then advance the schedule."""
    if run.task.grad_clip:
        run.scaler.unscale_(run.optimizer)
        nn.utils.clip_grad_norm_(run.model.parameters(), run.task.grad_clip)
    run.scaler.step(run.optimizer)
    run.scaler.update()
    if run.scheduler is not None:
        run.scheduler.step()


def capture_state(run: Run, meta: dict[str, Any]) -> dict[str, Any]:
    """The full training state at the current optimizer-step boundary (see job.state for the layout)."""
    rank_part = {
        "rank": 0,
        "rng": rng.capture(run.np_gen, cuda=run.cuda),
        "data": run.sampler.state_dict(),
        # Observed, then put back: lets the loader (and the verifier) prove the generators continue.
        "next_draws": rng.observe_next_draws(run.np_gen, cuda=run.cuda),
    }
    return {
        "schema": STATE_SCHEMA,
        "meta": meta,
        "progress": {"step": run.step, "epoch": run.sampler.epoch, "samples_seen": run.samples_seen,
                     "targets_seen": run.targets_seen, "next_lr": run.lr()},
        "model": run.model.state_dict(),
        "optimizer": run.optimizer.state_dict(),
        "scheduler": None if run.scheduler is None else run.scheduler.state_dict(),
        "scaler": run.scaler.state_dict(),
        "history": run.history.state_dict(),
        "ranks": [rank_part],
    }


def restore_state(run: Run, state: dict[str, Any], *, restore_rng: bool = True) -> None:
    """Load ``state`` into a freshly built run; generators last (skipped for the negative control)."""
    rank_part = state["ranks"][0]
    _load("model", lambda: run.model.load_state_dict(state["model"]))
    if (run.scheduler is None) != (state["scheduler"] is None):
        raise StateError("the state and the task disagree on whether a learning-rate scheduler exists")
    if run.scheduler is not None:
        _load("scheduler", lambda: run.scheduler.load_state_dict(state["scheduler"]))
    _load("optimizer", lambda: run.optimizer.load_state_dict(state["optimizer"]))
    _load_scaler(run, state["scaler"])
    run.sampler.load_state_dict(rank_part["data"])
    run.history = History.from_state_dict(state["history"])
    progress = state["progress"]
    run.step, run.samples_seen, run.targets_seen = progress["step"], progress["samples_seen"], progress["targets_seen"]
    if restore_rng:
        restore_generators(run, rank_part)


def restore_generators(run: Run, rank_part: dict[str, Any]) -> None:
    """Restore every generator and check that each one's next draw is the one observed at save time."""
    rng.restore(rank_part["rng"], run.np_gen, cuda=run.cuda)
    observed = rng.observe_next_draws(run.np_gen, cuda=run.cuda)
    saved = rank_part.get("next_draws", {})
    differing = sorted(k for k in observed if k in saved and observed[k] != saved[k])
    if differing:
        raise StateError(f"restored generators {differing} do not reproduce the draws observed at save time")


def _load(what: str, load: Any) -> None:
    try:
        load()
    except (RuntimeError, KeyError, ValueError, TypeError, IndexError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise StateError(f"the saved {what} state does not fit this task's {what}: {first}") from None


def _load_scaler(run: Run, scaler_state: dict[str, Any]) -> None:
    if run.scaler.is_enabled():
        if not scaler_state:
            raise StateError("the state has no GradScaler state but this run trains with AMP")
        _load("GradScaler", lambda: run.scaler.load_state_dict(scaler_state))
