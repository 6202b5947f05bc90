"""``train --fsdp``: the task's model sharded with FSDP2 (``fully_shard``) over the run's ranks, and its model and
optimizer state saved and loaded as a sharded generation (job.train.sharded) instead of inside
``training_state.pt``.

What stays exactly as under DDP (job.train.dist):

- **Initial weights**: every rank builds the model from its own seed; rank 0's parameters and buffers are
  broadcast to every rank *before* sharding (what DDP's constructor does), so the run starts from the same
  weights as a DDP run or a single process with the same seed.
- **The objective**: each rank divides its loss sum by the step's *global* target count (job.train.run
  ``train_step``), so gradients must be *summed* over ranks, not averaged: every FSDP unit reduce-scatters with
  a plain SUM and a divide factor of 1 (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms``).
- **Gradient accumulation**: the micro-batches before a step's last one only accumulate locally
  (``set_requires_gradient_sync(False)``), like DDP's ``no_sync``; the last one reduce-scatters the sum.

Which modules become FSDP units is the task's choice (``Task.fsdp_modules``; the root is always one). With world 1
the run still shards (over a process group of one) so that its generations have the same format and can be
resumed by any world size with ``--allow-world-change``: DCP reshards (``load_sharded``).

Saving (every rank, synchronously): ``get_state_dict`` gives the model and optimizer as sharded DTensors;
:func:`sharded_state` hands them to the Checkpointer, which writes them with ``write_sharded`` (each rank its own
shard file) and commits them in the same ``COMPLETE.json`` as ``training_state.pt`` (which then holds empty
``model``/``optimizer`` sections and ``meta.fsdp``) and the rank files. No rank ever holds the full state.

Loading (:func:`load_generation`, every rank): the freshly wrapped model and optimizer give the sharded state to
fill (``get_state_dict``), DCP reads into it only the chunks this rank needs, and ``set_state_dict`` puts it in
place; the rest of the restore follows as without FSDP (job.train.run ``restore_state``, generators last).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from job.train.dist import DistEnv
from job.train.sharded import load_sharded
from storage import GenerationInfo, GenerationStore


def wrap(model: nn.Module, units: list[nn.Module], env: DistEnv, device: torch.device) -> nn.Module:
    """Shard ``model`` in place over all ranks (a 1-D mesh): each of ``units`` and the root become FSDP units
    whose gradients are summed, not averaged. Every rank must call it (it broadcasts rank 0's weights first)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if env.world > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0)
    mesh = init_device_mesh(device.type, (env.world,))
    for unit in units:
        if unit is not model:
            fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM): nothing divides
    return model


def set_gradient_sync(model: nn.Module, sync: bool) -> None:
    """Whether the next backward reduce-scatters the gradients (False: accumulate locally, like DDP's no_sync)."""
    model.set_requires_gradient_sync(sync)  # type: ignore[operator]  # an FSDPModule (wrap)


def grad_scaler(device: torch.device, enabled: bool) -> torch.amp.GradScaler:
    """The GradScaler of a sharded run: an inf/NaN in any rank's gradient shard must skip the step on every rank,
    so the found-inf flags are all-reduced (FSDP's ShardedGradScaler; its state has the same keys)."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    return ShardedGradScaler(device.type, enabled=enabled)


def sharded_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model and optimizer state to save, as this rank's shards (DTensors; nothing gathered)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, optimizer)
    return {"model": msd, "optim": osd}


def load_generation(model: nn.Module, optimizer: torch.optim.Optimizer, store: GenerationStore, step: int, *,
                    world: int, contract: str, allow_world_change: bool) -> GenerationInfo:
    """Load the model and optimizer state of sharded generation ``step`` into the wrapped ``model`` and
    ``optimizer`` (every rank; DCP reshards when the generation's world differs and ``allow_world_change``)."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    msd, osd = get_state_dict(model, optimizer)  # initialises the optimizer's state, to be overwritten
    state = {"model": msd, "optim": osd}
    info = load_sharded(store, step, state, world=world, contract=contract, allow_world_change=allow_world_change)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return info


__all__ = ["wrap", "set_gradient_sync", "grad_scaler", "sharded_state", "load_generation"]
