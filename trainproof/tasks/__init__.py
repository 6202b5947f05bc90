"""Tasks: what is trained. The built-ins and the loader for ``--task package.module:factory``.

Owns: the :class:`~trainproof.tasks.base.Task` interface (model, optimizer, scheduler, sample ids -> micro-batch,
summed loss, target count), what a worker is asked to build and the generators it may draw from
(``trainproof.tasks.batches``), the built-in ``regression`` and ``tinylm`` tasks, and loading a user's task.
May import only ``trainproof.errors``: a task knows nothing of the loop, checkpoints or storage.
"""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

from trainproof.errors import ConfigError
from trainproof.tasks.adapter import AdaptedBatch, DatasetTask, dataset_digest
from trainproof.tasks.base import (
    PRECISIONS,
    Pretrained,
    Task,
    TaskContext,
    config_from_dict,
    eval_mode,
    peft_base_name,
    require,
    sha256_of,
)
from trainproof.tasks.batches import BatchRequest, sample_generators, sample_rng

BUILTIN_TASKS = {
    "regression": "trainproof.tasks.regression:make_task",
    "tinylm": "trainproof.tasks.tinylm:make_task",
}

__all__ = [
    "BUILTIN_TASKS", "PRECISIONS", "AdaptedBatch", "BatchRequest", "ConfigError", "DatasetTask", "Pretrained", "Task",
    "TaskContext", "config_from_dict", "dataset_digest", "eval_mode", "load_task", "peft_base_name", "require",
    "sample_generators", "sample_rng", "sha256_of",
]


def trusted_task(stored: Any, given: str | None, where: str) -> str:
    """The task to build for a run whose stored record ``where`` (plan.json, an export's config.json) names
    ``stored``. A stored file is compared, never obeyed: anyone who can write to the bucket can write it, and
    importing the module it names would run their code with this process's credentials.

    ``given`` (``--task``/``TRAINPROOF_TASK``, trusted) must equal the record; without it only a built-in task
    name is accepted. Raises ConfigError (exit 2) naming both otherwise.
    """
    shown = printable(stored)
    if given is not None:
        if given != stored:
            raise ConfigError(f"--task {given!r} but {where} records task {shown}: pass the run's own task, "
                              "or use another --store")
        return given
    if isinstance(stored, str) and stored in BUILTIN_TASKS:
        return stored
    raise ConfigError(f"{where} records task {shown}, which is not a built-in task: trainproof never imports code "
                      f"named by a stored file; if that is your task, pass --task {shown} yourself")


def printable(value: Any, limit: int = 120) -> str:
    """``repr`` of a value read from trainproof.storage, cut to ``limit`` characters and free of control characters."""
    text = repr(value)
    text = "".join(c if c.isprintable() else "?" for c in text)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def load_task(spec: str, config: dict[str, Any] | None = None) -> Task:
    """Build the task named by ``spec`` (a built-in name or ``package.module:factory``).

    ``factory(config: dict) -> Task`` receives the overrides from ``--config``.
    """
    target = BUILTIN_TASKS.get(spec, spec)
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ConfigError(
            f"unknown task {spec!r}: use one of {sorted(BUILTIN_TASKS)} or 'package.module:factory'"
        )
    if spec not in BUILTIN_TASKS and os.getcwd() not in sys.path and "" not in sys.path:
        # `trainproof` (a console script) does not put the working directory on the import path the way
        # `python -m` does: a user's `--task mymodule:factory` next to them must import either way.
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(f"task {spec!r}: cannot import {module_name!r}: {_import_hint(module_name, exc)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise ConfigError(f"task {spec!r}: {module_name} has no callable {attr!r}")
    task = factory(dict(config or {}))
    if not isinstance(task, Task):
        raise ConfigError(f"task {spec!r}: factory returned {type(task).__name__}, not a trainproof.tasks.Task")
    return task


def _import_hint(module_name: str, exc: ImportError) -> str:
    """Why a task module did not import, and where modules are looked for when it is the task's own module."""
    missing = getattr(exc, "name", None)
    parts = module_name.split(".")
    if missing and missing in (".".join(parts[:i]) for i in range(1, len(parts) + 1)):
        return (f"no module {missing!r} in the working directory ({os.getcwd()}) or the installed packages: run "
                f"from the folder that holds {parts[0]}/ or {parts[0]}.py, or add that folder to PYTHONPATH")
    if missing:
        return f"it imports {missing!r}, which is not installed here: pip install it (or fix that import)"
    return str(exc)

