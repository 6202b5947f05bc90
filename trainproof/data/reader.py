"""``ShardedDataset``: a packed dataset read from its bucket, verified part by part, as a map-style dataset.

``dataset[i]`` is sample ``i`` as a NumPy array (a record of the manifest's shape, or a 1-D sample of its own
length); ``dataset.__getitems__(ids)`` reads a micro-batch's samples at once, fetching the uncached parts they need
from every shard in parallel, a bounded number at a time (DatasetTask asks for micro-batches that way, in its
DataLoader workers). Reads go through the
store layer (``trainproof.storage.objects``): ranged reads, retried, each part verified against the manifest before a
byte of
it is used, kept in a local cache of bounded size shared by the processes of the machine:

- ``TRAINPROOF_DATA_CACHE``: the cache folder (default ``trainproof-data-cache-<uid>`` in ``TRAINPROOF_SPOOL_DIR`` or
  the system temp folder); ``TRAINPROOF_DATA_CACHE_MB``: its bound (default 4096). Give it room for the dataset when
  you can: a sample read from a part that is no longer cached fetches the whole part again (1 MiB by default).
  The folder must be this user's own, a folder (not a symbolic link) that no one else can write
  (:func:`cache_folder`): a given one that is not is refused (exit 2); a default one that is not (another user made
  it first in a shared temp folder) is passed over for a private folder of this process's (mode 0700), with one
  warning. A cached part is verified again anyway before a process first uses it (``PartCache``);
- the bucket's credentials and endpoint are the checkpoints' (``AWS_*`` variables, ``TRAINPROOF_IO_CONCURRENCY``).

Opening checks the manifest (``trainproof.data.manifest``) and lists the shards: a missing shard or one of another size
is a DataError naming it (exit 1: stored content the operator can restore, trainproof.errors) before training starts;
a part that does not match its sha256 is one when it is read (``trainproof.storage.objects.CorruptObjectError``), never
silently different data. Only a URL with nothing there at all is the operator's (ConfigError, exit 2).
``data_identity`` is the manifest's identity, what DatasetTask takes as the run contract's data identity.

Each process reads through its own store client and thread pool: a DataLoader worker forked from the trainer opens
them on its first read (a client's connections and threads do not survive a fork).
"""

from __future__ import annotations

import atexit
import bisect
import hashlib
import logging
import os
import shutil
import stat
import tempfile
from typing import Any

import numpy as np

from trainproof.data.manifest import DATASET_FILE, INDEX_DTYPE, MANIFEST_BYTES, Manifest, Shard, parse
from trainproof.data.writer import open_dataset_store
from trainproof.errors import ConfigError, DataError
from trainproof.storage import StoreOptions
from trainproof.storage.errors import StoreError
from trainproof.storage.objects import CorruptObjectError, ObjectReader, PartCache
from trainproof.storage.spool import spool_dir

CACHE_ENV, CACHE_MB_ENV = "TRAINPROOF_DATA_CACHE", "TRAINPROOF_DATA_CACHE_MB"
DEFAULT_CACHE_MB = 4096
log = logging.getLogger("trainproof.data")
_PRIVATE: dict[str, str] = {}
"""Default folder found untrusted -> the private folder this process uses instead (made once, removed at exit)."""


def cache_settings(directory: str | None = None, mib: int | None = None) -> tuple[str, int]:
    """(folder, bytes) of the part cache: the arguments, else the environment, else the defaults; the folder checked
    (and made) by :func:`cache_folder`."""
    folder = cache_folder(directory or os.environ.get(CACHE_ENV) or None)
    raw = os.environ.get(CACHE_MB_ENV, "").strip()
    if mib is None and raw:
        try:
            mib = int(raw)
        except ValueError:
            raise ConfigError(f"{CACHE_MB_ENV} must be a whole number of MiB, got {raw!r}") from None
    mib = DEFAULT_CACHE_MB if mib is None else mib
    if mib < 1:
        raise ConfigError(f"the data cache needs at least 1 MiB ({CACHE_MB_ENV}), got {mib}")
    return folder, mib * 2**20


def cache_folder(given: str | None) -> str:
    """The part cache's folder, made if missing (mode 0700) and checked to be this user's, a real folder that no one
    else can write: ``given`` (an argument or ``TRAINPROOF_DATA_CACHE``: the operator's, so ConfigError, exit 2, when
    it is not), else ``trainproof-data-cache-<uid>`` in the spool folder (when that is not, e.g. made first by another
    user of a shared temp folder or a symbolic link planted there: a private folder of this process's instead, with
    one warning)."""
    if given:
        why = _made_and_checked(given)
        if why:
            raise ConfigError(f"data cache folder {given} {why}, so parts cached there could be changed behind this "
                              f"run's back: set {CACHE_ENV} to a folder of your own that only you can write "
                              "(chmod 700), not a symbolic link")
        return given
    folder = os.path.join(spool_dir(), f"trainproof-data-cache-{os.getuid()}")
    why = _made_and_checked(folder)
    if not why:
        return folder
    if folder not in _PRIVATE:
        private = tempfile.mkdtemp(prefix=f"trainproof-data-cache-{os.getuid()}-", dir=spool_dir())
        atexit.register(_remove_private, private, os.getpid())
        log.warning("the data cache folder %s %s: caching in a private folder instead, %s (removed at exit); set "
                    "%s to a folder of your own to share the cache between runs", folder, why, private, CACHE_ENV)
        _PRIVATE[folder] = private
    return _PRIVATE[folder]


def _made_and_checked(folder: str) -> str | None:
    """Why ``folder`` (made if missing, mode 0700) cannot hold the cache, None when it can: it must be a folder (not a
    symbolic link), this user's, that neither its group nor others can write."""
    try:
        os.makedirs(folder, mode=0o700, exist_ok=True)
    except FileExistsError:
        pass  # a file or a link to nothing at that name: named below
    except OSError as exc:
        return f"cannot be made ({exc.strerror})"
    st = os.lstat(folder)
    if stat.S_ISLNK(st.st_mode):
        return "is a symbolic link"
    if not stat.S_ISDIR(st.st_mode):
        return "is not a folder"
    if st.st_uid != os.getuid():
        return f"belongs to another user (uid {st.st_uid})"
    if st.st_mode & 0o022:
        return f"can be written by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


def _remove_private(folder: str, pid: int) -> None:
    if os.getpid() == pid:  # not in a forked worker: the process that made it removes it
        shutil.rmtree(folder, ignore_errors=True)


class ShardedDataset:
    """A packed dataset at ``url`` (``s3://bucket/prefix``, a folder, ``memory://``), read as a map-style dataset."""

    def __init__(self, url: str, *, cache_dir: str | None = None, cache_mib: int | None = None,
                 options: StoreOptions | None = None) -> None:
        self.url, self.options = url, options
        self.cache_dir, self.cache_bytes = cache_settings(cache_dir, cache_mib)
        self._pid = -1
        self._open()
        self.manifest = self._read_manifest()
        self._check_listing()
        self._starts = np.cumsum([0] + [s.samples for s in self.manifest.shards]).tolist()
        self._dtype = np.dtype(self.manifest.dtype)
        self._indexes: dict[int, np.ndarray] = {}

    # -- what a task needs ------------------------------------------------------------------------------
    @property
    def data_identity(self) -> str:
        """The manifest's identity (``trainproof.data.manifest``): the run contract's data identity."""
        return self.manifest.identity()

    def __len__(self) -> int:
        return self.manifest.samples

    def __getitem__(self, i: int) -> np.ndarray:
        return self.__getitems__([i])[0]

    def __getitems__(self, ids: list[int]) -> list[np.ndarray]:
        """Samples ``ids``, in order: the uncached parts they need fetched in parallel, each verified."""
        located = [self._locate(i) for i in ids]
        ranges = [self._range(shard, k) for shard, k in located]
        raw = self._read([(self.manifest.shards[s].entry, a, b) for s, (a, b) in zip((s for s, _ in located), ranges)])
        shape = self.manifest.shape or (-1,)
        return [np.frombuffer(bytearray(data), dtype=self._dtype).reshape(shape) for data in raw]

    def lengths(self, ids: list[int]) -> list[int]:
        """Elements of each sample (a records dataset: the record's size; a samples dataset: from its shard's
        index), without reading the samples: e.g. a task's exact ``count_targets``."""
        out = []
        for s, k in (self._locate(i) for i in ids):
            if self.manifest.kind == "records":
                out.append(int(np.prod(self.manifest.shape)))
            else:
                index = self._index(s)
                out.append(int(index[k + 1] - index[k]) // self._dtype.itemsize)
        return out

    def take(self, start: int, stop: int) -> Samples:
        """Samples ``start``..``stop - 1`` as a dataset of their own (a training split and a held-out one)."""
        return Samples(self, start, stop)

    def verify(self) -> int:
        """Read every part of every shard from the store and check it (``trainproof data verify``); bytes read."""
        reader = self._reader_here()
        return self._guard(lambda: reader.verify([shard.entry for shard in self.manifest.shards]))

    # -- reading --------------------------------------------------------------------------------------------
    def _locate(self, i: int) -> tuple[int, int]:
        if not 0 <= int(i) < self.manifest.samples:
            raise IndexError(f"sample {i} is outside the dataset's {self.manifest.samples} samples")
        s = bisect.bisect_right(self._starts, int(i)) - 1
        return s, int(i) - self._starts[s]

    def _range(self, s: int, k: int) -> tuple[int, int]:
        if self.manifest.kind == "records":
            size = self.manifest.record_bytes
            return k * size, (k + 1) * size
        index = self._index(s)
        return int(index[k]), int(index[k + 1])

    def _index(self, s: int) -> np.ndarray:
        """The offsets table of shard ``s`` (a samples dataset), read and verified once per process, then checked:
        it must start at 0, never decrease, and end where the table starts."""
        if s not in self._indexes:
            shard: Shard = self.manifest.shards[s]
            raw = self._read([(shard.entry, shard.index_offset, shard.entry.size)])[0]
            index = np.frombuffer(raw, dtype=INDEX_DTYPE)
            if index[0] != 0 or index[-1] != shard.index_offset or (np.diff(index) < 0).any():
                # The shard's parts matched the manifest: the packer wrote a bad table. Never guess around it.
                raise DataError(f"dataset {self.url}: shard {shard.entry.name} has an index that does not describe "
                                "its samples; pack the dataset again")
            self._indexes[s] = index
        return self._indexes[s]

    def _read(self, wanted: list) -> list[bytes]:
        reader = self._reader_here()
        return self._guard(lambda: reader.read(wanted))

    def _guard(self, fn: Any) -> Any:
        try:
            return fn()
        except CorruptObjectError as exc:
            raise DataError(f"dataset {self.url}: shard {exc.name} {exc.reason}; the data in the bucket is not what "
                            f"its {DATASET_FILE} lists: restore the shard or pack the dataset again") from None
        except StoreError as exc:
            raise DataError(f"dataset {self.url}: {exc}") from None

    # -- per process ------------------------------------------------------------------------------------------
    def _open(self) -> None:
        self._store = open_dataset_store(self.url, self.options)
        self._reader = ObjectReader(self._store, PartCache(self.cache_dir, self.cache_bytes),
                                    concurrency=self._store.options.concurrency)
        self._pid = os.getpid()

    def _reader_here(self) -> ObjectReader:
        if self._pid != os.getpid():  # a forked DataLoader worker: its own client, pool and cache handle
            self._open()
        return self._reader

    def __getstate__(self) -> dict[str, Any]:
        # A worker started by pickling (spawn) opens its own store on its first read, like a forked one.
        return {**self.__dict__, "_store": None, "_reader": None, "_pid": -1}

    def _read_manifest(self) -> Manifest:
        try:
            raw = self._store.read_file(DATASET_FILE, max_bytes=MANIFEST_BYTES)
        except FileNotFoundError:
            raise self._no_manifest() from None
        except StoreError as exc:
            raise DataError(f"dataset {self.url}: {exc}") from None
        try:
            return parse(raw, limits=self._store.options.limits)
        except ValueError as exc:
            raise DataError(f"dataset {self.url}: {exc}") from None

    def _no_manifest(self) -> Exception:
        """No manifest: ConfigError (exit 2) when nothing at all is at the URL (the task's setting is wrong), else a
        DataError (exit 1): shards without their manifest are a packing that did not finish or a deleted manifest."""
        try:
            anything = bool(self._store.list_dir(""))
        except (StoreError, OSError):
            anything = False
        if not anything:
            return ConfigError(f"dataset {self.url}: no {DATASET_FILE}, nothing is there: check the task's dataset "
                               "URL, or pack the dataset there with `trainproof data pack`")
        return DataError(f"dataset {self.url}: no {DATASET_FILE} (its packing did not finish, or the manifest was "
                         "deleted): restore it or pack the dataset again with `trainproof data pack`")

    def _check_listing(self) -> None:
        """Every shard present with its size (one listing): a missing one is named before any training."""
        try:
            listed = {e.name: e.size for e in self._store.list_dir("") if not e.is_dir}
        except StoreError as exc:
            raise DataError(f"dataset {self.url}: {exc}") from None
        for shard in self.manifest.shards:
            name, size = shard.entry.name, shard.entry.size
            if name not in listed:
                raise DataError(f"dataset {self.url}: shard {name} is missing ({DATASET_FILE} lists it): restore it "
                                "or pack the dataset again")
            if listed[name] != size:
                raise DataError(f"dataset {self.url}: shard {name} is {listed[name]} bytes, {DATASET_FILE} says "
                                f"{size}: restore it or pack the dataset again")


class Samples:
    """A contiguous range of a :class:`ShardedDataset`'s samples, renumbered from 0; its ``data_identity`` is the
    dataset's identity with the range."""

    def __init__(self, dataset: ShardedDataset, start: int, stop: int) -> None:
        if not 0 <= start < stop <= len(dataset):
            raise ConfigError(f"samples {start}..{stop} are not a non-empty range of the dataset's {len(dataset)}")
        self.dataset, self.start, self.stop = dataset, start, stop

    @property
    def data_identity(self) -> str:
        return hashlib.sha256(f"{self.dataset.data_identity}[{self.start}:{self.stop}]".encode()).hexdigest()

    def __len__(self) -> int:
        return self.stop - self.start

    def _ids(self, ids: list[int]) -> list[int]:
        for i in ids:
            if not 0 <= int(i) < len(self):
                raise IndexError(f"sample {i} is outside the range's {len(self)} samples")
        return [self.start + int(i) for i in ids]

    def __getitem__(self, i: int) -> np.ndarray:
        return self.dataset.__getitems__(self._ids([i]))[0]

    def __getitems__(self, ids: list[int]) -> list[np.ndarray]:
        return self.dataset.__getitems__(self._ids(ids))

    def lengths(self, ids: list[int]) -> list[int]:
        return self.dataset.lengths(self._ids(ids))
