"""Data position: which samples each optimizer step consumes, and how to resume mid-epoch exactly.

The sampler owns no randomness of its own: each epoch's permutation is drawn from the run's NumPy
generator, *lazily* when the first batch of that epoch is requested. Drawing lazily matters: a run cut
exactly at an epoch boundary and a continuous run then draw the next permutation at the same point of
the generator's sequence (right before that epoch's first batch), so neither skips nor repeats data.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from job.errors import ConfigError, StateError

DATA_SCHEMA = "trainproof.data/1"


def epoch_plan(samples: int, per_rank: int, world: int = 1) -> dict[str, Any]:
    """The epoch plan of PROTOCOL.md: steps per epoch, tail size and quarter-epoch steps.

    Every sample is presented exactly once per epoch: no silent tail drop and no padding. The last step
    may be smaller, but must still give every rank at least one real sample.
    """
    if samples < 1 or per_rank < 1 or world < 1:
        raise ConfigError(f"an epoch plan needs samples, batch and world >= 1 (got {samples}, {per_rank}, {world})")
    global_batch = world * per_rank
    steps = math.ceil(samples / global_batch)
    tail = samples - (steps - 1) * global_batch
    if tail < world:
        raise ConfigError(
            f"the last step of an epoch would hold {tail} sample(s) for {world} ranks: "
            "change the batch size or the number of samples"
        )
    quarters = [math.ceil(steps * q / 4) for q in range(1, 5)]
    return {"samples": samples, "global_batch": global_batch, "steps": steps, "tail": tail, "quarter_steps": quarters}


class EpochSampler:
    """Hands out the sample ids of each optimizer step: one permutation per epoch and a cursor in it."""

    def __init__(self, num_samples: int, np_gen: np.random.Generator) -> None:
        if num_samples < 1:
            raise ConfigError("a task must have at least one sample")
        self.num_samples = num_samples
        self._gen = np_gen
        self.epoch = 0
        self.cursor = 0
        self.permutation: np.ndarray | None = None  # None until the first batch is requested

    def next_ids(self, batch_size: int) -> list[int]:
        """Sample ids for the next optimizer step (fewer than ``batch_size`` at the end of an epoch)."""
        if self.permutation is None or self.cursor >= self.num_samples:
            if self.permutation is not None:
                self.epoch += 1
            self.permutation = self._gen.permutation(self.num_samples).astype(np.int64)
            self.cursor = 0
        ids = self.permutation[self.cursor : self.cursor + batch_size]
        self.cursor += len(ids)
        return [int(i) for i in ids]

    def state_dict(self) -> dict[str, Any]:
        """Position as weights-only-loadable values (the permutation as an int64 tensor)."""
        perm = None if self.permutation is None else torch.from_numpy(self.permutation.copy())
        return {
            "schema": DATA_SCHEMA,
            "num_samples": self.num_samples,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "permutation": perm,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position after checking it describes a real permutation of this dataset."""
        check_state(state, self.num_samples)
        perm = state["permutation"]
        self.permutation = None if perm is None else perm.numpy().astype(np.int64).copy()
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])


def check_state(state: Any, num_samples: int) -> None:
    """Refuse a data position that does not fit a dataset of ``num_samples`` samples."""
    if not isinstance(state, dict) or state.get("schema") != DATA_SCHEMA:
        raise StateError(f"data position has an unknown schema (expected {DATA_SCHEMA!r})")
    if state.get("num_samples") != num_samples:
        raise StateError(
            f"data position is for {state.get('num_samples')} samples, the dataset has {num_samples}"
        )
    epoch, cursor, perm = state.get("epoch"), state.get("cursor"), state.get("permutation")
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(cursor, int) and 0 <= cursor <= num_samples):
        raise StateError(f"data position epoch={epoch!r} cursor={cursor!r} is out of range")
    if perm is None:
        if cursor != 0 or epoch != 0:
            raise StateError("data position has a cursor but no permutation")
        return
    if not isinstance(perm, torch.Tensor) or perm.dtype != torch.int64 or perm.shape != (num_samples,):
        raise StateError("data permutation must be an int64 tensor with one entry per sample")
    if not torch.equal(torch.sort(perm).values, torch.arange(num_samples)):
        raise StateError("data permutation is not a permutation of the dataset (a sample repeated or missing)")
