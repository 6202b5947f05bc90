"""Shared helpers for the distributed tests (no tests here).

Real worlds: ``python -m trainproof train --nproc-per-node W`` (trainproof's launcher, gloo on the CPU, a free
port), or torchrun itself. States are read back through the store and joined with their rank files,
exactly like a resume does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from trainproof.tasks.tinylm import TinyLMConfig, TinyLMTask
from tests.test_train_helpers import ROOT, entry_module, parse_events, train_env

# Short collective timeout: a test that breaks a rank must see the others give up quickly.
DIST_ARGS = ("--dist-timeout", "20")


def start_world(store: Path | str, *args: str, world: int = 2, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a ``world``-rank training run through trainproof's launcher (stdout/stderr piped)."""
    cmd = [sys.executable, "-m", entry_module(env), "train", "--nproc-per-node", str(world),
           "--store", str(store), *DIST_ARGS, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=train_env(env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def start_torchrun(store: Path | str, *args: str, world: int = 2) -> subprocess.Popen:
    """The same run under torchrun (trainproof as a plain worker; torchrun picks the port)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}"]
    cmd = [*torchrun, "-m", "trainproof", "train", "--store", str(store), *DIST_ARGS, *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=train_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


def read_until(proc: subprocess.Popen, predicate, lines: list[str]) -> dict[str, Any]:
    """Read the process's JSON lines until ``predicate(event)`` holds; fails if the process ends first."""
    while True:
        line = proc.stdout.readline()
        assert line, f"process ended before the awaited event: {lines[-3:]}"
        lines.append(line)
        for event in parse_events(line):
            if predicate(event):
                return event


def rank_pids(proc: subprocess.Popen, lines: list[str]) -> list[int]:
    """The worker pids the launcher announced, in rank order."""
    launch = read_until(proc, lambda e: e.get("event") == "launch", lines)
    return [r["pid"] for r in launch["ranks"]]


def load_world_state(store: Path | str, step: int | None = None) -> dict[str, Any]:
    """The joined state (every rank's part) of generation ``step`` (default: the newest usable one), with its full
    history reassembled from the run's generations (trainproof.format.history)."""
    from trainproof.format.history import from_store
    from trainproof.format.state import decode_generation
    from trainproof.storage import open_store

    s = open_store(str(store))
    loaded = s.load(step) if step is not None else s.load_latest(quarantine=False)
    assert loaded is not None, f"no usable generation in {store}"
    return from_store(s, decode_generation(loaded.files)).state


class TinyLM64(TinyLMTask):
    """tinylm in float64 (for the world-size equivalence: differences then sit far below any real effect)."""

    dtype = torch.float64


def tinylm64(config: dict[str, Any] | None = None) -> TinyLM64:
    """``--task tests.test_dist_helpers:tinylm64``."""
    from trainproof.tasks.base import config_from_dict

    return TinyLM64(config_from_dict(TinyLMConfig, config))
