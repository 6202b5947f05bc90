"""The reload check of an export's Hugging Face directory (trainproof.export.hf): what a ``transformers`` user does with
it, in an interpreter that cannot import trainproof.

The directory is read back from ``<dest>/hf/step-%08d/`` (every file against its own ``COMPLETE.json``); one holding
a file that ``save_pretrained`` does not write (a ``.py``, other weights) or a JSON file with ``auto_map`` is refused
before anything is loaded, whatever the bundle lists (trainproof.export.hf ``foreign``: the line names the file).
It must hold exactly the files, with the sha256, that the bundle's ``config.json`` lists; the files are copied into a
local folder, and a fresh ``python -I`` process, in which importing ``job`` or ``storage`` fails, loads it with
``from_pretrained`` of the class its ``config.json`` names (``LlamaForCausalLM``; ``AutoModelForCausalLM`` when
transformers has no such class; offline: ``HF_HUB_OFFLINE=1``, ``trust_remote_code=False``) and re-runs the held-out
evaluation of ``hf_eval.py`` (trainproof's own source text, never the copy read from the store), which must
reproduce the value ``metrics.json`` records under ``hf`` exactly (same bytes, same CPU kernels and thread count).

A ``peft`` model's adapter directory (``<dest>/hf-adapter/step-%08d/``, the bundle's ``hf_adapter``) is checked the
way a user loads it (:func:`check_adapter`): it must hold exactly ``adapter_config.json`` and
``adapter_model.safetensors`` with the listed sha256; the base model is written into a local folder as a published
one (the merged directory's ``config.json``, the base's tensors of the bundle's ``model.safetensors`` under their
published names, trainproof.tasks ``peft_base_name``), and a fresh ``python -I`` process without trainproof loads the
base with ``from_pretrained``, the adapter over it with ``peft.PeftModel.from_pretrained(base, folder)``, and must
reproduce the value ``metrics.json`` records under ``hf_adapter`` exactly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from typing import Any

from trainproof.export.bundle import EXACT_RTOL, sha256_of
from trainproof.export.hf import (
    ADAPTER_CONFIG,
    ADAPTER_FILES,
    ADAPTER_FOLDER,
    HF_EVAL,
    HF_EVAL_DATA_FILE,
    HF_FOLDER,
    MAX_JSON_BYTES,
    foreign,
)
from trainproof.storage import GenerationStore, StoreError
from trainproof.storage.manifest import step_dir
from trainproof.storage.spool import Spool, spool_dir

BOOT = r"""
import importlib, importlib.abc, json, sys

class NoTrainproof(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("trainproof",):
            raise ImportError(f"{name}: trainproof is not importable in this check")
        return None

sys.meta_path.insert(0, NoTrainproof())
reachable = []
for name in ("trainproof",):
    try:
        importlib.import_module(name)
        reachable.append(name)
    except ImportError:
        pass
folder, source, with_eval = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
adapter = sys.argv[4] if len(sys.argv) > 4 else ""
import torch
import transformers
# The class config.json names, if transformers has it (a causal LM, a classifier, ...), else the causal-LM auto class.
arch = (json.load(open(folder + "/config.json")).get("architectures") or [""])[0]
cls = getattr(transformers, arch, None) if isinstance(arch, str) and arch.isidentifier() else None
if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
    cls = transformers.AutoModelForCausalLM
model = cls.from_pretrained(folder, trust_remote_code=False)  # never code from the folder (no auto_map reaches here)
if adapter:  # a peft adapter over the base model just loaded, as its users load it
    from peft import PeftModel
    model = PeftModel.from_pretrained(model, adapter)
result = {"trainproof_importable": reachable, "architecture": type(model).__name__,
          "parameters": sum(p.numel() for p in model.parameters())}
if with_eval:
    namespace = {"__name__": "hf_eval"}
    exec(compile(source, "hf_eval.py", "exec"), namespace)
    from safetensors.torch import load_file
    metrics = json.load(open("metrics.json"))
    torch.set_num_threads(metrics["eval"]["threads"])
    result["value"] = namespace["evaluate"](model, load_file("hf_eval_data.safetensors"))
print("HF-RELOAD " + json.dumps(result))
"""


def check(dest: GenerationStore, step: int, files: dict[str, Any], config: dict[str, Any], metrics: dict[str, Any],
          *, timeout: float = 600.0) -> dict[str, Any]:
    """The ``hf_from_pretrained`` entry of the reload record: ``passed`` when the directory is the one the bundle
    lists, loads with ``from_pretrained`` without trainproof, and (when the bundle has ``hf_eval.py``) reproduces the
    recorded value."""
    listed = (config.get("hf") or {}).get("files")
    recorded = (metrics.get("hf") or {}).get("value")
    where = f"{dest.url.rstrip('/')}/{HF_FOLDER}/{step_dir(step)}"
    if not isinstance(listed, dict) or not listed:
        return {"passed": False, "why": "config.json's hf block lists no files"}
    try:
        loaded = dest.child(HF_FOLDER).load(step, spool_dir=spool_dir(), spool_from=1 << 20)
    except (StoreError, OSError, ValueError) as exc:  # missing, or a file that no longer matches its manifest
        return {"passed": False, "directory": where, "why": f"cannot read the directory: {exc}"}
    try:
        refused = foreign(loaded.files, read=_bytes)  # before anything is copied or loaded: never custom code
        if refused is not None:
            return {"passed": False, "directory": where, "why": f"not loaded: {refused}"}
        got = {name: sha256_of(data) for name, data in loaded.files.items()}
        if got != listed:
            return {"passed": False, "directory": where,
                    "why": f"the directory's files differ from config.json's hf list: {sorted(set(got) ^ set(listed))}"
                           if set(got) != set(listed) else "a file's sha256 differs from config.json's hf list"}
        with tempfile.TemporaryDirectory(prefix="trainproof-hf-check-", dir=spool_dir()) as work:
            folder = os.path.join(work, "hf")
            os.mkdir(folder)
            for name, data in loaded.files.items():
                _place(os.path.join(folder, name), data)
            with_eval = isinstance(recorded, (int, float)) and HF_EVAL_DATA_FILE in files
            if with_eval:
                _place(os.path.join(work, HF_EVAL_DATA_FILE), files[HF_EVAL_DATA_FILE])
                with open(os.path.join(work, "metrics.json"), "w") as fh:
                    json.dump(metrics, fh)
            result = _fresh_process(work, folder, with_eval, timeout)
    finally:
        loaded.close()
    out = {"directory": where, "files": len(listed), **result}
    if "error" in result:
        return {**out, "passed": False}
    isolated = not result.get("trainproof_importable")
    if not with_eval:
        return {**out, "passed": isolated, "evaluated": False}
    diff = abs(result["value"] - recorded)
    return {**out, "recorded": recorded, "reloaded": result["value"], "abs_diff": diff, "rtol": EXACT_RTOL,
            "passed": isolated and diff <= EXACT_RTOL * max(abs(recorded), 1e-30)}


def check_adapter(dest: GenerationStore, step: int, files: dict[str, Any], config: dict[str, Any],
                  metrics: dict[str, Any], *, timeout: float = 600.0) -> dict[str, Any]:
    """The ``hf_adapter_from_pretrained`` entry of the reload record: ``passed`` when the adapter directory is the one
    the bundle lists and, loaded with ``PeftModel.from_pretrained`` over the base without trainproof, reproduces the
    recorded value."""
    listed = (config.get("hf_adapter") or {}).get("files")
    recorded = (metrics.get("hf_adapter") or {}).get("value")
    where = f"{dest.url.rstrip('/')}/{ADAPTER_FOLDER}/{step_dir(step)}"
    if not isinstance(listed, dict) or set(listed) != ADAPTER_FILES:
        return {"passed": False, "why": f"config.json's hf_adapter block does not list {sorted(ADAPTER_FILES)}"}
    try:
        adapter = dest.child(ADAPTER_FOLDER).load(step)
        merged = dest.child(HF_FOLDER).load(step, skip=lambda name: not name.endswith(".json") or "index" in name)
    except (StoreError, OSError, ValueError) as exc:
        return {"passed": False, "directory": where, "why": f"cannot read the directories: {exc}"}
    got = {name: sha256_of(data) for name, data in adapter.files.items()}
    if got != listed:
        return {"passed": False, "directory": where, "why": f"the adapter's files differ from config.json's "
                                                           f"hf_adapter list: {sorted(set(got) ^ set(listed))}"
                if set(got) != set(listed) else "a file's sha256 differs from config.json's hf_adapter list"}
    refused = foreign({**merged.files, "model.safetensors": b""}, read=_bytes) or (
        "auto_map" in _json_object(_bytes(adapter.files[ADAPTER_CONFIG])) and f"{ADAPTER_CONFIG} has auto_map")
    if refused:
        return {"passed": False, "directory": where, "why": f"not loaded: {refused}"}
    if not isinstance(recorded, (int, float)) or HF_EVAL_DATA_FILE not in files:
        return {"passed": False, "directory": where, "why": "metrics.json records no hf_adapter value"}
    with tempfile.TemporaryDirectory(prefix="trainproof-adapter-check-", dir=spool_dir()) as work:
        base, folder = os.path.join(work, "base"), os.path.join(work, "adapter")
        os.mkdir(base)
        os.mkdir(folder)
        for name, data in adapter.files.items():
            _place(os.path.join(folder, name), data)
        for name, data in merged.files.items():
            _place(os.path.join(base, name), data)
        _write_base(os.path.join(base, "model.safetensors"), files["model.safetensors"])
        _place(os.path.join(work, HF_EVAL_DATA_FILE), files[HF_EVAL_DATA_FILE])
        with open(os.path.join(work, "metrics.json"), "w") as fh:
            json.dump(metrics, fh)
        result = _fresh_process(work, base, True, timeout, adapter=folder)
    out = {"directory": where, "files": len(listed), **result}
    if "error" in result:
        return {**out, "passed": False}
    diff = abs(result["value"] - recorded)
    return {**out, "recorded": recorded, "reloaded": result["value"], "abs_diff": diff, "rtol": EXACT_RTOL,
            "passed": not result.get("trainproof_importable") and diff <= EXACT_RTOL * max(abs(recorded), 1e-30)}


def _json_object(raw: bytes) -> dict[str, Any]:
    from trainproof.storage.limits import loads_untrusted

    try:
        value = loads_untrusted(raw, what=ADAPTER_CONFIG, max_bytes=MAX_JSON_BYTES)
    except ValueError:
        return {"auto_map": "unreadable"}
    return value if isinstance(value, dict) else {}


def _write_base(path: str, weights: Any) -> None:
    """The base model's weights as published (a ``peft`` model's base tensors of the bundle's full-precision
    ``model.safetensors``, under their base names: trainproof.tasks ``peft_base_name``), written tensor by tensor."""
    from trainproof.export.tensorfile import map_safetensors, write_safetensors
    from trainproof.tasks import peft_base_name

    if isinstance(weights, Spool):
        tensors = map_safetensors(weights.path)
    else:
        from safetensors.torch import load

        tensors = load(weights)
    base = {name: tensors[k] for k in tensors if (name := peft_base_name(k)) is not None}
    with open(path, "wb") as fh:
        write_safetensors(fh, base, metadata={"format": "pt"})


def _bytes(data: Any) -> bytes:
    """A file of the directory as bytes (a spooled one read back, at most ``MAX_JSON_BYTES`` + 1: a larger one is
    refused as not JSON save_pretrained writes)."""
    if not isinstance(data, Spool):
        return data
    with data.open() as fh:
        return fh.read(MAX_JSON_BYTES + 1)


def _place(path: str, data: Any) -> None:
    if isinstance(data, Spool):
        shutil.copyfile(data.path, path)
    else:
        with open(path, "wb") as fh:
            fh.write(data)


def _fresh_process(work: str, folder: str, with_eval: bool, timeout: float, *, adapter: str = "") -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1")
    argv = [sys.executable, "-I", "-c", BOOT, folder, HF_EVAL, "1" if with_eval else "0", adapter]
    try:
        proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the from_pretrained process did not finish within {timeout:.0f} s"}
    lines = [line for line in proc.stdout.splitlines() if line.startswith("HF-RELOAD ")]
    if proc.returncode != 0 or not lines:
        tail = " ".join(proc.stderr.strip().splitlines()[-3:])[-500:]
        return {"error": f"the from_pretrained process exited {proc.returncode}: {tail}"}
    return {"command": "python -I -c <trainproof.proof.hf_reload.BOOT> HF_FOLDER", **json.loads(lines[-1][10:])}
