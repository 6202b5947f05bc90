"""The model's frozen entries, committed once for the run instead of in every generation.

A LoRA fine-tune trains a few hundred MB of adapters on a base of 16 GB that no optimizer step changes. Stored in
every generation, the base would be written, read back and hashed at every commit for nothing. So the parameters
that require no gradient (``requires_grad=False``) leave the training state: they are serialised once into
``frozen.pt`` (trainproof.format.state.FROZEN_FILE), stored once for the run as a shared, content-addressed object
(``GenerationStore.put_shared``), and each generation's manifest references it by digest. A generation's bytes are
then what training changes.

"Frozen" is a promise the trainer checks rather than trusts: at each commit it fingerprints the frozen tensors (per
tensor: dtype, shape and the wrapping integer sum of its elements' bits, computed where the tensor lives), and
serialises and stores them again when the fingerprint moved (a task that writes a frozen parameter); the new
generation then references the new object. The verifier compares the merged model like any other (a resume that
loaded another base fails its checks).

Only where the model is held whole on every rank (one process or DDP); a sharded run (``--fsdp``) keeps its frozen
parameters in its shards.
"""

from __future__ import annotations

from typing import Any

import torch

from trainproof.format.state import FROZEN_FILE
from trainproof.storage import GenerationStore
from trainproof.storage.digest import Digest
from trainproof.storage.errors import StoreError

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
CHUNK = 1 << 24
"""Elements summed at a time (a bounded temporary, whatever the tensor's size)."""


def frozen_keys(model: torch.nn.Module) -> list[str]:
    """Names (as in ``model.state_dict()``) of the parameters that require no gradient."""
    return [name for name, p in model.named_parameters() if not p.requires_grad]


def split_frozen(model_state: dict[str, Any], keys: list[str]) -> dict[str, torch.Tensor]:
    """Take the frozen entries out of ``model_state`` (in place) and return them."""
    return {k: model_state.pop(k) for k in keys if k in model_state}


def fingerprint(tensors: dict[str, torch.Tensor]) -> tuple:
    """What must stay equal for the stored frozen object to still be these tensors: per tensor its dtype, shape and
    the integer sum of its elements' bit patterns (exact, on the tensor's own device, CHUNK elements at a time)."""
    out = []
    for name in sorted(tensors):
        t = tensors[name].detach()
        total = 0
        if t.numel():
            flat = t.contiguous().reshape(-1)
            view = flat.view(INT_VIEW[flat.element_size()]) if flat.element_size() in INT_VIEW else \
                flat.view(torch.uint8)
            for chunk in view.split(CHUNK):
                total += int(chunk.to(torch.int64).sum())
        out.append((name, str(t.dtype), tuple(t.shape), total))
    return tuple(out)


def restored_frozen_ref(store: GenerationStore, step: int, frozen: dict[str, torch.Tensor]) -> tuple | None:
    """(fingerprint, bytes, sha256) of the shared frozen object generation ``step`` references, with the fingerprint
    of ``frozen`` (the entries just restored from it, verified by its hash as they were read); None when the generation
    references none, holds them itself (a copy), or its manifest cannot be read now (the first commit then stores them
    again: correct, only slower)."""
    if not frozen:
        return None
    try:
        entry = (store.generation(step).manifest or {}).get("files", {}).get(FROZEN_FILE)
    except (StoreError, OSError):
        return None
    if not isinstance(entry, dict) or not entry.get("shared"):
        return None
    sha = Digest(entry["sha256"], tuple(entry.get("parts", ())), int(entry.get("part_bytes", 0)))
    return fingerprint(frozen), int(entry["bytes"]), sha
