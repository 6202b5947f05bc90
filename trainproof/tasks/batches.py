"""Micro-batches built ahead of the step, in DataLoader worker processes: what a worker is asked to build, and the
random generators it may draw from.

The trainer decides every step's sample ids (trainproof.train.data) and hands each micro-batch to the task as a
:class:`BatchRequest`; :meth:`trainproof.tasks.Task.build_batch` turns it into a CPU batch in a worker process (or in
the training process with no workers), and :meth:`trainproof.tasks.Task.batch_to_device` moves it to the run's device
when the step consumes it. Because a worker may run any number of micro-batches ahead, and because the worker that
builds a given micro-batch depends on the worker count, nothing a worker draws may come from a generator that lives
across
micro-batches. Instead every draw comes from a generator derived from values the trainer fixes:

- per sample (augmentation): :func:`sample_generators` (run seed, epoch, sample id), the same whatever the worker
  count, the prefetch depth, a resume, or the batch the sample lands in;
- per micro-batch (any other draw inside ``build_batch``, e.g. a library drawing from ``torch``'s global
  generator): the trainer seeds Python's ``random``, NumPy's legacy global generator and torch's CPU generator
  from (run seed, step, micro-batch index) for the call (:func:`batch_generators`), and puts the previous states
  back afterwards, so a batch built in the training process leaves the trainer's own generators untouched.

The derivation is named (:data:`SAMPLE_RNG`) and enters the run contract: another derivation is another experiment.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np
import torch

SAMPLE_RNG = "trainproof.sample-rng/1"
"""Name of the derivation below (recorded in the run contract of a task that builds batches with workers)."""
_SAMPLE_STREAM = 0x73616D70  # "samp": apart from the run's other streams (rng.DATA_STREAM, rank seeds)
_BATCH_STREAM = 0x62617463  # "batc"
_EVAL_STREAM = 0x6576616C  # "eval"


@dataclass(frozen=True, kw_only=True)
class BatchRequest:
    """One micro-batch of one rank, as the trainer asks a worker to build it."""

    seed: int
    """The run seed."""
    step: int
    """The optimizer step (1-based) the micro-batch belongs to."""
    micro: int
    """Its index among the step's micro-batches on this rank."""
    epoch: int
    """The epoch its samples come from."""
    sample_ids: tuple[int, ...]
    """The samples, in the order the trainer chose them."""

    def rng(self, sample_id: int) -> np.random.Generator:
        """The generator of one sample of this request (see :func:`sample_rng`)."""
        return sample_rng(self.seed, self.epoch, sample_id)

    def key(self) -> tuple[int, int, int, tuple[int, ...]]:
        """What identifies the request (the trainer checks a built batch against the step it consumes it in)."""
        return (self.step, self.micro, self.epoch, self.sample_ids)


def _sequence(*words: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(w) for w in words])


def sample_rng(seed: int, epoch: int, sample_id: int) -> np.random.Generator:
    """A NumPy generator derived from (run seed, epoch, sample id) alone: a sample's augmentation is the same in
    every process that builds it, and differs from epoch to epoch."""
    return np.random.Generator(np.random.PCG64(_sequence(_SAMPLE_STREAM, seed, epoch, sample_id)))


@contextlib.contextmanager
def sample_generators(seed: int, epoch: int, sample_id: int) -> Iterator[np.random.Generator]:
    """The sample's generator (:func:`sample_rng`), with Python's ``random``, NumPy's legacy global generator and
    torch's CPU generator seeded from the same derivation for the block (transform libraries draw from those), and
    their previous states put back afterwards."""
    with _seeded_globals(_sequence(_SAMPLE_STREAM, seed, epoch, sample_id, 1)):
        yield sample_rng(seed, epoch, sample_id)


def batch_generators(request: BatchRequest) -> contextlib.AbstractContextManager[None]:
    """Python's ``random``, NumPy's legacy global generator and torch's CPU generator seeded from (run seed, step,
    micro-batch index) for a ``build_batch`` call, their previous states put back afterwards."""
    return _seeded_globals(_sequence(_BATCH_STREAM, request.seed, request.step, request.micro))


def evaluation_generators() -> contextlib.AbstractContextManager[None]:
    """Python's ``random``, NumPy's legacy global generator and torch's CPU generator seeded from a constant for an
    evaluation (the export's metric, and its reload check in a fresh process), their previous states put back
    afterwards: whatever the evaluation draws (a collate that mixes samples, mixup, reused for the held-out data),
    it draws the same numbers in every process, and never from, nor moves, the training's generators."""
    return _seeded_globals(_sequence(_EVAL_STREAM))


@contextlib.contextmanager
def _seeded_globals(sequence: np.random.SeedSequence) -> Iterator[None]:
    # Only the CPU generator: torch.manual_seed would also re-seed every CUDA generator, which the trainer owns.
    words = sequence.generate_state(4, np.uint32)
    saved = random.getstate(), np.random.get_state(), torch.default_generator.get_state()
    try:
        random.seed(int(words[0]) << 32 | int(words[1]))
        np.random.seed(int(words[2]))
        torch.default_generator.manual_seed(int(words[3]) << 16 | int(words[0]) & 0xFFFF)
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.default_generator.set_state(saved[2])


def map_tensors(data: Any, fn: Any) -> Any:
    """``data`` with ``fn`` applied to every tensor inside it: in mappings (returned as dicts), named tuples, tuples,
    lists and dataclass instances (a copy with each field mapped; frozen ones too); NumPy arrays become tensors
    first. Anything else is returned as it is."""
    if isinstance(data, np.ndarray):
        data = torch.from_numpy(data)
    if isinstance(data, torch.Tensor):
        return fn(data)
    if isinstance(data, Mapping):
        return {k: map_tensors(v, fn) for k, v in data.items()}
    if isinstance(data, tuple) and hasattr(data, "_fields"):  # a namedtuple
        return type(data)(*(map_tensors(v, fn) for v in data))
    if isinstance(data, (list, tuple)):
        return type(data)(map_tensors(v, fn) for v in data)
    if dataclasses.is_dataclass(data) and not isinstance(data, type):
        out = copy.copy(data)
        for f in dataclasses.fields(data):
            object.__setattr__(out, f.name, map_tensors(getattr(data, f.name), fn))  # frozen ones too
        return out
    return data


def to_device(data: Any, device: torch.device, dtype: torch.dtype | None = None) -> Any:
    """``data`` with every tensor (inside dicts, lists, tuples and dataclasses: :func:`map_tensors`) moved to
    ``device``, floating-point ones cast to ``dtype`` when given (integer tensors such as labels and token ids keep
    theirs); NumPy arrays become tensors first."""

    def move(t: torch.Tensor) -> torch.Tensor:
        if dtype is not None and t.is_floating_point():
            return t.to(device=device, dtype=dtype, non_blocking=True)
        return t.to(device, non_blocking=True)

    return map_tensors(data, move)
