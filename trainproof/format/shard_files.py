"""Names of a sharded generation's files, importable without ``torch.distributed.checkpoint`` (whose import
costs seconds at every process start; only sharded runs pay it, in ``trainproof.train.sharded``)."""

from __future__ import annotations

METADATA_FILE = "dcp.metadata"
"""DCP's metadata: every tensor's chunks, and where each chunk lies."""


def shard_file(rank: int) -> str:
    """The file of rank ``rank``'s chunks of sharded tensors (every rank writes one)."""
    return f"shard-{rank:05d}.distcp"


def values_file(rank: int) -> str:
    """The file of the plain tensors and values rank ``rank`` was given to write (when it was given any)."""
    return f"values-{rank:05d}.distcp"


def is_sharded_file(name: str) -> bool:
    """Whether ``name`` is one of a sharded generation's DCP files (read through ``trainproof.train.sharded`` only)."""
    return name == METADATA_FILE or name.endswith(".distcp")
