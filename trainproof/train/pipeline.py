"""Where a step's micro-batches come from: built in the training process, or ahead of the step by DataLoader workers.

The trainer alone decides which samples every step and rank gets (trainproof.train.data: one permutation per epoch, a
cursor). Workers never decide anything: :class:`Lookahead` runs a *copy* of the sampler ahead of the loop and
turns the next steps' ids into :class:`trainproof.tasks.batches.BatchRequest` values, exactly as :func:`micro_batches`
splits them when the step runs; a ``torch.utils.data.DataLoader`` (its own worker processes, queues, pinning and
in-order delivery) hands each request to :meth:`trainproof.tasks.Task.build_batch` in a worker. When the step runs, the
trainer draws its ids from the *real* sampler and takes the next built batch, checking it was built for exactly
those ids. So the checkpointed data position is always what the trainer consumed; what the workers prefetched
is thrown away with them and rebuilt after a resume, from the same requests, with the same per-sample generators.

Neither the worker count nor the prefetch depth changes a result: every draw inside a build comes from generators
derived from the request (trainproof.tasks.batches), and a build in the training process (no workers) puts torch's,
NumPy's and Python's global generators back as it found them. A task that only implements ``make_batch`` is built
in the training process, at the step, as before (:class:`InProcess`).
"""

from __future__ import annotations

import collections
import copy
import itertools
import multiprocessing
import os
import signal
import time
from typing import Any, Iterator, Protocol

import torch
from torch.utils.data import DataLoader

from trainproof.errors import ConfigError, ContractError, DataError, StateError, TrainError
from trainproof.tasks.base import Task, TaskContext
from trainproof.tasks.batches import SAMPLE_RNG, BatchRequest, batch_generators
from trainproof.train.data import EpochSampler
from trainproof.train.dist import rank_slice

_ERRORS = {cls.__name__: cls for cls in (TrainError, ConfigError, ContractError, StateError, DataError)}


def micro_batches(ids: list[int], world: int, rank: int, micro: int) -> list[list[int]]:
    """This rank's micro-batches of a step whose global batch is ``ids``: its contiguous share, in slices of
    ``micro`` samples (the last one shorter)."""
    mine = rank_slice(ids, world, rank)
    return [mine[i : i + micro] for i in range(0, len(mine), micro)]


def pipeline_record(task: Task) -> dict[str, Any] | None:
    """What the run contract records of the batch pipeline: the per-sample generator derivation for a task that
    builds batches ahead (it changes results), None for one built in the training process. Never the worker count
    or the prefetch depth, which do not change results."""
    return {"build": "build_batch", "sample_rng": SAMPLE_RNG} if task.builds_batches else None


class BatchSource(Protocol):
    """Where :func:`trainproof.train.run.train_step` takes each micro-batch from."""

    def batch(self, request: BatchRequest, ctx: TaskContext) -> Any:
        """The micro-batch for ``request`` (this step's), on ``ctx.device``."""

    def close(self) -> float:
        """Stop building; the seconds it took."""

    def check_next(self, count: int) -> TrainError | None:
        """The failure building one of the next ``count`` micro-batches met (a damaged shard), found before the step
        that takes them begins, None when they built (or cannot be built ahead: a task's ``make_batch``)."""


def next_step_micro_batches(sampler: EpochSampler, global_batch: int, world: int, rank: int, micro: int) -> int:
    """How many micro-batches this rank takes in the sampler's next step (the tail of an epoch has fewer samples),
    without drawing anything."""
    drawn = sampler.permutation is not None and sampler.cursor < sampler.num_samples
    left = sampler.num_samples - sampler.cursor if drawn else sampler.num_samples
    return len(micro_batches(list(range(min(global_batch, left))), world, rank, micro))


class InProcess:
    """Each micro-batch built in the training process when the step runs: a task's ``make_batch`` (the run's
    generators), or its ``build_batch`` under the request's own generators (as a worker would build it, so a
    :class:`trainproof.train.run.Run` made without a pipeline trains exactly as one with workers)."""

    workers = 0

    def __init__(self, task: Task) -> None:
        self.task = task

    def batch(self, request: BatchRequest, ctx: TaskContext) -> Any:
        if not self.task.builds_batches:
            return self.task.make_batch(list(request.sample_ids), ctx)
        with batch_generators(request):
            built = self.task.build_batch(request)
        return self.task.batch_to_device(built, ctx.device)

    def close(self) -> float:
        return 0.0

    def check_next(self, count: int) -> TrainError | None:
        return None  # built at the step, from the run's generators: nothing can be built ahead


class Lookahead:
    """The requests of steps ``first`` onwards, from a copy of the sampler (the real one is never advanced here).

    It does not stop at the run's target: a run that reaches its target has batches in flight exactly as a
    preempted one does, so the verifier's cut path (a run stopped at its target) checkpoints in the same situation
    as a SIGTERM, and a position taken from the workers instead of the trainer is caught there. What the workers
    build past the target is dropped with them."""

    def __init__(self, sampler: EpochSampler, *, seed: int, first: int, global_batch: int, world: int, rank: int,
                 micro: int) -> None:
        self.sampler = copy.deepcopy(sampler)
        self.seed, self.first = seed, first
        self.global_batch, self.world, self.rank, self.micro = global_batch, world, rank, micro

    def __iter__(self) -> Iterator[BatchRequest]:
        for step in itertools.count(self.first):
            ids = self.sampler.next_ids(self.global_batch)
            for i, chunk in enumerate(micro_batches(ids, self.world, self.rank, self.micro)):
                yield BatchRequest(seed=self.seed, step=step, micro=i, epoch=self.sampler.epoch,
                                   sample_ids=tuple(chunk))


class _Builds:
    """The DataLoader's "dataset": a request in, the task's batch out (in a worker process, or in this one).

    A handled failure (a damaged shard is a DataError) travels back as a value, so the trainer can end with its
    one-line message instead of DataLoader's re-raised traceback text."""

    def __init__(self, task: Task) -> None:
        self.task = task

    def __getitem__(self, request: BatchRequest) -> tuple[tuple, Any, tuple | None]:
        try:
            with batch_generators(request):
                return request.key(), self.task.build_batch(request), None
        except TrainError as exc:
            return request.key(), None, (type(exc).__name__, str(exc))


def _as_built(item: Any) -> Any:
    return item  # DataLoader's default would convert NumPy arrays inside the batch: the task's batch is final


class WorkerBatches:
    """``build_batch`` run ahead by a DataLoader over :class:`Lookahead`'s requests, in ``workers`` processes (0:
    in this process, when the step asks, through the same code)."""

    def __init__(self, task: Task, lookahead: Lookahead, *, workers: int, prefetch: int, pin_memory: bool) -> None:
        self.task, self.workers, self.prefetch = task, workers, prefetch
        self.lookahead = lookahead
        self.left_running = 0
        """Worker processes still alive after :meth:`close` (0 unless one could not be stopped)."""
        """The requests being built: its sampler is where the workers are, never what a checkpoint holds."""
        self.loader = DataLoader(
            _Builds(task), sampler=lookahead, batch_size=None, collate_fn=_as_built, num_workers=workers,
            prefetch_factor=prefetch if workers else None, pin_memory=pin_memory,
            # A private generator: DataLoader draws its workers' base seed from this, never from torch's global
            # generator, whose state is the trainer's (dropout) and would then depend on the worker count.
            generator=torch.Generator(),
            multiprocessing_context=_fork() if workers else None, worker_init_fn=_own_process_group,
            timeout=WORKER_TIMEOUT_S if workers else 0,
        )
        self._it: Any = iter(self.loader)
        self._ready: collections.deque = collections.deque()
        """Built items taken from the loader ahead of their step by :meth:`check_next`, in order."""

    def check_next(self, count: int) -> TrainError | None:
        """Take the next step's ``count`` built micro-batches from the loader now (before the step uses any: every
        build is under its request's own generators, so this changes nothing), and return the first failure among
        them as an exception to raise, None when all built."""
        while len(self._ready) < count:
            self._ready.append(self._next())
        for _, _, error in itertools.islice(self._ready, count):
            if error is not None:
                return _ERRORS.get(error[0], TrainError)(error[1])
        return None

    def batch(self, request: BatchRequest, ctx: TaskContext) -> Any:
        key, data, error = self._ready.popleft() if self._ready else self._next()
        if error is not None:
            raise _ERRORS.get(error[0], TrainError)(error[1])
        if key != request.key():  # the lookahead and the loop split the steps differently: a trainer bug
            raise RuntimeError(f"data pipeline out of step: built {key[:3]} for the step's {request.key()[:3]}")
        return self.task.batch_to_device(data, ctx.device)

    def _next(self) -> tuple[tuple, Any, tuple | None]:
        try:
            return next(self._it)
        except StopIteration:  # the lookahead has no end: a trainer bug
            raise RuntimeError("the data pipeline ended") from None
        except Exception as exc:  # a worker died (killed for memory, a crash): DataLoader says so, or its pipe breaks
            failure = self._dead_worker() or worker_failure(exc)
            if failure is None:
                raise
            raise failure from None

    def _dead_worker(self) -> TrainError | None:
        """The failure naming a worker that has ended (waiting a moment for it to be reaped), None when all live."""
        deadline = time.monotonic() + 2.0
        while True:
            dead = [w for w in getattr(self._it, "_workers", []) if w.exitcode is not None]
            if dead or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not dead:
            return None
        code = dead[0].exitcode
        how = f"killed by signal {-code} ({signal.Signals(-code).name})" if code < 0 else f"exited with {code}"
        return worker_failure(RuntimeError(f"DataLoader worker (pid {dead[0].pid}) {how}"))

    def close(self) -> float:
        """Stop the workers: each finishes the batch in hand and exits (DataLoader's own shutdown, which gives a
        worker 5 s before terminating it); prefetched batches are dropped."""
        t0 = time.perf_counter()
        it, self._it = self._it, None
        self._ready.clear()
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        self.left_running = sum(w.is_alive() for w in getattr(it, "_workers", []))
        return time.perf_counter() - t0


WORKER_TIMEOUT_S = 600.0
"""Longest the workers may take to deliver the next batch. A worker that delivers nothing for that long is stuck (a
worker forked while another thread of the trainer held a lock it needs never runs; seen once, in a 2-rank test on a
loaded machine): the run ends with exit 1 and the retry starts fresh workers, instead of waiting forever."""


def worker_failure(exc: BaseException) -> TrainError | None:
    """The one-line failure (exit 1) for DataLoader's report of a dead or stuck worker, None for anything else.
    DataLoader raises a death from its SIGCHLD handler, so it may surface anywhere in the training thread."""
    text = str(exc).strip()
    if isinstance(exc, RuntimeError) and text.startswith("DataLoader worker"):
        return TrainError(f"a data worker died: {text.splitlines()[0]} (killed for memory? fewer --data-workers or "
                          "a smaller --prefetch need less); the run resumes from its last commit")
    if isinstance(exc, RuntimeError) and text.startswith("DataLoader timed out"):
        return TrainError(f"the data workers delivered no batch for {WORKER_TIMEOUT_S:g} s (a worker is stuck); the "
                          "run resumes from its last commit with fresh workers")
    return None


def _own_process_group(worker_id: int) -> None:
    """In each worker: leave the trainer's process group. A signal for the group (a terminal's Ctrl-C, ``kill 0``,
    an init that signals every process) then reaches only the trainer, which finishes its step and stops the workers
    itself; DataLoader's workers would otherwise die of a SIGTERM not sent by their parent (torch's handler) and turn
    a clean stop into a failure. The trainer's own shutdown and a dead trainer (DataLoader's watchdog) still end
    them."""
    try:
        os.setpgid(0, 0)
    except OSError:  # not permitted here (e.g. already a group leader): the worker stays in the trainer's group
        pass


def _fork() -> Any:
    """Workers are forked where the platform can (Linux): the task object (its dataset, its model factory) is
    then inherited as it is, closures included, instead of pickled."""
    methods = multiprocessing.get_all_start_methods()
    return multiprocessing.get_context("fork") if "fork" in methods else None


def check_workers(task: Task, workers: int) -> None:
    """ConfigError (exit 2, before anything is written) when workers are asked of a task that cannot use them."""
    if workers and not task.builds_batches:
        raise ConfigError(f"{type(task).__name__} builds its batches in the training process (make_batch): data "
                          "workers need a task that implements build_batch (DatasetTask does); drop --data-workers "
                          "/ TRAINPROOF_DATA_WORKERS")


def open_batches(task: Task, sampler: EpochSampler, *, seed: int, first: int, world: int, rank: int, workers: int,
                 prefetch: int, pin_memory: bool) -> BatchSource:
    """The batch source of steps ``first`` onwards for this rank, from ``sampler``'s position (not advanced)."""
    check_workers(task, workers)
    if not task.builds_batches:
        return InProcess(task)
    lookahead = Lookahead(sampler, seed=seed, first=first, global_batch=task.batch_size * world,
                          world=world, rank=rank, micro=task.micro_batch_size)
    return WorkerBatches(task, lookahead, workers=workers, prefetch=prefetch, pin_memory=pin_memory)
