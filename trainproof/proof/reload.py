"""The export bundle's reload check: a fresh process reads the committed bundle from its destination,
rebuilds the model from ``config.json`` alone and re-runs the evaluation.

Identical checksums prove the copy; only a reload proves the content is enough to rebuild the work
(docs/protocol.md). Three comparisons, each with its tolerance recorded:

- full-precision weights reproduce the recorded metric (same bytes, same CPU kernels and thread count: exact
  up to ``EXACT_RTOL``);
- bf16 weights reproduce the bf16 metric recorded at export (likewise exact);
- bf16 weights stay within ``BF16_RTOL`` of the full-precision metric (why: ``trainproof.export.bundle.BF16_WHY``).

The result is written next to the bundle (``step-%08d.reload-check.json``), never into it: a committed
generation is immutable, and the check must read what a consumer reads, i.e. the committed bundle.

:func:`export_and_check` is the one sequence export -> fresh-process check -> record that ``trainproof export``,
the verifier, a deadline's finishing export and ``plan --measure`` all run; each maps its errors its own way.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Callable

import torch

from trainproof.errors import ConfigError
from trainproof.export.bundle import (
    BF16_FILE,
    BF16_RTOL,
    EXACT_RTOL,
    SUMS_FILE,
    Bundle,
    evaluate_weights,
    export,
    sha256_of,
)
from trainproof.format.state import StateError, load_weights_only
from trainproof.proof.paths import VerificationIncomplete, absolute_url, job_argv, run_processes
from trainproof.storage import GenerationStore
from trainproof.storage.limits import loads_untrusted
from trainproof.storage.manifest import step_dir
from trainproof.storage.spool import Spool, spool_dir
from trainproof.tasks import load_task, trusted_task

log = logging.getLogger("trainproof.export")
RELOAD_SCHEMA = "trainproof.reload_check/1"
MAX_RECORD_BYTES = 1 << 20
"""config.json and metrics.json of a bundle are a few KiB; larger ones are not ours."""
SPOOL_FROM = 1 << 20
"""Bundle files of this many bytes or more (the weights of any real model) are read back into local spool files
(``TRAINPROOF_SPOOL_DIR``) and mapped, not held in memory."""


def record_name(step: int) -> str:
    """Run-level file, next to the bundle, holding its reload check."""
    return f"{step_dir(step)}.reload-check.json"


def reload_check(dest: GenerationStore, step: int, *, task: str) -> dict[str, Any]:
    """Run the check in *this* process (the hidden ``reload-check`` command); return the record.

    ``task`` comes from the process that made the bundle; the bundle's ``config.json`` is compared with it,
    never obeyed (see :func:`trainproof.tasks.trusted_task`).
    """
    # Size and sha256 of every file against COMPLETE.json, read from the store; the weight files into local spool
    # files that are mapped, not read into memory (a bundle of a large model), the small records as bytes.
    loaded = dest.load(step, spool_dir=spool_dir(), spool_from=SPOOL_FROM)
    try:
        return _check(dest, step, loaded.files, task)
    finally:
        loaded.close()


def _check(dest: GenerationStore, step: int, files: dict[str, Any], task: str) -> dict[str, Any]:
    where = f"{dest.url}/{step_dir(step)}"
    try:
        sums = _record(files[SUMS_FILE], SUMS_FILE)
        config = loads_untrusted(_record(files["config.json"], "config.json"), what="config.json",
                                 max_bytes=MAX_RECORD_BYTES)
        metrics = loads_untrusted(_record(files["metrics.json"], "metrics.json"), what="metrics.json",
                                  max_bytes=MAX_RECORD_BYTES)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{where} is not a readable bundle: {exc}") from None
    if not isinstance(config, dict) or not isinstance(metrics, dict) or not isinstance(config.get("task_config"), dict):
        raise ConfigError(f"{where}: config.json or metrics.json is not a bundle record")
    built = load_task(trusted_task(config.get("task"), task, f"config.json of {where}"), config["task_config"])
    full = _weights(files, (config.get("weights") or {}).get("full_precision"), where)
    bf16 = _weights(files, BF16_FILE, where)
    not_bf16 = sorted(k for k, v in bf16.items() if v.is_floating_point() and v.dtype != torch.bfloat16)
    fp_metric, fp_others, threads = evaluate_weights(built, full)
    bf16_metric, bf16_others, _ = evaluate_weights(built, bf16)
    recorded = metrics["eval"]
    checks = {
        "full_precision_reproduced": _close(recorded["value"], fp_metric, EXACT_RTOL),
        "bf16_reproduced": _close(recorded["value_bf16"], bf16_metric, EXACT_RTOL),
        "bf16_within_tolerance": _close(recorded["value"], bf16_metric, BF16_RTOL),
        "other_metrics_reproduced": _others_close(recorded, fp_others, bf16_others),
        "sha256sums": {"passed": _sums_ok(files, sums)},
        "bf16_dtype": {"passed": not not_bf16, **({"not_bf16": not_bf16[:5]} if not_bf16 else {})},
    }
    # A transformers model's Hugging Face directory, loaded without trainproof (trainproof.proof.hf_reload).
    if "hf" in config:
        from trainproof.proof import hf_reload

        checks["hf_from_pretrained"] = hf_reload.check(dest, step, files, config, metrics)
    if "hf_adapter" in config:  # a peft model's adapter, over its base, without trainproof
        from trainproof.proof import hf_reload

        checks["hf_adapter_from_pretrained"] = hf_reload.check_adapter(dest, step, files, config, metrics)
    return {
        "schema": RELOAD_SCHEMA, "bundle": f"{dest.url.rstrip('/')}/{step_dir(step)}", "step": step,
        "pid": os.getpid(), "files_verified_against": "COMPLETE.json (size and sha256 of every file)",
        "metric": recorded["metric"], "recorded": recorded["value"], "recorded_bf16": recorded["value_bf16"],
        "reloaded_full_precision": fp_metric, "reloaded_bf16": bf16_metric, "threads": threads,
        "others": {name: {"recorded": _number(recorded.get("others"), name), "reloaded": value}
                   for name, value in fp_others.items()},
        "checks": checks, "passed": all(c["passed"] for c in checks.values()),
        "checked_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
    }


def _others_close(recorded: dict[str, Any], full: dict[str, float], bf16: dict[str, float]) -> dict[str, Any]:
    """The task's other metrics (``eval_metrics``: accuracy, ...) reproduced exactly from both weights files, and
    the same names recorded as reloaded (a recorded metric the task no longer computes, or one it computes that
    the bundle lacks, fails)."""
    failed = []
    for key, reloaded in (("others", full), ("others_bf16", bf16)):
        saved = recorded.get(key, {})
        saved = saved if isinstance(saved, dict) else {}
        if set(saved) != set(reloaded):
            failed.append(f"{key}: recorded {sorted(map(str, saved))[:8]}, reloaded {sorted(reloaded)[:8]}")
            continue
        for name, value in reloaded.items():
            was = _number(saved, name)
            if was is None or not _close(was, value, EXACT_RTOL)["passed"]:
                failed.append(f"{key}.{name}")
    return {"passed": not failed, "metrics": sorted(full), **({"failed": failed[:8]} if failed else {})}


def _number(record: Any, name: str) -> float | None:
    """A recorded metric's value, or None when the record holds no number by that name."""
    value = record.get(name) if isinstance(record, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _weights(files: dict[str, Any], name: Any, where: str) -> dict[str, torch.Tensor]:
    """A weights file of the bundle: a spooled one mapped (its pages read as the evaluation uses them), a small one
    from its bytes; torch archives weights-only after the archive check (no zip bomb reaches torch.load).
    ConfigError naming the file when it is missing or not what its name says."""
    if not isinstance(name, str) or name not in files:
        raise ConfigError(f"{where}: the weights file {name!r} named by config.json is not in the bundle")
    data = files[name]
    try:
        if name.endswith(".safetensors"):
            if isinstance(data, Spool):
                from trainproof.export.tensorfile import map_safetensors

                return map_safetensors(data.path, name=name)
            from safetensors.torch import load

            return load(data)
        return load_weights_only(data)
    except (ValueError, StateError) as exc:
        raise ConfigError(f"{where}: {name} cannot be read: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - safetensors' own parse errors have their own class
        raise ConfigError(f"{where}: {name} cannot be read: {type(exc).__name__}: {exc}") from None


def _close(recorded: float, reloaded: float, rtol: float) -> dict[str, Any]:
    diff = abs(reloaded - recorded)
    return {"abs_diff": diff, "rtol": rtol, "passed": diff <= rtol * max(abs(recorded), 1e-30)}


def _record(data: Any, name: str) -> bytes:
    """A small record of the bundle as bytes (read from its spool file when it was spooled), at most
    ``MAX_RECORD_BYTES``."""
    if not isinstance(data, Spool):
        return data
    if data.size > MAX_RECORD_BYTES:
        raise ValueError(f"{name} is {data.size} bytes, more than a bundle record ({MAX_RECORD_BYTES})")
    with data.open() as fh:
        return fh.read(MAX_RECORD_BYTES + 1)


def _sums_ok(files: dict[str, Any], sums: bytes) -> bool:
    listed = {}
    for line in sums.decode(errors="replace").splitlines():
        digest, _, name = line.partition("  ")
        listed[name] = digest
    others = {n for n in files if n != SUMS_FILE}
    return set(listed) == others and all(sha256_of(files[n]) == listed[n] for n in others)


def check_in_fresh_process(dest_url: str, step: int, *, task: str, store_args: list[str],
                           timeout: float) -> dict[str, Any]:
    """Run :func:`reload_check` in a new ``python -m trainproof reload-check`` process; return its record.

    Raises VerificationIncomplete when the process printed no record (it crashed or could not read the store).
    """
    argv = job_argv("reload-check", "--bundle", dest_url, "--step", str(step), "--task", task, *store_args)
    result = run_processes([("reload-check", dest_url, argv)], timeout=timeout)[0]
    records = [e for e in result.events if e.get("schema") == RELOAD_SCHEMA]
    if not records:
        raise VerificationIncomplete(f"the reload check of {dest_url}/{step_dir(step)} printed no result "
                                     f"(exit {result.code}): {shlex.join(argv)}\n{result.stderr_tail}")
    return {**records[-1], "command": shlex.join(argv), "exit_code": result.code}


def write_record(dest: GenerationStore, step: int, record: dict[str, Any]) -> str:
    """Upload the record next to the bundle; return its URL (a later check of the same bundle replaces it)."""
    name = record_name(step)
    dest.write_file(name, (json.dumps(record, indent=2, sort_keys=True) + "\n").encode())
    return f"{dest.url.rstrip('/')}/{name}"


@dataclass(frozen=True)
class Checked:
    """An export bundle and the record of its reload check in a fresh process."""

    bundle: Bundle
    record: dict[str, Any]
    """What the check printed (:func:`reload_check`), with its command line and exit code."""
    location: str | None
    """Where the record was written next to the bundle; None when the caller did not keep it."""

    @property
    def passed(self) -> bool:
        """Every comparison of the reload check passed."""
        return bool(self.record["passed"])

    def to_json(self) -> dict[str, Any]:
        """The ``export`` block of verification.json."""
        return {**self.bundle.to_json(), "reload_check": self.record, "reload_check_location": self.location}


def export_and_check(run: GenerationStore, *, task: str | None, store_args: list[str], timeout: float,
                     step: int | None = None, dest: GenerationStore | None = None, ends_at: float | None = None,
                     exported: Callable[[Bundle], None] | None = None, keep_record: bool = True) -> Checked:
    """Export generation ``step`` of ``run`` (default: the newest usable one) under ``dest`` (default
    ``<run>/exports``), reload it in a fresh ``reload-check`` process, and write the record next to the bundle.

    ``timeout``: seconds the reload check may run; ``ends_at`` (a ``time.monotonic()`` value) instead gives it what
    is left until then once the export is committed (at least a second): a deadline counts the export's own time.
    ``exported`` is told about the bundle as soon as it is committed, before the check (a command line says so
    while the check runs). ``keep_record=False`` writes nothing beside the bundle (a measurement's scratch run).

    A bundle found stored at its name and reused (not built by this process) whose check fails, or prints no record,
    is not the run's own: it is moved to quarantine (one warning) and the export built and checked once more, and
    only that one's result counts. A bundle this process built that fails is the result: rebuilding it gives the
    same bytes (the export is deterministic).
    Raises what :func:`trainproof.export.bundle.export` raises (ConfigError ...), VerificationIncomplete when the check
    printed no record, and StoreError/OSError from the store; a check that ran and failed is ``passed`` False.
    """
    bundle = export(run, step=step, dest=dest, task=task)
    check = lambda b: _check_bundle(b, store_args=store_args, timeout=timeout, ends_at=ends_at,  # noqa: E731
                                    exported=exported, keep_record=keep_record)
    if not bundle.reused:
        return check(bundle)
    try:
        record = check(bundle)
    except VerificationIncomplete as exc:
        why = " ".join(str(exc).split())[:300]
    else:
        if record.passed:
            return record
        why = f"its reload check failed ({_failed(record.record)})"
    log.warning("%s/%s: the stored bundle this export reused is not the run's own (%s): moving it to quarantine and "
                "building the export again", bundle.dest.url, step_dir(bundle.step), why)
    bundle.dest.quarantine(bundle.step, f"a stored bundle reused by the export: {why}")
    return check(export(run, step=bundle.step, dest=bundle.dest, task=bundle.task))


def _check_bundle(bundle: Bundle, *, store_args: list[str], timeout: float, ends_at: float | None,
                  exported: Callable[[Bundle], None] | None, keep_record: bool) -> Checked:
    """The reload check of a committed (or reused) bundle in a fresh process; its record written when kept and
    passed, or when the bundle is this process's own (a failing reused one is moved aside by the caller)."""
    if exported is not None:
        exported(bundle)
    if ends_at is not None:
        timeout = max(ends_at - time.monotonic(), 1.0)
    record = check_in_fresh_process(absolute_url(bundle.dest), bundle.step, task=bundle.task, store_args=store_args,
                                    timeout=timeout)
    keep = keep_record and (bool(record["passed"]) or not bundle.reused)
    location = write_record(bundle.dest, bundle.step, record) if keep else None
    return Checked(bundle, record, location)


def _failed(record: dict[str, Any]) -> str:
    """The failing checks of a reload-check record, by name (what an hf check says why, too)."""
    checks = record.get("checks")
    checks = checks if isinstance(checks, dict) else {}
    names = [n for n, c in checks.items() if not (isinstance(c, dict) and c.get("passed"))]
    failed_hf = [c for n, c in checks.items() if n.startswith("hf_") and isinstance(c, dict) and not c.get("passed")]
    hf = failed_hf[0] if failed_hf else None
    why = hf.get("why") or hf.get("error") if hf is not None else None
    return ", ".join(names[:6]) + (f": {' '.join(str(why).split())[:300]}" if why else "") or "no check passed"
