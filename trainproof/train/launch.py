"""``trainproof train --nproc-per-node W``: trainproof's own launcher for a distributed run.

Why not torchrun alone: torchrun treats every non-zero worker exit as a failure. When the workers exit 75
("stopped early after committing: run again"), torchrun SIGTERMs the workers still running and itself
exits 1 (checked with torch 2.13), so a Kubernetes Job would count a clean preemption as a failed attempt.
This launcher keeps the exit-code contract (README, "Exit codes") for the whole world:

- it spawns one ``python -m trainproof <same arguments>`` worker per local rank with ``RANK``, ``WORLD_SIZE``,
  ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set, as torchrun does;
- node 0's launcher hosts the rendezvous store itself (``TORCHELASTIC_USE_AGENT_STORE``, like torchrun's
  agent), on a free port when none is given: no port to pick, no race for it;
- SIGTERM/SIGINT are forwarded to every worker, which agree on one step, commit it and exit 75; nothing is
  killed after a fixed delay (the Kubernetes grace period is the limit that counts);
- when a worker fails, the others get ``failure_grace_s`` (the collective timeout) to notice and fail on
  their own; they do at once when the peer died. Survivors after that are killed;
- the launcher exits 0 when every rank reached the target, 75 when every rank stopped after committing,
  2 when any rank hit a configuration or contract error, and 1 otherwise.

Multi-node: run the launcher on every node with ``--nnodes N --node-rank i --master-addr HOST
--master-port P`` (a static rendezvous hosted by node 0). Node 0's launcher keeps the store up until every
other node's launcher reports its ranks exited (at most ``exit_barrier_s``), as torchrun's agent does. Under torchrun's
elastic rendezvous,
``trainproof train`` runs unchanged as a worker; the job's exit code is then torchrun's (1 for a
preemption). Workers get SIGTERM when their launcher dies (Linux), so an orphaned rank still commits.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from trainproof.errors import ConfigError
from trainproof.train.config import setting

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_STOPPED = 0, 1, 2, 75
ENTRY_MODULE = "trainproof"
"""The module every process trainproof starts runs as (``python -m trainproof``): ranks, verifier paths, reload checks.

A constant, not a setting: tests that wrap the entry point (to slow a step or break a resume on purpose)
replace it in their own wrapper process, so the processes it starts run the wrapper too."""


def entry_argv(*args: str) -> list[str]:
    """``python -m trainproof <args>`` with this interpreter: the command line of every process trainproof starts."""
    return [sys.executable, "-m", ENTRY_MODULE, *args]
LAUNCHED_ENV = "TRAINPROOF_LAUNCHED"


@dataclass(kw_only=True)
class LaunchConfig:
    """Where this node's ranks sit in the world and how they meet."""

    nproc_per_node: int = setting(1, "Ranks on this node (> 1: launch them; DDP, or FSDP2 with --fsdp).")
    nnodes: int = setting(1, "Nodes of a multi-node launch (each runs this command).")
    node_rank: int = setting(0, "This node's index in a multi-node launch.")
    """Node 0 hosts the rendezvous store."""
    master_addr: str = setting("127.0.0.1", "Host of node 0 (rendezvous).")
    """Reachable from every node."""
    master_port: int = setting(0, "Rendezvous port on node 0 (0: any free one).")
    """Any free port: single node only."""
    failure_grace_s: float = 600.0
    """After a rank failed, how long the others may take to fail on their own before they are killed."""
    exit_barrier_s: float = 120.0
    """Multi-node: how long node 0's launcher keeps the rendezvous store up for the other nodes' ranks to exit."""
    json_events: bool = True
    """Launcher events as JSON lines on stdout (else plain lines on stderr)."""

    def __post_init__(self) -> None:
        if self.nproc_per_node < 1 or self.nnodes < 1 or not 0 <= self.node_rank < self.nnodes:
            raise ConfigError(f"--nproc-per-node {self.nproc_per_node} / --nnodes {self.nnodes} / --node-rank "
                              f"{self.node_rank}: need >= 1 process, >= 1 node and 0 <= node rank < nodes")
        if self.nnodes > 1 and not self.master_port:
            raise ConfigError("a multi-node launch needs --master-port (and --master-addr of node 0)")

    @property
    def world(self) -> int:
        """Ranks over all nodes."""
        return self.nproc_per_node * self.nnodes


def world_exit_code(codes: Sequence[int]) -> int:
    """The world's exit code from every local rank's (a negative code: killed by that signal)."""
    if all(c == EXIT_OK for c in codes):
        return EXIT_OK
    if all(c == EXIT_STOPPED for c in codes):
        return EXIT_STOPPED
    return EXIT_USAGE if EXIT_USAGE in codes else EXIT_FAILURE


def launch(argv: Sequence[str], cfg: LaunchConfig) -> int:
    """Run ``python -m trainproof *argv`` once per local rank; return the world's exit code (see module doc)."""
    store = _host_store(cfg) if cfg.node_rank == 0 else None  # kept alive until every worker is done
    port = store.port if store is not None else cfg.master_port
    procs = [_spawn(argv, cfg, local, port) for local in range(cfg.nproc_per_node)]
    previous = {sig: signal.signal(sig, lambda s, _f: _forward(procs, s)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        _event(cfg, "launch", world=cfg.world, node_rank=cfg.node_rank, master=f"{cfg.master_addr}:{port}",
               ranks=[{"rank": cfg.node_rank * cfg.nproc_per_node + i, "pid": p.pid} for i, p in enumerate(procs)])
        codes = _wait(procs, cfg)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    code = world_exit_code(codes)
    if cfg.nnodes > 1:
        _exit_barrier(cfg, store, port, code)
    _event(cfg, "world_exit", codes=codes, exit_code=code)
    return code


def _exit_barrier(cfg: LaunchConfig, store: Any, port: int, code: int) -> None:
    """Keep node 0's store up until every other node's ranks have exited (as torchrun's agent does).

    The ranks talk to the store until their very end (process-group teardown); a store that vanishes under a
    rank still tearing down aborts it in C++ ("terminate called without an active exception"), turning a
    clean exit 0/75 into a crash. Each other node's launcher reports here once its ranks exited; node 0
    waits for all of them, at most ``exit_barrier_s`` (a node that died never reports).
    """
    from torch.distributed import TCPStore

    keys = [f"trainproof/exited/{n}" for n in range(1, cfg.nnodes)]
    started = time.monotonic()
    try:
        if store is not None:
            store.wait(keys, timedelta(seconds=cfg.exit_barrier_s))
        else:
            client = TCPStore(cfg.master_addr, port, None, False, timedelta(seconds=30))
            client.set(keys[cfg.node_rank - 1], str(code))
    except (RuntimeError, ValueError) as exc:  # a timeout, or node 0 already gone: nothing left to protect
        _event(cfg, "exit_barrier_incomplete", after_s=round(time.monotonic() - started, 3),
               error=(str(exc).strip().splitlines() or [type(exc).__name__])[0][:200])


def _host_store(cfg: LaunchConfig) -> Any:
    from torch.distributed import TCPStore  # torch only here: the launcher itself trains nothing

    return TCPStore(cfg.master_addr, cfg.master_port, None, True, timedelta(seconds=cfg.failure_grace_s),
                    wait_for_workers=False)


def _spawn(argv: Sequence[str], cfg: LaunchConfig, local: int, port: int) -> subprocess.Popen:
    env = dict(os.environ)
    env.update({
        "RANK": str(cfg.node_rank * cfg.nproc_per_node + local), "WORLD_SIZE": str(cfg.world),
        "LOCAL_RANK": str(local), "LOCAL_WORLD_SIZE": str(cfg.nproc_per_node), "GROUP_RANK": str(cfg.node_rank),
        "MASTER_ADDR": cfg.master_addr, "MASTER_PORT": str(port), "TORCHELASTIC_USE_AGENT_STORE": "True",
        LAUNCHED_ENV: "1",
    })
    env.setdefault("OMP_NUM_THREADS", "1")  # W ranks x all cores each would oversubscribe the CPU
    return subprocess.Popen(entry_argv(*argv), env=env, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    # Runs in the child before exec: SIGTERM it when the launcher dies (Linux prctl PR_SET_PDEATHSIG), so an
    # orphaned rank stops at the next step boundary instead of training on alone.
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)


def _forward(procs: list[subprocess.Popen], sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(sig)


def _wait(procs: list[subprocess.Popen], cfg: LaunchConfig) -> list[int]:
    """Every worker's exit code; after a failure, survivors get ``failure_grace_s`` before SIGKILL."""
    codes: list[int | None] = [None] * len(procs)
    failed_at: float | None = None
    while any(c is None for c in codes):
        for i, p in enumerate(procs):
            if codes[i] is None and (rc := p.poll()) is not None:
                codes[i] = rc
                if rc not in (EXIT_OK, EXIT_STOPPED) and failed_at is None:
                    failed_at = time.monotonic()
                    _event(cfg, "rank_failed", rank=cfg.node_rank * cfg.nproc_per_node + i, exit_code=rc)
        if failed_at is not None and time.monotonic() - failed_at > cfg.failure_grace_s:
            survivors = [p for p in procs if p.poll() is None]
            _event(cfg, "kill_survivors", pids=[p.pid for p in survivors], after_s=cfg.failure_grace_s)
            for p in survivors:
                p.kill()
            failed_at = float("inf")  # kill once
        time.sleep(0.05)
    return [int(c) for c in codes]


def _event(cfg: LaunchConfig, name: str, **fields: Any) -> None:
    if cfg.json_events:
        sys.stdout.write(json.dumps({"event": name, "source": "launcher", **fields}) + "\n")
        sys.stdout.flush()
    else:
        details = " ".join(f"{k}={v}" for k, v in fields.items())
        print(f"trainproof launcher: {name} {details}", file=sys.stderr, flush=True)


def world_command(train_args: Sequence[str], world: int) -> list[str]:
    """The command line of a ``world``-rank run on this machine (CPU: gloo; a free port is picked)."""
    return entry_argv("train", "--nproc-per-node", str(world), *train_args)


def run_world(train_args: Sequence[str], world: int, *, env: dict[str, str] | None = None,
              timeout: float | None = None, cwd: str | None = None) -> subprocess.CompletedProcess:
    """Run ``trainproof train`` with ``world`` ranks on this machine and wait (for the verifier and tests).

    ``train_args``: every ``train`` option but ``--nproc-per-node``. Returns the CompletedProcess (text
    stdout/stderr captured); its return code is the world's (0, 75, 2 or 1).
    """
    return subprocess.run(world_command(train_args, world), env=env, cwd=cwd, timeout=timeout,
                          capture_output=True, text=True, check=False)
