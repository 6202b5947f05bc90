"""The training state: one consistent moment after a complete optimizer step, as safe bytes.

Layout (``training_state.pt``, a dict saved with ``torch.save``)::

    schema     "trainproof.state/2"
    meta       contract, world, world_changes ([{step, from, to}], empty unless --allow-world-change was
               used), task, task_config, seed, objective, data_identity, code_version (trainproof.format.identity),
               code_changes ([{step, from, to}], empty unless --allow-code-change was used), versions
               (python/torch/numpy), device, epoch_plan, trainer settings (with ``resumed_from``: the step this
               process restored, None on a fresh start)
    progress   step, epoch, samples_seen, targets_seen, next_lr
    model / optimizer / scheduler / scaler    their state_dicts (scheduler None when the task has none)
    history    per-step columns: step, epoch, loss, lr, targets, sample ids (flat + offsets), for the steps
               since the previous committed generation of this run only (``history_chain.first``..step)
    history_chain  {first, before, digest}: the first step held, the hash chain's value before it (the previous
               generation's ``digest``; ``HISTORY_GENESIS`` when first is 1) and after the last row. The chain
               covers every row since step 1 (see :class:`History`): trainproof.format.history reassembles a full
               history from the run's generations and checks it end to end against ``digest``
    task_state the task's own state (``Task.state_dict()``, ``{}`` for tasks that keep none; absent in states
               written before it existed, which load as ``{}``)
    ranks      [rank 0's part]: {rank, rng, data, next_draws}; ``data`` is the global data position
               (epoch, cursor, the data generator before this epoch's permutation and now: O(1), the
               permutation is redrawn on load, trainproof.train.data), the same on every rank

So a checkpoint's size is the model, optimizer and task state plus O(1) bookkeeping (for a fixed checkpoint
interval): it grows neither with the number of steps trained nor with the dataset size.

With world > 1, rank r >= 1 keeps its own part in ``rank-%05d.pt`` beside the state (schema, step, world,
rank, rng, next_draws, and a ``data`` copy of epoch and cursor that proves it belongs to the same moment);
rank 0's part stays inline, so ``training_state.pt`` alone is a complete one-process view.
:func:`decode_generation` reads a generation's files into one state whose ``ranks`` holds every part.

Loading is ``torch.load(io.BytesIO(b), map_location="cpu", weights_only=True)`` and nothing else: the
state holds only builtins and tensors, so a file carrying a pickled object (a class instance, a
callable) fails to load and is refused. :func:`encode` checks the types *before* saving, so the trainer
can never write a state that its own loader would refuse.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import pickle
import re
import struct
import sys
import zipfile
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from itertools import pairwise
from typing import IO, Any, ClassVar, cast

import torch

from trainproof.errors import StateError
from trainproof.storage.spool import LiveSpool, Spool, SpoolWriter

STATE_SCHEMA = "trainproof.state/2"  # /2: bounded history + history_chain, O(1) data position
STATE_FILE = "training_state.pt"
RANK_SCHEMA = "trainproof.rank/1"
RANK_KEYS = ("rank", "step", "world", "rng", "data", "next_draws")
TOP_KEYS = ("schema", "meta", "progress", "model", "optimizer", "scheduler", "scaler", "history", "history_chain",
            "ranks")
# Exact types, not isinstance: subclasses such as torch's TorchVersion (a str) or np.float64 (a float)
# pickle as their own class, which weights-only loading refuses.
_SCALARS = (str, int, float, bool, type(None))
_MAPPINGS = (dict, OrderedDict)
_SEQUENCES = (list, tuple)


HISTORY_GENESIS = hashlib.sha256(b"trainproof.history/1").hexdigest()
"""The chain value before step 1: ``d_0``. Row k then chains as ``d_k = sha256(d_{k-1} || row_k)``."""
_ROW = struct.Struct("<qqddqq")  # step, epoch, loss, lr, targets, number of sample ids; then the ids, int64 LE


class History:
    """Per-step record of what each update consumed and produced (for the verifier's comparison).

    Kept as typed arrays (8 bytes a value), not Python objects, and bounded: a state holds only the rows since
    the previous committed generation (``first``..step), so a checkpoint's size does not grow with the run.
    What ties the rows of successive generations together is a **hash chain** over every row since step 1:
    ``d_0 = HISTORY_GENESIS``, ``d_k = sha256(d_{k-1} || canonical bytes of row k)`` (:data:`_ROW`, then the
    sample ids; floats by their IEEE-754 bits). ``before`` is the chain value before ``first`` (the previous
    generation's ``digest``), :attr:`digest` the value after the last row. A full history reassembled from
    generations (:mod:`trainproof.format.history`) is checked end to end against the newest state's digest.
    Digests are computed lazily (at a save or a check), never per training step.
    """

    COLUMNS: ClassVar[dict[str, str]] = {"step": "q", "epoch": "q", "loss": "d", "lr": "d", "targets": "q"}

    def __init__(self, *, first: int = 1, before: str = HISTORY_GENESIS, last: dict[str, Any] | None = None) -> None:
        self._cols = {name: array(code) for name, code in self.COLUMNS.items()}
        self._ids = array("q")
        self._offsets = array("q", [0])
        self.first = first
        """The step of the first row held (the row after the previous committed generation)."""
        self._before = bytes.fromhex(before)
        self._digests = bytearray()  # 32 bytes per row, the chain value after it; filled lazily
        self._last = last  # the newest row, kept when the rows themselves were committed and dropped

    def append(self, *, step: int, epoch: int, loss: float, lr: float, targets: int, sample_ids: list[int]) -> None:
        """Record one completed optimizer step."""
        for name, value in (("step", step), ("epoch", epoch), ("loss", loss), ("lr", lr), ("targets", targets)):
            self._cols[name].append(value)
        self._ids.extend(sample_ids)
        self._offsets.append(len(self._ids))

    def __len__(self) -> int:
        return len(self._cols["step"])

    def column(self, name: str) -> list[Any]:
        """One column as a list (``step``, ``epoch``, ``loss``, ``lr``, ``targets``)."""
        return self._cols[name].tolist()

    def row(self, i: int) -> dict[str, Any]:
        """Row ``i`` held (0-based; negative counts from the end) as a dict, sample ids included."""
        i = range(len(self))[i]
        out = {name: col[i] for name, col in self._cols.items()}
        out["sample_ids"] = self._ids[self._offsets[i] : self._offsets[i + 1]].tolist()
        return out

    @property
    def last_row(self) -> dict[str, Any] | None:
        """The newest step's row, even when it was already committed and dropped (None before any step)."""
        return self.row(-1) if len(self) else self._last

    @property
    def rows(self) -> list[dict[str, Any]]:
        """Every step as a dict (convenient for comparisons; builds Python objects, so not for hot paths)."""
        return [self.row(i) for i in range(len(self))]

    # -- the chain ------------------------------------------------------------------------------------------
    def _chain_after(self, n: int) -> bytes:
        """The chain value after the first ``n`` rows held (``before`` for 0)."""
        have = len(self._digests) // 32
        d = self._before if have == 0 else bytes(self._digests[-32:])
        for i in range(have, n):
            h = hashlib.sha256(d)
            c = self._cols
            ids = self._ids[self._offsets[i] : self._offsets[i + 1]]
            h.update(_ROW.pack(c["step"][i], c["epoch"][i], c["loss"][i], c["lr"][i], c["targets"][i], len(ids)))
            h.update(_le_bytes(ids))
            d = h.digest()
            self._digests += d
        return self._before if n == 0 else bytes(self._digests[32 * (n - 1) : 32 * n])

    @property
    def before(self) -> str:
        """The chain value before the first row held (hex)."""
        return self._before.hex()

    @property
    def digest(self) -> str:
        """The chain value after the last row held (hex): the digest of every step since step 1."""
        return self._chain_after(len(self)).hex()

    def chain(self) -> dict[str, Any]:
        """The state's ``history_chain`` section: ``first`` step held, chain value ``before`` it, ``digest`` after."""
        return {"first": self.first, "before": self.before, "digest": self.digest}

    def committed(self, step: int) -> None:
        """Generation ``step`` is committed: drop the rows through ``step`` (the store holds them now); the chain
        carries on from the digest after ``step``. Rows after ``step`` (training went on meanwhile) stay."""
        n = step - self.first + 1
        if n <= 0:
            return
        if n > len(self):
            raise ValueError(f"history holds steps {self.first}..{self.first + len(self) - 1}, not {step}")
        if n == len(self):
            self._last = self.row(-1)
        self._before = self._chain_after(n)
        cut = self._offsets[n]
        self._cols = {name: col[n:] for name, col in self._cols.items()}
        self._ids = self._ids[cut:]
        self._offsets = array("q", [o - cut for o in self._offsets[n:]])
        self._digests = self._digests[32 * n :]
        self.first = step + 1

    def since(self, step: int) -> History:
        """A copy holding only the rows from ``step`` on (the chain value before it computed)."""
        out = History.join([self])
        out.committed(step - 1)
        return out

    @classmethod
    def join(cls, parts: list[History]) -> History:
        """Consecutive parts (each one's ``first`` right after the previous one's last step) as one history.

        The caller checks that each part's ``before`` is the previous part's ``digest`` (trainproof.format.history)."""
        out = cls(first=parts[0].first, before=parts[0].before, last=parts[-1].last_row)
        for part in parts:
            for name in cls.COLUMNS:
                out._cols[name].extend(part._cols[name])
            base = len(out._ids)
            out._ids.extend(part._ids)
            out._offsets.extend(o + base for o in part._offsets[1:])
        return out

    # -- (de)serialisation ----------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, torch.Tensor]:
        """Columnar tensors: exact (float64 for loss and lr), compact, fast to (de)serialise."""
        out = {name: _tensor(col) for name, col in self._cols.items()}
        out["sample_ids"] = _tensor(self._ids)
        out["sample_offsets"] = _tensor(self._offsets)
        return out

    @classmethod
    def from_state_dict(cls, state: Any, *, first: int = 1, before: str = HISTORY_GENESIS) -> History:
        """Rebuild from :meth:`state_dict` output, refusing wrong types or ragged columns.

        ``first``/``before``: where these rows sit in the run's chain (a state's ``history_chain``)."""
        if not isinstance(state, dict):
            raise StateError("history is not a dict of columns")
        arrays = {}
        for name, code in [*cls.COLUMNS.items(), ("sample_ids", "q"), ("sample_offsets", "q")]:
            t = state.get(name)
            dtype = torch.float64 if code == "d" else torch.int64
            if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.dim() != 1:
                raise StateError(f"history column {name!r} must be a 1-D {dtype} tensor")
            arrays[name] = array(code, t.contiguous().numpy().tobytes())
        hist = cls(first=first, before=before)
        hist._cols = {name: arrays[name] for name in cls.COLUMNS}
        hist._ids, hist._offsets = arrays["sample_ids"], arrays["sample_offsets"]
        n, offsets = len(hist), hist._offsets
        if any(len(col) != n for col in hist._cols.values()) or len(offsets) != n + 1:
            raise StateError("history columns have inconsistent lengths")
        if offsets[0] != 0 or offsets[-1] != len(hist._ids) or any(a > b for a, b in pairwise(offsets)):
            raise StateError("history sample offsets are not a valid index")
        return hist


def _le_bytes(values: array) -> bytes:
    if sys.byteorder == "little":
        return values.tobytes()
    swapped = array(values.typecode, values)
    swapped.byteswap()
    return swapped.tobytes()


def check_chain(chain: Any) -> dict[str, Any]:
    """Refuse a ``history_chain`` section of the wrong shape; return it."""
    ok = (isinstance(chain, dict) and type(chain.get("first")) is int and chain["first"] >= 1
          and all(isinstance(chain.get(k), str) and len(chain[k]) == 64 and _is_hex(chain[k])
                  for k in ("before", "digest")))
    if not ok:
        raise StateError(f"the state's history_chain is malformed: {chain!r:.200}")
    if chain["first"] == 1 and chain["before"] != HISTORY_GENESIS:
        raise StateError("history_chain starts at step 1 but not from the chain's genesis value")
    return chain


def _is_hex(text: str) -> bool:
    try:
        bytes.fromhex(text)
    except ValueError:
        return False
    return True


def check_history(state: dict[str, Any]) -> History:
    """The state's own rows (``first``..its step, each exactly once), proven to chain from ``before`` to ``digest``.

    What a single state can prove; that ``before`` is the previous generation's digest is checked when a full
    history is reassembled (trainproof.format.history)."""
    own = state["progress"]["step"]
    chain = check_chain(state.get("history_chain"))
    history = History.from_state_dict(state["history"], first=chain["first"], before=chain["before"])
    if history.column("step") != list(range(chain["first"], own + 1)):
        raise StateError(f"history does not record steps {chain['first']}..{own} exactly once each "
                         "(a step repeated or skipped)")
    if history.digest != chain["digest"]:
        raise StateError(f"history rows {chain['first']}..{own} do not hash to the state's chain digest "
                         f"(a row was changed after it was recorded)")
    return history


def _tensor(values: array) -> torch.Tensor:
    dtype = torch.float64 if values.typecode == "d" else torch.int64
    if not values:
        return torch.zeros(0, dtype=dtype)
    return torch.frombuffer(bytearray(values.tobytes()), dtype=dtype)


def save_archive(obj: Any, out: IO[bytes]) -> None:
    """``torch.save(obj, out)``, byte for byte, but for the crc32 that torch computes of every record: its fields are
    left 0. Every file trainproof stores is hashed with sha256 as it is written and verified by it when read, and
    ``torch.load`` does not check the crc32; computing it cost 0.43 CPU-s per GiB saved on the test VM (most of
    ``torch.save``'s own time, which without it is 0.004 s per GiB: ``bench/RESULTS.md``). A tool that tests the
    archive as a zip file (``unzip -t``) reports the zero crc32s; the export bundle, which users open with other
    tools, keeps them (``torch.save``). Where this torch lacks the writer's internals named below, it is
    ``torch.save``."""
    writer = _writer_without_crc(out)
    if writer is None:
        torch.save(obj, out)
        return
    from torch import serialization

    try:
        serialization._save(obj, writer, pickle, serialization.DEFAULT_PROTOCOL, False)
    except BaseException:
        # Ended here, as torch.save's own context does: left to the writer's C++ destructor, the ending of a failed
        # archive throws there, and the process is killed (std::terminate) instead of the error being raised.
        with contextlib.suppress(BaseException):
            writer.write_end_of_file()
        raise
    writer.write_end_of_file()


_SAVE_PARAMS = ("obj", "zip_file", "pickle_module", "pickle_protocol", "_disable_byteorder_record")


def _writer_without_crc(out: IO[bytes]) -> Any:
    """torch's archive writer for ``out`` with its crc32 off, as ``torch.save`` makes it; None where this torch's
    internals differ from those of the version this was written for (2.13: ``_save``'s parameters, the storage
    alignment, the writer's ``(file, compute_crc32, alignment)``)."""
    import inspect

    from torch import serialization

    save = getattr(serialization, "_save", None)
    alignment = getattr(serialization, "_get_storage_alignment", None)
    if save is None or alignment is None or tuple(inspect.signature(save).parameters) != _SAVE_PARAMS:
        return None
    try:
        return torch._C.PyTorchFileWriter(out, False, alignment())
    except TypeError:
        return None


def encode(state: dict[str, Any]) -> bytes:
    """Serialise ``state`` with torch.save (:func:`save_archive`) after checking it holds only weights-only-loadable
    types."""
    check_types(state)
    buf = io.BytesIO()
    save_archive(state, buf)
    return buf.getvalue()


def encode_spool(state: dict[str, Any], directory: str | None = None, *, write_behind: bool = False) -> Spool:
    """:func:`encode` into a spool file (``trainproof.storage.spool``): ``torch.save`` streams each tensor into the file
    while it is hashed, so serialising never holds a second copy of the state in memory. ``write_behind``: the spool
    becomes the stored file (``SpoolWriter``'s)."""
    check_types(state)
    with SpoolWriter(directory, write_behind=write_behind) as out:
        save_archive(state, cast(IO[bytes], out))
    return out.finish()


def encode_live(state: dict[str, Any], directory: str | None = None, *, write_behind: bool = False,
                keep_parts: bool = False) -> LiveSpool:
    """:func:`encode_spool` on a thread of its own: the spool is returned at once and its bytes can be read (and
    uploaded, ``GenerationStore.uploads_while_written``, or read back from a folder's device,
    ``verifies_while_written``) while ``torch.save`` writes them; ``keep_parts``: each part is kept in memory until
    that read-back compares it (``trainproof.storage.spool.KeptParts``). The caller keeps ``state`` unchanged until
    the spool is done (``LiveSpool.join``)."""
    check_types(state)
    expected = tensor_bytes(state)
    expected += expected // 100 + 2**20  # the archive's own records (pickle, headers): a margin, never a shortfall
    return LiveSpool.serialise(lambda out: save_archive(state, out), directory, expected=expected,
                               write_behind=write_behind, keep_parts=keep_parts)


def tensor_bytes(value: Any, seen: set | None = None) -> int:
    """About the bytes ``torch.save`` writes for the tensors in ``value`` (a state of dicts, lists and tuples): each
    storage once, however many tensors view it (tied weights, views of one flat buffer); a tensor without a storage
    of its own (sparse) by its elements."""
    seen = set() if seen is None else seen
    if isinstance(value, torch.Tensor):
        try:
            storage = value.untyped_storage()
        except (NotImplementedError, RuntimeError):
            return sum(tensor_bytes(t, seen) for t in _parts_of(value))
        key = (storage.data_ptr(), str(value.device), storage.nbytes())
        if key in seen:
            return 0
        seen.add(key)
        return storage.nbytes()
    if isinstance(value, dict):
        return sum(tensor_bytes(v, seen) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v, seen) for v in value)
    return 0


def _parts_of(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The dense tensors a sparse one is saved as (its indices and values), else none."""
    if tensor.layout == torch.sparse_coo:
        return [tensor._indices(), tensor._values()]
    if tensor.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [tensor.crow_indices(), tensor.col_indices(), tensor.values()]
    if tensor.layout in (torch.sparse_csc, torch.sparse_bsc):
        return [tensor.ccol_indices(), tensor.row_indices(), tensor.values()]
    return []


def decode(data: bytes | Spool) -> dict[str, Any]:
    """Load a state safely (weights_only=True, CPU) and check its structure. A :class:`Spool` is memory-mapped
    (``torch.load(mmap=True)``): its tensors are read from the file when used, never copied up front.

    A pickled object (class instance, callable, NumPy array) is refused with StateError; so is a file
    that is not a training state at all.
    """
    state = load_weights_only(data)
    check_structure(state)
    return state


def rank_file(rank: int) -> str:
    """``rank-%05d.pt``: where rank ``rank`` (>= 1) keeps its part of a generation."""
    return f"rank-{rank:05d}.pt"


def encode_rank_part(part: dict[str, Any], *, step: int, world: int) -> bytes:
    """Serialise one rank's part (rng, next_draws, data position copy) with the step and world it belongs to."""
    return encode({"schema": RANK_SCHEMA, "step": step, "world": world, **part})


def decode_rank_part(data: bytes | Spool) -> dict[str, Any]:
    """Load a ``rank-%05d.pt`` safely and check its structure."""
    part = load_weights_only(data)
    if not isinstance(part, dict) or part.get("schema") != RANK_SCHEMA:
        raise StateError(f"a rank file has schema {part.get('schema') if isinstance(part, dict) else None!r}, "
                         f"expected {RANK_SCHEMA!r}")
    missing = [k for k in RANK_KEYS if k not in part]
    if missing:
        raise StateError(f"a rank file lacks {missing}")
    return part


HISTORY_FILE = "history.pt"
HISTORY_DIR = "history"
"""Under the run: a copy of each generation's ``history.pt`` as a generation of its own, never deleted by retention
(trainproof.train.checkpoint writes it with ``--keep``; trainproof.format.history reads it, chain-checked)."""
HISTORY_SCHEMA = "trainproof.history/1"


def encode_history(state: dict[str, Any]) -> bytes:
    """``history.pt``: this generation's own history rows and their chain link (a few KB), committed beside
    ``training_state.pt``. A reader that needs only the history of an older generation (trainproof.format.history: the
    verifier, the audit, the export's loss curve) reads this instead of the whole state, whose model and optimizer
    may be gigabytes. The chain check makes it as trustworthy as the copy inside the state."""
    return encode({"schema": HISTORY_SCHEMA, "progress": {"step": state["progress"]["step"]},
                   "history": state["history"], "history_chain": state["history_chain"]})


def decode_history(data: bytes | Spool) -> dict[str, Any]:
    """Load a ``history.pt`` safely (weights-only) and check its structure: a mapping with ``progress.step``,
    ``history`` and ``history_chain``, enough for :func:`check_history`."""
    section = load_weights_only(data)
    if not isinstance(section, dict) or section.get("schema") != HISTORY_SCHEMA:
        raise StateError(f"{HISTORY_FILE} has schema {section.get('schema') if isinstance(section, dict) else None!r}, "
                         f"expected {HISTORY_SCHEMA!r}")
    step = section.get("progress", {}).get("step") if isinstance(section.get("progress"), dict) else None
    if type(step) is not int or not isinstance(section.get("history"), dict) or "history_chain" not in section:
        raise StateError(f"{HISTORY_FILE} lacks progress.step, history or history_chain")
    return section


FROZEN_FILE = "frozen.pt"
"""The model's frozen entries (parameters that require no gradient: no optimizer step changes them, e.g. the base of a
LoRA run), as ``{name: tensor}``: stored once for the run as a shared object that each generation references
(``GenerationStore.put_shared``), and merged back into ``model`` when a generation is decoded. The state's
``meta.frozen.keys`` lists them."""


def encode_frozen(tensors: dict[str, torch.Tensor], directory: str | None = None, *,
                  write_behind: bool = False) -> Spool:
    """The frozen entries serialised into a spool (``torch.save`` of a flat dict, weights-only loadable);
    ``write_behind`` as :func:`encode_spool`'s."""
    check_types(tensors, "frozen")
    with SpoolWriter(directory, write_behind=write_behind) as out:
        save_archive(dict(sorted(tensors.items())), cast(IO[bytes], out))  # a write-only file object
    return out.finish()


def decode_frozen(data: bytes | Spool) -> dict[str, torch.Tensor]:
    """The frozen entries of a ``frozen.pt``, loaded weights-only; StateError when it is not a flat dict of tensors."""
    frozen = load_weights_only(data)
    if not isinstance(frozen, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                               for k, v in frozen.items()):
        raise StateError(f"{FROZEN_FILE} is not a dict of named tensors")
    return frozen


def with_frozen(state: dict[str, Any], files: dict[str, Any]) -> dict[str, Any]:
    """``state`` with its model's frozen entries (``frozen.pt``) merged back into ``model``: exactly the names its
    ``meta.frozen.keys`` lists, none of them also in ``model``. A state without frozen entries is returned as is."""
    keys = (state["meta"].get("frozen") or {}).get("keys")
    if keys is None:
        return state
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
        raise StateError("the state's meta.frozen.keys is not a list of names")
    if FROZEN_FILE not in files:
        raise StateError(f"the state lists {len(keys)} frozen model entries but the generation has no {FROZEN_FILE}")
    frozen = decode_frozen(files[FROZEN_FILE])
    if sorted(frozen) != sorted(keys) or set(frozen) & set(state["model"]):
        raise StateError(f"{FROZEN_FILE} holds other entries than the state's meta.frozen.keys lists")
    return {**state, "model": {**state["model"], **frozen}}


def decode_generation(files: dict[str, bytes], state: dict[str, Any] | None = None) -> dict[str, Any]:
    """The state of a generation: ``training_state.pt`` plus every ``rank-%05d.pt`` it needs, joined so that
    ``state["ranks"][r]`` is rank r's part, and the model's frozen entries (:data:`FROZEN_FILE`) merged back. Refuses
    a missing rank file or one from another moment.

    ``state``: ``training_state.pt`` already decoded (saves decoding a large state twice).
    """
    state = with_frozen(decode(files[STATE_FILE]) if state is None else state, files)
    world = state["meta"].get("world", 1)
    if not isinstance(world, int) or world < 1:
        raise StateError(f"state meta.world is {world!r}")
    parts = [state["ranks"][0]]
    for r in range(1, world):
        if rank_file(r) not in files:
            raise StateError(f"the generation of world {world} has no {rank_file(r)}")
        parts.append(_checked_part(decode_rank_part(files[rank_file(r)]), r, state))
    return {**state, "ranks": parts}


def _checked_part(part: dict[str, Any], rank: int, state: dict[str, Any]) -> dict[str, Any]:
    """Refuse a rank part that is not rank ``rank``'s part of this very step, world and data position."""
    want = {"rank": rank, "step": state["progress"]["step"], "world": state["meta"]["world"]}
    got = {k: part.get(k) for k in want}
    if got != want:
        raise StateError(f"{rank_file(rank)} is {got}, the state expects {want}: rank files of another moment")
    data, data0 = part["data"], state["ranks"][0]["data"]
    if (data.get("epoch"), data.get("cursor")) != (data0.get("epoch"), data0.get("cursor")):
        raise StateError(f"{rank_file(rank)} data position (epoch {data.get('epoch')}, cursor {data.get('cursor')}) "
                         f"differs from rank 0's (epoch {data0.get('epoch')}, cursor {data0.get('cursor')})")
    return part


MAX_EXPANSION = 1.05
"""How much larger than the file its archive's members may be in all: ``torch.save`` stores them uncompressed,
so the sum of member sizes is the file size less the archive's own headers. Anything that expands further
(a deflated member, a zip bomb) is refused before torch reads it."""


def check_archive(data: bytes | Spool) -> None:
    """Refuse a checkpoint archive whose members would expand past :data:`MAX_EXPANSION` times its size."""
    spooled = isinstance(data, Spool)
    size = data.size if spooled else len(data)
    try:
        with zipfile.ZipFile(data.path if spooled else io.BytesIO(data)) as archive:
            members = archive.infolist()
    except (zipfile.BadZipFile, ValueError, OSError) as exc:
        raise StateError(f"the state file is not a torch checkpoint archive ({type(exc).__name__}: {exc})") from None
    expanded = sum(m.file_size for m in members)
    compressed = [m.filename for m in members if m.compress_type != zipfile.ZIP_STORED]
    if compressed or expanded > MAX_EXPANSION * size:
        raise StateError(f"refused: the state file ({size:,} bytes) would expand to {expanded:,} bytes "
                         f"({len(compressed)} compressed member(s)); torch.save writes stored members only")


def load_weights_only(data: bytes | Spool) -> Any:
    """A torch archive (bytes, or a spool file: then mapped, not read) loaded with ``weights_only=True``, after
    :func:`check_archive`; StateError when it is not one or holds anything but plain values and tensors."""
    check_archive(data)
    try:
        if isinstance(data, Spool):  # mapped, not read: the tensors page in from the file when used
            return torch.load(data.path, map_location="cpu", weights_only=True, mmap=True)
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is a long how-to-bypass text; keep the line naming the forbidden global.
        found = re.search(r"(Unsupported global: GLOBAL \S+|WeightsUnpickler error:[^\n]*)", str(exc))
        detail = found.group(1) if found else type(exc).__name__
        raise StateError(
            f"refused: the state file holds a pickled object that weights-only loading forbids ({detail})"
        ) from None
    except Exception as exc:
        raise StateError(f"the state file cannot be read as a torch checkpoint: {type(exc).__name__}: {exc}") from None


def check_types(value: Any, path: str = "state") -> None:
    """Refuse anything but builtins and tensors, naming where it sits (e.g. a NumPy array from a task)."""
    if isinstance(value, torch.Tensor) or type(value) in _SCALARS:
        return
    if type(value) in _MAPPINGS:
        for k, v in value.items():
            if type(k) not in (str, int):
                raise StateError(f"{path}: key {k!r} of type {type(k).__name__} is not a str or int")
            check_types(v, f"{path}.{k}")
        return
    if type(value) in _SEQUENCES:
        for i, v in enumerate(value):
            check_types(v, f"{path}[{i}]")
        return
    kind = f"{type(value).__module__}.{type(value).__name__}"
    raise StateError(f"{path} is a {kind}: only builtins and tensors can be saved")


def check_structure(state: Any) -> None:
    """Cheap structural check (used as the store's read-back check): schema and sections present."""
    if not isinstance(state, dict):
        raise StateError(f"the state is a {type(state).__name__}, not a dict")
    if state.get("schema") != STATE_SCHEMA:
        raise StateError(f"state schema is {state.get('schema')!r}; this trainproof reads {STATE_SCHEMA!r}")
    missing = [k for k in TOP_KEYS if k not in state]
    if missing:
        raise StateError(f"the state lacks section(s) {missing}")
    if not isinstance(state["ranks"], list) or not state["ranks"]:
        raise StateError("the state has no per-rank part")


@dataclass(kw_only=True)
class Expected:
    """What a state must agree with to be resumed by this run."""

    contract: str
    """The run contract (plan.json)."""
    world: int
    """World size of this run."""
    code_version: str
    """trainproof version of this process."""
    data_identity: str
    """sha256 of this run's data."""
    step: int | None = None
    """The generation's step (from its directory / COMPLETE.json), when known."""


def check_consistency(state: dict[str, Any], expected: Expected) -> list[str]:
    """Refuse a state that belongs to another run or contradicts itself; return soft warnings.

    Raises StateError naming the first inconsistency. Warnings (other torch/numpy versions: the
    resume is still correct but may not be bitwise equal) are returned for the caller to log.
    """
    check_self_consistent(state, step=expected.step, contract=expected.contract)
    meta = state["meta"]
    _same("world", meta.get("world"), expected.world, "resume with the original world size")
    _same("code_version", meta.get("code_version"), expected.code_version,
          "resume with the version that wrote it, or start a new --store")
    _same("data_identity", meta.get("data_identity"), expected.data_identity, "the data changed since the save")
    if len(state["ranks"]) != expected.world:
        raise StateError(f"state holds {len(state['ranks'])} rank part(s) for world {expected.world}")
    return _version_warnings(meta.get("versions", {}))


def check_self_consistent(state: dict[str, Any], *, step: int | None, contract: str) -> None:
    """Refuse a state that contradicts itself or the generation it was read from (StateError).

    Such a state was not written by a correct trainer of this run (damage, or a planted copy: an older state
    under a newer folder name): the caller quarantines its generation and falls back to the previous one.
    ``step`` is the generation's step (its folder name), None when the state stands alone.
    """
    check_structure(state)
    meta, progress = state["meta"], state["progress"]
    _same("contract", meta.get("contract"), contract, "the state belongs to another run")
    own = progress.get("step")
    if not isinstance(own, int) or isinstance(own, bool) or own < 0:
        raise StateError(f"state progress.step is {own!r}, not a step count")
    if step is not None:
        _same("progress.step", own, step, "the generation's name and its content disagree")
    check_history(state)
    _check_schedule(state["scheduler"], own)
    world = meta.get("world")
    if not isinstance(world, int) or len(state["ranks"]) != world:
        raise StateError(f"state holds {len(state['ranks'])} rank part(s) for world {world!r}")


def _check_schedule(sched: Any, step: int) -> None:
    """A scheduler steps once per optimizer step; one stepped on a metric (ReduceLROnPlateau's state: ``best``,
    ``num_bad_epochs``) once per ``scheduler_every`` of them, so at most ``step`` times (the trainer, knowing the
    task's cadence, checks the exact count)."""
    if sched is None:
        return
    taken = sched.get("last_epoch")
    if "num_bad_epochs" in sched and "best" in sched:
        if type(taken) is not int or not 0 <= taken <= step:
            raise StateError(f"the scheduler stepped on a metric has taken {taken!r} steps in {step} optimizer steps")
    elif taken != step:
        raise StateError(f"scheduler has taken {taken} steps but progress says {step}")


def _same(field: str, got: Any, want: Any, hint: str) -> None:
    if got != want:
        raise StateError(f"state {field} is {got!r}, this run expects {want!r}: {hint}")


def _version_warnings(saved: dict[str, Any]) -> list[str]:
    now = runtime_versions()
    return [
        f"state was written with {name} {saved.get(name)}, this process runs {now[name]}: "
        "the resume is valid but may not be bitwise equal"
        for name in now
        if saved.get(name) != now[name]
    ]


def runtime_versions() -> dict[str, str]:
    """Library versions that can change numerics (recorded in the state, compared on load)."""
    import platform

    import numpy

    return {"python": platform.python_version(), "torch": str(torch.__version__), "numpy": str(numpy.__version__)}
