"""trainproof's generation store over fsspec: write → verify → mark usable, discovery, retention, retries.

Knows nothing about training: a generation is a set of named byte files plus a ``COMPLETE.json`` manifest.
Remote backends are imported lazily, so a local run imports nothing remote.
"""

from storage.errors import (CommitConflictError, CorruptGenerationError, StoreConfigError, StoreError,
                            StoreUnavailableError)
from storage.generations import COMPLETE, CORRUPT, FOREIGN, INCOMPLETE, GenerationInfo, Loaded
from storage.options import RetryPolicy, StoreOptions
from storage.retention import plan_retention
from storage.store import GenerationStore, open_store

__all__ = [
    "open_store", "GenerationStore", "GenerationInfo", "Loaded", "StoreOptions", "RetryPolicy", "plan_retention",
    "StoreError", "StoreConfigError", "StoreUnavailableError", "CommitConflictError", "CorruptGenerationError",
    "COMPLETE", "INCOMPLETE", "CORRUPT", "FOREIGN",
]
