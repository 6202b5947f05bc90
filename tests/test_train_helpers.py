"""Shared helpers for the training process tests (no tests here).

Real processes (``python -m trainproof train``) against the local-folder store in ``tmp_path``; states are
read back through the store (verified) and decoded weights-only, exactly like a resume does.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tests.support.timing import budget

ROOT = Path(__file__).resolve().parent.parent
HOOK_PREFIX = "TPHOOK_"
"""Variables read by the test wrapper tests/support/hooked.py (never by the product)."""


def entry_module(env: dict[str, str] | None = None) -> str:
    """``trainproof``, or the test wrapper that injects faults when ``env`` asks for any (tests/support/hooked.py)."""
    return "tests.support.hooked" if any(k.startswith(HOOK_PREFIX) for k in env or {}) else "trainproof"


def train_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """A clean environment for a training process: no inherited TRAINPROOF_* options or hooks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINPROOF_")}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["TRAINPROOF_LOG_FORMAT"] = "json"
    env.update(extra or {})
    return env


def train_cmd(store: Path | str | None, *args: str, module: str = "trainproof") -> list[str]:
    """Command line of one training process (``store`` None: no --store option, e.g. from the environment)."""
    return [sys.executable, "-m", module, "train", *(["--store", str(store)] if store is not None else []), *args]


@dataclass
class Result:
    """A finished training process."""

    code: int
    events: list[dict[str, Any]]
    stderr: str

    def last(self, name: str) -> dict[str, Any]:
        """The last JSON event called ``name``."""
        found = [e for e in self.events if e.get("event") == name]
        assert found, f"no {name!r} event; stderr: {self.stderr}"
        return found[-1]


def parse_events(stdout: str) -> list[dict[str, Any]]:
    """The JSON lines a training process printed."""
    return [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]


def start(store: Path | str | None, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start a training process (stdout/stderr piped, text mode)."""
    return subprocess.Popen(train_cmd(store, *args, module=entry_module(env)), cwd=ROOT, env=train_env(env), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen, timeout: float = 120) -> Result:
    """Wait for a process started with :func:`start` and parse its output."""
    out, err = proc.communicate(timeout=budget(timeout))
    return Result(proc.returncode, parse_events(out), err)


def run_all(*jobs: tuple) -> list[Result]:
    """Run several independent training processes concurrently: each job is (store, *args)."""
    procs = [start(*job) for job in jobs]
    return [finish(p) for p in procs]


def run(store: Path | str, *args: str, env: dict[str, str] | None = None) -> Result:
    """Run one training process to completion."""
    return finish(start(store, *args, env=env))


def stopped_after_step(store: Path | str, *args: str, step: int, env: dict[str, str] | None = None,
                       step_delay: str = "0.3") -> Result:
    """A train process SIGTERMed once it printed step ``step`` (its steps slowed by ``step_delay`` s, so the signal
    lands mid-run), run to its end: the stopped attempt of a stop-and-resume test."""
    victim = start(store, *args, env={**(env or {}), "TPHOOK_STEP_DELAY": step_delay})
    seen: list[str] = []
    try:
        while True:
            line = victim.stdout.readline()
            assert line, f"the run ended before step {step}: {seen[-3:]} {victim.stderr.read()}"
            seen.append(line)
            if line.startswith("{") and json.loads(line).get("event") == "step" and json.loads(line)["step"] >= step:
                break
        victim.send_signal(signal.SIGTERM)
        return finish(victim, timeout=budget(300))
    finally:
        victim.kill()


def startup_s(folder: Path) -> float:
    """This machine's start-up of a train process now, as the product measures it: a 1-step run with a far deadline
    (in ``folder``) reports the reserve it keeps, 3.5 s + 1.5 x its start-up (trainproof.lifecycle.finish.Finisher).
    A deadline test sizes its deadline from it: the load average alone lags (a high one over a quick process)."""
    probe = run(folder, "--max-steps", "1", "--deadline", "1h", "--log-every", "1000")
    assert probe.code == 0, probe.stderr
    return (probe.last("start")["deadline_reserve_s"] - 3.5) / 1.5


def load_state(store: Path | str, step: int | None = None, *, history: str = "full") -> dict[str, Any]:
    """The decoded training state of generation ``step`` (default: the newest usable one).

    ``history``: ``full`` reassembles every step's history row from the run's generations (trainproof.format.history,
    chain checked; fails when retention deleted some), ``kept`` as far back as the kept generations reach, ``own``
    leaves the generation's own rows (those since the previous generation) as stored."""
    from trainproof.format.history import from_store
    from trainproof.format.state import STATE_FILE, decode, with_frozen
    from trainproof.storage import open_store

    s = open_store(str(store))
    loaded = s.load(step) if step is not None else s.load_latest(quarantine=False)
    assert loaded is not None, f"no usable generation in {store}"
    state = with_frozen(decode(loaded.files[STATE_FILE]), loaded.files)  # the model whole, frozen entries included
    return state if history == "own" else from_store(s, state, partial=history == "kept").state


def differences(a: Any, b: Any, path: str = "state") -> list[str]:
    """Every place where two states differ: exact tensors (dtype, shape, bits), exact floats, same keys.

    Non-finite floats are reported as differences even when both sides agree (the protocol refuses them).
    """
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
            return [f"{path}: tensor vs {type(b if isinstance(a, torch.Tensor) else a).__name__}"]
        if a.dtype != b.dtype or a.shape != b.shape:
            return [f"{path}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"]
        if a.is_floating_point() and not bool(torch.isfinite(a).all()):
            return [f"{path}: non-finite values"]
        return [] if torch.equal(a, b) else [f"{path}: values differ"]
    if isinstance(a, dict) and isinstance(b, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(str, set(a) ^ set(b)))} differ"]
        return [d for k in a for d in differences(a[k], b[k], f"{path}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} vs {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and isinstance(b, float) and not (math.isfinite(a) and math.isfinite(b)):
        return [f"{path}: non-finite {a} / {b}"]
    return [] if type(a) is type(b) and a == b else [f"{path}: {a!r} vs {b!r}"]


def trajectory(state: dict[str, Any]) -> dict[str, Any]:
    """Everything a resumed run must reproduce: all sections but the per-invocation trainer settings."""
    meta = {k: v for k, v in state["meta"].items() if k != "trainer"}
    return {**{k: v for k, v in state.items() if k != "meta"}, "meta": meta}


def from_step(state: dict[str, Any], first: int) -> dict[str, Any]:
    """``state`` (with its full history) as a store that kept only the generations from step ``first`` on shows it:
    history rows ``first``.. and the chain value before them. Comparing that with ``load_state(..., history="kept")``
    of another run still compares every step: equal ``history_chain.before`` values mean equal rows before ``first``
    (sha256 chain), equal rows and digest the rest."""
    from trainproof.format.state import History

    chain = state["history_chain"]
    assert first >= chain["first"], f"the state's history starts at step {chain['first']}, after {first}"
    kept = History.from_state_dict(state["history"], first=chain["first"], before=chain["before"]).since(first)
    chain = {**chain, "first": kept.first, "before": kept.before}
    return {**state, "history": kept.state_dict(), "history_chain": chain}


def kept_differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    """``differences`` of two runs' trajectories whose histories reach back only as far as their kept generations
    (``load_state(..., history="kept")``): compared from the later first step on (:func:`from_step`)."""
    first = max(a["history_chain"]["first"], b["history_chain"]["first"])
    return differences(trajectory(from_step(a, first)), trajectory(from_step(b, first)))


def history_rows(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-step history as rows (step, epoch, loss, lr, targets, sample_ids)."""
    from trainproof.format.state import History

    return History.from_state_dict(state["history"]).rows
