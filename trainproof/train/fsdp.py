"""``train --fsdp``: the task's model sharded with FSDP2 (``fully_shard``) over the run's ranks, and its model and
optimizer state saved and loaded as a sharded generation (trainproof.train.sharded) instead of inside
``training_state.pt``.

What stays exactly as under DDP (trainproof.train.dist):

- **Initial weights**: every rank builds the model from its own seed; rank 0's parameters and buffers are
  broadcast to every rank *before* sharding (what DDP's constructor does), so the run starts from the same
  weights as a DDP run or a single process with the same seed.
- **The objective**: each rank divides its loss sum by the step's *global* target count (trainproof.train.run
  ``train_step``), so gradients must be *summed* over ranks, not averaged: every FSDP unit reduce-scatters with
  a plain SUM and a divide factor of 1 (``set_gradient_divide_factor(1.0)``, ``set_force_sum_reduction_for_comms``).
- **Gradient accumulation**: the micro-batches before a step's last one only accumulate locally
  (``set_requires_gradient_sync(False)``), like DDP's ``no_sync``; the last one reduce-scatters the sum.

Which modules become FSDP units is the task's choice (``Task.fsdp_modules``; the root is always one). With world 1
the run still shards (over a process group of one) so that its generations have the same format and can be
resumed by any world size with ``--allow-world-change``: DCP reshards (``load_sharded``).

Saving (every rank): ``get_state_dict`` gives the model and optimizer as sharded DTensors; :func:`sharded_state`
hands them to the Checkpointer (by default through a host snapshot of this rank's shards, on the save thread:
trainproof.train.async_save), which writes them with ``write_sharded`` (each rank its own shard file) and commits them
in the same ``COMPLETE.json`` as ``training_state.pt`` (which then holds empty
``model``/``optimizer`` sections and ``meta.fsdp``) and the rank files. No rank ever holds the full state.

Loading (:func:`load_generation`, every rank): the freshly wrapped model and optimizer give the sharded state to
fill (``get_state_dict``), DCP reads into it only the chunks this rank needs, and ``set_state_dict`` puts it in
place; the rest of the restore follows as without FSDP (trainproof.train.run ``restore_state``, generators last).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from trainproof.format.layout import sharded
from trainproof.storage import GenerationInfo, GenerationStore
from trainproof.train.dist import DistEnv
from trainproof.train.sharded import METADATA_FILE, GenerationReader, ShardedLoadError, load_sharded


def wrap(model: nn.Module, units: list[nn.Module], env: DistEnv, device: torch.device, *,
         group: Any = None) -> nn.Module:
    """Shard ``model`` in place over all ranks (a 1-D mesh): each of ``units`` and the root become FSDP units
    whose gradients are summed, not averaged. Every rank must call it (it broadcasts rank 0's weights first).

    ``model`` is in host memory (``build_run`` builds a sharded model there): rank 0's weights are broadcast over
    ``group``, a gloo group (the run's control group: the default group on the CPU), and ``fully_shard`` then
    moves each unit to ``device`` as it shards it, so a device holds one unit whole at most, never the model.
    Note: written for CUDA (NCCL for training, gloo for this broadcast) and run on the CPU only so far."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if env.world > 1:
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor.data, src=0, group=group)
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


def load_full_model(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Whole (unsharded) tensors by name into the sharded ``model``: each rank keeps its own shard of each (a fresh
    start from pretrained weights; a tied entry left out of ``tensors`` is loaded through its twin)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, tensors, options=StateDictOptions(full_state_dict=True, strict=False))


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


def full_state(store: GenerationStore, step: int, state: dict[str, Any], *,
               contract: str | None = None, sections: tuple[str, ...] = ("model", "optim")) -> dict[str, Any]:
    """``state`` (generation ``step``'s decoded training state, whose ``model`` and ``optimizer`` are empty in a
    sharded run) with ``model`` and ``optimizer`` filled from the generation's shards, as full CPU tensors.

    One process, no process group (:class:`ShardedSections`): every tensor is allocated whole from the *verified*
    metadata's sizes and dtypes and filled through the verified reader. ``model`` is ``{fqn: tensor}``;
    ``optimizer`` is ``{"state": {fqn: {...}}, "param_groups": [...]}`` keyed by parameter name as
    ``get_state_dict`` gives it (not by index as a replicated run's), the same in every sharded run, which is all a
    comparison or an export needs. Raises ShardedLoadError (``corrupt`` when a byte disagrees with the manifest).

    ``sections``: what to read, of ``model`` and ``optim``; a section left out stays ``{}`` and none of its bytes
    is allocated (an export reads only the model: a third of a model + Adam state).

    Memory: the sections asked for, whole, in this process, plus the parts of a shard file in flight (each file is
    read part by part, ``trainproof.storage.generations.read_parts``). The export then writes its files tensor by tensor
    and frees these tensors (trainproof.export.bundle ``build_files``); the verifier does not call this: it compares a
    group of entries at a time (:class:`ShardedSections`, trainproof.proof.compare).
    """
    shards = ShardedSections(store, step, contract=contract)
    model, optimizer = shards.whole(sections)
    return {**state, "model": model, "optimizer": optimizer}


class ShardedSections:
    """A sharded generation's model and optimizer, read on demand: a few entries at a time, or whole.

    ``entries`` maps each flattened name (DCP's) to its :class:`Entry`, from the generation's *verified* metadata
    (every path checked; every tensor's chunks checked to tile it exactly, so no byte of it is left unread).
    :meth:`read` allocates the named tensors whole and has DCP (``no_dist``) fill them through the verified reader
    (:class:`trainproof.train.sharded.GenerationReader`: every part checked against ``COMPLETE.json`` before a byte is
    used, plain values loaded weights-only), reading only the parts of the shard files that hold them. The
    verifier compares two generations group by group (:meth:`groups`), so its memory is a group, not the state.
    """

    def __init__(self, store: GenerationStore, step: int, *, contract: str | None = None) -> None:
        self.store, self.step = store, step
        self._reader = GenerationReader(store, step, contract=contract)
        metadata = self._reader.read_metadata()  # verified against the manifest, allowlisted unpickling
        self.name = self._reader.generation().name
        self.entries: dict[str, Entry] = {}
        mapping = metadata.planner_data
        if not isinstance(mapping, dict) or set(mapping) != set(metadata.state_dict_metadata):
            raise ShardedLoadError(f"{self.name}/{METADATA_FILE}: no nesting for every entry", corrupt=True)
        order = {}
        for index, where in metadata.storage_data.items():
            fqn = getattr(index, "fqn", None)
            order[fqn] = min(order.get(fqn, (where[0], where[1])), (where[0], where[1]))
        for fqn, md in metadata.state_dict_metadata.items():
            path, where = _checked_path(self.name, fqn, mapping[fqn], len(mapping)), order.get(fqn, ("", 0))
            if isinstance(md, TensorStorageMetadata):
                _check_tiling(self.name, fqn, tuple(md.size), md.chunks)
                self.entries[fqn] = Entry(path, tuple(md.size), md.properties.dtype, where)
            else:
                self.entries[fqn] = Entry(path, None, None, where)
        heads = {e.path[0] for e in self.entries.values()}
        if not heads <= {"model", "optim"}:
            raise ShardedLoadError(f"{self.name}: unexpected sections {sorted(heads - {'model', 'optim'})} in the "
                                   "shards", corrupt=True)

    def read(self, fqns: list[str]) -> dict[str, Any]:
        """The named entries, full CPU tensors (plain values as saved), read from the verified shard files."""
        flat: dict[str, Any] = {}
        for fqn in fqns:
            e = self.entries[fqn]
            # a plain value (param_groups' entries) is loaded weights-only by the planner
            flat[fqn] = None if e.size is None else torch.empty(e.size, dtype=e.dtype)
        if flat:
            load_sharded(self.store, self.step, flat, world=1, allow_world_change=True, planner=_FullLoadPlanner(),
                         no_dist=True, reader=self._reader)
        return flat

    def whole(self, sections: tuple[str, ...] = ("model", "optim")) -> tuple[dict[str, Any], dict[str, Any]]:
        """The ``model`` and ``optimizer`` sections, nested as saved (a section not in ``sections``: ``{}``)."""
        wanted = [fqn for fqn, e in self.entries.items() if e.path[0] in sections]
        nested = _unflatten(self.name, self.read(wanted), {fqn: self.entries[fqn].path for fqn in wanted})
        return nested.get("model", {}), nested.get("optim", {})

    def groups(self, fqns: list[str], budget: int) -> list[list[str]]:
        """``fqns`` in the order their bytes lie in the shard files (the state's order), cut into groups of about
        ``budget`` bytes (a tensor larger than that is a group of its own; the plain values, which are small and
        saved after the tensors, a last group)."""
        plain = [f for f in fqns if self.entries[f].size is None]
        tensors = sorted((f for f in fqns if self.entries[f].size is not None), key=lambda f: self.entries[f].where)
        out, group, held = [], [], 0
        for fqn in tensors:
            n = self.entries[fqn].nbytes
            if group and held + n > budget:
                out.append(group)
                group, held = [], 0
            group.append(fqn)
            held += n
        return out + [g for g in (group, plain) if g]


@dataclass(frozen=True)
class Entry:
    """One flattened entry of a sharded generation's metadata."""

    path: tuple
    """Its place in the nested state: ``("model", fqn)`` or ``("optim", "state", fqn, "exp_avg")`` ... (list
    indices as ints)."""
    size: tuple[int, ...] | None
    """A tensor's shape, or None for a plain value."""
    dtype: torch.dtype | None
    where: tuple[str, int]
    """The shard file and offset of its first chunk (to read neighbours together)."""

    @property
    def nbytes(self) -> int:
        """Bytes of the whole tensor (0 for a plain value)."""
        return 0 if self.size is None else math.prod(self.size) * self.dtype.itemsize


def complete_state(store: GenerationStore, step: int, state: dict[str, Any], *,
                   contract: str | None = None, optimizer: bool = True) -> dict[str, Any]:
    """``state`` itself, or for a sharded run's state (``meta.fsdp``) :func:`full_state` (what the verifier and
    the export compare and write: the same sections as a replicated run's state). ``optimizer=False``: the model
    only (the optimizer stays ``{}``), for a consumer of the weights."""
    if not sharded(state.get("meta")):
        return state
    return full_state(store, step, state, contract=contract, sections=("model", "optim") if optimizer else ("model",))


def sharded_digests(files: dict[str, Any]) -> dict[str, str]:
    """The manifest digests of a sharded generation's files (``dcp_metadata_sha256``), for a copy of it."""
    return {"dcp_metadata": METADATA_FILE} if METADATA_FILE in files else {}


class _FullLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner over a flat state dict (keys: the metadata's flattened names); plain values are
    loaded weights-only (the reader has already refused any other)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)

    def load_bytes(self, read_item, value) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def _check_tiling(name: str, fqn: str, size: tuple[int, ...], chunks: list) -> None:
    """The chunks of a tensor lie inside it, do not overlap and cover it: every element is read exactly once."""
    boxes = [(tuple(c.offsets), tuple(c.sizes)) for c in chunks]
    ok = all(len(o) == len(size) == len(s) and all(0 <= a and 0 <= b and a + b <= n for a, b, n in zip(o, s, size))
             for o, s in boxes)
    ok = ok and sum(math.prod(s) for _, s in boxes) == math.prod(size)
    for i, (o1, s1) in enumerate(boxes if ok else []):
        for o2, s2 in boxes[i + 1:]:
            if all(s1) and all(s2) and all(a < c + d and c < a + b for a, b, c, d in zip(o1, s1, o2, s2)):
                ok = False
    if not ok:
        raise ShardedLoadError(f"{name}/{METADATA_FILE}: the chunks of {fqn!r} do not tile its {size}", corrupt=True)


def _checked_path(name: str, fqn: str, path: Any, entries: int) -> tuple:
    """A flattened entry's path of keys (``metadata.planner_data``): a non-empty tuple of strings and list
    indices, starting with ``model`` or ``optim``'s string key."""
    if not (isinstance(path, tuple) and path and isinstance(path[0], str)
            and all(isinstance(p, str) or (type(p) is int and 0 <= p < entries) for p in path)):
        raise ShardedLoadError(f"{name}/{METADATA_FILE}: bad path for {fqn!r}", corrupt=True)
    return path


def _unflatten(name: str, flat: dict[str, Any], mapping: Any) -> dict[str, Any]:
    """The nested state DCP flattened (``mapping``: flattened name -> path of keys and list indices)."""
    root: dict[str, Any] = {}
    if not isinstance(mapping, dict) or set(mapping) != set(flat):
        raise ShardedLoadError(f"{name}/{METADATA_FILE}: no nesting for every entry", corrupt=True)
    for fqn, value in flat.items():
        path = _checked_path(name, fqn, mapping[fqn], len(flat))
        node: Any = root
        try:
            for key, nxt in zip(path, path[1:]):
                if isinstance(node, list):
                    node.extend([None] * (key + 1 - len(node)))
                    if node[key] is None:
                        node[key] = [] if isinstance(nxt, int) else {}
                    node = node[key]
                else:
                    node = node.setdefault(key, [] if isinstance(nxt, int) else {})
            if isinstance(node, list):
                node.extend([None] * (path[-1] + 1 - len(node)))
            node[path[-1]] = value
        except (TypeError, AttributeError):
            raise ShardedLoadError(f"{name}/{METADATA_FILE}: paths that do not nest ({fqn!r})", corrupt=True) from None
    return root


__all__ = ["wrap", "set_gradient_sync", "grad_scaler", "sharded_state", "load_generation", "full_state",
           "complete_state", "sharded_digests", "ShardedSections", "Entry"]
