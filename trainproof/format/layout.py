"""The parallel layout of a run: how its ranks hold the model and optimizer. Chosen once, recorded, asked.

In the manner of torchtitan's ``ParallelDims``: a small value of degrees, validated once when the run is built,
then asked questions (``sharded``, ``name``, ``describe``) instead of a flag threaded through every function.
Two layouts exist today:

- **replicated** (DDP, or one process): every rank holds the whole model and optimizer; ``dp_replicate`` is the
  world, ``dp_shard`` 1. A generation holds them inside ``training_state.pt``.
- **fully sharded** (FSDP2 on a 1-D mesh of every rank, ``train --fsdp``): ``dp_shard`` is the world. It is
  sharded even over one rank, so its generations have one format whatever the world. A generation holds DCP
  shard files beside a ``training_state.pt`` whose ``model``/``optimizer`` sections are empty.

Hybrid sharding (a 2-D mesh of ``dp_replicate`` × ``dp_shard``) or tensor parallelism would be a new value of
these degrees with its own strategy (``trainproof.train.parallel``); they are refused until one exists.

How it is recorded: ``plan.json`` and every state's ``meta`` carry ``layout`` (:meth:`Layout.record`), and a
sharded run keeps the ``fsdp: true`` field it always had, which is part of the contract hash (a replicated run's
contract is what it always was). Readers ask :func:`sharded` of a plan or a state's meta, which understands
records written before ``layout`` existed (only ``fsdp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainproof.errors import ConfigError

REPLICATED, FULLY_SHARDED = "replicated", "fully_sharded"


@dataclass(frozen=True, kw_only=True)
class Layout:
    """The degrees of a run's parallelism (their product is the world size)."""

    world: int
    """Ranks of the run."""
    dp_shard: int = 1
    """Ranks one copy of the model and optimizer is sharded over."""
    sharded: bool = False
    """The model and optimizer are held as shards (FSDP2), over one rank too."""

    def __post_init__(self) -> None:
        if self.world < 1:
            raise ConfigError(f"the world size must be >= 1 (got {self.world})")
        if self.sharded and self.dp_shard != self.world:
            raise ConfigError(f"sharding over {self.dp_shard} of {self.world} ranks (hybrid sharding) is not "
                              "supported: --fsdp shards over every rank")
        if not self.sharded and self.dp_shard != 1:
            raise ConfigError(f"dp_shard {self.dp_shard} needs a sharded layout (--fsdp)")

    @classmethod
    def choose(cls, *, world: int, fsdp: bool) -> Layout:
        """The layout of a run of ``world`` ranks: fully sharded with ``--fsdp`` (or a task that asks), else
        replicated."""
        return cls(world=world, dp_shard=world, sharded=True) if fsdp else cls(world=world)

    @property
    def dp_replicate(self) -> int:
        """Copies of the model and optimizer across the ranks."""
        return self.world // self.dp_shard

    @property
    def name(self) -> str:
        """``fully_sharded`` or ``replicated``."""
        return FULLY_SHARDED if self.sharded else REPLICATED

    def describe(self) -> str:
        """For a log line: ``FSDP2 over 4 rank(s)``, ``DDP over 4 rank(s)``, ``one process``."""
        if self.sharded:
            return f"FSDP2 over {self.world} rank(s)"
        return "one process" if self.world == 1 else f"DDP over {self.world} rank(s)"

    def record(self) -> dict[str, Any]:
        """The ``layout`` field of plan.json and of a state's meta (plus ``fsdp: true`` when sharded, as before)."""
        return {"layout": {"name": self.name, "dp_replicate": self.dp_replicate, "dp_shard": self.dp_shard},
                **({"fsdp": True} if self.sharded else {})}

    def contract_fields(self) -> dict[str, Any]:
        """What the layout adds to the contract hash: ``fsdp: true`` when sharded, nothing when replicated (so
        neither kind of run's contract changed when layouts came)."""
        return {"fsdp": True} if self.sharded else {}


def sharded(record: dict[str, Any] | None) -> bool:
    """Whether a plan.json or a state's meta describes a sharded run (``layout`` or, before it, ``fsdp``)."""
    record = record if isinstance(record, dict) else {}
    layout = record.get("layout")
    if isinstance(layout, dict) and "name" in layout:
        return layout["name"] == FULLY_SHARDED
    return bool(record.get("fsdp"))


def flag(is_sharded: bool) -> list[str]:
    """The ``train`` option that asks for this layout (``--fsdp``, or nothing): for the command lines the verifier
    and the audit start."""
    return ["--fsdp"] if is_sharded else []
