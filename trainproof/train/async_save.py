"""Asynchronous checkpoints: training is blocked only while the state is copied to host memory.

At a step boundary the trainer takes a **snapshot** (:func:`snapshot`): every tensor of the captured state is
*copied* (on CUDA into pinned host buffers, non-blocking, ordered on the current stream by an event the
worker waits on), and every container is rebuilt, so the next optimizer step may modify the live tensors,
lists and dicts freely. A background thread (:class:`BackgroundSaver`) then serialises the snapshot and
hands it to the ordinary :class:`trainproof.train.checkpoint.Checkpointer` (serialised into a local spool file, then
uploaded from it: the only in-memory copy of the state is the snapshot itself): the commit is exactly today's one
(every file create-only, read back from the store, sha256 and a weights-only load checked, ``COMPLETE.json``
written last, create-only; retention after a successful commit), only on another thread. A thread is
enough: ``torch.save``'s storage writes, sha256 and the store's I/O release the GIL.

Rules, and why:

* **Staging buffers are reused** (:class:`_Snapshotter`): the copy writes into resident memory, so the training
  thread pays a memcpy, not page faults; one state's worth of host memory stays allocated between checkpoints.
* **At most one save in flight.** A second snapshot waits for the previous commit first (``checkpoint_wait``
  event with the seconds waited): two snapshots in memory would double the host memory, and an ordered
  sequence of commits keeps ``last_step`` and retention simple.
* **A background failure fails the run at the next step boundary** (:meth:`BackgroundSaver.poll`), with a
  one-line error naming the step and the cause and the exit code of the underlying error (1, or 2 for a
  configuration error). Nothing was marked usable: the store writes ``COMPLETE.json`` only after every
  check passed, so the previous generation stays the resume point.
* **Events are emitted by the training thread.** The worker's ``checkpoint`` / ``retention`` events are
  queued and emitted at the next boundary or wait (:class:`DeferredReporter`), so two threads never write
  the JSON log at once and events keep their order; warnings go to stderr at once as single writes.
* **The stop path** (SIGTERM, spot notice, deadline) first waits for the commit in flight, then commits the
  final step (trainproof.train.saver ``Saving.finish``), keeping the exit-75 promise.

Distributed runs (world > 1, DDP or sharded) save in the background too. Every rank snapshots what it commits:
rank 0 the training state, every other rank its own part (generators, data position), and in a sharded run
(``--fsdp``) every rank its own shards of the model and optimizer: the snapshot of a DTensor copies only its
local shard and keeps its placement, so a rank never holds more than one extra copy of *its* shard. Every rank's
save thread then runs the cross-rank commit of trainproof.train.checkpoint (DCP writes the shards, the rank parts are
gathered, rank 0 commits, the outcome is broadcast) over the run's *checkpoint group*
(trainproof.train.dist ``Collectives.saves``: a gloo group no other code uses), so its collectives never interleave
with the training thread's. Two more rules make it safe across ranks:

* **A failure is agreed, not just seen.** A commit fails on every rank together (the outcome is broadcast), but
  each rank's thread finishes at its own moment; so a rank that sees its save failed says so in the next step
  boundary's all-reduce (trainproof.train.loop ``Trainer._agree``) and every rank stops there with exit 1, instead of
  one rank exiting while the others wait in a collective for it.
* **The final commit after a stop is agreed too**: when any rank estimates it does not fit ``--stop-grace``,
  every rank skips it, so no rank waits alone in a save the others skipped.
"""

from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any, Callable

import torch

from trainproof.errors import TrainError
from trainproof.format.state import encode_history
from trainproof.train.checkpoint import Capture, Checkpointer
from trainproof.train.progress import Reporter


class DeferredReporter(Reporter):
    """A reporter for the worker thread: events are queued for the training thread; warnings go out at once."""

    def __init__(self, target: Reporter) -> None:
        super().__init__()
        self.target = target
        self._queue: collections.deque[tuple[str, dict[str, Any]]] = collections.deque()

    def event(self, name: str, **fields: Any) -> None:
        self._queue.append((name, fields))  # deque.append is atomic: no lock needed

    def warn(self, message: str) -> None:
        # One write call: a line is not interleaved with the training thread's own stderr lines.
        sys.stderr.write(f"warning: {message}\n")
        sys.stderr.flush()

    def drain(self) -> None:
        """Emit the queued events on the calling (training) thread, oldest first."""
        while self._queue:
            name, fields = self._queue.popleft()
            self.target.event(name, **fields)


class _Snapshotter:
    """Copies a captured state into host memory, into staging buffers kept from one snapshot to the next.

    Why keep them: a fresh 256 MiB allocation costs page faults (and zeroing) on the training thread, often more
    than the copy itself; resident buffers make the blocked time a plain memcpy (pinned on CUDA, so the
    device → host copies can be non-blocking). Reusing them is safe because at most one save is in flight and the
    next snapshot is taken only after it was committed. The price: one state's worth of host memory stays
    allocated between checkpoints.
    """

    def __init__(self) -> None:
        self._buffers: list[torch.Tensor] = []

    def copy(self, state: Any) -> tuple[Any, torch.cuda.Event | None]:
        memo: dict[tuple, torch.Tensor] = {}
        used: list[int] = [0]
        cuda_seen = [False]

        def tensor(t: torch.Tensor) -> torch.Tensor:
            if _is_dtensor(t):  # a shard of a sharded tensor: copy the local shard, keep its placement
                return _with_local(t, tensor(t._local_tensor))  # type: ignore[attr-defined]
            # Tensors that share storage (tied weights) stay shared in the copy, as torch.save would keep them.
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype, t.device)
            if key in memo:
                return memo[key]
            cuda = t.device.type == "cuda"
            cuda_seen[0] |= cuda
            out = self._buffer_like(t, used, pin=cuda)
            out.copy_(t.detach(), non_blocking=cuda)
            memo[key] = out
            return out

        def walk(obj: Any) -> Any:
            if isinstance(obj, torch.Tensor):
                return tensor(obj)
            if isinstance(obj, dict):  # keeps OrderedDict (a state_dict) an OrderedDict
                return type(obj)((k, walk(v)) for k, v in obj.items())
            if isinstance(obj, list):
                return [walk(v) for v in obj]
            if isinstance(obj, tuple):
                return tuple(walk(v) for v in obj)
            return obj  # str, int, float, bool, None: immutable

        copied = walk(state)
        done = None
        if cuda_seen[0]:
            done = torch.cuda.Event()
            done.record()  # the copies are queued on the current stream; the worker waits for this event
        return copied, done

    def _buffer_like(self, t: torch.Tensor, used: list[int], *, pin: bool) -> torch.Tensor:
        # The i-th tensor of a state is the same one at every boundary (model, then optimizer, ...): same buffer.
        i = used[0]
        used[0] += 1
        if i < len(self._buffers):
            buf = self._buffers[i]
            if buf.shape == t.shape and buf.dtype == t.dtype and buf.is_pinned() == pin:
                return buf
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=pin)
        if i < len(self._buffers):
            self._buffers[i] = buf
        else:
            self._buffers.append(buf)
        return buf


def _is_dtensor(t: torch.Tensor) -> bool:
    dtensor = sys.modules.get("torch.distributed.tensor")  # imported by any run that has DTensors
    return dtensor is not None and isinstance(t, dtensor.DTensor)


def _with_local(t: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A DTensor like ``t`` (same mesh, placements, global shape and stride) whose local shard is ``local``.

    No collective and no move: ``DTensor.from_local`` would move a host copy back to the mesh's device, so the
    DTensor is built from ``t``'s own spec, as torch's checkpoint staging does. DCP's planner only reads the
    spec (the shard's offsets in the global tensor) and ``to_local()``, which now gives the host copy."""
    from torch.distributed.tensor import DTensor

    return DTensor(local, t._spec, requires_grad=False)  # type: ignore[attr-defined]


def snapshot(state: Any) -> Any:
    """A deep copy of ``state`` in host memory that shares nothing mutable with the live training objects."""
    copied, done = _Snapshotter().copy(state)
    if done is not None:
        done.synchronize()
    return copied


class BackgroundSaver:
    """Runs :meth:`Checkpointer.commit` of one snapshot at a time on a background thread (see the module doc).

    ``on_saved(seconds)`` is called on the training thread with the worker's measured time (serialise +
    write + read back + verify + commit) of each successful save: the deadline's save estimate and the
    stop-grace decision use it. ``on_committed(step)`` too, first: only a commit that landed lets the trainer
    drop the history rows it holds, so a failed save never loses a row.
    """

    mode = "async"
    """The ``checkpoint`` field of the ``start`` event (trainproof.train.saver ``Saver``)."""

    def __init__(self, checkpointer: Checkpointer, reporter: Reporter, on_saved: Callable[[float], None],
                 on_committed: Callable[[int], None] | None = None) -> None:
        self.checkpointer = checkpointer
        self.on_committed = on_committed
        """Called on the training thread with the step of each commit collected (the trainer then drops the history
        rows that generation holds); never for a failed one."""
        self.events = DeferredReporter(reporter)
        checkpointer.reporter = self.events  # the worker reports through the queue
        self.on_saved = on_saved
        self._snapshotter = _Snapshotter()
        self._thread: threading.Thread | None = None
        self._step: int | None = None
        self._result: tuple[float, BaseException | None] | None = None
        self.measured_s: list[float] = []
        """Total time of every background save of this process (serialise → commit), in order."""

    @property
    def in_flight(self) -> int | None:
        """Step of the save not yet collected (running, or finished but not yet :meth:`poll`-ed), or None."""
        return self._step

    def submit(self, step: int, state: dict[str, Any] | None, *, extra: dict[str, Any], blocked_s: float,
               part: dict[str, Any] | None = None, sharded: dict[str, Any] | None = None,
               frozen: dict[str, Any] | None = None, frozen_fields: dict[str, Any] | None = None) -> None:
        """Snapshot what this rank commits (training must not step until this returns) and commit it in the
        background: ``state`` (rank 0's training state; None on other ranks), ``part`` (a rank >= 1's own part)
        and ``sharded`` (this rank's shards of a sharded run); ``frozen`` (rank 0's frozen model entries, only when
        they must be stored: the first commit, or a task wrote into one) is snapshotted with them, ``frozen_fields``
        (their fingerprint, or the stored object they are) passed on. See Checkpointer.commit.

        The caller has already waited (:meth:`wait`): at most one save is in flight.
        """
        assert self._step is None, "one save in flight at most: wait() first"
        t0 = time.perf_counter()
        copied, done = self._snapshotter.copy({"state": state, "part": part, "sharded": sharded})
        # Frozen entries to store (rarely: a process's first commit of a fresh run, or after a task wrote into one):
        # copied apart, not into the reused buffers, so their copy is freed once stored.
        copied["frozen"] = None if frozen is None else {k: v.detach().to("cpu", copy=True) for k, v in frozen.items()}
        del state, part, sharded, frozen  # the live references: the worker only ever sees the copy
        blocked_s += time.perf_counter() - t0
        holder = [copied]
        del copied
        self._step, self._result = step, None
        self._thread = threading.Thread(target=self._work, args=(step, holder, done, extra, blocked_s,
                                                                 frozen_fields or {}),
                                        name=f"trainproof-save-{step}", daemon=True)
        self._thread.start()

    def save(self, capture: Capture, *, blocked_since: float) -> None:
        """:meth:`submit` of one step's capture (trainproof.train.saver ``Saver``): blocked since ``blocked_since``."""
        self.submit(capture.step, capture.state, extra=capture.extra, blocked_s=time.perf_counter() - blocked_since,
                    part=capture.part, sharded=capture.sharded, frozen=capture.frozen,
                    frozen_fields={"frozen_mark": capture.frozen_mark, "frozen_ref": capture.frozen_ref})

    def _work(self, step: int, holder: list, done: torch.cuda.Event | None, extra: dict[str, Any],
              blocked_s: float, frozen_fields: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        failure: BaseException | None = None
        _lower_priority()
        try:
            if done is not None:
                done.synchronize()  # the non-blocking device → host copies have landed
            copied = holder.pop()
            state = copied.pop("state")
            frozen = {"frozen": copied.pop("frozen"), **frozen_fields}
            own = {k: v for k, v in copied.items() if v is not None}  # part, sharded: this rank's own
            del copied
            if self.checkpointer.world > 1 or own:
                # Every rank enters the cross-rank commit whatever happens, so that no rank waits alone in one of
                # its collectives: rank 0 serialises the state inside it, where a failure reaches every rank.
                self.checkpointer.commit(Capture(step=step, state=state, extra=extra, blocked_s=blocked_s,
                                                 **frozen, **own))
            else:
                # Serialised into a spool file (no in-memory copy); the snapshot is dropped once it is written.
                history = encode_history(state) if "history" in state else None
                spool = self.checkpointer.encode(state)  # on S3 still being written: uploaded as it is
                del state  # the serialising thread holds it until it is written
                self.checkpointer.commit(Capture(step=step, state=None, extra=extra, encoded=spool, history=history,
                                                 blocked_s=blocked_s, **frozen))
        except BaseException as exc:  # noqa: BLE001 - handed to the training thread, which fails the run
            failure = exc
        self._result = (time.perf_counter() - t0, failure)

    def poll(self) -> None:
        """At a step boundary: collect a finished save (events, measured time); raise if it failed."""
        self.events.drain()
        if self._thread is not None and not self._thread.is_alive():
            self._collect()

    def poll_failed(self) -> bool:
        """Like :meth:`poll`, but a failed save is left to :meth:`wait` to raise: True when the save in flight has
        finished and failed (a distributed run agrees on it with the other ranks first: module doc)."""
        self.events.drain()
        if self._thread is not None and not self._thread.is_alive():
            if self._result is not None and self._result[1] is not None:
                return True
            self._collect()
        return False

    def wait(self) -> float:
        """Block until the save in flight (if any) is committed; return the seconds waited. Raises its failure."""
        t0 = time.perf_counter()
        if self._thread is not None:
            self._thread.join()
            self._collect()
        self.events.drain()
        return time.perf_counter() - t0

    def _collect(self) -> None:
        step, (seconds, failure) = self._step, self._result
        self._thread = self._step = self._result = None
        self.events.drain()
        if failure is not None:
            raise _failed(step, failure)
        self.measured_s.append(seconds)
        if self.on_committed is not None:
            self.on_committed(step)
        self.on_saved(seconds)


SAVE_NICE = 10
"""Niceness of the save thread (and of the I/O threads it starts, which inherit it): when training keeps every
CPU core busy (CPU training, or a data pipeline on the host), serialising, hashing and uploading take the cores'
idle time first instead of slowing the steps. A stop waits for the commit with the training thread idle, so the
commit then gets the cores all the same."""


def _lower_priority() -> None:
    """Best effort: lower this thread's CPU priority (Linux: ``setpriority`` on the thread id affects that thread
    only); elsewhere, or when not permitted, nothing changes."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), SAVE_NICE)
    except (AttributeError, OSError):
        pass


def _failed(step: int, exc: BaseException) -> TrainError:
    """One line naming the step and the cause, with the cause's exit code (2 for a configuration error)."""
    cause = " ".join((str(exc) or type(exc).__name__).split())
    if isinstance(exc, TrainError):
        err = type(exc)(f"background checkpoint of step {step} failed: {cause}")
    else:
        err = TrainError(f"background checkpoint of step {step} failed: {type(exc).__name__}: {cause}")
    err.__cause__ = exc
    return err
