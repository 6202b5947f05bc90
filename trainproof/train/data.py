"""Data position: which samples each optimizer step consumes, and how to resume mid-epoch exactly.

Each epoch's permutation is drawn from the data generator (seeded from the run seed alone, so the data
order is the same on every rank and for every world size), *lazily* when the first batch of that epoch
is requested. Drawing lazily matters: a run cut exactly at an epoch boundary and a continuous run then
draw the next permutation at the same point of the generator's sequence (right before that epoch's first
batch), so neither skips nor repeats data.

The saved position is O(1), whatever the dataset size: not the permutation (8 bytes a sample) but the data
generator's state right *before* this epoch's permutation was drawn (``epoch_generator``), the cursor, and the
generator's current state. Loading redraws the permutation from ``epoch_generator`` exactly as
:meth:`EpochSampler.next_ids` drew it, and refuses the position unless the generator then stands exactly at the
saved ``generator``: the pair proves itself (a tampered or mismatched pair, another NumPy, another dataset
size would all land elsewhere).
"""

from __future__ import annotations

import copy
import math
from typing import Any

import numpy as np
import torch

from trainproof.errors import ConfigError, StateError
from trainproof.train import rng

DATA_SCHEMA = "trainproof.data/3"  # /3: O(1): the generator before the epoch's draw replaces the permutation


def epoch_plan(samples: int, per_rank: int, world: int = 1) -> dict[str, Any]:
    """The epoch plan of docs/protocol.md: steps per epoch, tail size and quarter-epoch steps.

    Every sample is presented exactly once per epoch: no silent tail drop and no padding. The last step
    may be smaller, but must still give every rank at least one real sample; otherwise ConfigError (exit 2)
    names the numbers and batch sizes that would work.
    """
    if samples < 1 or per_rank < 1 or world < 1:
        raise ConfigError(f"an epoch plan needs samples, batch and world >= 1 (got {samples}, {per_rank}, {world})")
    global_batch = world * per_rank
    steps = math.ceil(samples / global_batch)
    tail = samples - (steps - 1) * global_batch
    if tail < world:
        raise ConfigError(
            f"epoch plan: {samples} samples in global batches of {global_batch} ({world} ranks x {per_rank}) "
            f"leave {tail} sample(s) for the last step of each epoch, fewer than the {world} ranks (every rank "
            f"needs at least one real sample; trainproof neither drops nor pads the tail). Set the task's per-rank "
            f"batch_size (--config) to {_fitting_batches(samples, per_rank, world)}, use another world size, or "
            f"a sample count whose remainder modulo {global_batch} is 0 or at least {world}"
        )
    quarters = [math.ceil(steps * q / 4) for q in range(1, 5)]
    return {"samples": samples, "global_batch": global_batch, "steps": steps, "tail": tail, "quarter_steps": quarters}


def _fitting_batches(samples: int, per_rank: int, world: int) -> str:
    """The nearest per-rank batch sizes below and above ``per_rank`` whose epoch tail fits the world."""
    def fits(b: int) -> bool:
        return samples - (math.ceil(samples / (world * b)) - 1) * world * b >= world

    below = next((b for b in range(per_rank - 1, 0, -1) if fits(b)), None)
    above = next((b for b in range(per_rank + 1, per_rank + 4 * world + 2) if fits(b)), None)
    found = [str(b) for b in (below, above) if b is not None]
    return " or ".join(found) if found else "another value"


class EpochSampler:
    """Hands out the sample ids of each optimizer step: one permutation per epoch and a cursor in it.

    It owns the data generator (:func:`trainproof.train.rng.data_generator`): the permutations are one global sequence,
    the same on every rank and for any world size; each rank then takes its slice of each step's ids.
    """

    def __init__(self, num_samples: int, np_gen: np.random.Generator) -> None:
        if num_samples < 1:
            raise ConfigError("a task must have at least one sample")
        self.num_samples = num_samples
        self._gen = np_gen
        self.epoch = 0
        self.cursor = 0
        self.permutation: np.ndarray | None = None  # None until the first batch is requested
        self._epoch_gen: dict[str, Any] | None = None  # the data generator right before this epoch's draw

    def next_ids(self, batch_size: int) -> list[int]:
        """Sample ids for the next optimizer step (fewer than ``batch_size`` at the end of an epoch)."""
        if self.permutation is None or self.cursor >= self.num_samples:
            if self.permutation is not None:
                self.epoch += 1
            self._epoch_gen = rng.generator_state(self._gen)
            self.permutation = draw_permutation(self._gen, self.num_samples)
            self.cursor = 0
        ids = self.permutation[self.cursor : self.cursor + batch_size]
        self.cursor += len(ids)
        return [int(i) for i in ids]

    def state_dict(self) -> dict[str, Any]:
        """The position as weights-only-loadable builtins, O(1) in the dataset size (see the module doc)."""
        drawn = self.permutation is not None
        return {
            "schema": DATA_SCHEMA,
            "num_samples": self.num_samples,
            "epoch": self.epoch,
            "cursor": self.cursor,
            "drawn": drawn,
            "epoch_generator": copy.deepcopy(self._epoch_gen) if drawn else None,
            "generator": rng.generator_state(self._gen),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the position: redraw this epoch's permutation and check it lands on the saved generator.

        The generator itself is restored separately, by :meth:`restore_generator`, with the other generators: last.
        """
        perm = permutation_of(state, self.num_samples)
        self.permutation = None if perm is None else perm.numpy().copy()
        self._epoch_gen = copy.deepcopy(state["epoch_generator"]) if state["drawn"] else None
        self.epoch = int(state["epoch"])
        self.cursor = int(state["cursor"])

    def restore_generator(self, state: dict[str, Any]) -> None:
        """Put the data generator back to the state saved with this position."""
        self._gen.bit_generator.state = state["generator"]

    def next_draw(self) -> float:
        """The data generator's next draw, observed and then put back (see ``rng.observe_next_draws``)."""
        saved = self._gen.bit_generator.state
        try:
            return float(self._gen.random())
        finally:
            self._gen.bit_generator.state = saved


def draw_permutation(gen: np.random.Generator, num_samples: int) -> np.ndarray:
    """One epoch's permutation, drawn from ``gen`` (which it advances): the only place the sampler draws."""
    return gen.permutation(num_samples).astype(np.int64)


def permutation_of(state: Any, num_samples: int) -> torch.Tensor | None:
    """The epoch permutation a data position stands in (None before the first draw), redrawn from its
    ``epoch_generator``; StateError unless the position fits the dataset and the redraw ends exactly on the
    saved ``generator`` state."""
    check_state(state, num_samples)
    if not state["drawn"]:
        return None
    gen = np.random.Generator(np.random.PCG64())
    try:
        gen.bit_generator.state = state["epoch_generator"]
    except (TypeError, ValueError, KeyError) as exc:
        raise StateError("data position's epoch_generator is not a "
                         f"PCG64 state ({type(exc).__name__}: {exc})") from None
    perm = draw_permutation(gen, num_samples)
    if rng.generator_state(gen) != state["generator"]:
        raise StateError("data position refused: redrawing the epoch's permutation from its epoch_generator does "
                          "not end on the saved generator state (a tampered or mismatched generator pair)")
    return torch.from_numpy(perm)


def check_state(state: Any, num_samples: int) -> None:
    """Refuse a data position that does not fit a dataset of ``num_samples`` samples."""
    if not isinstance(state, dict) or state.get("schema") != DATA_SCHEMA:
        raise StateError(f"data position has an unknown schema (expected {DATA_SCHEMA!r})")
    if type(num_samples) is not int or state.get("num_samples") != num_samples:
        raise StateError(
            f"data position is for {state.get('num_samples')} samples, the dataset has {num_samples}"
        )
    epoch, cursor, drawn = state.get("epoch"), state.get("cursor"), state.get("drawn")
    if not (isinstance(epoch, int) and epoch >= 0 and isinstance(cursor, int) and 0 <= cursor <= num_samples):
        raise StateError(f"data position epoch={epoch!r} cursor={cursor!r} is out of range")
    if type(drawn) is not bool:
        raise StateError(f"data position 'drawn' is {drawn!r}, not a bool")
    if not drawn and (cursor != 0 or epoch != 0):
        raise StateError("data position has a cursor but no permutation drawn")
    for key in ("generator", *(("epoch_generator",) if drawn else ())):
        gen = state.get(key)
        if not isinstance(gen, dict) or gen.get("bit_generator") != "PCG64":
            raise StateError(f"data position lacks its PCG64 {key.replace('_', ' ')} state")
