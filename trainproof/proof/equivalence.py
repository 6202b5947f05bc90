"""The arithmetic the float64 equivalence checks share: did two runs see the same data, and how far apart did they end.

The world-size check (:mod:`trainproof.proof.world`) and the objective check (:mod:`trainproof.proof.objective`) both
compare runs that must train the *same model* by different routes (W ranks vs one; unequal micro-batches vs one), each
in float64 and within an absolute tolerance. Unlike the resume comparison (:mod:`trainproof.proof.compare`, bitwise,
every entry walked), they need two things only: whether both runs consumed the same samples in the same steps
(:func:`same_experience`, exact), and the largest absolute difference of what they trained
(:func:`max_differences`). Kept in one place: the two copies that existed drifted, and the world-size one raised on
a task whose optimizer keeps no state.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from trainproof.format.state import History

EXPERIENCE = ("sample_ids", "sample_offsets", "targets", "lr", "epoch")
"""History columns two equivalent runs hold equal: what each step consumed, and the rate it was trained with."""


def same_experience(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same samples in the same steps, same target counts, learning rates and epochs (exact)."""
    ha, hb = History.from_state_dict(a["history"]), History.from_state_dict(b["history"])
    if len(ha) != len(hb):
        return False
    for k in EXPERIENCE:
        x, y = a["history"].get(k), b["history"].get(k)
        if x is None or y is None or x.shape != y.shape or not bool((x == y).all()):
            return False
    return True


def max_differences(a: dict[str, Any], b: dict[str, Any]) -> dict[str, float]:
    """Largest absolute difference of parameters (and floating buffers), optimizer moments and per-step losses.

    An optimizer that keeps no state (plain SGD without momentum) gives 0 for ``optimizer``: the parameters carry
    the gradient then. Optimizer states that hold other parameters' entries give inf (they cannot line up), as do
    loss histories of other lengths; empty and non-floating entries (an integer step count) are skipped.
    """
    opt_a, opt_b = a["optimizer"]["state"], b["optimizer"]["state"]
    if set(opt_a) != set(opt_b):
        optimizer = math.inf
    else:
        optimizer = max((_max_abs(opt_a[i][k], opt_b[i][k]) for i in opt_a for k in opt_a[i]
                         if _compared(opt_a[i][k])), default=0.0)
    loss_a, loss_b = a["history"]["loss"], b["history"]["loss"]
    return {
        "parameters": max((_max_abs(a["model"][k], b["model"][k]) for k in a["model"] if _compared(a["model"][k])),
                          default=0.0),
        "optimizer": optimizer,
        "losses": _max_abs(loss_a, loss_b) if loss_a.shape == loss_b.shape else math.inf,
    }


def _compared(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.numel() > 0


def _max_abs(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((x - y).abs().max()) if x.numel() else 0.0
