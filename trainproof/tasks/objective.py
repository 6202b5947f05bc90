"""The task the verifier's objective check trains (``train --objective-check``): a deterministic, float64
view of any task, with the step's split into micro-batches chosen by the check.

The objective check (trainproof.proof.objective) asks whether the trainer really optimises the objective the run
declares: the global mean over every target of a step, whatever its split into micro-batches and ranks.
To compare splits to ~1e-12 every random draw must be gone and the arithmetic must be float64, so this
wrapper takes the task's :meth:`~trainproof.tasks.Task.deterministic_objective` variant, sets every ``nn.Dropout``
module's p to 0, casts floating batch tensors to float64, and overrides ``batch_size`` and
``micro_batch_size``. Everything else (data, model, optimizer, scheduler, loss, target counts) is the
user's own code, unchanged: that is what is being checked.
"""

from __future__ import annotations

import functools
import json
import types
from typing import Any

import torch
from torch import nn

from trainproof.errors import ConfigError
from trainproof.tasks.base import Task, TaskContext, require
from trainproof.tasks.batches import BatchRequest, map_tensors


class ObjectiveCheckTask(Task):
    """``task.deterministic_objective()`` in float64, dropout off, with the given step split."""

    dtype = torch.float64
    cpu_threads = 1
    precision = "fp32"  # float64 arithmetic: no autocast, whatever the task trains with

    def __init__(self, task: Task, *, batch_size: int | None = None, micro_batch_size: int | None = None,
                 record_targets: bool = False) -> None:
        self.inner = task.deterministic_objective()
        self.record_targets = record_targets
        same_task(task, self.inner)
        self._batch = batch_size or task.batch_size
        self._micro = micro_batch_size or min(task.micro_batch_size, self._batch)
        require(1 <= self._micro <= self._batch, "objective check: need 1 <= micro_batch_size <= batch_size")
        self.objective, self.grad_clip = self.inner.objective, self.inner.grad_clip
        self.supports_cuda, self.default_steps = self.inner.supports_cuda, self.inner.default_steps
        self.eval_metric, self.fsdp = self.inner.eval_metric, task.fsdp
        self.num_workers, self.prefetch = self.inner.num_workers, self.inner.prefetch

    @property
    def batch_size(self) -> int:
        return self._batch

    @property
    def micro_batch_size(self) -> int:
        return self._micro

    def config(self) -> dict[str, Any]:
        # The split and dtype are part of this run's contract: the check's runs are experiments of their own.
        return {**self.inner.config(), "objective_check": {"batch_size": self._batch,
                                                           "micro_batch_size": self._micro, "dtype": "float64"}}

    def num_samples(self) -> int:
        return self.inner.num_samples()

    def data_identity(self) -> str:
        return self.inner.data_identity()

    def build_model(self) -> nn.Module:
        model = self.inner.build_model()
        for module in model.modules():
            # The trainer keeps the model in training mode: dropout must be off by value (modules, and the
            # attention dropout MultiheadAttention applies functionally, e.g. inside nn.TransformerEncoderLayer).
            if isinstance(module, nn.modules.dropout._DropoutNd):
                module.p = 0.0
            elif isinstance(module, nn.MultiheadAttention):
                module.dropout = 0.0
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return self.inner.build_optimizer(model)

    def fsdp_modules(self, model: nn.Module) -> list[nn.Module]:
        return self.inner.fsdp_modules(model)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> Any:
        return self.inner.build_scheduler(optimizer)

    def count_targets(self, sample_ids: list[int]) -> int:
        return self.inner.count_targets(sample_ids)

    def make_batch(self, sample_ids: list[int], ctx: TaskContext) -> Any:
        return _float64(self.inner.make_batch(sample_ids, ctx))

    @property
    def builds_batches(self) -> bool:
        return self.inner.builds_batches

    def build_batch(self, request: BatchRequest) -> Any:
        return self.inner.build_batch(request)

    def batch_to_device(self, batch: Any, device: torch.device) -> Any:
        return _float64(self.inner.batch_to_device(batch, device))

    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        loss = self.inner.loss_sum(model, batch)
        if self.record_targets:
            print(json.dumps({"event": "target_losses", "loss_sum": float(loss.detach()),
                              **given_targets(self.inner, model, batch)}), flush=True)
        return loss

    def use_amp(self, device: torch.device) -> bool:
        return False  # float64 arithmetic: no autocast

    def pretrained(self) -> list[Any]:
        return self.inner.pretrained()  # the same starting point as the run it checks

    def pretrained_name(self, name: str) -> str | None:
        return self.inner.pretrained_name(name)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def evaluate(self, model: nn.Module) -> float:
        return self.inner.evaluate(model)

    def evaluate_metrics(self, model: nn.Module) -> dict[str, float]:
        return self.inner.evaluate_metrics(model)


def given_targets(task: Task, model: nn.Module, batch: Any) -> dict[str, Any]:
    """What ``task.target_losses`` gives for ``model`` and ``batch`` (no gradient, under a fork of the generators,
    so the run computes exactly what it would without it): ``{"given": False}`` when it gives nothing, else each
    sample's sum of target losses and number of targets (``sample_sums``, ``sample_targets``) and the sum of their
    magnitudes (``abs_sum``, for the tolerance). The objective
    check's ``single`` run prints it as a ``target_losses`` event (JSON log lines), after each ``loss_sum``."""
    with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model)):
        losses = task.target_losses(model, batch)
    if losses is None:
        return {"given": False}
    rows = list(losses) if not isinstance(losses, torch.Tensor) or losses.dim() >= 1 else [losses]
    if not all(isinstance(r, torch.Tensor) and r.is_floating_point() for r in rows):
        raise ConfigError(f"{type(task).__qualname__}.target_losses must return a floating-point tensor (samples,) or "
                          "(samples, targets), or a list of 1-D tensors (one per sample), or None")
    return {"given": True, "sample_sums": [float(r.double().sum()) for r in rows],
            "sample_targets": [int(r.numel()) for r in rows],
            "abs_sum": float(sum(r.double().abs().sum() for r in rows))}


def _cuda_devices(model: nn.Module) -> list[int]:
    return sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})


def _float64(value: Any) -> Any:
    """Every floating tensor of a batch as float64 (in mappings, sequences, named tuples and dataclasses:
    trainproof.tasks.batches.map_tensors); everything else unchanged."""
    return map_tensors(value, lambda t: t.to(torch.float64) if t.is_floating_point() else t)


def same_task(task: Task, variant: Task) -> None:
    """Refuse (ConfigError: exit 2, one line) a ``deterministic_objective()`` that is not ``task`` itself with its
    draws switched off: another class, or another function in place of one of the task's own (its loss, its model
    factory, its collate). An attribute set to None in the variant is a draw switched off (``DatasetTask`` drops
    ``augment``)."""
    name = type(task).__qualname__
    fix = (f"make {name}.deterministic_objective() return this task's own class with only its random draws switched "
           f"off (e.g. clone = copy.copy(self); clone.noise = 0.0; return clone), so the objective check trains "
           f"your loss_sum and model (docs/tasks.md, deterministic_objective)")
    if type(variant) is not type(task):
        raise ConfigError(f"objective check: {name}.deterministic_objective() returned a "
                          f"{type(variant).__module__}.{type(variant).__qualname__}, not a {name}: {fix}")
    theirs = vars(variant)
    for key, value in vars(task).items():
        mine = _function_identity(value)
        if mine is None or theirs.get(key) is None:
            continue
        if _function_identity(theirs.get(key)) != mine:
            raise ConfigError(f"objective check: {name}.deterministic_objective() replaced the task's {key!r} "
                              f"({_shown(value)}) by {_shown(theirs.get(key))}: {fix}")


def _function_identity(value: Any) -> Any:
    """What makes a function attribute the same function: its code (a lambda rebuilt by the factory is the same);
    None for a value that is not a function."""
    if isinstance(value, types.MethodType):
        return ("method", _function_identity(value.__func__))
    if isinstance(value, functools.partial):
        return ("partial", _function_identity(value.func), len(value.args), tuple(sorted(value.keywords)))
    if isinstance(value, types.FunctionType):
        return ("function", value.__code__)
    if isinstance(value, types.BuiltinFunctionType):
        return ("builtin", value)
    return None


def _shown(value: Any) -> str:
    return getattr(value, "__qualname__", None) or type(value).__qualname__
