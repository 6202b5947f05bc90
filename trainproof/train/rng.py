"""Every random generator the training loop really draws from: seed, capture, restore, observe.

Which generators, and why these:

- Python's global ``random`` (tasks use it for augmentation; user code often does too);
- the rank's own NumPy ``Generator(PCG64)`` (task noise), passed to the task;
- the data generator, another ``PCG64`` that draws the epoch permutations: seeded from the run seed only,
  identical on every rank and for every world size (the sampler owns it and saves it with the data position);
- NumPy's legacy global ``np.random`` (user code that calls ``np.random.rand``);
- PyTorch's global CPU generator (``nn.Dropout`` cannot be given a generator, so it must be the global one)
  and, on CUDA runs, the generator of every visible device.

With several ranks each rank seeds its generators from ``trainproof.train.dist.rank_seed(seed, rank)``, so ranks draw
different dropout masks and noise; rank 0 uses the run seed itself, as a one-process run does.

Captured states are plain primitives and byte tensors so that ``torch.load(weights_only=True)`` accepts
them: Python's Mersenne Twister as a list of ints, PCG64 as its state dict of ints and strings, MT19937
as a list of ints, PyTorch's as ``ByteTensor``. No NumPy arrays, no pickled objects.
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from trainproof.errors import StateError

RNG_SCHEMA = "trainproof.rng/1"
DATA_STREAM = 0x64617461  # "data": keeps the permutation stream apart from the run seed's own stream


def seed_all(seed: int) -> np.random.Generator:
    """Seed the process-global generators and return the run's NumPy generator.

    This is how a run *starts*. It is not a restore: re-seeding a resumed run restarts every sequence
    from the beginning (that is exactly what ``--omit-rng-restore`` demonstrates).
    """
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily
    return np.random.Generator(np.random.PCG64(seed))


def data_generator(seed: int) -> np.random.Generator:
    """The generator of the epoch permutations: seeded from the run seed alone, the same on every rank and
    for every world size, so the data order is one global sequence however many ranks share it."""
    return np.random.Generator(np.random.PCG64([seed, DATA_STREAM]))


def generator_state(gen: np.random.Generator) -> dict[str, Any]:
    """A NumPy generator's bit-generator state as weights-only-loadable builtins."""
    return _plain(gen.bit_generator.state)


def reseed(np_gen: np.random.Generator, seed: int) -> None:
    """Seed the process-global generators and ``np_gen`` in place (used when a world-size change
    re-derives every rank's streams; objects holding ``np_gen`` keep working)."""
    np_gen.bit_generator.state = seed_all(seed).bit_generator.state


def capture(np_gen: np.random.Generator, *, cuda: bool = False) -> dict[str, Any]:
    """Return the state of every generator as weights-only-loadable primitives."""
    version, internal, gauss_next = random.getstate()
    legacy = np.random.get_state(legacy=True)
    return {
        "schema": RNG_SCHEMA,
        "python": {"version": int(version), "internal": [int(v) for v in internal], "gauss_next": gauss_next},
        "numpy": _plain(np_gen.bit_generator.state),
        "numpy_global": {
            "bit_generator": str(legacy[0]),
            "key": [int(v) for v in legacy[1]],
            "pos": int(legacy[2]),
            "has_gauss": int(legacy[3]),
            "cached_gaussian": float(legacy[4]),
        },
        "torch": torch.get_rng_state(),
        "torch_cuda": _cuda_states() if cuda else [],
    }


def restore(state: dict[str, Any], np_gen: np.random.Generator, *, cuda: bool = False) -> None:
    """Put every generator back to ``state`` (as returned by :func:`capture`).

    Call it LAST, after every object that consumes random draws was built and loaded, right before
    training continues: anything that draws afterwards (a model constructor, a sampler) would silently
    shift the sequences.
    """
    check_state(state)
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss_next"]))
    np_gen.bit_generator.state = state["numpy"]
    leg = state["numpy_global"]
    key = np.asarray(leg["key"], dtype=np.uint32)
    np.random.set_state((leg["bit_generator"], key, leg["pos"], leg["has_gauss"], leg["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if cuda:
        _restore_cuda(state["torch_cuda"])


def check_state(state: Any) -> None:
    """Refuse an RNG state that is missing a generator or has the wrong shape (never guess a default)."""
    if not isinstance(state, dict) or state.get("schema") != RNG_SCHEMA:
        raise StateError(f"RNG state has schema {_schema_of(state)!r}, expected {RNG_SCHEMA!r}")
    missing = [k for k in ("python", "numpy", "numpy_global", "torch", "torch_cuda") if k not in state]
    if missing:
        raise StateError(f"RNG state lacks generator(s) {missing}")
    if len(state["python"].get("internal", [])) != 625:
        raise StateError("RNG state: Python random state must hold 625 ints")
    if state["numpy"].get("bit_generator") != "PCG64":
        raise StateError(f"RNG state: NumPy generator is {state['numpy'].get('bit_generator')!r}, expected 'PCG64'")
    if len(state["numpy_global"].get("key", [])) != 624:
        raise StateError("RNG state: legacy NumPy MT19937 key must hold 624 ints")
    t = state["torch"]
    if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
        raise StateError("RNG state: torch CPU state must be a 1-D ByteTensor")


def observe_next_draws(np_gen: np.random.Generator, *, cuda: bool = False) -> dict[str, Any]:
    """Draw the next value of every generator, then put every generator back.

    The verifier compares these "next draws" between the continuous and the resumed path; because the
    states are restored afterwards, observing does not disturb the run.
    """
    saved = capture(np_gen, cuda=cuda)
    try:
        draws: dict[str, Any] = {
            "python": random.random(),
            "numpy": float(np_gen.random()),
            "numpy_global": float(np.random.random()),
            "torch": float(torch.rand((), dtype=torch.float64)),
        }
        if cuda:
            draws["torch_cuda"] = [
                float(torch.rand((), dtype=torch.float64, device=f"cuda:{i}"))
                for i in range(len(saved["torch_cuda"]))
            ]
        return draws
    finally:
        restore(saved, np_gen, cuda=cuda)


def _plain(value: Any) -> Any:
    """Deep-copy a bit-generator state into builtins (NumPy may hand back NumPy integer types)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (np.integer, int)):
        return int(value)
    if isinstance(value, (str, float, bool)) or value is None:
        return value
    raise StateError(f"unexpected value of type {type(value).__name__} in a NumPy bit-generator state")


def _cuda_states() -> list[torch.Tensor]:
    return [torch.cuda.get_rng_state(i) for i in range(torch.cuda.device_count())]


def _restore_cuda(states: list[torch.Tensor]) -> None:
    count = torch.cuda.device_count()
    if len(states) != count:
        raise StateError(
            f"the state holds CUDA RNG states for {len(states)} device(s) but {count} are visible: "
            "resume on the same number of GPUs"
        )
    for i, s in enumerate(states):
        torch.cuda.set_rng_state(s, i)


def _schema_of(state: Any) -> Any:
    return state.get("schema") if isinstance(state, dict) else type(state).__name__
