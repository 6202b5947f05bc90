"""How a resume reads a generation, importable before torch: a restarted ``train`` starts fetching the newest
generation with these very settings while it imports torch and builds its model (``GenerationStore.fetch_ahead``),
and its resume then takes what was fetched (``trainproof.train.discover``)."""

from __future__ import annotations

from typing import Any

from trainproof.format.shard_files import is_sharded_file
from trainproof.storage.generations import PLAN
from trainproof.storage.spool import spool_dir


def spooled() -> dict[str, Any]:
    """Resume loads every file into a spool file (parallel ranged reads, hashed as they arrive) and maps it, so a
    state of any size is never held twice in memory (``trainproof.storage.spool``)."""
    # A sharded generation's DCP files are read by each rank itself, only those it needs (trainproof.train.sharded).
    return {"spool_dir": spool_dir(), "spool_from": 0, "skip": is_sharded_file}


def fetch_ahead(store: Any) -> None:
    """Start fetching the generation a resume will load first, beside the process's set-up (every rank: each loads
    the generation's files it reads itself): the newest complete one of the contract the run's stored plan names
    (none for a run without a plan: a fresh start). The resume discards what it did not take."""
    try:
        settings = spooled()
        store.fetch_ahead(lambda: stored_contract(store), **settings)
    except (OSError, RuntimeError):  # no spool folder, no thread: the resume meets the first itself, and says so
        return


def stored_contract(store: Any) -> str | None:
    """The contract of the run's stored plan (read on the fetch's thread, size-capped, parsed defensively), or None:
    no plan, or none that names one. It only picks what to fetch; the resume checks the plan itself. Anything else
    it raises (a store fault, a folder at plan.json) ends the fetch, which fetches nothing."""
    try:
        plan = store.read_json(PLAN)
    except (FileNotFoundError, ValueError):
        return None
    contract = plan.get("contract") if isinstance(plan, dict) else None
    return contract if isinstance(contract, str) else None
