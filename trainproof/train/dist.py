"""Distributed training plumbing: who this process is (rank, world), the process group with its timeout,
DistributedDataParallel with a *summing* gradient hook, and the handful of collectives the trainer needs.

Why these pieces, and not more:

- **Rank and world** come from the environment torchrun and trainproof's own launcher (:mod:`trainproof.train.launch`)
  both set (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). With world 1 there
  is no process group at all and every collective below is local: a single process runs exactly as before.
- **Timeouts**: ``init_process_group(timeout=...)`` bounds the rendezvous and every collective of the group.
  A rank that dies closes its sockets, which gloo reports at once ("Connection reset by peer"); a rank that
  hangs is reported after the timeout. Either way the surviving ranks raise :class:`PeerError` (exit 1)
  instead of waiting forever. The timeout must cover rank 0's upload of a generation, during which the
  other ranks wait for its outcome.
- **Control plane on gloo**: flags, counts and checkpoint bytes travel as CPU tensors on a gloo group
  (the default group on CPU, a second group next to NCCL on CUDA), so they never touch GPU memory. Checkpoint
  commits have a gloo group of their own (``Collectives.saves``), so that they can run on a background thread.
- **Launching**: :func:`run_world` (re-exported from :mod:`trainproof.train.launch`) runs ``trainproof train`` with W
  ranks on this machine, e.g. for the verifier: ``run_world(["--store", url, "--max-steps", "10"], 2)``.
- **Gradient sum, not mean**: DDP averages gradients over ranks by default. The global objectives divide
  each rank's loss sum by the *global* target count, so the gradients must be *summed*; a comm hook that
  all-reduces with SUM and skips the division makes DDP do exactly that (see :func:`wrap_model`).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch

from trainproof.errors import ConfigError, TrainError
from trainproof.train.launch import run_world, world_command  # noqa: F401 - launching a world: see trainproof.train.launch

T = TypeVar("T")
DEFAULT_TIMEOUT_S = 600.0


class PeerError(TrainError):
    """A collective failed: another rank died, failed, or stopped responding within the timeout (exit 1)."""


class RemoteFailure(TrainError):
    """Rank 0 failed a step every rank depends on; other ranks re-raise it with rank 0's exit code."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True, kw_only=True)
class DistEnv:
    """This process's place in the job."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> DistEnv:
        """Read ``RANK``/``WORLD_SIZE``/``LOCAL_RANK`` (set by torchrun or trainproof's launcher); world 1 without."""
        env = os.environ if environ is None else environ
        if "WORLD_SIZE" not in env:
            return cls()
        try:
            world, rank = int(env["WORLD_SIZE"]), int(env.get("RANK", "0"))
            local = int(env.get("LOCAL_RANK", str(rank)))
        except ValueError:
            raise ConfigError(f"RANK/WORLD_SIZE/LOCAL_RANK must be integers (got {env.get('RANK')!r}, "
                              f"{env.get('WORLD_SIZE')!r}, {env.get('LOCAL_RANK')!r})") from None
        if world < 1 or not 0 <= rank < world or local < 0:
            raise ConfigError(f"RANK {rank} / WORLD_SIZE {world} / LOCAL_RANK {local} are inconsistent")
        return cls(rank=rank, world=world, local_rank=local)


def rank_slice(ids: list[int], world: int, rank: int) -> list[int]:
    """Rank ``rank``'s contiguous share of a step's global batch, split as evenly as possible.

    Full steps give every rank exactly the per-rank batch; the epoch's tail gives the first ``len % world``
    ranks one sample more. The epoch plan guarantees every rank at least one sample.
    """
    base, extra = divmod(len(ids), world)
    start = rank * base + min(rank, extra)
    return ids[start : start + base + (1 if rank < extra else 0)]


def rank_seed(seed: int, rank: int, step: int = 0) -> int:
    """The seed of rank ``rank``'s generators, derived deterministically from (seed, rank, step).

    Rank 0 at step 0 uses ``seed`` itself, so a one-process run is unchanged. ``step`` > 0 re-derives every
    rank's streams after a world-size change (``--allow-world-change``).
    """
    if rank == 0 and step == 0:
        return seed
    digest = hashlib.sha256(f"trainproof.rank-seed/1:{seed}:{rank}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1  # 63 bits: valid for random, NumPy and torch


class Collectives:
    """The trainer's collectives over the control group; local (no communication) when world is 1.

    Every method names what it does in its failure message, so a log says which agreement broke.
    """

    def __init__(self, env: DistEnv, group: Any = None, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 saves: Collectives | None = None) -> None:
        self.env, self.group, self.timeout_s = env, group, timeout_s
        self.saves: Collectives = saves or self
        """The same collectives over the run's *checkpoint group* (:func:`session`): a gloo group used by
        checkpoint commits only, so a background save's collectives (on the save thread) never interleave with
        the training thread's on the other groups. ``self`` when there is no process group (world 1)."""

    @property
    def rank(self) -> int:
        """This process's rank."""
        return self.env.rank

    @property
    def world(self) -> int:
        """Ranks in the run."""
        return self.env.world

    def sum_ints(self, values: list[int], what: str) -> list[int]:
        """Element-wise sum over ranks (exact: int64)."""
        if self.world == 1:
            return list(values)
        t = torch.tensor(values, dtype=torch.int64)
        self._call(what, lambda: torch.distributed.all_reduce(t, group=self.group))
        return [int(v) for v in t.tolist()]

    def sum_float(self, value: float, what: str) -> float:
        """Sum over ranks of one float64 (the order of the additions is the backend's)."""
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64)
        self._call(what, lambda: torch.distributed.all_reduce(t, group=self.group))
        return float(t[0])

    def broadcast_bytes(self, data: bytes | None, what: str, src: int = 0) -> bytes:
        """Rank ``src``'s bytes on every rank (``data`` is ignored elsewhere)."""
        if self.world == 1:
            return data or b""
        size = torch.tensor([len(data or b"") if self.rank == src else 0], dtype=torch.int64)
        self._call(what, lambda: torch.distributed.broadcast(size, src, group=self.group))
        buf = _to_tensor(data) if self.rank == src else torch.zeros(int(size[0]), dtype=torch.uint8)
        if buf.numel():
            self._call(what, lambda: torch.distributed.broadcast(buf, src, group=self.group))
        return buf.numpy().tobytes()

    def gather_bytes(self, data: bytes, what: str) -> list[bytes] | None:
        """Every rank's bytes, in rank order, on rank 0 (None elsewhere)."""
        if self.world == 1:
            return [data]
        sizes = self.sum_ints([len(data) if r == self.rank else 0 for r in range(self.world)], what)
        padded = torch.zeros(max(sizes), dtype=torch.uint8)
        padded[: len(data)] = _to_tensor(data)
        bufs = [torch.empty_like(padded) for _ in range(self.world)] if self.rank == 0 else None
        self._call(what, lambda: torch.distributed.gather(padded, bufs, dst=0, group=self.group))
        return None if bufs is None else [b[:n].numpy().tobytes() for b, n in zip(bufs, sizes)]

    def on_rank0(self, what: str, fn: Callable[[], T]) -> T | None:
        """Run ``fn`` on rank 0 only; every rank raises if it failed (with rank 0's message and exit code).

        For steps whose effect every rank depends on (writing plan.json, discovering the generation to
        resume): the other ranks wait here instead of racing rank 0 or proceeding after its failure.
        """
        result, failure, raised = None, b"", None
        if self.rank == 0:
            try:
                result = fn()
            except TrainError as exc:
                failure, raised = f"{exc.exit_code}:{exc}".encode(), exc
            except Exception as exc:  # noqa: BLE001 - told to the others, then re-raised unchanged
                failure, raised = f"1:{type(exc).__name__}: {exc}".encode(), exc
        failure = self.broadcast_bytes(failure, f"{what} (outcome from rank 0)")
        if raised is not None:
            raise raised
        if failure:
            code, _, message = failure.decode().partition(":")
            raise RemoteFailure(f"rank 0 failed to {what}: {message}", int(code))
        return result

    def require_all(self, ok: bool, what: str) -> None:
        """Agree that every rank succeeded at ``what``; ranks that did not raise their own error themselves."""
        failed = self.sum_ints([0 if ok else 1], what)[0]
        if failed and ok:
            raise PeerError(f"{failed} other rank(s) failed to {what} (see their log lines); stopping this rank too")

    def _call(self, what: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except (RuntimeError, ValueError) as exc:  # gloo/NCCL errors and timeouts are RuntimeErrors
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
            raise PeerError(f"collective '{what}' failed (a rank died, failed or stopped responding within "
                            f"{self.timeout_s:g} s): {first}") from None


def _to_tensor(data: bytes | None) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)


@contextmanager
def session(env: DistEnv, device: torch.device, timeout_s: float = DEFAULT_TIMEOUT_S, *,
            group_of_one: bool = False) -> Iterator[Collectives]:
    """The process group for this run (none when world is 1, unless ``group_of_one``: FSDP needs one even
    then, a one-process group without a rendezvous), torn down on a normal exit.

    Note: after a failure the group is *not* destroyed: tearing down a group whose peer died can block;
    the process is about to exit anyway, which releases everything.
    """
    if env.world == 1 and not group_of_one:
        yield Collectives(env, timeout_s=timeout_s)
        return
    import torch.distributed as dist

    timeout = timedelta(seconds=timeout_s)
    backend = "nccl" if device.type == "cuda" else "gloo"
    # One process: an in-memory store instead of MASTER_ADDR/MASTER_PORT (nothing to meet).
    alone = {"store": dist.HashStore()} if env.world == 1 else {}
    try:
        dist.init_process_group(backend, rank=env.rank, world_size=env.world, timeout=timeout,
                                device_id=device if device.type == "cuda" else None, **alone)
    except (RuntimeError, ValueError) as exc:
        raise PeerError(f"could not join the process group of {env.world} ranks within "
                        f"{timeout_s:g} s: {str(exc).strip().splitlines()[0][:300]}") from None
    control = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
    # Checkpoint commits get a gloo group of their own: a background save (trainproof.train.async_save) runs its
    # collectives (the rank parts' gather, the outcome broadcast, DCP's plan and results) on the save thread
    # while the training thread keeps using the others. A group is used by one thread at a time, in the same
    # order on every rank, which is what keeps the collectives of two threads apart.
    saves = dist.new_group(backend="gloo", timeout=timeout)
    yield Collectives(env, control, timeout_s, saves=Collectives(env, saves, timeout_s))
    dist.destroy_process_group()


def _sum_hook(group, bucket):  # noqa: ANN001 - DDP checks the annotations: none, or torch's own types
    """DDP comm hook: all-reduce each gradient bucket with SUM and no division by the world size."""
    fut = torch.distributed.all_reduce(bucket.buffer(), group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


def wrap_model(model: torch.nn.Module, env: DistEnv, device: torch.device) -> torch.nn.Module | None:
    """DistributedDataParallel over ``model`` with summed gradients (None when world is 1).

    Construction broadcasts rank 0's parameters and buffers, so every rank starts from the same weights.
    Note: every micro-batch must use every parameter (``find_unused_parameters`` is off, as it costs an
    extra graph traversal per step); a task with conditional branches would need it on.
    """
    if env.world == 1:
        return None
    from torch.nn.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    ddp.register_comm_hook(None, _sum_hook)  # state None: the default group
    return ddp
