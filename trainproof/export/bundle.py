"""Export bundle: the weights, configuration, metrics and data identity a consumer needs, committed with
the store's write -> verify -> mark-usable semantics, then reloaded from its destination in a fresh process.

Layout (``<dest>/step-%08d/``, ``<dest>`` defaulting to ``<run>/exports``)::

    model_bf16.pt       plain state_dict, floating tensors in bfloat16 (integer buffers kept as they are)
    model_bf16.safetensors  the same bf16 weights as safetensors
    model.safetensors   full precision
    config.json         task, task settings, dtype, seed, contract, source generation, versions, model_args
    metrics.json        final loss, evaluation metric (full precision and bf16), steps, samples/targets seen, and
                        ``history``: the steps the loss curve covers (``first_step``..``last_step``; reassembled from
                        the run's generations, trainproof.format.history: later than 1 when retention deleted older
                        ones)
    data.json           data identity, epoch plan and position
    model.py            the architecture and evaluation in plain torch (known tasks: trainproof.export.standalone)
    eval_data.safetensors  the evaluation's exact batches (with model.py)
    model.pt2           a torch.export program of the model, when it can be traced
    loss.png            training loss per step (with matplotlib), over metrics.json's ``history`` steps
    README.md           loading instructions and a snippet that needs only torch and safetensors
    SHA256SUMS          ``sha256sum -c`` compatible
    COMPLETE.json       written last by the store: every file's size and sha256, ``export_bytes/_sha256``

The reload check reads the *committed* bundle (a consumer trusts nothing else), and a committed
generation is never modified, so its result goes next to the bundle: ``<dest>/step-%08d.reload-check.json``
(see :mod:`trainproof.proof.reload`).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import io
import json
import logging
import os
import tempfile
import zipfile
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from trainproof.errors import ConfigError
from trainproof.format import history
from trainproof.format.contract import PLAN_FILE, absolute_url, read_run_plan
from trainproof.format.layout import sharded
from trainproof.format.state import STATE_FILE, History, decode, with_frozen
from trainproof.storage import COMPLETE, INCOMPLETE, CorruptGenerationError, GenerationStore
from trainproof.storage.backend import CHUNK
from trainproof.storage.digest import FileHasher, digest_bytes
from trainproof.storage.limits import loads_untrusted
from trainproof.storage.manifest import step_dir
from trainproof.storage.spool import Spool, SpoolWriter, spool_dir
from trainproof.tasks import Task, load_task, trusted_task
from trainproof.tasks.batches import evaluation_generators
from trainproof.train.fetch import spooled as resume_spooling

log = logging.getLogger("trainproof.export")
EXPORT_SCHEMA = "trainproof.export/1"
BF16_FILE, SUMS_FILE = "model_bf16.pt", "SHA256SUMS"
BF16_SAFETENSORS, FP_FILE = "model_bf16.safetensors", "model.safetensors"
BF16_RTOL = 2.0 ** -5
BF16_WHY = (
    "bfloat16 keeps 8 significant bits, so rounding moves each weight by at most u = 2^-8 (0.39%) of its value; "
    "to first order the metric moves by at most u * sum|dm/dw * w|, a few u for these small networks. "
    "We allow 8u = 2^-5 (3.1%) relative to the full-precision metric; the bf16 metric measured at export "
    "must also be reproduced exactly on reload (same bytes, same CPU kernels).")
EXACT_RTOL = 1e-12  # a re-evaluation of the same bytes on the CPU at the same thread count is bitwise


@dataclass(kw_only=True)
class Bundle:
    """A committed export bundle."""

    dest: GenerationStore
    step: int
    files: dict[str, str]
    """File name -> sha256 (from COMPLETE.json)."""
    export_bytes: int
    export_sha256: str
    reused: bool
    """True when an identical bundle of this step was already committed (nothing written)."""
    task: str
    """The task the bundle was built with (trusted: from the caller, compared with plan.json)."""

    @property
    def url(self) -> str:
        """Where the bundle is (absolute for a local folder)."""
        return f"{absolute_url(self.dest)}/{step_dir(self.step)}"

    def to_json(self) -> dict[str, Any]:
        """The export block of verification.json."""
        return {"location": self.url, "step": self.step, "files": self.files, "export_bytes": self.export_bytes,
                "export_sha256": self.export_sha256, "reused": self.reused}


def export(run: GenerationStore, *, step: int | None = None, dest: GenerationStore | None = None,
           task: str | None = None) -> Bundle:
    """Build the bundle of generation ``step`` (default: the newest usable one) and commit it under ``dest``.

    ``task``: the run's task as the caller knows it (``--task``); the name in plan.json is only compared with
    it, and without it only a built-in task is built (see :func:`trainproof.tasks.trusted_task`). Read-only towards
    the run's generations (nothing is quarantined or deleted). Raises ConfigError when there is nothing to
    export, the task is not given, or it cannot evaluate.
    """
    plan = read_run_plan(run)
    task_name = trusted_task(plan.get("task"), task, f"{PLAN_FILE} of {run.url}")
    loaded = _load_source(run, plan, step)
    try:
        return _export_loaded(run, plan, task_name, loaded, dest)
    finally:
        loaded.close()  # the spool file (the mapped state stays readable until it is dropped)


def _export_loaded(run: GenerationStore, plan: dict[str, Any], task_name: str, loaded: Any,
                   dest: GenerationStore | None) -> Bundle:
    state = with_frozen(decode(loaded.files[STATE_FILE]), loaded.files)  # mapped from the spools, not copied
    if sharded(state["meta"]):
        # A sharded run (--fsdp): the model gathered whole in this process from the verified shards; the optimizer
        # (two thirds of a model + Adam state) is never read: a bundle holds weights only.
        from trainproof.train.fsdp import complete_state  # only sharded runs import torch.distributed.checkpoint

        state = complete_state(run, loaded.info.step, state, contract=plan["contract"], optimizer=False)
    # Each generation holds only its own steps' history: the loss curve and the last row need the rows before it.
    model = state.pop("model")  # held by one dict only, which build_files may swap for a map of the written file
    assembled = history.from_store(run, state, contract=plan["contract"], partial=True)
    if assembled.stopped:
        log.warning("export of %s: the history covers steps %d..%d only (%s)", loaded.info.name, assembled.first,
                    assembled.step, assembled.stopped)
    state = {**assembled.state, "model": model}
    del model
    dest = dest or run.child("exports")
    source = {"run": run.url, "generation": loaded.info.name,
              "state_sha256": loaded.info.manifest["files"][STATE_FILE]["sha256"],
              "committed_at": loaded.info.manifest.get("created_at")}
    step = loaded.info.step
    existing, pending = _existing(dest, step, source, task_name)
    if existing is not None:
        return existing
    hf_files: dict[str, Any] = {}  # a transformers model's Hugging Face directory (trainproof.export.hf)
    adapter_files: dict[str, Any] = {}  # a peft model's adapter directory (then hf_files is the merged model)
    files = build_files(load_task(task_name, plan["task_config"]), plan, state, source, assembled.to_json(),
                        hf_out=hf_files, adapter_out=adapter_files)
    directories = _directories(hf_files, adapter_files)
    commit = {"contract": plan["contract"], "world": plan.get("world", 1),
              "code_version": state["meta"].get("code_version", "")}
    if pending is not None:  # without a key: reused only when every stored byte is what this state exports
        problem = _differs(dest, step, pending, files, directories)
        if problem is None:
            discard(files)
            discard(hf_files)
            return _bundle(dest, step, pending, reused=True, task=task_name)
        _quarantine_bundle(dest, step, source, problem)
    try:
        from trainproof.export.hf import commit_directory

        for folder, listed in directories.items():  # before the bundle, whose config.json lists their files
            commit_directory(dest, loaded.info.step, listed, check=check_file, digest=sha256_of, folder_name=folder,
                             **commit)
        info = dest.commit(loaded.info.step, files, check=check_file, digests={"export": BF16_FILE},
                           extra={"kind": "export", "source": source}, **commit)
    finally:
        discard(files)
        discard(hf_files)
    return _bundle(dest, info.step, info.manifest, reused=False, task=task_name)


def _directories(hf_files: dict[str, Any], adapter_files: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The Hugging Face directories of an export by folder (trainproof.export.hf): the model's (or a ``peft``
    model's merged one) and a ``peft`` model's adapter, those it has."""
    from trainproof.export.hf import ADAPTER_FOLDER, HF_FOLDER

    return {folder: listed for folder, listed in ((HF_FOLDER, hf_files), (ADAPTER_FOLDER, adapter_files)) if listed}


def _load_source(run: GenerationStore, plan: dict[str, Any], step: int | None):
    """The generation to export, downloaded into spool files (never whole in memory; ``trainproof.storage.spool``)."""
    def check(name: str, data: bytes | Spool) -> None:
        if name == STATE_FILE:
            decode(data)

    spooled = resume_spooling()  # as a resume reads it: shards are read by complete_state
    if step is not None:
        complete = sorted(g.step for g in run.scan(contract=plan["contract"]) if g.status == COMPLETE)
        if step not in complete:  # a usage error, not a damaged generation: say what can be exported
            raise ConfigError(f"--step {step}: {run.url} has no complete generation at step {step}; complete "
                              f"steps: {_steps_text(complete)}")
        return run.load(step, check, contract=plan["contract"], **spooled)
    loaded = run.load_latest(contract=plan["contract"], check=check, quarantine=False, **spooled)
    if loaded is None:
        raise ConfigError(f"{run.url} has no complete generation to export")
    return loaded


def _steps_text(steps: list[int]) -> str:
    return ", ".join(map(str, steps[-20:])) + (f" (and {len(steps) - 20} older)" if len(steps) > 20 else "") or "none"


def _existing(dest: GenerationStore, step: int, source: dict[str, Any],
              task: str) -> tuple[Bundle | None, dict[str, Any] | None]:
    """An already committed bundle of this step, reused only when it is this state's own: its files verify, its
    ``COMPLETE.json`` names this generation and state, its ``config.json`` parses as an object naming the same state,
    and, with a signing key, it is validly signed (discovery refuses it otherwise): then ``(bundle, None)``. Without
    a key nothing but its bytes can tell a planted bundle from ours, so one that passes these checks comes back as
    ``(None, manifest)``: the caller builds the export (it is deterministic) and reuses the stored one only when
    every file, the Hugging Face directory's too, is byte for byte what it built (:func:`_differs`). Any other bundle
    in the way is moved to the destination's quarantine (evidence kept, one warning) and rebuilt: ``(None, None)``."""
    info = dest.generation(step)
    if info.status == INCOMPLETE:
        return None, None  # no COMPLETE.json: the commit writes beside what is there
    problem = info.reason if info.status != COMPLETE else None
    loaded = None
    if problem is None:
        try:
            loaded = dest.load(step, skip=lambda name: name != "config.json")
            problem = _not_ours(loaded, source)
        except CorruptGenerationError as exc:
            problem = exc.reason
    manifest = loaded.info.manifest if loaded is not None else None
    if problem is None and manifest is not None:
        if dest.options.signing is not None:
            return _bundle(dest, step, manifest, reused=True, task=task), None
        return None, manifest
    _quarantine_bundle(dest, step, source, problem or "unreadable")
    return None, None


def _quarantine_bundle(dest: GenerationStore, step: int, source: dict[str, Any], problem: str) -> None:
    log.warning("%s/%s holds a bundle that is not this state's export (%s): moving it to quarantine and "
                "building the export again", dest.url, step_dir(step), problem)
    dest.quarantine(step, f"not the export of {source['generation']}: {problem}")


def _not_ours(loaded: Any, source: dict[str, Any]) -> str | None:
    """Why a verified bundle does not even claim to be the export of ``source`` (None when it does)."""
    extra = loaded.info.manifest.get("extra") or {}
    theirs = extra.get("source") if isinstance(extra, dict) else None
    if not isinstance(theirs, dict) or extra.get("kind") != "export" or any(
            theirs.get(k) != source[k] for k in ("generation", "state_sha256")):
        return "its COMPLETE.json names another source"
    try:
        raw = loaded.files["config.json"]
        config = loads_untrusted(raw, what="config.json", max_bytes=len(raw))
    except (KeyError, ValueError) as exc:
        return f"config.json is unreadable ({type(exc).__name__})"
    if not isinstance(config, dict) or not isinstance(config.get("source"), dict) \
            or config["source"].get("state_sha256") != source["state_sha256"]:
        return "its config.json names another state"
    return None


def _differs(dest: GenerationStore, step: int, manifest: dict[str, Any], files: dict[str, Any],
             directories: dict[str, dict[str, Any]]) -> str | None:
    """Why the stored bundle (``manifest``, and its Hugging Face directory) is not byte for byte the ``files`` this
    state exports (None when it is). Digests are compared as the store computes them, then every stored byte is
    read back against its manifest: a file the export does not write, or one that differs, is a reason."""
    listed = manifest.get("files")
    stored: dict[str, Any] = listed if isinstance(listed, dict) else {}
    if set(stored) != set(files):
        extra, missing = sorted(set(stored) - set(files))[:3], sorted(set(files) - set(stored))[:3]
        return f"its files are not the export's (extra {extra}, missing {missing})"
    for name, data in files.items():
        ours = str(data.sha256) if isinstance(data, Spool) else str(digest_bytes(data))
        entry = stored[name]
        if not isinstance(entry, dict) or entry.get("sha256") != ours:
            return f"its {name} is not this state's"
    problem = dest.verify(step)
    if problem is not None:
        return problem
    from trainproof.export.hf import same_directory

    for folder, listed in directories.items():
        if not same_directory(dest.child(folder), step, {n: sha256_of(d) for n, d in listed.items()}, sha256_of):
            return f"its Hugging Face directory {folder}/ is not this state's"
    return None


def _bundle(dest: GenerationStore, step: int, manifest: dict[str, Any], *, reused: bool, task: str) -> Bundle:
    return Bundle(dest=dest, step=step, files={n: m["sha256"] for n, m in manifest["files"].items()},
                  export_bytes=manifest["export_bytes"], export_sha256=manifest["export_sha256"], reused=reused,
                  task=task)


# -- the files --------------------------------------------------------------------------------------------
def build_files(task: Task, plan: dict[str, Any], state: dict[str, Any], source: dict[str, Any],
                history_covered: dict[str, Any] | None = None, *, directory: str | None = None,
                hf_out: dict[str, Any] | None = None, adapter_out: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every file of the bundle (SHA256SUMS last, over the others): the three weight files as spool files
    (``trainproof.storage.spool.Spool``, in ``directory``, default ``spool_dir()``), the rest as bytes. The caller hands
    them to the store and deletes the spools (:func:`discard`); on an error here they are deleted already.

    Memory: the weight files are written tensor by tensor (``trainproof.export.tensorfile``; the bf16 cast one tensor at
    a
    time). Once ``model.safetensors`` is written, ``state["model"]`` is replaced by a map of that file (``mmap``):
    the weights the caller gathered can then be freed, and every later reader (the evaluations, ``model_bf16.pt``,
    ``model.pt2``) reads the file's pages. The bf16 weights are mapped from their file the same way. What stays in
    anonymous memory is one model built to evaluate (or trace) them at a time.

    ``history_covered``: which steps ``state``'s history holds (trainproof.format.history ``Assembled.to_json``),
    recorded in metrics.json; retention may have deleted the generations holding the oldest rows.

    ``hf_out``: when given and the task's model is a ``transformers`` model, filled with the files of its Hugging
    Face directory (trainproof.export.hf, spooled weights among them: the caller commits and discards them too), which
    config.json and metrics.json then describe (``hf``). ``adapter_out``: for a ``peft`` model, filled with its
    adapter directory (``hf_adapter`` in config.json and metrics.json; ``hf_out`` then holds the merged model)."""
    from trainproof.export.bundle_readme import readme
    from trainproof.export.plot import loss_png
    from trainproof.export.standalone import (
        EVAL_DATA_FILE,
        MODEL_FILE,
        PROGRAM_FILE,
        PROGRAM_INPUTS_FILE,
        export_program,
        standalone,
    )
    from trainproof.export.tensorfile import map_safetensors, write_safetensors

    weights = {k: v.detach().cpu().contiguous() for k, v in state["model"].items()}  # no copy of host weights
    files: dict[str, Any] = {}
    sums: dict[str, str] = {}
    try:
        files[FP_FILE], sums[FP_FILE] = _spooled(lambda out: write_safetensors(out, weights), directory)
        # From here on the weights are read from that file's pages (page cache, which the kernel can drop), so the
        # tensors the caller gathered (a sharded run's model, in anonymous memory) can be freed.
        mapped = map_safetensors(files[FP_FILE].path)
        state["model"] = weights = {k: mapped[k] for k in weights}
        _give_back_freed_memory()
        files[BF16_SAFETENSORS], sums[BF16_SAFETENSORS] = _spooled(
            lambda out: write_safetensors(out, weights, cast=_bf16), directory)
        mapped = map_safetensors(files[BF16_SAFETENSORS].path)
        bf16 = {k: mapped[k] for k in weights}  # the file's order is the library's; the state_dict's order is kept
        files[BF16_FILE], sums[BF16_FILE] = _spooled(lambda out: torch.save(bf16, out), directory)
        metric, others, threads = evaluate_weights(task, weights)
        metric_bf16, others_bf16, _ = evaluate_weights(task, bf16)
        from trainproof.export import hf as hf_export

        hf, hf_refused = _hf_directory(task, weights, directory, threads) if hf_out is not None else (None, "")
        if hf is not None and hf_out is not None:
            hf_out.update(hf.files)
            if adapter_out is not None:
                adapter_out.update(hf.adapter or {})
        hf_config, hf_metrics = hf_export.records(hf, step_of(state), metric) if hf is not None else ({}, {})
        adapter_config, adapter_metrics = hf_export.adapter_records(hf, step_of(state), metric) \
            if hf is not None and adapter_out is not None else ({}, {})
        alone = standalone(plan["task"], task)
        # torch.export costs seconds (10+ on first use) on every export, verify included: only where no model.py
        # can rebuild the architecture does the bundle need a program to be loadable without the task's code.
        program, example, program_note = (None, {}, "not needed: model.py rebuilds it") if alone else \
            (None, {}, "not needed: the Hugging Face directory rebuilds it") if hf is not None else \
            export_program(task, weights)
        rows = History.from_state_dict(state["history"])
        covered = history_covered or {"first_step": state["history_chain"]["first"],
                                      "last_step": state["progress"]["step"]}
        title = f"{plan['task']}: training loss" + ("" if covered["first_step"] == 1 else
                                                    f" (steps {covered['first_step']}..{covered['last_step']}: older "
                                                    "generations are no longer kept)")
        plot = loss_png(rows.column("step"), rows.column("loss"), title)
        files.update({
            "config.json": _json({**_config(task, plan, state, source, FP_FILE),
                                  "model_args": alone.model_args if alone else {},
                                  "standalone": {"model_py": alone is not None, "program": program_note},
                                  **({"hf": hf_config} if hf_config else {}),
                                  **({"hf_adapter": adapter_config} if adapter_config else {}),
                                  **({"hf_refused": hf_refused} if hf_refused else {})}),
            "metrics.json": _json({**_metrics(task, plan, state, (metric, others), (metric_bf16, others_bf16),
                                            threads), "history": covered,
                                   **({"hf": hf_metrics} if hf_metrics else {}),
                                   **({"hf_adapter": adapter_metrics} if adapter_metrics else {})}),
            "data.json": _json(_data(task, plan, state)),
            "README.md": readme(metric_name=task.eval_metric, metric=metric, others=others, fp_name=FP_FILE,
                                bf16_names=[BF16_SAFETENSORS, BF16_FILE], has_model_py=alone is not None,
                                program_note=program_note, has_plot=plot is not None,
                                hf_folder=hf_config.get("folder"), hf_eval=bool(hf and hf.eval_data)).encode(),
        })
        if hf is not None and hf.eval_data is not None:
            files[hf_export.HF_EVAL_FILE] = hf_export.HF_EVAL.encode()
            files[hf_export.HF_EVAL_DATA_FILE] = _safetensors_bytes(hf.eval_data)
        if alone is not None:
            files[MODEL_FILE], files[EVAL_DATA_FILE] = alone.source.encode(), _safetensors_bytes(alone.eval_data)
        if program is not None:  # saved straight into a spool: the program holds the weights
            files[PROGRAM_FILE], sums[PROGRAM_FILE] = _program_spool(program, directory)
            files[PROGRAM_INPUTS_FILE] = _safetensors_bytes(example)
            del program
        if plot is not None:
            files["loss.png"] = plot
        files[SUMS_FILE] = "".join(f"{sums.get(name) or sha256_of(data)}  {name}\n"
                                   for name, data in sorted(files.items())).encode()
    except BaseException:
        discard(files)
        discard(hf_out or {})
        raise
    return files


def _hf_directory(task: Task, weights: dict[str, torch.Tensor], directory: str | None,
                  threads: int) -> tuple[Any, str]:
    """The Hugging Face directory of a ``transformers`` model (trainproof.export.hf; None for another model), and
    why it is left out when its files would hold custom code or a file save_pretrained does not write ('' else):
    the rest of the bundle is exported as for any model."""
    from trainproof.export import hf as hf_export

    try:
        return hf_export.directory(task, weights, lambda write: _spooled(write, directory), threads), ""
    except hf_export.Refused as exc:
        why = " ".join(str(exc).split())
        log.warning("export: no Hugging Face directory: %s", why)
        return None, why


def step_of(state: dict[str, Any]) -> int:
    """The step a state was taken at."""
    return int(state["progress"]["step"])


def discard(files: dict[str, Any]) -> None:
    """Delete the spool files among ``files`` (from :func:`build_files`)."""
    for data in files.values():
        if isinstance(data, Spool):
            data.unlink()


def _give_back_freed_memory() -> None:
    """Ask glibc to return freed heap memory to the system: tensors of a few MiB come from its heap, whose free
    space it keeps for the process otherwise (so a freed gathered model would still count against a container's
    limit). No-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _bf16(tensor: torch.Tensor) -> torch.Tensor:
    """The bundle's bf16 weights: floating tensors in bfloat16, integer buffers as they are."""
    return tensor.to(torch.bfloat16) if tensor.is_floating_point() else tensor


class _Summed:
    """A binary file object that writes to a spool and keeps the plain sha256 of what it wrote (SHA256SUMS)."""

    def __init__(self, writer: SpoolWriter) -> None:
        self.writer, self.sha = writer, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.writer.write(data)

    def flush(self) -> None:
        pass


def _spooled(write: Callable[[Any], Any], directory: str | None) -> tuple[Spool, str]:
    """A spool file filled by ``write(out)``, and its plain sha256."""
    with SpoolWriter(directory, prefix="trainproof-export-") as writer:
        out = _Summed(writer)
        write(out)
    return writer.finish(), out.sha.hexdigest()


def _program_spool(program: Any, directory: str | None) -> tuple[Spool, str]:
    """``model.pt2`` saved by ``torch.export.save`` into a file of the spool folder (it wants a ``.pt2`` path or a
    seekable buffer, and a buffer would hold the weights in memory), then hashed from there like a spool."""
    fd, path = tempfile.mkstemp(prefix="trainproof-export-", suffix=".pt2", dir=spool_dir(directory))
    os.close(fd)
    try:
        torch.export.save(program, path)
        with open(path, "rb") as fh:
            sha, plain = FileHasher(), hashlib.sha256()
            for chunk in iter(lambda: fh.read(CHUNK), b""):
                sha.update(chunk)
                plain.update(chunk)
            return Spool(path=path, size=fh.tell(), sha256=sha.hexdigest()), plain.hexdigest()
    except BaseException:
        os.unlink(path)
        raise


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save(tensors)


def _config(task: Task, plan: dict, state: dict, source: dict, fp_name: str) -> dict[str, Any]:
    meta = state["meta"]
    return {
        "schema": EXPORT_SCHEMA, "task": plan["task"], "task_config": plan["task_config"],
        "dtype": str(task.dtype).removeprefix("torch."), "seed": plan["seed"], "objective": plan["objective"],
        "contract": plan["contract"], "step": state["progress"]["step"], "code_version": meta.get("code_version"),
        "versions": meta.get("versions"), "trained_on": meta.get("device"), "amp": meta.get("amp"),
        "autocast": meta.get("autocast"),
        "weights": {"bf16": BF16_FILE, "bf16_safetensors": BF16_SAFETENSORS, "full_precision": fp_name},
        "source": source,  # with the source generation's commit time: the bundle is a function of the state alone
    }


def _metrics(task: Task, plan: dict, state: dict, full: tuple[float, dict[str, float]],
             bf16: tuple[float, dict[str, float]], threads: int) -> dict[str, Any]:
    """metrics.json; ``full``/``bf16``: the evaluation metric and the task's other metrics of each weights file."""
    (metric, others), (metric_bf16, others_bf16) = full, bf16
    rows, progress = History.from_state_dict(state["history"]), state["progress"]
    last = rows.row(-1) if len(rows) else {}
    return {
        "step": progress["step"], "epoch": progress["epoch"], "final_loss": last.get("loss"),
        "final_lr": last.get("lr"), "next_lr": progress.get("next_lr"), "samples_seen": progress["samples_seen"],
        "targets_seen": progress["targets_seen"],
        "target_unit": "tokens" if plan["objective"].startswith("global_token_mean") else "targets",
        "eval": {"metric": task.eval_metric, "value": metric, "value_bf16": metric_bf16, "device": "cpu",
                 "threads": threads, "dtype": str(task.dtype).removeprefix("torch."),
                 "others": others, "others_bf16": others_bf16},
        "bf16_tolerance": {"rtol": BF16_RTOL, "why": BF16_WHY},
    }


def _data(task: Task, plan: dict, state: dict) -> dict[str, Any]:
    data = state["ranks"][0].get("data") or {}
    epoch_plan = state["meta"].get("epoch_plan")  # what the run trained on (a verification: a subset of the samples)
    samples = epoch_plan.get("samples") if isinstance(epoch_plan, dict) else None
    return {"data_identity": plan["data_identity"], "contract": plan["contract"],
            "num_samples": samples if isinstance(samples, int) else task.num_samples(),
            "epoch_plan": state["meta"].get("epoch_plan"), "epoch": data.get("epoch"), "cursor": data.get("cursor"),
            "samples_seen": state["progress"]["samples_seen"], "targets_seen": state["progress"]["targets_seen"]}


# -- helpers shared with the reload check ---------------------------------------------------------------
def evaluate_weights(task: Task, weights: dict[str, torch.Tensor]) -> tuple[float, dict[str, float], int]:
    """``task.evaluate_metrics`` of a freshly built CPU model holding ``weights`` (cast to the task's dtype).

    Returns (the ``eval_metric``, the task's other metrics by name, CPU threads used). The thread count is the
    task's (one for the built-ins), so the same bytes give the same metrics in any process. The model is built and
    evaluated with the global generators seeded from a constant (trainproof.tasks.batches.evaluation_generators) and
    put back afterwards: an evaluation that draws (a training collate reused for the held-out data) draws the same
    numbers in the export and in its reload check, and takes nothing from the training's generators.
    """
    with _cpu_threads(task.cpu_threads) as threads, evaluation_generators():
        model = task.build_model().to(dtype=task.dtype)
        model.load_state_dict(weights)  # each tensor copied (and cast) into the model's own: no converted copy
        try:
            values = task.evaluate_metrics(model)
        except NotImplementedError as exc:
            raise ConfigError(f"cannot export: {exc} (the bundle's metric needs it)") from None
    if not isinstance(values, dict) or task.eval_metric not in values:
        raise ConfigError(f"cannot export: evaluate_metrics must return a dict holding eval_metric "
                          f"{task.eval_metric!r} (got {type(values).__name__})")
    others = {str(k): float(v) for k, v in values.items() if k != task.eval_metric}
    return float(values[task.eval_metric]), others, threads


@contextlib.contextmanager
def _cpu_threads(threads: int | None) -> Iterator[int]:
    saved = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield torch.get_num_threads()
    finally:
        torch.set_num_threads(saved)


def check_file(name: str, data: Any) -> None:
    """Content check run by the store on every file read back before COMPLETE.json is written. ``data``: the
    file's bytes, or a spool file (``trainproof.storage.spool.Spool``) holding them: a weights file is then mapped
    (``mmap``), and a safetensors file's tensors are read one at a time, so the check holds no second copy of the
    weights."""
    path = data.path if isinstance(data, Spool) else None
    if name.endswith(".pt"):
        source = path if path else io.BytesIO(data)
        weights = torch.load(source, map_location="cpu", weights_only=True, mmap=path is not None)
        if not isinstance(weights, dict) or not all(isinstance(v, torch.Tensor) for v in weights.values()):
            raise ValueError(f"{name} is not a plain state_dict of tensors")
    elif name.endswith(".safetensors"):
        from safetensors import safe_open
        from safetensors.torch import load

        if path is None:
            load(data)
            return
        with safe_open(path, framework="pt") as tensors:
            for key in tensors.keys():
                tensors.get_tensor(key)  # each read (and checked against its header) and dropped
    elif name.endswith(".json"):
        json.loads(data)
    elif name.endswith(".pt2") and not zipfile.is_zipfile(path or io.BytesIO(data)):
        raise ValueError(f"{name} is not a torch.export archive")


def _json(value: Any) -> bytes:
    return (json.dumps(value, indent=2, sort_keys=True) + "\n").encode()


def sha256_of(data: Any) -> str:
    """The plain sha256 (as in SHA256SUMS) of bytes or of a spool file, read a chunk at a time."""
    sha = hashlib.sha256()
    if not isinstance(data, Spool):
        sha.update(data)
        return sha.hexdigest()
    with data.open() as fh:
        for chunk in iter(lambda: fh.read(CHUNK), b""):
            sha.update(chunk)
    return sha.hexdigest()
