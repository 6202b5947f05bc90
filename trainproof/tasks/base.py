"""The task interface: what the trainer needs from a model + data + objective, and nothing more.

The built-in tasks (``regression``, ``tinylm``) implement it, and so can a user's own task, loaded with
``--task package.module:factory`` where ``factory(config: dict) -> Task``.

The split of responsibilities is deliberate:

- the trainer owns the loop, the random generators, the data position, checkpointing and AMP;
- the task owns *what* is trained: it builds model, optimizer and scheduler, turns sample ids into a
  micro-batch (drawing augmentation randomness only from the generators it is handed or the global
  Python/PyTorch ones), and returns the **sum** of per-target losses of a micro-batch.

Returning a sum plus a separate target count (:meth:`Task.count_targets`, computed from sample ids
before any forward pass) is what makes the global-mean objective exact under gradient accumulation:
the trainer divides by the count of real targets of the whole step, and a distributed run can
all-reduce that count before the first backward.
"""

from __future__ import annotations

import abc
import contextlib
import dataclasses
import hashlib
import json
import typing
from dataclasses import dataclass
from typing import Any, Iterator, Sequence, TypeVar

import numpy as np
import torch
from torch import nn

from trainproof.errors import ConfigError
from trainproof.tasks.batches import BatchRequest, to_device

C = TypeVar("C")


@dataclass(kw_only=True)
class TaskContext:
    """What a task may use while building a micro-batch."""

    np_rng: np.random.Generator
    """The run's NumPy generator (checkpointed and restored by the trainer)."""
    device: torch.device
    """Where the batch tensors must live."""


class Task(abc.ABC):
    """One trainable experiment. Subclasses set the class attributes and implement the methods."""

    objective: str = "mean_v1"
    """Name of the loss definition; part of the run contract (changing it changes the experiment)."""
    supports_cuda: bool = True
    """False pins the task to the CPU (``--device auto`` then picks the CPU, ``cuda`` is refused)."""
    cpu_threads: int | None = None
    """PyTorch CPU threads; a fixed count keeps CPU reductions, hence results, bitwise reproducible."""
    dtype: torch.dtype = torch.float32
    """Parameter dtype."""
    default_steps: int = 10
    """Target when neither ``--max-steps`` nor ``--steps`` is given."""
    verify_samples: int | None = None
    """Samples ``trainproof verify`` trains its paths on: the first this many of the dataset, so that an epoch (and
    the three the verification crosses) stays short for a large dataset; ``verify --samples`` overrides it. None:
    the whole dataset. It never changes a training run."""
    grad_clip: float | None = None
    """Max global gradient norm, or None for no clipping."""
    scheduler_metric: str = "train_loss"
    """What a scheduler stepped on a metric (``ReduceLROnPlateau``) is stepped on: ``train_loss``, the step's mean
    training loss over every micro-batch and rank, or the name of one of :meth:`evaluate_metrics`' metrics (evaluated
    then, on the held-out data). Other schedulers step once per optimizer step and ignore it."""
    scheduler_every: int = 1
    """Optimizer steps between two steps of a scheduler stepped on a metric: it steps after every step whose number
    is a multiple of this (e.g. the steps of an epoch, to step on an evaluation once an epoch)."""
    fsdp: bool = False
    """True: always train sharded with FSDP2, as ``train --fsdp`` asks (a model too large for one device). It
    enters the run's plan: a run cannot change between sharded and replicated training."""
    precision: str = "auto"
    """Mixed precision of the forward passes (see :data:`PRECISIONS`): ``auto`` (float16 autocast with a GradScaler
    where :meth:`use_amp` says, by default on CUDA; nothing on the CPU), ``bf16`` (bfloat16 autocast, no GradScaler,
    on any device, the CPU included), ``fp16`` (float16 autocast with a GradScaler on any device) or ``fp32`` (no
    autocast). Any value but ``auto`` enters the run contract: a run cannot change its precision."""
    tokenizer: Any = None
    """A Hugging Face tokenizer (anything with ``save_pretrained(folder)``) that an export of a ``transformers`` model
    writes into its Hugging Face directory; None: no tokenizer files."""
    num_workers: int = 0
    """DataLoader worker processes that build micro-batches ahead of the step (:meth:`build_batch`); 0 builds them
    in the training process. ``train --data-workers`` overrides it. It never changes results, so it is not part of
    the run contract (a run may resume with another count)."""
    prefetch: int = 2
    """Micro-batches each worker builds ahead (DataLoader's ``prefetch_factor``); ``train --prefetch`` overrides
    it. Not part of the contract either."""

    @property
    @abc.abstractmethod
    def batch_size(self) -> int:
        """Samples per optimizer step (per rank)."""

    @property
    def micro_batch_size(self) -> int:
        """Samples per forward/backward; a step accumulates gradients over its micro-batches."""
        return self.batch_size

    @abc.abstractmethod
    def config(self) -> dict[str, Any]:
        """The task's settings as JSON-able values. They enter the run contract."""

    @abc.abstractmethod
    def num_samples(self) -> int:
        """Number of samples in one epoch."""

    @abc.abstractmethod
    def data_identity(self) -> str:
        """sha256 (hex) identifying the exact data; part of the run contract."""

    @abc.abstractmethod
    def build_model(self) -> nn.Module:
        """A freshly initialised model (the trainer moves it to the device and dtype)."""

    @abc.abstractmethod
    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over ``model``'s parameters."""

    def build_scheduler(self, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler | None:
        """A learning-rate scheduler stepped once per optimizer step, or None. A ``ReduceLROnPlateau`` is stepped on
        :attr:`scheduler_metric` every :attr:`scheduler_every` steps; a ``OneCycleLR``'s ``total_steps`` is the most
        steps a run (and a verification's path) may train."""
        return None

    def count_targets(self, sample_ids: list[int]) -> int:
        """Number of real targets (rows, tokens) in these samples, known before any forward pass."""
        return len(sample_ids)

    def make_batch(self, sample_ids: list[int], ctx: TaskContext) -> Any:
        """Build one micro-batch from sample ids in the training process, on ``ctx.device`` (augmentation drawn
        from ``ctx.np_rng``). Implement this or :meth:`build_batch`."""
        raise NotImplementedError(f"{type(self).__name__} implements neither make_batch nor build_batch")

    def build_batch(self, request: BatchRequest) -> Any:
        """Build one micro-batch on the CPU, in a DataLoader worker process (``num_workers`` > 0) or in the
        training process: load, decode, augment and collate ``request.sample_ids``. Random draws come from
        ``request.rng(sample_id)`` (or :func:`trainproof.tasks.batches.sample_generators`); see
        trainproof.tasks.batches. The result travels between processes (picklable; tensors go through shared memory).
        Implementing this instead of :meth:`make_batch` is what lets the trainer build batches ahead with workers."""
        raise NotImplementedError(f"{type(self).__name__} does not implement build_batch")

    @property
    def builds_batches(self) -> bool:
        """Whether the trainer builds this task's micro-batches through :meth:`build_batch` (ahead, possibly in
        workers) rather than :meth:`make_batch`: true when a subclass implements it."""
        return type(self).build_batch is not Task.build_batch

    def batch_to_device(self, batch: Any, device: torch.device) -> Any:
        """A batch :meth:`build_batch` made, on ``device`` for the step that consumes it. Default: every tensor
        moved there, floating-point ones cast to ``dtype``."""
        return to_device(batch, device, self.dtype)

    @abc.abstractmethod
    def loss_sum(self, model: nn.Module, batch: Any) -> torch.Tensor:
        """Sum (not mean) of the per-target losses of one micro-batch, as a scalar tensor."""

    def target_losses(self, model: nn.Module, batch: Any) -> torch.Tensor | Sequence[torch.Tensor] | None:
        """Optional: the loss of every real target of one micro-batch, unreduced: a tensor ``(samples,)`` or
        ``(samples, targets)`` when every sample has as many targets, else a list with one 1-D tensor per sample
        (padding left out). The verifier's objective check then checks the declared objective: ``loss_sum`` is
        their sum, ``count_targets`` their number, and the loss the trainer trained on their mean over the step
        (trainproof.proof.objective). Default: None (not given; ``DatasetTask`` gives ``per_sample_loss``'s)."""
        return None

    def fsdp_modules(self, model: nn.Module) -> list[nn.Module]:
        """With ``--fsdp``: the submodules of ``model`` that each become one FSDP unit (their parameters are
        gathered together for their forward and backward, then freed); the root is always one too and holds the
        rest. Default: the children of every ``nn.ModuleList`` (transformer blocks), and the children with
        parameters of a root ``nn.Sequential``. Override for another split (shared parameters must stay in one
        unit)."""
        units = [child for m in model.modules() if isinstance(m, nn.ModuleList) for child in m]
        if isinstance(model, nn.Sequential):
            units += [child for child in model if any(True for _ in child.parameters())]
        return units

    def state_dict(self) -> dict[str, Any]:
        """State the task itself keeps between steps and must get back on a resume (a curriculum stage, a
        counter, a private generator's state), saved in every checkpoint as ``task_state``.

        Only weights-only-safe values: tensors, numbers, strings, booleans, None, and lists/dicts of them
        (a ``torch.Generator``'s ``get_state()`` is a tensor; a NumPy generator's ``bit_generator.state`` holds
        ints and strings). Default: ``{}`` (a task that keeps no state, the recommended kind)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back what :meth:`state_dict` returned. Called on a resume after the model, optimizer,
        scheduler, data position and history were loaded and *before* the trainer's generators are restored
        (the protocol's order, docs/protocol.md). Default: nothing to load (an empty dict is expected)."""
        if state:
            raise ConfigError(f"{type(self).__name__} keeps no state, but the checkpoint holds task state "
                              f"{sorted(state)[:5]}: implement load_state_dict")

    def deterministic_objective(self) -> Task:
        """This task with every random draw of ``make_batch`` and ``loss_sum`` switched off (augmentation,
        input noise, dropout the trainer cannot see): what the verifier's objective check trains
        (trainproof.proof.objective). The check also sets every ``nn.Dropout`` module's p to 0 and trains in
        float64 itself; a task that draws in ``make_batch`` (or uses functional dropout) must override this,
        e.g. return the task built from its config with the noise settings at 0. Default: ``self``."""
        return self

    def use_amp(self, device: torch.device) -> bool:
        """With ``precision = "auto"``: whether to run forward passes under float16 autocast with a GradScaler."""
        return device.type == "cuda"

    def autocast_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype of the forward passes on ``device`` (None: no autocast), from :attr:`precision`. A
        GradScaler runs with float16 only: bfloat16 keeps float32's exponent range, so its gradients do not
        underflow the way float16's do."""
        precision = check_precision(self.precision)
        if precision == "auto":
            return torch.float16 if self.use_amp(device) else None
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[precision]

    def pretrained(self) -> list[Pretrained]:
        """Weights files the model starts from on a fresh start, instead of its seeded initialisation (the
        trainer reads and verifies them, then loads them into :meth:`build_model`'s model: trainproof.train.pretrained).
        Their sha256 enter the run contract; a resume never reads them (the checkpoint holds the weights).
        Default: none."""
        return []

    def pretrained_name(self, name: str) -> str | None:
        """The name in the :meth:`pretrained` files of the model's state_dict entry ``name``, or None for an entry
        they do not hold, which keeps its seeded initialisation (a LoRA adapter added to a published model: see
        :func:`peft_base_name`). Default: the name itself (the files cover every entry)."""
        return name

    eval_metric: str = "metric"
    """Name of what :meth:`evaluate` returns (recorded in export bundles), e.g. ``mse``."""

    def evaluate(self, model: nn.Module) -> float:
        """A deterministic evaluation of ``model`` (lower is better): no dropout, no random draws.

        The export bundle records it and its fresh-process reload must reproduce it. Optional for a
        user's task: ``trainproof export`` refuses a task without it.
        """
        raise NotImplementedError(f"{type(self).__name__} does not implement evaluate(model)")

    def evaluate_metrics(self, model: nn.Module) -> dict[str, float]:
        """Every metric of one deterministic evaluation of ``model``: :attr:`eval_metric` (what :meth:`evaluate`
        returns) and any others the task declares, e.g. ``accuracy`` (their names say which way is better). The
        export bundle records them all and its fresh-process reload check must reproduce each. Default: only
        ``{eval_metric: evaluate(model)}``; override it to compute further metrics in the same pass."""
        return {self.eval_metric: float(self.evaluate(model))}


def first_samples(task: Task, samples: int) -> Task:
    """``task`` trained on its first ``samples`` samples (ids ``0 .. samples - 1``) only: what ``verify --samples``
    runs. The data identity names the subset (a run of it is another experiment than the whole dataset's); nothing
    else of the task changes. ConfigError (exit 2) when the dataset is smaller."""
    total = task.num_samples()
    if isinstance(samples, bool) or not isinstance(samples, int) or not 1 <= samples <= total:
        raise ConfigError(f"verify on the first {samples!r} samples: the task has {total}; give --samples between 1 "
                          f"and {total}")
    if samples == total:
        return task
    whole = task.data_identity
    # Instance attributes shadow the methods: every caller, the task's own code included, sees the subset.
    task.num_samples = lambda: samples  # type: ignore[method-assign]
    task.data_identity = lambda: sha256_of("trainproof.first_samples/1", whole(), samples)  # type: ignore[method-assign]
    return task


PRECISIONS = ("auto", "bf16", "fp16", "fp32")
"""The values of :attr:`Task.precision`."""


def check_precision(value: Any) -> str:
    """``value`` when it is one of :data:`PRECISIONS`, else ConfigError (exit 2) naming them."""
    if value not in PRECISIONS:
        raise ConfigError(f"precision {value!r} is not one of {list(PRECISIONS)}")
    return value


@dataclass(frozen=True, kw_only=True)
class Pretrained:
    """Weights a task starts from: a safetensors file at ``url`` whose plain sha256 (what ``sha256sum`` prints) is
    ``sha256``, or a Hugging Face model directory at ``url`` (``config.json``, ``model.safetensors`` or its shards
    and ``model.safetensors.index.json``, the tokenizer's files) whose digest (what ``trainproof digest URL`` prints:
    the sha256 of the directory's ``trainproof-listing.json``, which lists every file's size and sha256) is
    ``digest``. Give exactly one of ``sha256`` and ``digest``.

    ``url``: a local path, ``file:///abs/path``, or an S3 object or prefix (``s3://bucket/key``), read through the
    store layer with the run's credentials and settings. A file is refused by name unless its bytes hash to
    ``sha256``; a directory unless its listing hashes to ``digest`` and every file in it is the one listed, nothing
    more. The tensors are loaded by name into the model (every parameter and buffer of the model must be covered, by
    this file or directory or another of the task's :meth:`Task.pretrained`; a tensor the model ties to another,
    e.g. an output layer sharing the embedding, may be left out)."""

    url: str
    sha256: str = ""
    digest: str = ""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.strip():
            raise ConfigError(f"pretrained weights: url must be a path or URL, got {self.url!r}")
        if bool(self.sha256) == bool(self.digest):
            raise ConfigError(f"pretrained weights {self.url}: give sha256 (a safetensors file's, `sha256sum FILE` "
                              "prints it) or digest (a model directory's, `trainproof digest URL` prints it), not "
                              f"{'both' if self.sha256 else 'neither'}")
        what, value = (("sha256", "the file's sha256") if self.sha256 else ("digest", "the directory's digest"))
        if not _hex64(getattr(self, what)):
            hint = "`sha256sum FILE` prints it" if self.sha256 else "`trainproof digest URL` prints it"
            raise ConfigError(f"pretrained weights {self.url}: {what} must be {value} as 64 lowercase hex digits "
                              f"({hint}), got {getattr(self, what)!r}")

    @property
    def directory(self) -> bool:
        """Whether ``url`` names a model directory (declared with ``digest``) rather than one file."""
        return bool(self.digest)

    @property
    def declared(self) -> str:
        """What enters the run contract (``init_sha256``): the file's sha256 or the directory's digest."""
        return self.digest or self.sha256


def peft_base_name(name: str) -> str | None:
    """:meth:`Task.pretrained_name` of a ``peft`` model (``get_peft_model(base, LoraConfig(...))``) whose pretrained
    files are its base model's, as published: ``base_model.model.X`` is the base's ``X``, a layer ``peft`` wrapped
    keeps its weights as ``X.base_layer.weight`` (the base's ``X.weight``), and the adapters (``lora_A``, ``lora_B``,
    ``lora_embedding_A``/``B``, ``lora_magnitude_vector``) are not in the base: None (their seeded initialisation)."""
    if any(part.startswith("lora_") for part in name.split(".")):
        return None
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def _hex64(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[nn.Module]:
    """Evaluation mode and no autograd for the block, then the model's previous mode back (an evaluation
    in the middle of training must not leave dropout switched off)."""
    was_training = model.training
    try:
        with torch.no_grad():
            yield model.eval()
    finally:
        model.train(was_training)


def config_from_dict(cls: type[C], overrides: dict[str, Any] | None) -> C:
    """Build a task config dataclass from user overrides, refusing unknown keys by name."""
    overrides = dict(overrides or {})
    known = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown {cls.__name__} key(s) {unknown}; known keys: {sorted(known)}")
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001  (a user's annotation that does not resolve: leave the check to the class)
        hints = {}
    for key, value in overrides.items():
        expected = _type_error(hints.get(key), value)
        if expected:  # checked before __post_init__, whose comparisons would fail with a TypeError that names no key
            raise ConfigError(f"{cls.__name__}: {key!r} must be {expected}, got {value!r} "
                              f"({type(value).__name__}); fix it in the --config file")
    try:
        return cls(**overrides)
    except TypeError as exc:
        raise ConfigError(f"{cls.__name__}: {exc}") from None


def _type_error(hint: Any, value: Any) -> str | None:
    """What ``value`` should have been for the annotation ``hint`` (None when it fits or the hint is not checked)."""
    if hint is bool:
        return None if isinstance(value, bool) else "true or false"
    if hint is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if hint is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if hint is str:
        return None if isinstance(value, str) else "a string"
    if typing.get_origin(hint) is list:
        (item,) = typing.get_args(hint) or (Any,)
        if not isinstance(value, list):
            return "a list"
        bad = [v for v in value if _type_error(item, v)]
        return f"a list of {_type_error(item, bad[0]).removeprefix('a ').removeprefix('an ')}s" if bad else None
    return None


def require(condition: bool, message: str) -> None:
    """Config validation helper for ``__post_init__``: raise ConfigError (exit 2) unless ``condition``."""
    if not condition:
        raise ConfigError(message)


def sha256_of(*parts: Any) -> str:
    """sha256 hex over a sequence of bytes-like values and JSON-able values (canonical JSON)."""
    h = hashlib.sha256()
    for part in parts:
        if isinstance(part, (bytes, bytearray, memoryview)):
            h.update(bytes(part))
        elif isinstance(part, np.ndarray):
            h.update(np.ascontiguousarray(part).tobytes())
        elif isinstance(part, torch.Tensor):
            h.update(part.detach().cpu().contiguous().numpy().tobytes())
        else:
            h.update(json.dumps(part, sort_keys=True, separators=(",", ":")).encode())
        h.update(b"\x00")
    return h.hexdigest()
