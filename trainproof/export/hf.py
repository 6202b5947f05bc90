"""The Hugging Face directory of an export: for a task whose model is a ``transformers`` model, what
``AutoModelForCausalLM.from_pretrained(folder)`` (or the model's own ``from_pretrained``) loads, with no trainproof.

Committed under ``<dest>/hf/step-%08d/`` with the store's write -> verify -> mark usable semantics, *before* the
bundle (trainproof.export.bundle), whose ``config.json`` lists every one of its files with its sha256 (``hf`` block): a
committed bundle vouches for its directory. It holds:

    config.json                 the model's configuration (``architectures`` names its class), as save_pretrained
    generation_config.json      when the model generates
    model.safetensors           the trained weights in full precision, or, above ``TRAINPROOF_HF_SHARD_MB`` (default
                                5000 MB, Hugging Face's own default), ``model-00001-of-0000N.safetensors`` ... with
                                ``model.safetensors.index.json`` (``weight_map``: tensor -> file)
    tokenizer files             ``task.tokenizer.save_pretrained``: tokenizer.json, tokenizer_config.json, ...

Nothing else, and never custom code: :data:`TOKENIZER_FILES` and :func:`foreign` name exactly what may be in a
directory (the files these ``save_pretrained`` calls write), and a directory holding any other file (a ``.py``,
``pytorch_model.bin``, a shard the index does not name) or whose ``config.json`` (or another JSON file of it) has
``auto_map`` (code that ``from_pretrained(..., trust_remote_code=True)`` would import) is never written: the export
leaves the Hugging Face directory out with a one-line reason (``config.json``'s ``hf_refused``) and keeps the rest
of the bundle; the reload check refuses to load one (trainproof.proof.hf_reload), and an export that finds one at
its name moves it to quarantine and commits its own (:func:`commit_directory`).

A ``peft`` model (``get_peft_model(base, LoraConfig(...))``, examples/hf_lora.py) gets two directories: its adapter,
committed the same way under ``<dest>/hf-adapter/step-%08d/`` (:data:`ADAPTER_FILES`: ``adapter_config.json`` and
``adapter_model.safetensors`` as ``save_pretrained`` of the ``peft`` model writes them, what
``PeftModel.from_pretrained(base, folder)`` loads over the base model), and the merged model
(``merge_and_unload``: the base's own class and tensor names, each adapted weight plus its low-rank update) as the
Hugging Face directory above. The bundle's ``config.json`` and ``metrics.json`` describe the adapter under
``hf_adapter`` (its files' sha256; ``hf_eval.py``'s evaluation of the base with the adapter, measured at export).

The weight files are written tensor by tensor into spool files (trainproof.export.tensorfile, ``{"format": "pt"}`` in
their header), never built in memory. For a task whose held-out samples are token windows (``DatasetTask`` with
``(input_ids, targets)`` integer pairs, as examples/hf_llama.py) the bundle also carries ``hf_eval.py`` and
``hf_eval_data.safetensors``: the held-out evaluation in plain torch over the directory's model, whose value at
export is recorded in ``metrics.json`` (``hf``); the reload check re-runs it in an interpreter that cannot import
trainproof (trainproof.proof.hf_reload).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from trainproof.tasks import Task

HF_FOLDER = "hf"
"""The directories' folder beside the bundles: ``<dest>/hf/step-%08d/``."""
ADAPTER_FOLDER = "hf-adapter"
"""A ``peft`` model's adapters' folder beside the bundles: ``<dest>/hf-adapter/step-%08d/``."""
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
ADAPTER_FILES = frozenset({ADAPTER_CONFIG, ADAPTER_WEIGHTS})
"""What an adapter directory holds (``save_pretrained`` of a ``peft`` model, without its README model card)."""
HF_EVAL_FILE, HF_EVAL_DATA_FILE = "hf_eval.py", "hf_eval_data.safetensors"
SHARD_ENV = "TRAINPROOF_HF_SHARD_MB"
DEFAULT_SHARD_BYTES = 5_000 * 10**6
INDEX_FILE = "model.safetensors.index.json"
WEIGHTS_FILE = "model.safetensors"
SHARD_FILE = re.compile(r"model-(\d{5})-of-(\d{5})\.safetensors")
"""A weights file of a sharded directory (:func:`directory` names them ``model-%05d-of-%05d.safetensors``)."""
MODEL_FILES = frozenset({"config.json", "generation_config.json", WEIGHTS_FILE, INDEX_FILE})
"""What :func:`directory` writes of the model (``config.save_pretrained``, ``generation_config.save_pretrained``, the
weights), besides the shards."""
TOKENIZER_FILES = frozenset({
    # PreTrainedTokenizerBase.save_pretrained's own files (transformers' TOKENIZER_CONFIG_FILE, FULL_TOKENIZER_FILE,
    # SPECIAL_TOKENS_MAP_FILE, ADDED_TOKENS_FILE, CHAT_TEMPLATE_FILE and the legacy chat_template.json) ...
    "tokenizer_config.json", "tokenizer.json", "special_tokens_map.json", "added_tokens.json", "chat_template.jinja",
    "chat_template.json",
    # ... and save_vocabulary's (a tokenizer class's vocab_files_names) of the byte-level BPE, WordPiece and
    # SentencePiece tokenizers.
    "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "sentencepiece.bpe.model"})
"""The files a tokenizer's ``save_pretrained`` may add to a directory; a tokenizer that writes any other file (or a
sub-folder, which is left out) gets no Hugging Face directory."""
MAX_JSON_BYTES = 64 << 20
"""A directory's JSON files are read whole to look for ``auto_map`` (tokenizer.json of a large vocabulary: a few
tens of MB); a larger one is not one save_pretrained wrote."""

HF_EVAL = '''"""The held-out evaluation of this export over its Hugging Face directory, in plain torch and transformers
(no trainproof): python hf_eval.py HF_FOLDER, from the bundle folder; it prints what metrics.json records as hf."""

import json
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def evaluate(model, data):
    """Token-mean next-token cross-entropy over the held-out windows, in the batches the export evaluated."""
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(len([k for k in data if k.startswith("inputs_")])):
            inputs, targets = data[f"inputs_{i:04d}"], data[f"targets_{i:04d}"]
            logits = model(input_ids=inputs, use_cache=False).logits
            logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
            losses = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                     reduction="none").view(targets.shape)
            total += float(losses.to(torch.promote_types(losses.dtype, torch.float32)).sum().double())
            count += targets.numel()
    return total / count


if __name__ == "__main__":
    from transformers import AutoModelForCausalLM

    metrics = json.load(open("metrics.json"))
    torch.set_num_threads(metrics["eval"]["threads"])  # the thread count of the recorded evaluation
    folder = sys.argv[1] if len(sys.argv) > 1 else "hf"
    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=False)  # never code from the folder
    value = evaluate(model, load_file("hf_eval_data.safetensors"))
    print(json.dumps({"hf_eval": value, "recorded": metrics["hf"]["value"]}))
'''


@dataclass(kw_only=True)
class HFDirectory:
    """The files of a Hugging Face directory and what the bundle records of it."""

    files: dict[str, Any]
    """File name -> bytes, or a spool file (``trainproof.storage.spool.Spool``) for the weights."""
    sums: dict[str, str] = field(default_factory=dict)
    """Plain sha256 of the spooled files (the others are hashed from their bytes)."""
    architecture: str = ""
    shards: int = 1
    eval_data: dict[str, torch.Tensor] | None = None
    """The held-out batches for ``hf_eval.py`` (None: the task's samples are not token windows)."""
    value: float | None = None
    """``hf_eval.py``'s evaluation of the exported weights, measured at export."""
    why_no_eval: str = ""
    adapter: dict[str, bytes] | None = None
    """A ``peft`` model's adapter directory (:data:`ADAPTER_FILES`; the files above are then the merged model's)."""
    adapter_value: float | None = None
    """``hf_eval.py``'s evaluation of the ``peft`` model (the base with the adapter), measured at export."""


def is_transformers_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers.PreTrainedModel`` (by its class ancestry: no import of transformers)."""
    return any(c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
               for c in type(model).__mro__)


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is a ``peft.PeftModel`` (LoRA adapters over a base model; by class ancestry: no import)."""
    return any(c.__name__ == "PeftModel" and c.__module__.startswith("peft.") for c in type(model).__mro__)


def shard_bytes() -> int:
    """The largest weights file of a directory (``TRAINPROOF_HF_SHARD_MB``; a larger model is split)."""
    raw = os.environ.get(SHARD_ENV, "")
    try:
        value = int(float(raw) * 10**6) if raw else DEFAULT_SHARD_BYTES
    except ValueError:
        value = 0
    if value < 1:
        from trainproof.errors import ConfigError

        raise ConfigError(f"{SHARD_ENV}={raw!r} is not a positive number of MB "
                          f"(default {DEFAULT_SHARD_BYTES // 10**6})")
    return value


class Refused(Exception):
    """The task's model is a ``transformers`` model, but its directory would hold custom code or a file
    ``save_pretrained`` of the model and tokenizer does not write (the message: one line naming it)."""


def foreign(files: dict[str, Any], read: Callable[[Any], bytes] | None = None) -> str | None:
    """Why a Hugging Face directory of ``files`` (name -> bytes, or what ``read`` turns into bytes) is not one this
    export writes (None when it is): a file outside :data:`MODEL_FILES`, the shards and :data:`TOKENIZER_FILES`;
    weights both whole and sharded, shards the index does not name, or none at all; ``auto_map`` in a JSON file."""
    for name in sorted(files):
        if name not in MODEL_FILES and name not in TOKENIZER_FILES and not SHARD_FILE.fullmatch(name):
            return f"{name} is not a file save_pretrained writes (custom code, or another format's weights)"
    problem = _weights_problem(files, read)
    if problem is not None:
        return problem
    for name in sorted(n for n in files if n.endswith(".json") and n != INDEX_FILE):
        if "auto_map" in _json_object(files[name], read, name):
            return f"{name} has auto_map (custom code that from_pretrained would import): not written, not loaded"
    return None


def _weights_problem(files: dict[str, Any], read: Callable[[Any], bytes] | None) -> str | None:
    shards = sorted(n for n in files if SHARD_FILE.fullmatch(n))
    if WEIGHTS_FILE in files:
        extra = shards + ([INDEX_FILE] if INDEX_FILE in files else [])
        return f"{extra[0]} is a weights file beside {WEIGHTS_FILE}" if extra else None
    if not shards or INDEX_FILE not in files:
        return f"no {WEIGHTS_FILE}, nor shards with {INDEX_FILE}"
    weight_map = _json_object(files[INDEX_FILE], read, INDEX_FILE).get("weight_map")
    named = set(weight_map.values()) if isinstance(weight_map, dict) else set()
    if named != set(shards):
        odd = sorted(set(map(str, named)) ^ set(shards))[:1] or [INDEX_FILE]
        return f"{odd[0]}: the shards and {INDEX_FILE}'s weight_map differ"
    return None


def _json_object(data: Any, read: Callable[[Any], bytes] | None, name: str) -> dict[str, Any]:
    """A JSON file of the directory as an object (an empty one when it is not one: nothing to find in it)."""
    from trainproof.storage.limits import loads_untrusted

    raw = data if read is None else read(data)
    try:
        value = loads_untrusted(raw, what=name, max_bytes=MAX_JSON_BYTES)
    except ValueError:
        return {"auto_map": f"{name} is not JSON of at most {MAX_JSON_BYTES} bytes"}  # refused as if it had one
    return value if isinstance(value, dict) else {}


def directory(task: Task, weights: dict[str, torch.Tensor], spooled: Callable[[Callable[[Any], Any]], tuple[Any, str]],
              threads: int) -> HFDirectory | None:
    """The Hugging Face directory of ``weights`` when the task's model is a ``transformers`` model, else None.
    Raises :class:`Refused` when its model or tokenizer would write custom code (``auto_map``) or any file that is
    not one of a plain directory's (:func:`foreign`).

    ``spooled(write)``: a spool file filled by ``write(out)`` and its plain sha256 (trainproof.export.bundle
    ``_spooled``)."""
    probe = _model_class_probe(task)
    peft = is_peft_model(probe)
    if not (peft or is_transformers_model(probe)):
        return None
    with torch.random.fork_rng(devices=[]):
        model = task.build_model()
    model.to(dtype=task.dtype).load_state_dict(weights)
    adapter, adapter_value = None, None
    if peft:  # the adapter as peft saves it, evaluated over the base; then the merged model is the directory's
        eval_data, _ = eval_batches(task)
        adapter = adapter_files(model)
        adapter_value = run_eval(model, eval_data, threads) if eval_data is not None else None
        model = getattr(model, "merge_and_unload")()  # noqa: B009  (peft's, untyped: nn.Module's __getattr__)
        weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    files, sums = _config_files(model, task), {}
    problem = foreign({**files, WEIGHTS_FILE: b""})  # the weights, written below, are ours
    if problem is not None:
        raise Refused(f"{type(model).__name__}'s save_pretrained: {problem}")
    groups = _shards(weights, shard_bytes())
    from trainproof.export.tensorfile import write_safetensors

    names = [WEIGHTS_FILE] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    try:
        for name, group in zip(names, groups):
            files[name], sums[name] = spooled(lambda out, g=group: write_safetensors(
                out, {k: weights[k] for k in g}, metadata={"format": "pt"}))
    except BaseException:
        for data in files.values():
            getattr(data, "unlink", lambda: None)()
        raise
    if len(groups) > 1:
        total = sum(t.numel() * t.element_size() for t in weights.values())
        files[INDEX_FILE] = _json({"metadata": {"total_size": total},
                                   "weight_map": {k: name for name, g in zip(names, groups) for k in g}})
    out = HFDirectory(files=files, sums=sums, architecture=type(model).__name__, shards=len(groups),
                      adapter=adapter, adapter_value=adapter_value)
    out.eval_data, out.why_no_eval = eval_batches(task)
    if out.eval_data is not None:
        out.value = run_eval(model, out.eval_data, threads)
    return out


def adapter_files(model: nn.Module) -> dict[str, bytes]:
    """The adapter directory of a ``peft`` model: :data:`ADAPTER_FILES` as its ``save_pretrained`` writes them (the
    adapters' tensors only, in full precision, and their configuration). Raises :class:`Refused` when it writes
    them otherwise (another ``peft`` version's names) or its configuration names custom code (``auto_map``)."""
    with tempfile.TemporaryDirectory(prefix="trainproof-hf-adapter-") as folder:
        getattr(model, "save_pretrained")(folder, safe_serialization=True)  # noqa: B009  (peft's, untyped)
        files = {}
        for name in sorted(ADAPTER_FILES):
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise Refused(f"{type(model).__name__}'s save_pretrained wrote no {name}")
            with open(path, "rb") as fh:
                files[name] = fh.read()
    if "auto_map" in _json_object(files[ADAPTER_CONFIG], None, ADAPTER_CONFIG):
        raise Refused(f"{ADAPTER_CONFIG} has auto_map (custom code): not written")
    return files


def _model_class_probe(task: Task) -> nn.Module:
    """The task's model built on the meta device (no memory, no initialisation work), only to learn its class; on a
    model that cannot be built there, a real one."""
    with torch.random.fork_rng(devices=[]):
        try:
            with torch.device("meta"):
                return task.build_model()
        except Exception:  # noqa: BLE001  (user code that insists on real tensors: build it for real)
            return task.build_model()


def _config_files(model: nn.Module, task: Task) -> dict[str, Any]:
    """config.json (and generation_config.json, the tokenizer's files) as ``save_pretrained`` writes them."""
    with tempfile.TemporaryDirectory(prefix="trainproof-hf-") as folder:
        model.config.architectures = [type(model).__name__]
        model.config.save_pretrained(folder)
        generation = getattr(model, "generation_config", None)
        if generation is not None and getattr(model, "can_generate", lambda: False)():
            generation.save_pretrained(folder)
        if task.tokenizer is not None:
            task.tokenizer.save_pretrained(folder)
        files = {}
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if os.path.isfile(path):  # a tokenizer may write sub-folders (none of the common ones do): left out
                with open(path, "rb") as fh:
                    files[name] = fh.read()
    return files


def _shards(weights: dict[str, torch.Tensor], limit: int) -> list[list[str]]:
    """Tensor names grouped into files of at most ``limit`` bytes in state_dict order (a tensor larger than the
    limit gets a file of its own), as Hugging Face shards."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, tensor in weights.items():
        nbytes = tensor.numel() * tensor.element_size()
        if groups[-1] and size + nbytes > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    return groups


def eval_batches(task: Task) -> tuple[dict[str, torch.Tensor] | None, str]:
    """The held-out batches ``hf_eval.py`` evaluates: the task's ``eval_dataset`` in its micro-batches, when its
    samples are ``(input_ids, targets)`` pairs of integer tensors; else (None, why not)."""
    dataset = getattr(task, "eval_dataset", None)
    if dataset is None:
        return None, "the task has no eval_dataset of token windows (trainproof.tasks.DatasetTask)"
    micro, n = task.micro_batch_size, len(dataset)
    data: dict[str, torch.Tensor] = {}
    for i, start in enumerate(range(0, n, micro)):
        samples = [dataset[j] for j in range(start, min(start + micro, n))]
        if not all(isinstance(s, (tuple, list)) and len(s) == 2 and all(
                isinstance(t, torch.Tensor) and not t.is_floating_point() for t in s) for s in samples):
            return None, "the task's held-out samples are not (input_ids, targets) pairs of integer tensors"
        data[f"inputs_{i:04d}"] = torch.stack([s[0] for s in samples]).contiguous()
        data[f"targets_{i:04d}"] = torch.stack([s[1] for s in samples]).contiguous()
    return data, ""


def run_eval(model: nn.Module, data: dict[str, torch.Tensor], threads: int) -> float:
    """``hf_eval.py``'s ``evaluate`` (the same source text) over ``model``, at ``threads`` CPU threads."""
    namespace: dict[str, Any] = {"__name__": "hf_eval"}
    exec(compile(HF_EVAL, HF_EVAL_FILE, "exec"), namespace)  # our own source text, never one read from a store
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with torch.random.fork_rng(devices=[]):
            return float(namespace["evaluate"](model, data))
    finally:
        torch.set_num_threads(saved)


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def records(hf: HFDirectory, step: int, metric: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``hf`` blocks of the bundle's config.json (where the directory is and the sha256 of each of its files)
    and metrics.json (``hf_eval.py``'s value at export, and whether it equals the task's own metric)."""
    import hashlib

    from trainproof.storage.manifest import step_dir

    files = {name: hf.sums.get(name) or hashlib.sha256(data).hexdigest() for name, data in sorted(hf.files.items())}
    config = {"folder": f"{HF_FOLDER}/{step_dir(step)}", "files": files, "architecture": hf.architecture,
              "shards": hf.shards, "loader": "transformers.AutoModelForCausalLM.from_pretrained"}
    if hf.value is None:
        return config, {"value": None, "why": hf.why_no_eval}
    return config, {"metric": "held-out token cross-entropy over the directory's model (hf_eval.py)",
                    "value": hf.value, "equals_eval": hf.value == metric}


def adapter_records(hf: HFDirectory, step: int, metric: float) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``hf_adapter`` blocks of the bundle's config.json (where the adapter directory is, its files' sha256) and
    metrics.json (``hf_eval.py``'s value of the base with the adapter at export); empty ones without an adapter."""
    import hashlib

    from trainproof.storage.manifest import step_dir

    if hf.adapter is None:
        return {}, {}
    files = {name: hashlib.sha256(data).hexdigest() for name, data in sorted(hf.adapter.items())}
    config = {"folder": f"{ADAPTER_FOLDER}/{step_dir(step)}", "files": files,
              "loader": "peft.PeftModel.from_pretrained(base, folder)", "merged": f"{HF_FOLDER}/{step_dir(step)}",
              "base": "the model directory the run started from (its pretrained weights)"}
    if hf.adapter_value is None:
        return config, {"value": None, "why": hf.why_no_eval}
    return config, {"metric": "held-out token cross-entropy over the base with the adapter (hf_eval.py)",
                    "value": hf.adapter_value, "equals_eval": hf.adapter_value == metric}


def commit_directory(dest: Any, step: int, files: dict[str, Any], *, check: Callable[[str, Any], None],
                     digest: Callable[[Any], str], contract: str, world: int, code_version: str,
                     folder_name: str = HF_FOLDER) -> None:
    """Commit the directory's files as generation ``step`` of ``<dest>/hf`` (write -> verify -> mark usable, ``check``
    run on each file read back), before the bundle that lists them. One already committed there with the same files
    (``digest``: a file's plain sha256; an export that stopped between the two commits) is kept; one with other
    files (another export's, or planted: its config.json could name custom code a user's ``from_pretrained`` runs)
    is moved to quarantine and this one committed."""
    from trainproof.storage import COMPLETE

    folder = dest.child(folder_name)
    if any(g.step == step and g.status == COMPLETE for g in folder.scan()):
        if same_directory(folder, step, {n: digest(d) for n, d in files.items()}, digest):
            return
        folder.quarantine(step, "not this state's Hugging Face directory: its files differ from the export's")
    folder.commit(step, files, contract=contract, world=world, code_version=code_version, check=check,
                  extra={"kind": "hf-directory" if folder_name == HF_FOLDER else "hf-adapter"})


def same_directory(folder: Any, step: int, ours: dict[str, str], digest: Callable[[Any], str]) -> bool:
    """Whether generation ``step`` of ``folder`` is complete, holds exactly the files of ``ours`` (name -> plain
    sha256) and each read back (verified against its manifest) hashes to it."""
    from trainproof.storage import COMPLETE
    from trainproof.storage.errors import CorruptGenerationError
    from trainproof.storage.spool import spool_dir

    info = folder.generation(step)
    if info.status != COMPLETE or set((info.manifest or {}).get("files") or {}) != set(ours):
        return False
    try:
        loaded = folder.load(step, spool_dir=spool_dir(), spool_from=1 << 20)
    except CorruptGenerationError:
        return False
    try:
        return all(digest(loaded.files[n]) == ours[n] for n in ours)
    finally:
        loaded.close()
