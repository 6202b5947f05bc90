"""The live state of a run at a step boundary, as the verifier's ``live_vs_restored`` check compares it.

A checkpoint that saves the wrong value (a GradScaler's growth tracker saved as 0, a counter the task saves stale)
is wrong in *every* generation, the uninterrupted path's own too, so comparing stored states finds nothing. What a
process had in memory at a cut and what the next process restored from it must be equal exactly (it is a copy, on
any device): the verifier asks (``train --variant '{"live_state_at": [...]}'``, trainproof.train.variant) the
uninterrupted path to record, from its live objects, everything the next step reads at each cut, and a resumed path
the same right after restoring, before its first update; it compares the two records
(trainproof.proof.live). Never on for training.

A record is, per component (``parameters``, ``buffers``, ``optimizer``, ``scheduler``, ``grad_scaler``,
``rng_states``, ``data_position``, ``progress``, ``task_state``, ``task_attributes``), every leaf's key (the
state_dict's path, e.g. ``state.0.step``) and a short fingerprint: the value itself for a number or a one-element
tensor (dtype and exact repr), else a sha256 prefix of the dtype, shape and bytes. Nothing large is written.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any

import numpy as np
import torch
from torch import nn

from trainproof.train import rng

COMPONENTS = ("parameters", "buffers", "optimizer", "scheduler", "grad_scaler", "rng_states", "data_position",
              "progress", "task_state", "task_attributes")
WIDE = 64
"""A list with more entries than this is one fingerprint (a dataset kept on the task is not listed by item)."""


def fingerprint(value: Any) -> str:
    """A short string equal for equal values (bitwise, for tensors) and, in practice, different otherwise."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        t = t.to_local() if hasattr(t, "to_local") else t  # a sharded (FSDP2) tensor: this rank's shard
        t = t.cpu()
        if t.numel() == 1:
            return f"{str(t.dtype).removeprefix('torch.')} {t.reshape(()).item()!r}"
        digest = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
        digest.update(t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)} sha256:{digest.hexdigest()[:16]}"
    if isinstance(value, np.ndarray):
        return fingerprint(torch.from_numpy(np.ascontiguousarray(value)))
    if isinstance(value, (bool, int, float, str, type(None), np.generic)):
        return f"{type(value).__name__} {value!r}"
    return f"{type(value).__name__} sha256:{hashlib.sha256(repr(value).encode()).hexdigest()[:16]}"


def flatten(value: Any, prefix: str = "", out: dict[str, str] | None = None) -> dict[str, str]:
    """Every leaf of a nested state (dicts, lists) by its dotted key, fingerprinted (:func:`fingerprint`); a list of
    plain values, or of more than :data:`WIDE` entries, is one leaf."""
    out = {} if out is None else out
    items: list[tuple[Any, Any]] | None = None
    if isinstance(value, dict):
        items = list(value.items())
    elif isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple, torch.Tensor)) for v in value):
        items = list(enumerate(value))
    if items is None or (len(items) > WIDE and isinstance(value, (list, tuple))):
        out[prefix or "value"] = fingerprint(value if items is None else [(k, flatten(v)) for k, v in items])
        return out
    for key, item in items:
        flatten(item, f"{prefix}.{key}" if prefix else str(key), out)
    return out


def task_attributes(task: Any, prefix: str = "", depth: int = 0) -> dict[str, str]:
    """The task object's own tensors, arrays, numbers and generators (``vars(task)``; a wrapped task's too), where
    state kept outside ``Task.state_dict()`` lives. Strings, callables and None are left out (configuration, and a
    lazily built attribute that one side has not built yet)."""
    out: dict[str, str] = {}
    for name, value in sorted(vars(task).items()) if hasattr(task, "__dict__") else []:
        key = f"{prefix}{name}"
        if isinstance(value, (torch.Tensor, np.ndarray, dict, list, tuple)) or (
                isinstance(value, (int, float, np.generic)) and not isinstance(value, bool)):
            if not isinstance(value, (dict, list, tuple)) or _numeric(value):
                flatten(value, key, out)
        elif isinstance(value, nn.Module):
            flatten(value.state_dict(), key, out)
        elif isinstance(value, np.random.Generator):
            out[key] = fingerprint(value.bit_generator.state)
        elif isinstance(value, torch.Generator):
            out[key] = fingerprint(value.get_state())
        elif isinstance(value, random.Random):
            out[key] = fingerprint(value.getstate())
        elif depth < 2 and hasattr(value, "loss_sum") and hasattr(value, "build_model"):  # a wrapped task
            out.update(task_attributes(value, f"{key}.", depth + 1))
    return out


def _numeric(value: Any) -> bool:
    """A container whose leaves are all tensors, arrays or numbers (an EMA of the weights, a list of counters)."""
    if isinstance(value, dict):
        return bool(value) and all(_numeric(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return bool(value) and all(_numeric(v) for v in value)
    return isinstance(value, (torch.Tensor, np.ndarray, int, float, np.generic)) and not isinstance(value, bool)


def live_state(run: Any) -> dict[str, dict[str, str]]:
    """The record of ``run`` (a trainproof.train.run.Run) at its current step boundary: per component of
    :data:`COMPONENTS`, each leaf's key and fingerprint (this rank's; the verifier reads rank 0's)."""
    model = run.model.state_dict()
    params = {name for name, _ in run.model.named_parameters()}
    return {
        "parameters": flatten({k: v for k, v in model.items() if k in params}),
        "buffers": flatten({k: v for k, v in model.items() if k not in params}),
        "optimizer": flatten(run.optimizer.state_dict()),
        "scheduler": flatten(None if run.scheduler is None else run.scheduler.state_dict()),
        "grad_scaler": flatten(run.scaler.state_dict()),
        "rng_states": flatten(rng.capture(run.np_gen, cuda=run.cuda)),
        "data_position": flatten(run.sampler.state_dict()),
        "progress": flatten({"step": run.step, "epoch": run.sampler.epoch, "samples_seen": run.samples_seen,
                             "targets_seen": run.targets_seen, "lr": run.lr()}),
        "task_state": flatten(run.task.state_dict()),
        "task_attributes": task_attributes(run.task),
    }
