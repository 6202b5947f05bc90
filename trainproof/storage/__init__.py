"""trainproof's generation store over fsspec: write → verify → mark usable, discovery, retention, retries.

Knows nothing about training: a generation is a set of named byte files plus a ``COMPLETE.json`` manifest.
Remote backends are imported lazily, so a local run imports nothing remote.
"""

from trainproof.storage.errors import (
                            CommitConflictError,
                            CorruptGenerationError,
                            StoreConfigError,
                            StoreError,
                            StoreUnavailableError,
)
from trainproof.storage.generations import COMPLETE, CORRUPT, FOREIGN, INCOMPLETE, GenerationInfo, Loaded
from trainproof.storage.limits import Limits, redact_url
from trainproof.storage.options import RetryPolicy, StoreOptions
from trainproof.storage.retention import MIN_GRACE_SECONDS, KeepEvery, RetentionPolicy, plan_retention
from trainproof.storage.store import GenerationStore, create_store, open_store

__all__ = [
    "open_store", "create_store", "GenerationStore", "GenerationInfo", "Loaded", "StoreOptions", "RetryPolicy",
    "Limits",
    "plan_retention", "RetentionPolicy", "KeepEvery", "MIN_GRACE_SECONDS", "redact_url",
    "StoreError", "StoreConfigError", "StoreUnavailableError", "CommitConflictError", "CorruptGenerationError",
    "COMPLETE", "INCOMPLETE", "CORRUPT", "FOREIGN",
]
