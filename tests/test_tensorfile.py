"""``trainproof.export.tensorfile``: safetensors written tensor by tensor are the library's own bytes, and mapped back
they are the same tensors; a header that points outside its file is refused."""

from __future__ import annotations

import io
import json
import struct

import pytest
import torch
from safetensors.torch import load, save

from trainproof.export.tensorfile import map_safetensors, write_safetensors


def _mixed(seed: int) -> dict[str, torch.Tensor]:
    """Tensors of every common dtype and odd shapes (empty, scalar, transposed), in a random insertion order."""
    g = torch.Generator().manual_seed(seed)
    tensors = {
        "w.weight": torch.randn(7, 5, generator=g).t(),  # not contiguous
        "w.bias": torch.randn(7, generator=g),
        "half": torch.randn(3, 2, generator=g).half(),
        "brain": torch.randn(4, generator=g).bfloat16(),
        "double": torch.randn(2, 2, generator=g).double(),
        "steps": torch.randint(0, 100, (3,), generator=g),
        "i32": torch.randint(-5, 5, (2,), generator=g, dtype=torch.int32),
        "i16": torch.randint(-5, 5, (2,), generator=g, dtype=torch.int16),
        "i8": torch.randint(-5, 5, (1,), generator=g, dtype=torch.int8),
        "u8": torch.randint(0, 255, (5,), generator=g, dtype=torch.uint8),
        "mask": torch.rand(3, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(2.5),
    }
    order = torch.randperm(len(tensors), generator=g).tolist()
    names = list(tensors)
    return {names[i]: tensors[names[i]] for i in order}


def _bf16(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16) if t.is_floating_point() else t


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("cast", [None, _bf16], ids=["as-is", "bf16"])
def test_written_bytes_are_what_safetensors_itself_writes(seed, cast):
    tensors = _mixed(seed)
    out = io.BytesIO()
    size = write_safetensors(out, tensors, cast=cast)
    expected = save({k: (cast or (lambda t: t))(v).contiguous() for k, v in tensors.items()})
    assert out.getvalue() == expected and size == len(expected)


def test_a_mapped_file_gives_back_equal_tensors_without_copying_them(tmp_path):
    tensors = _mixed(3)
    path = tmp_path / "m.safetensors"
    with open(path, "wb") as fh:
        write_safetensors(fh, tensors)
    mapped = map_safetensors(str(path))
    assert set(mapped) == set(tensors)
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name
    assert load(path.read_bytes()).keys() == mapped.keys()
    big = mapped["w.weight"]
    assert not big.untyped_storage().resizable()  # a view of the mapped file, not a tensor of its own


def test_a_header_pointing_outside_the_file_is_refused(tmp_path):
    data = save({"a": torch.arange(4, dtype=torch.float32)})
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["a"]["data_offsets"] = [0, 1 << 20]
    text = json.dumps(header).encode()
    text += b" " * (-(len(text)) % 8)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    with pytest.raises(ValueError, match="outside the file"):
        map_safetensors(str(bad))
    short = tmp_path / "short.safetensors"
    short.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ValueError, match="does not fit"):
        map_safetensors(str(short))


@pytest.mark.parametrize("entry", [
    {"dtype": "F99", "shape": [4], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [-4], "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": "4", "data_offsets": [0, 16]},
    {"dtype": "F32", "shape": [4], "data_offsets": [0]},
    {"dtype": "F32", "shape": [4], "data_offsets": [0.0, 16]},
    [1, 2, 3],
], ids=["dtype", "negative-dim", "shape-type", "offsets-length", "offsets-type", "not-an-object"])
def test_a_header_entry_that_safetensors_would_not_write_is_refused(tmp_path, entry):
    text = json.dumps({"a": entry}).encode()
    text += b" " * (-(len(text)) % 8)
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(struct.pack("<Q", len(text)) + text + bytes(16))
    with pytest.raises(ValueError, match="is not a safetensors tensor entry"):
        map_safetensors(str(bad))
