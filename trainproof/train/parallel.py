"""The strategy of each parallel layout (trainproof.format.layout): how a model is placed, synchronised, saved and
loaded.

The trainer never asks "is this run sharded?": it asks the run's strategy, chosen once from its layout
(:func:`strategy_for`). :class:`Replicated` is DDP (trainproof.train.dist ``wrap_model``; nothing when world is 1):
the model and optimizer travel inside ``training_state.pt``. :class:`Sharded` is FSDP2 on a 1-D mesh
(trainproof.train.fsdp): they travel as DCP shard files beside it, written and read by every rank. A new layout (HSDP on
a 2-D mesh, tensor parallel) is a new strategy here and a new value of :class:`trainproof.format.layout.Layout`.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

import torch
from torch import nn

from trainproof.format.layout import Layout
from trainproof.storage import GenerationStore
from trainproof.tasks.base import Task
from trainproof.train.dist import Collectives, DistEnv, wrap_model


class Strategy(Protocol):
    """What a layout does at each point of a run's life."""

    layout: Layout
    inline_state: bool
    """Whether the model and optimizer are saved inside ``training_state.pt`` (else as shards beside it)."""
    needs_group: bool
    """Whether the run needs a process group even with one rank."""

    def place(self, task: Task, device: torch.device, env: DistEnv,
              sync: Collectives | None) -> tuple[nn.Module, nn.Module | None]:
        """Build the task's model on its ranks: (the model, the wrapper the forward passes go through or None)."""

    def grad_scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        """The GradScaler of this layout."""

    def accumulate(self, model: nn.Module, wrapper: nn.Module | None, *,
                   last: bool) -> contextlib.AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: reduce the gradients only on the step's ``last`` one."""

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        """What this rank saves of the model and optimizer besides ``training_state.pt`` (None: nothing)."""

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, store: GenerationStore, step: int, *,
             world: int, contract: str, allow_world_change: bool) -> str | None:
        """Before the rest of the state is restored: load what :meth:`capture` saved (every rank). Returns why the
        generation is corrupt (a byte disagrees with its manifest: fall back to an older one), or None."""

    def load_initial(self, model: nn.Module, names: list[str], get: Callable[[str], torch.Tensor]) -> None:
        """On a fresh start from pretrained weights (trainproof.train.pretrained): put tensor ``get(name)`` of every
        name into the placed model (every rank, from the same verified file)."""


class Replicated:
    """Every rank holds the whole model and optimizer; DDP sums the gradients when world > 1."""

    inline_state = True
    needs_group = False

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def place(self, task: Task, device: torch.device, env: DistEnv,
              sync: Collectives | None) -> tuple[nn.Module, nn.Module | None]:
        model = task.build_model().to(device=device, dtype=task.dtype)
        model.train()
        return model, wrap_model(model, env, device)  # DDP broadcasts rank 0's initial weights

    def grad_scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        return torch.amp.GradScaler(device.type, enabled=enabled)

    def accumulate(self, model: nn.Module, wrapper: nn.Module | None, *,
                   last: bool) -> contextlib.AbstractContextManager[Any]:
        # DDP's no_sync must cover the forward pass too: that is where DDP decides.
        return contextlib.nullcontext() if wrapper is None or last else wrapper.no_sync()

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        return None

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, store: GenerationStore, step: int, *,
             world: int, contract: str, allow_world_change: bool) -> str | None:
        """Nothing beside the state: the model and optimizer are restored from it (trainproof.train.run)."""
        return None

    def load_initial(self, model: nn.Module, names: list[str], get: Callable[[str], torch.Tensor]) -> None:
        from trainproof.train.pretrained import copy_into

        copy_into(model, names, get)  # into the parameters DDP and the optimizer already hold


class Sharded:
    """FSDP2 over every rank (trainproof.train.fsdp); imports torch.distributed's FSDP and DCP only when chosen."""

    inline_state = False
    needs_group = True

    def __init__(self, layout: Layout) -> None:
        self.layout = layout

    def place(self, task: Task, device: torch.device, env: DistEnv,
              sync: Collectives | None) -> tuple[nn.Module, nn.Module | None]:
        from trainproof.train import fsdp

        # The model stays in host memory until FSDP shards it: fully_shard moves each unit to the device as it
        # shards it, so the whole model never has to fit one device.
        model = task.build_model().to(device=torch.device("cpu"), dtype=task.dtype)
        model.train()
        fsdp.wrap(model, task.fsdp_modules(model), env, device, group=sync.group if sync else None)
        return model, None

    def grad_scaler(self, device: torch.device, enabled: bool) -> torch.amp.GradScaler:
        if not enabled:
            return torch.amp.GradScaler(device.type, enabled=False)
        from trainproof.train import fsdp

        return fsdp.grad_scaler(device, enabled)

    def accumulate(self, model: nn.Module, wrapper: nn.Module | None, *,
                   last: bool) -> contextlib.AbstractContextManager[Any]:
        from trainproof.train.fsdp import set_gradient_sync

        set_gradient_sync(model, last)  # FSDP2 decides in the backward: a flag, set before it
        return contextlib.nullcontext()

    def capture(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any] | None:
        from trainproof.train.fsdp import sharded_state

        return sharded_state(model, optimizer)  # this rank's shards (DTensors), nothing gathered

    def load(self, model: nn.Module, optimizer: torch.optim.Optimizer, store: GenerationStore, step: int, *,
             world: int, contract: str, allow_world_change: bool) -> str | None:
        """DCP reads only the chunks this rank needs (and reshards after an allowed world change); every rank
        learns from DCP when a shard file's bytes disagree with the manifest. Other failures raise
        trainproof.train.sharded.ShardedLoadError."""
        from trainproof.train import fsdp
        from trainproof.train.sharded import ShardedLoadError

        try:
            fsdp.load_generation(model, optimizer, store, step, world=world, contract=contract,
                                 allow_world_change=allow_world_change)
        except ShardedLoadError as exc:
            if not exc.corrupt:
                raise
            return str(exc)
        return None

    def load_initial(self, model: nn.Module, names: list[str], get: Callable[[str], torch.Tensor]) -> None:
        from trainproof.train import fsdp

        fsdp.load_full_model(model, {name: get(name) for name in names})


def strategy_for(layout: Layout) -> Strategy:
    """The strategy of ``layout``."""
    return Sharded(layout) if layout.sharded else Replicated(layout)
