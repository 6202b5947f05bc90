"""Datasets in the bucket: the sharded format, packing it, and reading it verified.

Owns: ``dataset.json`` and what it may say (``manifest``: fixed-size records such as token windows, or samples of
any size with an index; every shard's size, sha256 and part digests; the identity a task's ``data_identity`` is),
packing local arrays and files into shards written, read back and then named by the manifest (``writer``,
``trainproof data pack``), and :class:`ShardedDataset`, the map-style dataset that reads samples through the store
layer, every part verified before use and cached locally (``reader``). May import only ``trainproof.errors`` and
``storage``: it knows nothing of the trainer, which asks a task for batches and never for a dataset.
"""

from trainproof.data.manifest import DATASET_FILE, Manifest
from trainproof.data.reader import ShardedDataset, cache_settings
from trainproof.data.writer import PART_BYTES, SHARD_BYTES, Packed, pack_records, pack_samples, token_windows

__all__ = ["DATASET_FILE", "Manifest", "PART_BYTES", "Packed", "SHARD_BYTES", "ShardedDataset", "cache_settings",
           "pack_records", "pack_samples", "token_windows"]
