"""How a resume reads a generation, importable before torch: a restarted ``train`` starts fetching the newest
generation with these very settings while it imports torch and builds its model (``GenerationStore.fetch_ahead``),
and its resume then takes what was fetched (``trainproof.train.discover``)."""

from __future__ import annotations

from typing import Any

from trainproof.format.shard_files import is_sharded_file
from trainproof.storage.spool import spool_dir


def spooled() -> dict[str, Any]:
    """Resume loads every file into a spool file (parallel ranged reads, hashed as they arrive) and maps it, so a
    state of any size is never held twice in memory (``trainproof.storage.spool``)."""
    # A sharded generation's DCP files are read by each rank itself, only those it needs (trainproof.train.sharded).
    return {"spool_dir": spool_dir(), "spool_from": 0, "skip": is_sharded_file}


def fetch_ahead(store: Any) -> None:
    """Start fetching the generation a resume will load first, beside the process's set-up (every rank: each loads
    the generation's files it reads itself)."""
    try:
        settings = spooled()
    except OSError:  # the spool folder cannot be made: the resume meets that itself, and says so
        return
    store.fetch_ahead(**settings)
