"""Where a run computes and how deterministically: the device a rank trains on and the determinism switches.

Set once, before the model is built (:func:`resolve_device`, then :func:`configure_determinism`): the
cuBLAS workspace setting must precede the first cuBLAS call, and a task's fixed CPU thread count must be in
force before its first kernel, or two processes of one run would add in other orders.
"""

from __future__ import annotations

import os
import sys

import torch

from trainproof.errors import ConfigError
from trainproof.tasks import Task
from trainproof.train.dist import DistEnv


def resolve_device(choice: str, task: Task, env: DistEnv | None = None) -> torch.device:
    """``cpu``, ``cuda`` (refused when absent or unsupported by the task), or ``auto``.

    A distributed rank takes the GPU of its ``LOCAL_RANK``.
    """
    if choice == "cuda":
        if not task.supports_cuda:
            raise ConfigError("this task runs on the CPU only (its results are defined on the CPU)")
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda, but no CUDA device is visible")
    if choice == "cuda" or (choice == "auto" and task.supports_cuda and torch.cuda.is_available()):
        if env is not None and env.world > 1:
            if env.local_rank >= torch.cuda.device_count():
                raise ConfigError(f"LOCAL_RANK {env.local_rank} but only {torch.cuda.device_count()} GPU(s) "
                                  "are visible: start at most one rank per GPU on each node")
            torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def configure_determinism(task: Task, device: torch.device) -> None:
    """Deterministic kernels; a fixed CPU thread count when the task asks for one.

    Note: on CUDA some kernels (e.g. attention backward) have no deterministic implementation, so
    CUDA runs only warn; exact bitwise resume is claimed and tested on the CPU.
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # must precede the first cuBLAS call
        torch.backends.cudnn.benchmark = False
    elif task.cpu_threads:
        torch.set_num_threads(task.cpu_threads)
    use_deterministic_algorithms(warn_only=device.type == "cuda")


def use_deterministic_algorithms(*, warn_only: bool) -> None:
    """``torch.use_deterministic_algorithms(True)`` without its import of ``torch._inductor`` (which pulls in
    dynamo: 1.5 s of every process start on a small CPU, paid by every resume). The two things it does are done
    here: the kernels' flag, and inductor's ``deterministic`` setting — through its environment variable when
    inductor is not imported yet (it reads the variable on import), on the config when it is."""
    setter = getattr(torch._C, "_set_deterministic_algorithms", None)
    if setter is None:  # another torch: the public call
        torch.use_deterministic_algorithms(True, warn_only=warn_only)
        return
    config = sys.modules.get("torch._inductor.config")
    if config is not None:
        try:
            config.deterministic = True
        except AttributeError:  # a torch before 2.10: its inductor has no such setting (and its call sets none)
            pass
    else:
        os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1"
    setter(True, warn_only=warn_only)
