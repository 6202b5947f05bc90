"""``trainproof data pack`` and ``trainproof data verify``: datasets in the bucket (trainproof.data)."""

from __future__ import annotations

import glob
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from trainproof.cli.app import app
from trainproof.cli.common import EndpointArg, PathStyleArg, RegionArg, fail, handled, setup_logging
from trainproof.errors import ConfigError, TrainError
from trainproof.storage import StoreOptions

data_app = typer.Typer(help="Datasets in the bucket: pack local arrays or files into verified shards, verify them.",
                       no_args_is_help=True)
app.add_typer(data_app, name="data")

UrlArg = Annotated[str, typer.Argument(help="Dataset location: s3://bucket/prefix, file:///path, a folder, or "
                                            "memory://name.")]


def _options(endpoint_url: str | None, region: str | None, path_style: bool | None) -> StoreOptions:
    return StoreOptions.from_env(endpoint_url=endpoint_url, region=region, path_style=path_style)


def _loaded(path: Path, dtype: str | None) -> Any:
    """An array from a ``.npy`` file (memory-mapped), or a raw binary file of ``dtype``."""
    import numpy as np

    if not path.is_file():
        raise ConfigError(f"{path} is not a file")
    if path.suffix == ".npy":
        return np.load(path, mmap_mode="r", allow_pickle=False)
    if dtype is None:
        raise ConfigError(f"{path} is not a .npy file: give its element type with --dtype (e.g. uint16)")
    return np.memmap(path, dtype=np.dtype(dtype), mode="r")


@data_app.command("pack")
@handled
def pack_command(
    url: UrlArg,
    records: Annotated[Optional[Path], typer.Option(help="A .npy array of shape (N, ...): sample i is row i.")] = None,
    tokens: Annotated[Optional[Path], typer.Option(
        help="A 1-D token stream (.npy, or raw with --dtype), cut into records of --context + 1 tokens, one every "
             "--context.")] = None,
    context: Annotated[int, typer.Option(help="With --tokens: tokens a window predicts.")] = 0,
    files: Annotated[Optional[list[str]], typer.Option(
        help="Files (globs allowed), each one sample of bytes, in sorted order (repeat the option).")] = None,
    dtype: Annotated[Optional[str], typer.Option(help="Element type of a raw --tokens file (e.g. uint16).")] = None,
    shard_mib: Annotated[float, typer.Option(help="Shard (object) size in MiB.")] = 64.0,
    part_kib: Annotated[int, typer.Option(help="Part size in KiB: what a reader fetches and verifies at once.")] = 1024,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Pack local data into a dataset at URL: shards written create-only and read back, then dataset.json, last.
    Prints the dataset's identity (the data_identity of a task that trains on it). Exit 0, 2 bad input or a
    location that already holds a dataset, 1 a storage failure."""
    setup_logging()
    given = [name for name, value in (("--records", records), ("--tokens", tokens), ("--files", files)) if value]
    try:
        if len(given) != 1:
            raise ConfigError("give exactly one of --records, --tokens or --files")
        from trainproof.data import pack_records, pack_samples, token_windows

        sizes = {"shard_bytes": int(shard_mib * 2**20), "part_bytes": part_kib * 1024,
                 "options": _options(endpoint_url, region, path_style)}
        if records is not None:
            packed = pack_records(url, _loaded(records, None), source={"records": records.name}, **sizes)
        elif tokens is not None:
            if context < 1:
                raise ConfigError("--tokens needs --context N (tokens each window predicts)")
            windows = token_windows(_loaded(tokens, dtype), context)
            packed = pack_records(url, windows, source={"tokens": tokens.name, "context": context}, **sizes)
        else:
            paths = sorted({p for pattern in files for p in (glob.glob(pattern) or [pattern])})
            missing = [p for p in paths if not os.path.isfile(p)]
            if missing:
                raise ConfigError(f"--files: {missing[0]} is not a file")
            packed = pack_samples(url, (Path(p).read_bytes() for p in paths), source={"files": len(paths)}, **sizes)
    except TrainError as exc:
        raise fail(str(exc), exc.exit_code) from None
    m = packed.manifest
    print(json.dumps({"dataset": url, "identity": packed.identity, "kind": m.kind, "dtype": m.dtype,
                      "shape": list(m.shape), "samples": m.samples, "shards": len(m.shards), "bytes": m.bytes}))


@data_app.command("verify")
@handled
def verify_command(
    url: UrlArg,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Read every part of every shard of the dataset at URL from the store and check it against dataset.json.
    Exit 0 when all match (prints the identity), 2 when a shard is missing, damaged or the manifest is malformed
    (one line naming it), 1 a storage failure."""
    setup_logging()
    try:
        from trainproof.data import ShardedDataset

        dataset = ShardedDataset(url, options=_options(endpoint_url, region, path_style))
        read = dataset.verify()
    except TrainError as exc:
        raise fail(str(exc), exc.exit_code) from None
    m = dataset.manifest
    print(json.dumps({"dataset": url, "identity": dataset.data_identity, "verified": True, "kind": m.kind,
                      "samples": m.samples, "shards": len(m.shards), "bytes": m.bytes, "bytes_read": read}))
    sys.stdout.flush()
