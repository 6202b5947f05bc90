"""A fresh start from pretrained weights: the task's :meth:`~trainproof.tasks.Task.pretrained` files, read through the
store layer, verified against the sha256 the task declares, and loaded by name into the model it built.

The rules this keeps (docs/tasks.md, "Start from pretrained weights"):

- **initialisation comes from the seeded generator or from a verified file**, nothing else: the model is built
  and seeded as always (so the generators are in the same state on every fresh start), then every parameter and
  buffer is overwritten with the file's tensors. A file whose bytes do not hash to the declared sha256 is refused
  by name before any tensor is read: a flipped byte, a truncated copy or another file at the same path. That is a
  DataError (exit 1: stored content the operator can put back, so the Job's retry can go on), not exit 2;
- **the sha256 is in the run contract** (trainproof.format.contract ``init_sha256``), so declaring another file is
  another experiment, and a resume with it is refused (exit 2, naming the field);
- **a resume never reads the file**: only a fresh start calls :func:`start_from_pretrained` (trainproof.train.resume);
  the checkpoint holds the weights from the first commit on, so the file may be gone by then.

The file is downloaded into a local spool file (``TRAINPROOF_SPOOL_DIR``; room for the file is needed once) while it
is hashed, then read with the safetensors library one tensor at a time, each copied into the model and dropped: the
process holds the model it trains and one tensor of the file. Every rank reads the files itself.

A Hugging Face model directory (``Pretrained(url=..., digest=...)``) is verified file by file against its listing,
whose sha256 is the declared digest (trainproof.train.model_dir); its weights files (``model.safetensors``, or the
shards ``model.safetensors.index.json`` maps each tensor to) are then loaded like files, each shard holding exactly
the tensors the index maps to it.
"""

from __future__ import annotations

import contextlib
import os
import time
from typing import Any, Callable
from urllib.parse import urlparse

import torch
from torch import nn

from trainproof.errors import ConfigError, DataError
from trainproof.storage import StoreOptions, open_store, redact_url
from trainproof.storage.errors import StoreConfigError
from trainproof.storage.spool import Spool, spool_dir
from trainproof.tasks.base import Pretrained
from trainproof.train import model_dir
from trainproof.train.model_dir import Weights

_SHOWN = 5  # names listed in a message


def start_from_pretrained(files: list[Pretrained], load: Any, model: nn.Module,
                          rename: Callable[[str], str | None] | None = None) -> dict[str, Any]:
    """Read, verify and load ``files`` into ``model`` through ``load(model, names, get)`` (the layout's strategy,
    trainproof.train.parallel ``load_initial``: ``get(name)`` reads one tensor, which the strategy copies into the
    model's own, cast to its dtype). Returns what to report (the files and directories, their bytes, the time).
    ConfigError (exit 2) naming the file when one is missing, is not a safetensors file, or does not fit the model;
    DataError (exit 1) when it does not hash to its declared sha256 (for a directory: its listing to the declared
    digest, each file to its listed sha256; trainproof.train.model_dir).

    ``rename``: the task's :meth:`~trainproof.tasks.Task.pretrained_name` (a model entry's name in the files, None
    for one they do not hold, which keeps its seeded initialisation); default: every entry by its own name."""
    t0 = time.perf_counter()
    spools: list[Spool] = []
    records: list[dict[str, Any]] = []
    total = 0
    with contextlib.ExitStack() as files_open:
        handles: dict[str, Any] = {}
        shapes: dict[str, list[int]] = {}
        origin: dict[str, str] = {}
        try:
            for spec in files:
                weights, record, size = _fetch(spec)
                spools.extend(w.spool for w in weights)
                records.append(record)
                total += size
                for w in weights:
                    handle, entries = _opened(files_open, w)
                    for key, shape in entries.items():
                        if key in handles:
                            raise ConfigError(f"pretrained weights: tensor {key!r} is in both {origin[key]} and "
                                              f"{w.label}: each tensor must come from one file")
                        handles[key], shapes[key], origin[key] = handle, shape, w.label
            named = file_names(model, rename)
            check_fits(model, shapes, [r["url"] for r in records], named)
            covered = sorted(k for k, f in named.items() if f in handles)
            load(model, covered, lambda key: handles[named[key]].get_tensor(named[key]))
        finally:
            for spool in spools:
                spool.unlink()  # an open file stays readable until closed (POSIX)
    return {"files": records, "bytes": total, "tensors": len(shapes), "seconds": round(time.perf_counter() - t0, 3)}


def _fetch(spec: Pretrained) -> tuple[list[Weights], dict[str, Any], int]:
    """The verified weights files of ``spec`` (a file, or a model directory's), what to report, and the bytes read."""
    if spec.directory:
        got = model_dir.fetch(spec.url, spec.digest)
        return got.weights, got.record, got.bytes
    spool = fetch_verified(spec)
    return [Weights(_shown(spec.url), spool)], {"url": _shown(spec.url), "sha256": spec.sha256}, spool.size


def _opened(files_open: contextlib.ExitStack, weights: Weights) -> tuple[Any, dict[str, list[int]]]:
    """The safetensors handle of ``weights`` and its tensors' shapes (the header only: no tensor is read), checked
    against the tensors the directory's index maps to it."""
    from safetensors import safe_open

    try:  # the library's own checked parser (offsets, sizes, dtypes), over bytes already verified
        handle = files_open.enter_context(safe_open(weights.spool.path, framework="pt"))
        entries = {k: handle.get_slice(k).get_shape() for k in handle.keys()}
    except Exception as exc:  # noqa: BLE001 - safetensors' parse errors have their own classes
        raise ConfigError(f"pretrained weights {weights.label} are not a safetensors file: "
                          f"{type(exc).__name__}: {exc}") from None
    if weights.tensors is not None:
        absent = sorted(set(weights.tensors) - set(entries))
        if absent:
            raise ConfigError(f"pretrained weights {weights.label}: tensor {absent[0]!r}, which {model_dir.INDEX} "
                              f"maps to this shard, is not in it" + (f" (nor {len(absent) - 1} more)"
                                                                      if len(absent) > 1 else ""))
        unmapped = sorted(set(entries) - set(weights.tensors))
        if unmapped:
            raise ConfigError(f"pretrained weights {weights.label} hold tensor {unmapped[0]!r}, which "
                              f"{model_dir.INDEX} does not map to this shard")
    return handle, entries


def fetch_verified(spec: Pretrained) -> Spool:
    """The file of ``spec`` in a local spool file whose plain sha256 is the declared one, else a one-line error
    naming it: DataError (exit 1) for other bytes, ConfigError (exit 2) for no file at the URL."""
    parent, name = split_url(spec.url)
    try:
        store = open_store(parent, StoreOptions.from_env())
        spool = store.download_file(name, directory=spool_dir())
    except FileNotFoundError:
        raise ConfigError(f"pretrained weights {_shown(spec.url)} do not exist: fix the task's url, or copy the file "
                          "there") from None
    except (StoreConfigError, ValueError) as exc:
        raise ConfigError(f"pretrained weights {_shown(spec.url)}: {exc}") from None
    if spool.sha256 != spec.sha256:
        spool.unlink()
        raise DataError(f"pretrained weights {_shown(spec.url)}: its sha256 is {spool.sha256}, not the declared "
                        f"{spec.sha256}: the file was changed or damaged, so the run does not start from it. Put "
                        "back the file the task declares (the Job's retry then goes on), or declare the new file's "
                        "sha256 (another experiment: a new --store)")
    return spool


def split_url(url: str) -> tuple[str, str]:
    """(the store URL of the file's folder, the file's name) for a local path, ``file://`` or ``s3://`` URL."""
    parsed = urlparse(url)
    if parsed.scheme.lower() in ("s3", "s3a"):
        key = parsed.path.strip("/")
        folder, _, name = key.rpartition("/")
        if not name:
            raise ConfigError(f"pretrained weights {_shown(url)}: name the file, e.g. s3://bucket/models/w.safetensors")
        return f"{parsed.scheme}://{parsed.netloc}/{folder}".rstrip("/"), name
    if parsed.scheme.lower() not in ("", "file"):
        raise ConfigError(f"pretrained weights {_shown(url)}: unsupported scheme {parsed.scheme!r}; use a local path, "
                          "file:///abs/path or s3://bucket/key")
    path = os.path.abspath(os.path.expanduser(parsed.path if parsed.scheme else url))
    return os.path.dirname(path), os.path.basename(path)


def file_names(model: nn.Module, rename: Callable[[str], str | None] | None = None) -> dict[str, str]:
    """Each entry of ``model``'s state_dict that the pretrained files hold -> its name there (``rename``, default the
    entry's own name; None leaves the entry out: it keeps its seeded initialisation)."""
    names = {k: k if rename is None else rename(k) for k in model.state_dict(keep_vars=True)}
    return {k: f for k, f in names.items() if f is not None}


def check_fits(model: nn.Module, tensors: dict[str, list[int]], names: list[str],
               named: dict[str, str] | None = None) -> None:
    """ConfigError unless ``tensors`` (name -> shape) cover every entry of ``model``'s state_dict with its shape and
    nothing else (with ``named``, :func:`file_names`: the entries it names, under their names in the files).
    An entry the model ties to another one (the same parameter under two names, e.g. an output layer sharing the
    embedding) may be absent when the other is given: loading one loads both."""
    own = model.state_dict(keep_vars=True)
    expected = {f: own[k] for k, f in (named if named is not None else {k: k for k in own}).items()}
    where = ", ".join(names)
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ConfigError(f"pretrained weights {where} hold {len(unexpected)} tensor(s) the model does not have: "
                          f"{unexpected[:_SHOWN]}; the model has e.g. {sorted(expected)[:_SHOWN]}")
    given = {id(expected[k]) for k in tensors}
    missing = sorted(k for k in expected if k not in tensors and id(expected[k]) not in given)
    if missing:
        raise ConfigError(f"pretrained weights {where} lack {len(missing)} of the model's tensor(s): "
                          f"{missing[:_SHOWN]}")
    wrong = [f"{k}: file {list(shape)}, model {list(expected[k].shape)}" for k, shape in sorted(tensors.items())
             if tuple(shape) != tuple(expected[k].shape)]
    if wrong:
        raise ConfigError(f"pretrained weights {where} do not fit the model: {'; '.join(wrong[:_SHOWN])}")


def copy_into(model: nn.Module, names: list[str], get: Callable[[str], torch.Tensor]) -> None:
    """Copy each tensor into the model's own (cast to its dtype, moved to its device), one at a time: a replicated
    layout's load (every rank loads the same verified bytes, so the replicas start equal)."""
    own = model.state_dict(keep_vars=True)
    with torch.no_grad():
        for key in names:
            own[key].copy_(get(key))


def _shown(url: str) -> str:
    return redact_url(url)
