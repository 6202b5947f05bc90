"""safetensors files written and mapped tensor by tensor, for an export that must not hold a model's weights twice.

``safetensors.torch.save`` builds the whole file as one ``bytes`` object (a second copy of every weight, a third for
a cast), and its loader copies every tensor out of the file. :func:`write_safetensors` writes the same bytes (the
library's layout: an 8-byte little-endian header length, the JSON header padded with spaces to a multiple of 8, then
the tensors' data ordered by dtype (widest first) and name) one tensor at a time into any binary file object, casting
one tensor at a time when asked. :func:`map_safetensors` gives read-only tensors over a file, backed by the page
cache (``mmap``), not by new memory; its header is checked entry by entry (a file read back from a store, e.g. a
bundle's, is verified against its manifest but not trusted to be well formed).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from typing import Any, BinaryIO, Callable

import torch

# The library's dtype names, in its own order (``Dtype`` in safetensors' Rust code): data is laid out in descending
# order of this rank, ties by name; tests compare the bytes with safetensors.torch.save.
_DTYPES: list[tuple[torch.dtype, str]] = [
    (torch.bool, "BOOL"), (torch.uint8, "U8"), (torch.int8, "I8"), (torch.float8_e5m2, "F8_E5M2"),
    (torch.float8_e4m3fn, "F8_E4M3"), (torch.int16, "I16"), (torch.uint16, "U16"), (torch.float16, "F16"),
    (torch.bfloat16, "BF16"), (torch.int32, "I32"), (torch.uint32, "U32"), (torch.float32, "F32"),
    (torch.float64, "F64"), (torch.int64, "I64"), (torch.uint64, "U64"),
]
_NAME = {dtype: name for dtype, name in _DTYPES}
_RANK = {dtype: i for i, (dtype, _) in enumerate(_DTYPES)}
_BY_NAME = {name: dtype for dtype, name in _DTYPES}
MAX_HEADER = 100 * 2**20  # the library's own cap on a header


def write_safetensors(out: BinaryIO, tensors: dict[str, torch.Tensor],
                      cast: Callable[[torch.Tensor], torch.Tensor] | None = None,
                      metadata: dict[str, str] | None = None) -> int:
    """Write ``tensors`` (``cast`` applied to each, one at a time) to ``out`` as a safetensors file, byte for byte
    what ``safetensors.torch.save`` returns for the cast tensors (and ``metadata``, the header's string map, e.g.
    ``{"format": "pt"}`` that Hugging Face loaders look for); return the bytes written. Memory: one cast tensor
    at a time (a contiguous CPU tensor that needs no cast is written from its own memory)."""
    cast = cast or (lambda t: t)
    shapes: dict[str, tuple[torch.dtype, list[int]]] = {}
    for name, tensor in tensors.items():
        dtype = cast(torch.empty(0, dtype=tensor.dtype)).dtype  # what the cast makes of this dtype
        if dtype not in _NAME:
            raise ValueError(f"{name}: dtype {dtype} cannot be written to safetensors here")
        shapes[name] = (dtype, list(tensor.shape))
    order = sorted(shapes, key=lambda n: (-_RANK[shapes[n][0]], n))
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name in order:
        dtype, shape = shapes[name]
        size = _numel(shape) * torch._utils._element_size(dtype)
        header[name] = {"dtype": _NAME[dtype], "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    out.write(struct.pack("<Q", len(text)))
    out.write(text)
    for name in order:
        tensor = cast(tensors[name].detach()).cpu().contiguous()
        if tensor.numel():
            out.write(memoryview(tensor.reshape(-1).view(torch.uint8).numpy()))
        del tensor
    return 8 + len(text) + offset


def map_safetensors(path: str, *, name: str | None = None) -> dict[str, torch.Tensor]:
    """Read-only tensors over the safetensors file at ``path``, sharing the file's pages through ``mmap`` instead of
    copying them. ValueError when the header is not safetensors' (a JSON object of entries with a known dtype, a
    shape of non-negative integers and offsets that lie inside the file and match the shape), naming the file as
    ``name`` (default: its path)."""
    what = name or path
    with open(path, "rb") as fh:
        size = os.fstat(fh.fileno()).st_size
        if size < 8:
            raise ValueError(f"{what}: {size} bytes, too short for a safetensors file")
        (length,) = struct.unpack("<Q", fh.read(8))
        if length > min(MAX_HEADER, size - 8):
            raise ValueError(f"{what}: header of {length} bytes does not fit the file")
        try:
            header = json.loads(fh.read(length))
        except ValueError as exc:
            raise ValueError(f"{what}: the header is not JSON ({exc})") from None
        mapped = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None
    if not isinstance(header, dict):
        raise ValueError(f"{what}: the header is not a JSON object")
    base, out = 8 + length, {}
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        dtype, shape, offsets = _entry(what, key, meta)
        count = _numel(shape)
        start, end = offsets
        if not 0 <= start <= end <= size - base or end - start != count * torch._utils._element_size(dtype):
            raise ValueError(f"{what}: {key!r} lies outside the file or does not match its shape")
        if count == 0:
            out[key] = torch.empty(shape, dtype=dtype)
            continue
        with warnings.catch_warnings():  # read-only pages: the tensors are only ever read
            warnings.simplefilter("ignore", UserWarning)
            out[key] = torch.frombuffer(mapped, dtype=dtype, count=count, offset=base + start).view(shape)
    return out


def _entry(path: str, name: str, meta: Any) -> tuple[torch.dtype, list[int], list[int]]:
    """A header entry's dtype, shape and offsets, checked to be what safetensors writes (a file read back from a
    store is not trusted to be well formed)."""
    ok = isinstance(meta, dict) and meta.get("dtype") in _BY_NAME
    shape, offsets = (meta.get("shape"), meta.get("data_offsets")) if ok else (None, None)
    ok = ok and isinstance(shape, list) and all(type(n) is int and n >= 0 for n in shape)
    ok = ok and isinstance(offsets, list) and len(offsets) == 2 and all(type(n) is int for n in offsets)
    if not ok:
        raise ValueError(f"{path}: header entry {name!r} is not a safetensors tensor entry")
    return _BY_NAME[meta["dtype"]], shape, offsets


def _numel(shape: list[int]) -> int:
    count = 1
    for n in shape:
        count *= int(n)
    return count
