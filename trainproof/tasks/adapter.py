"""``DatasetTask``: a :class:`~trainproof.tasks.base.Task` from a map-style Dataset, a model factory and a per-target
loss.

The adapter does the parts of a task that are easy to get subtly wrong:

- **the objective**: ``per_sample_loss(model, batch)`` returns the *unreduced* losses, one per target
  (shape ``(n,)`` with one target per sample, ``(n, targets_per_sample)`` otherwise); the adapter checks
  the shape and returns their **sum**, and :meth:`count_targets` is the exact count
  (``len(ids) * targets_per_sample``), so the trainer's global mean is exact under gradient accumulation
  and across ranks. A mean (a scalar) or a wrongly shaped loss is refused with a ConfigError (exit 2);
- **batches built ahead**: the adapter implements :meth:`build_batch`, so its micro-batches are loaded, augmented
  and collated by ``num_workers`` DataLoader worker processes ahead of the step (0: in the training process), and
  moved to the device when the step consumes them. A dataset with ``__getitems__(ids)`` (a bucket dataset,
  trainproof.data) is asked for a micro-batch's samples at once;
- **randomness**: samples come from ``dataset[i]``, which must be deterministic; augmentation goes through
  ``augment(sample, rng)`` with the sample's own generator, derived from (run seed, epoch, sample id)
  (trainproof.tasks.batches), so a sample's augmentation is the same whatever the worker count or a resume; Python's
  ``random``, NumPy's and torch's global generators are seeded from it too for the call. Dropout and other draws
  of the model use torch's global generator in the training process, which the trainer owns. The adapter itself
  draws nothing;
- **the run contract**: ``config`` (the complete, resolved settings of the user's factory) is what
  :meth:`config` returns, so ``factory(task.config())`` must rebuild the same task (the export's reload
  check and ``verify --audit`` do exactly that); ``data_identity`` defaults to the dataset's own
  ``data_identity`` attribute (a bucket dataset's manifest digest), else a sha256 over every sample.

Example::

    def factory(config):
        cfg = config_from_dict(MyConfig, config)
        return DatasetTask(
            dataset=MyDataset(cfg), build_model=lambda: MyNet(cfg), per_sample_loss=my_loss,
            config=asdict(cfg), batch_size=cfg.batch_size, lr=cfg.lr,
        )
"""

from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
from torch import nn
from torch.utils.data import Dataset, default_collate

from trainproof.errors import ConfigError
from trainproof.tasks.base import Pretrained, Task, check_precision, eval_mode, require
from trainproof.tasks.batches import BatchRequest, sample_generators, to_device

__all__ = ["AdaptedBatch", "DatasetTask", "OPTIMIZERS", "dataset_digest", "to_device"]

OPTIMIZERS: dict[str, type[torch.optim.Optimizer]] = {
    "sgd": torch.optim.SGD,
    "adam": torch.optim.Adam,
    "adamw": torch.optim.AdamW,
}
"""Optimizers by name (their settings are the adapter's arguments, which the user's config must hold)."""


@dataclass(frozen=True)
class AdaptedBatch:
    """One micro-batch as the adapter hands it to the trainer: the collated data and what it must yield."""

    data: Any
    """What ``collate`` made of the samples, on the run's device."""
    samples: int
    """Samples in the micro-batch."""
    targets: int
    """Targets the per-target loss must cover (``samples * targets_per_sample``)."""

    def pin_memory(self) -> AdaptedBatch:
        """The batch with its tensors in page-locked memory (DataLoader's ``pin_memory`` calls this on CUDA runs)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        return AdaptedBatch(data=pin_memory(self.data), samples=self.samples, targets=self.targets)


class DatasetTask(Task):
    """A task from a map-style ``torch.utils.data.Dataset`` (see the module docstring).

    Keyword arguments:

    - ``dataset``: ``len(dataset)`` samples; ``dataset[i]`` must return the same sample every time;
    - ``build_model()``: a freshly initialised model (draws from the global PyTorch generator only);
    - ``per_sample_loss(model, batch)``: unreduced losses of a collated batch, ``(n,)`` or
      ``(n, targets_per_sample)``;
    - ``config``: the factory's complete, resolved settings (JSON-able). It is the task's part of the run
      contract and ``factory(config)`` must rebuild this task, so every value that shapes training
      (batch size, learning rate, model size, data selection) should come from it;
    - ``batch_size`` / ``micro_batch_size``: samples per optimizer step / per forward and backward;
    - ``optimizer`` (``sgd``, ``adam``, ``adamw``), ``lr``, ``weight_decay``, ``optimizer_options``
      (e.g. ``{"betas": [0.9, 0.95]}``);
    - ``lr_schedule(step) -> factor``: a plain function for ``LambdaLR``, or None for a constant rate;
    - ``scheduler(optimizer) -> scheduler``: any other learning-rate scheduler instead (a ``OneCycleLR``, a
      ``ReduceLROnPlateau``); ``scheduler_metric`` (``train_loss``, or ``eval_metric`` or a key of ``eval_metrics``,
      evaluated on ``eval_dataset``) and ``scheduler_every`` (optimizer steps between its steps): what a
      ``ReduceLROnPlateau`` is stepped on, and how often (as on :class:`Task`);
    - ``grad_clip``: max global gradient norm, or None;
    - ``augment(sample, rng) -> sample``: per-sample augmentation with the sample's own NumPy generator (run seed,
      epoch, sample id: trainproof.tasks.batches);
    - ``num_workers`` / ``prefetch``: DataLoader worker processes building micro-batches ahead, and micro-batches
      each builds ahead (``train --data-workers`` / ``--prefetch`` override them; neither changes results);
    - ``collate``: list of samples -> batch (default ``torch.utils.data.default_collate``); the batch's
      tensors are then moved to the run's device, floating-point ones cast to ``dtype``;
    - ``eval_collate``: the collate without random draws, for :meth:`evaluate` and for the verifier's objective check
      (:meth:`deterministic_objective`), e.g. ``default_collate`` beside a mixup ``collate``; default: ``collate``;
    - ``data_identity``: a sha256 hex of the exact data; default: the dataset's ``data_identity`` attribute when it
      has one (trainproof.data's bucket datasets), else computed over every sample once;
    - ``eval_dataset``: held-out samples for :meth:`evaluate` (the per-target mean loss), or None;
    - ``eval_metrics``: further metrics of the same evaluation, ``{name: per_sample(model, batch)}``; each function
      returns one value per target like ``per_sample_loss`` (e.g. ``(model(x).argmax(1) == y).float()`` for
      ``accuracy``) and the metric is their mean over ``eval_dataset``. Exports record them beside ``eval_metric``;
    - ``objective``, ``cpu_threads`` (default 1: bitwise-reproducible CPU runs), ``dtype``,
      ``supports_cuda``, ``default_steps``, ``precision`` (``auto``, ``bf16``, ``fp16``, ``fp32``), ``tokenizer``:
      as on :class:`Task`;
    - ``pretrained``: weights files (:class:`~trainproof.tasks.base.Pretrained`) the model starts from on a fresh start;
    - ``pretrained_name``: the name in those files of a model entry, None for one they do not hold (it keeps its
      seeded initialisation), as :meth:`Task.pretrained_name`; e.g. :func:`trainproof.tasks.peft_base_name` for LoRA
      adapters on a published model. Default: the entry's own name;
    - ``verify_samples``: ``trainproof verify`` trains on the first this many samples (a short epoch for a large
      dataset; ``verify --samples`` overrides it), or None for all of them.
    """

    def __init__(
        self, *, dataset: Dataset, build_model: Callable[[], nn.Module],
        per_sample_loss: Callable[[nn.Module, Any], torch.Tensor], config: Mapping[str, Any], batch_size: int,
        micro_batch_size: int | None = None, targets_per_sample: int = 1, optimizer: str = "adamw",
        lr: float = 1e-3, weight_decay: float = 0.0, optimizer_options: Mapping[str, Any] | None = None,
        lr_schedule: Callable[[int], float] | None = None, grad_clip: float | None = None,
        augment: Callable[[Any, np.random.Generator], Any] | None = None,
        collate: Callable[[list[Any]], Any] = default_collate,
        eval_collate: Callable[[list[Any]], Any] | None = None, data_identity: str | None = None,
        eval_dataset: Dataset | None = None, eval_metric: str = "loss", objective: str = "per_target_mean_v1",
        cpu_threads: int | None = 1, dtype: torch.dtype = torch.float32, supports_cuda: bool = True,
        default_steps: int = 10, precision: str = "auto", pretrained: Sequence[Pretrained] = (),
        tokenizer: Any = None, num_workers: int = 0, prefetch: int = 2, verify_samples: int | None = None,
        eval_metrics: Mapping[str, Callable[[nn.Module, Any], torch.Tensor]] | None = None,
        scheduler: Callable[[torch.optim.Optimizer], Any] | None = None, scheduler_metric: str = "train_loss",
        scheduler_every: int = 1, pretrained_name: Callable[[str], str | None] | None = None,
    ) -> None:
        require(isinstance(config, Mapping), f"config must be a dict of settings, not {type(config).__name__}")
        try:
            # Round-trip through strict JSON now: a value that cannot enter the contract (a tensor, a NaN, a
            # tuple that would come back as a list) fails here, by name, not at the first checkpoint.
            self._config = json.loads(json.dumps(dict(config), allow_nan=False))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"DatasetTask: config must be JSON-able: {exc}") from None
        require(self._config == dict(config), "DatasetTask: config must survive a JSON round trip unchanged "
                                                "(use lists, not tuples; str keys)")
        require(len(dataset) >= 1, "DatasetTask: the dataset is empty")  # type: ignore[arg-type]
        require(batch_size >= 1, f"DatasetTask: batch_size must be >= 1 (got {batch_size})")
        micro = batch_size if micro_batch_size is None else micro_batch_size
        require(1 <= micro <= batch_size, f"DatasetTask: need 1 <= micro_batch_size <= batch_size (got {micro})")
        require(targets_per_sample >= 1, "DatasetTask: targets_per_sample must be >= 1")
        require(optimizer in OPTIMIZERS, f"DatasetTask: optimizer {optimizer!r} is not one of {sorted(OPTIMIZERS)}")
        require(lr > 0 and weight_decay >= 0, "DatasetTask: need lr > 0 and weight_decay >= 0")
        require(grad_clip is None or grad_clip > 0, "DatasetTask: grad_clip must be > 0 or None")
        require(data_identity is None or _is_sha256(data_identity),
                 "DatasetTask: data_identity must be a sha256 hex digest (64 lowercase hex digits)")
        require(isinstance(num_workers, int) and num_workers >= 0, "DatasetTask: num_workers must be >= 0")
        require(isinstance(prefetch, int) and prefetch >= 1, "DatasetTask: prefetch must be >= 1")
        require(verify_samples is None or (isinstance(verify_samples, int) and not isinstance(verify_samples, bool)
                                           and 1 <= verify_samples <= len(dataset)),  # type: ignore[arg-type]
                f"DatasetTask: verify_samples must be between 1 and the dataset's {len(dataset)} samples "  # type: ignore[arg-type]
                f"(got {verify_samples!r})")
        self.verify_samples = verify_samples
        self._eval_metrics = _checked_metrics(eval_metrics, eval_metric)
        _check_scheduler(lr_schedule, scheduler, scheduler_metric, scheduler_every,
                         metrics=[eval_metric, *self._eval_metrics] if eval_dataset is not None else [])
        self._scheduler, self.scheduler_metric, self.scheduler_every = scheduler, scheduler_metric, scheduler_every
        self.dataset, self.eval_dataset = dataset, eval_dataset
        self._build_model, self._per_sample_loss = build_model, per_sample_loss
        self._batch_size, self._micro_batch_size = batch_size, micro
        self.targets_per_sample = targets_per_sample
        self._optimizer = (OPTIMIZERS[optimizer], {"lr": lr, "weight_decay": weight_decay,
                                                    **dict(optimizer_options or {})})
        self._lr_schedule, self._augment, self._collate = lr_schedule, augment, collate
        require(eval_collate is None or callable(eval_collate), "DatasetTask: eval_collate must be a function or None")
        self._eval_collate, self._draws_off = eval_collate, False
        own = getattr(dataset, "data_identity", None)  # a bucket dataset knows its manifest's digest
        self._data_identity = data_identity or (own if _is_sha256(own) else None)
        self.num_workers, self.prefetch = num_workers, prefetch
        # Instance attributes shadow the Task class defaults the trainer reads.
        self.grad_clip, self.eval_metric, self.objective = grad_clip, eval_metric, objective
        self.cpu_threads, self.dtype, self.supports_cuda = cpu_threads, dtype, supports_cuda
        self.default_steps, self.precision, self.tokenizer = default_steps, check_precision(precision), tokenizer
        require(all(isinstance(p, Pretrained) for p in pretrained),
                "DatasetTask: pretrained must be a list of trainproof.tasks.Pretrained(url=..., sha256=...)")
        self._pretrained = list(pretrained)
        require(pretrained_name is None or callable(pretrained_name),
                "DatasetTask: pretrained_name must be a function (model entry name -> name in the files, or None)")
        self._pretrained_name = pretrained_name

    def pretrained(self) -> list[Pretrained]:
        return list(self._pretrained)

    def pretrained_name(self, name: str) -> str | None:
        return name if self._pretrained_name is None else self._pretrained_name(name)

    def deterministic_objective(self) -> DatasetTask:
        """This task without ``augment``, its batches collated with ``eval_collate`` when given (the objective check's
        variant; it switches dropout modules off itself)."""
        clone = copy.copy(self)
        clone._augment, clone._draws_off = None, True
        return clone

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def micro_batch_size(self) -> int:
        return self._micro_batch_size

    def config(self) -> dict[str, Any]:
        # A copy: the trainer hashes it into the contract and must not see later edits.
        return json.loads(json.dumps(self._config))

    def num_samples(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def data_identity(self) -> str:
        if self._data_identity is None:
            # Derived from the data alone (no training state): computing it once and keeping it is safe.
            self._data_identity = dataset_digest(self.dataset)
        return self._data_identity

    def build_model(self) -> nn.Module:
        model = self._build_model()
        require(isinstance(model, nn.Module), f"DatasetTask: build_model returned {type(model).__name__}, "
                                               "not a torch.nn.Module")
        return model

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        cls, options = self._optimizer
        # Frozen parameters (requires_grad=False: a LoRA run's base) are not the optimizer's: no state, no decay.
        return cls([p for p in model.parameters() if p.requires_grad], **options)

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        if self._scheduler is not None:
            return self._scheduler(optimizer)
        if self._lr_schedule is None:
            return None
        # LambdaLR's state_dict stores None for a plain function (weights-only safe); the factor comes back
        # from the code and the config on resume, never from the checkpoint.
        return torch.optim.lr_scheduler.LambdaLR(optimizer, self._lr_schedule)

    def count_targets(self, sample_ids: list[int]) -> int:
        return len(sample_ids) * self.targets_per_sample

    def build_batch(self, request: BatchRequest) -> AdaptedBatch:
        """The request's samples read (at once when the dataset has ``__getitems__``), each augmented with its own
        generator, and collated, on the CPU (in a worker process when ``num_workers`` > 0)."""
        ids = list(request.sample_ids)
        getitems = getattr(self.dataset, "__getitems__", None)
        samples = list(getitems(ids)) if callable(getitems) else [self.dataset[i] for i in ids]
        if self._augment is not None:
            augmented = []
            for i, sample in zip(ids, samples):
                with sample_generators(request.seed, request.epoch, i) as rng:
                    augmented.append(self._augment(sample, rng))
            samples = augmented
        collate = self._eval_collate if self._draws_off and self._eval_collate is not None else self._collate
        return AdaptedBatch(data=collate(samples), samples=len(ids), targets=self.count_targets(ids))

    def batch_to_device(self, batch: AdaptedBatch, device: torch.device) -> AdaptedBatch:
        # Floating inputs in the model's dtype (the trainer casts the model to ``dtype``, not the data).
        return AdaptedBatch(data=to_device(batch.data, device, self.dtype), samples=batch.samples,
                            targets=batch.targets)

    def loss_sum(self, model: nn.Module, batch: AdaptedBatch) -> torch.Tensor:
        losses = self._per_sample_loss(model, batch.data)
        self._check_losses(losses, batch)
        # At least float32 even under autocast: thousands of float16 terms lose digits in the sum.
        return losses.to(torch.promote_types(losses.dtype, torch.float32)).sum()

    def target_losses(self, model: nn.Module, batch: AdaptedBatch) -> torch.Tensor | None:
        """``per_sample_loss``'s values, one per target (the objective check compares the trained loss with their
        mean). None when a subclass counts its own targets (``count_targets``): its rows may then hold padding the
        count leaves out, so they are not known to be one value per target (implement ``target_losses`` there)."""
        if type(self).count_targets is not DatasetTask.count_targets:
            return None
        losses = self._per_sample_loss(model, batch.data)
        self._check_losses(losses, batch)
        return losses

    def _check_losses(self, losses: Any, batch: AdaptedBatch) -> None:
        self._check_values(losses, batch, "per_sample_loss")

    def _check_values(self, values: Any, batch: AdaptedBatch, what: str) -> None:
        """ConfigError naming ``what`` unless ``values`` is one floating-point value per target of ``batch``."""
        want = (batch.samples,) if self.targets_per_sample == 1 else (batch.samples, self.targets_per_sample)
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            raise ConfigError(f"{what} must return a floating-point tensor of shape {want}, "
                              f"got {type(values).__name__}" + (f" of {values.dtype} (use .float())"
                                                                 if isinstance(values, torch.Tensor) else ""))
        if tuple(values.shape) != want:
            hint = (" (a scalar: the values were reduced; use reduction='none')" if values.dim() == 0 else "")
            raise ConfigError(f"{what} returned shape {tuple(values.shape)}, expected {want}: one value "
                              f"per target, {batch.samples} samples x targets_per_sample={self.targets_per_sample}"
                              f"{hint}")

    def evaluate(self, model: nn.Module) -> float:
        """Per-target mean of ``per_sample_loss`` over ``eval_dataset``, in order, no augmentation, dropout off."""
        return self.evaluate_metrics(model)[self.eval_metric]

    def evaluate_metrics(self, model: nn.Module) -> dict[str, float]:
        """The evaluation loss and every ``eval_metrics`` entry, per-target means over ``eval_dataset`` in one pass
        (in order, no augmentation, dropout off, batches collated with ``eval_collate``, else ``collate``)."""
        if self.eval_dataset is None:
            raise NotImplementedError("DatasetTask: pass eval_dataset=... to make the task exportable")
        weight = next(model.parameters())
        totals = dict.fromkeys([self.eval_metric, *self._eval_metrics], 0.0)
        count = 0
        n = len(self.eval_dataset)  # type: ignore[arg-type]
        collate = self._eval_collate or self._collate
        with eval_mode(model):
            for start in range(0, n, self._micro_batch_size):
                ids = list(range(start, min(start + self._micro_batch_size, n)))
                data = to_device(collate([self.eval_dataset[i] for i in ids]), weight.device, weight.dtype)
                batch = AdaptedBatch(data=data, samples=len(ids), targets=len(ids) * self.targets_per_sample)
                totals[self.eval_metric] += float(self.loss_sum(model, batch).double())
                for name, per_sample in self._eval_metrics.items():
                    values = per_sample(model, batch.data)
                    self._check_values(values, batch, f"eval_metrics[{name!r}]")
                    totals[name] += float(values.double().sum())
                count += batch.targets
        return {name: total / count for name, total in totals.items()}


def _check_scheduler(lr_schedule: Any, scheduler: Any, metric: Any, every: Any, *, metrics: list[str]) -> None:
    """ConfigError naming the argument unless the scheduler settings are usable together."""
    require(lr_schedule is None or scheduler is None,
            "DatasetTask: give lr_schedule (a LambdaLR factor) or scheduler (any scheduler), not both")
    require(scheduler is None or callable(scheduler),
            "DatasetTask: scheduler must be a function optimizer -> scheduler, e.g. "
            "lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt)")
    require(isinstance(every, int) and not isinstance(every, bool) and every >= 1,
            f"DatasetTask: scheduler_every must be a whole number of optimizer steps >= 1 (got {every!r})")
    require(metric == "train_loss" or metric in metrics,
            f"DatasetTask: scheduler_metric {metric!r} must be 'train_loss' or one of the evaluation metrics "
            f"{metrics} (an evaluation metric needs eval_dataset)")


def _checked_metrics(metrics: Any, primary: str) -> dict[str, Callable[[nn.Module, Any], torch.Tensor]]:
    """``eval_metrics`` as a dict, each name a non-empty string other than ``eval_metric`` with a function."""
    if metrics is None:
        return {}
    require(isinstance(metrics, Mapping), "DatasetTask: eval_metrics must be a dict {name: per_sample(model, batch)}")
    for name, fn in metrics.items():
        require(isinstance(name, str) and name.strip() != "" and len(name) <= 64 and name.isprintable(),
                f"DatasetTask: eval_metrics names must be short printable strings (got {name!r})")
        require(name != primary, f"DatasetTask: eval_metrics[{name!r}] has the name of eval_metric, which is the "
                                 "evaluation loss; name it otherwise")
        require(callable(fn), f"DatasetTask: eval_metrics[{name!r}] must be a function (model, batch) -> values")
    return dict(metrics)


def dataset_digest(dataset: Dataset) -> str:
    """sha256 hex over every sample of ``dataset`` in index order (tensors by dtype, shape and bytes)."""
    h = hashlib.sha256(b"trainproof.dataset/1\x00")
    for i in range(len(dataset)):  # type: ignore[arg-type]
        _digest(h, dataset[i])
    return h.hexdigest()


def _digest(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous()
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        # Through a byte view: numpy has no bfloat16, and the bytes are what identifies the data.
        h.update(value.reshape(-1).view(torch.uint8).numpy().tobytes() if value.numel() else b"")
    elif isinstance(value, np.ndarray):
        h.update(f"A{value.dtype.str}{value.shape}".encode())
        h.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, Mapping):
        h.update(b"{")
        for key in sorted(value, key=str):
            _digest(h, str(key))
            _digest(h, value[key])
        h.update(b"}")
    elif isinstance(value, (list, tuple)):
        h.update(b"[")
        for item in value:
            _digest(h, item)
        h.update(b"]")
    elif isinstance(value, (str, int, float, bool, type(None))):
        h.update(json.dumps(value).encode())
    elif isinstance(value, (np.integer, np.floating, np.bool_)):
        h.update(f"S{value.dtype.str}".encode() + value.tobytes())
    else:
        raise ConfigError(f"DatasetTask: cannot hash a sample value of type {type(value).__name__} for the data "
                          "identity; pass data_identity=sha256 of your data")
    h.update(b"\x00")


def _is_sha256(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)
