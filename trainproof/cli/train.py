"""``trainproof train``: fills a TrainConfig from options / TRAINPROOF_* variables and runs it."""

from __future__ import annotations

import logging
import os
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

import trainproof
from trainproof.cli.app import app
from trainproof.cli.common import (
    EXIT_PREEMPTED,
    EndpointArg,
    PathStyleArg,
    RegionArg,
    StoreArg,
    fail,
    handled,
    open_run,
    setup_logging,
)
from trainproof.errors import ConfigError, TrainError
from trainproof.lifecycle.finish import Finisher
from trainproof.lifecycle.signals import Deadline, StopRequest
from trainproof.lifecycle.spot import PROVIDERS, SpotConfig, SpotWatcher
from trainproof.train.config import TrainConfig, load_task_config
from trainproof.train.variant import Variant


def _opt(env: str, help: str) -> Any:
    return typer.Option(envvar=f"TRAINPROOF_{env}", show_envvar=True, help=help)


@app.command("train")
@handled
def train_command(
    store: StoreArg,
    task: Annotated[str, _opt("TASK", "Built-in task (regression, tinylm) or package.module:factory.")] = "regression",
    max_steps: Annotated[int | None, _opt("MAX_STEPS", "Target total of optimizer steps (idempotent).")] = None,
    steps: Annotated[int | None, _opt("STEPS", "Additional optimizer steps from where this run resumes.")] = None,
    checkpoint_every: Annotated[int, _opt("CHECKPOINT_EVERY", "Commit every N steps (0: off).")] = 0,
    checkpoint_every_seconds: Annotated[
        float, _opt("CHECKPOINT_EVERY_SECONDS", "Commit every S seconds (0: off).")] = 600.0,
    keep: Annotated[int, _opt("KEEP", "Complete generations to keep (0: all).")] = 3,
    resume: Annotated[str, _opt("RESUME", "auto: resume from the newest usable generation; never.")] = "auto",
    omit_rng_restore: Annotated[bool, _opt("OMIT_RNG_RESTORE", "Negative control: skip the RNG restore.")] = False,
    variant: Annotated[Optional[str], typer.Option(
        hidden=True, help="The verifier's mode of this process, a JSON object (trainproof.train.variant). Never for "
        "training; no environment variable sets it.")] = None,
    seed: Annotated[int, _opt("SEED", "Seed of every generator (part of the run contract).")] = 1234,
    config: Annotated[Path | None, _opt("CONFIG", "JSON or TOML file of task settings.")] = None,
    deadline: Annotated[str | None, _opt("DEADLINE", "Stop in time to commit, export and reload-check the export "
                                         "before this: ISO time, or 90s/10m/2h/1d2h from the run's FIRST start "
                                         "(recorded in deadline.json). Then exit 0; 75 if the export did not "
                                         "make it.")] = None,
    rental_ends: Annotated[str | None, _opt("RENTAL_ENDS", "Like --deadline, absolute ISO time only.")] = None,
    spot_notice: Annotated[str, _opt("SPOT_NOTICE", f"Watch spot interruption notices: {'|'.join(PROVIDERS)}; a "
                                     "notice stops like SIGTERM (commit, exit 75).")] = "none",
    spot_endpoint: Annotated[str | None, _opt("SPOT_ENDPOINT", "Metadata service base URL (default: the "
                                              "provider's link-local address).")] = None,
    spot_interval: Annotated[float, _opt("SPOT_INTERVAL", "Seconds between metadata polls.")] = 5.0,
    device: Annotated[str, _opt("DEVICE", "auto, cpu or cuda.")] = "auto",
    log_every: Annotated[int, _opt("LOG_EVERY", "Log every N steps.")] = 1,
    log_format: Annotated[str, _opt("LOG_FORMAT", "auto (rich on a terminal), rich or json.")] = "auto",
    nproc_per_node: Annotated[int, _opt("NPROC_PER_NODE", "Ranks on this node (> 1: launch "
                                                          "them; DDP, or FSDP2 with --fsdp).")] = 1,
    nnodes: Annotated[int, _opt("NNODES", "Nodes of a multi-node launch (each runs this command).")] = 1,
    node_rank: Annotated[int, _opt("NODE_RANK", "This node's index in a multi-node launch.")] = 0,
    master_addr: Annotated[str, _opt("MASTER_ADDR", "Host of node 0 (rendezvous).")] = "127.0.0.1",
    master_port: Annotated[int, _opt("MASTER_PORT", "Rendezvous port on node 0 (0: any free one).")] = 0,
    dist_timeout: Annotated[float, _opt("DIST_TIMEOUT", "Seconds any collective may wait for a rank.")] = 600.0,
    allow_world_change: Annotated[
        bool, _opt("ALLOW_WORLD_CHANGE", "Resume on another world size (no longer bitwise comparable).")] = False,
    allow_code_change: Annotated[
        bool, _opt("ALLOW_CODE_CHANGE", "Resume a generation written by other code (another source digest of "
                   "trainproof/); recorded in meta.code_changes.")] = False,
    fsdp: Annotated[bool, _opt("FSDP", "Shard the model and optimizer over the ranks with FSDP2 instead of DDP; "
                               "checkpoints are sharded (each rank writes its own shards, none holds the whole "
                               "state). Part of the run's plan: give it on every start. Resume on "
                               "another world size with --allow-world-change (DCP reshards).")] = False,
    sync_checkpoint: Annotated[bool, _opt("SYNC_CHECKPOINT", "Commit checkpoints inline, blocking training for "
                                          "the whole save (default: only a copy to host memory blocks; the "
                                          "commit runs in the background).")] = False,
    stop_grace: Annotated[float, _opt("STOP_GRACE", "Seconds between SIGTERM (or a spot notice) and SIGKILL: "
                                      "the final step is committed only when its measured commit time fits; "
                                      "else exit 75 from the commit in flight. Kubernetes: match "
                                      "terminationGracePeriodSeconds (150 in infra/k8s); AWS spot 120.")] = 25.0,
    data_workers: Annotated[Optional[int], _opt("DATA_WORKERS", "DataLoader worker processes that load, decode, "
                                                "augment and collate micro-batches ahead of the step (default: the "
                                                "task's num_workers; 0: in the training process). Never changes "
                                                "results: a run may resume with another count.")] = None,
    prefetch: Annotated[Optional[int], _opt("PREFETCH", "Micro-batches each data worker builds ahead (default: "
                                            "the task's prefetch, 2).")] = None,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Train; resume from the latest valid generation. Exit 0 done (target reached, or deadline reached with a
    committed checkpoint and a reload-verified export), 75 stopped early after committing (signal, spot notice,
    or a deadline whose export did not make it: run again), 2 config, 1 other."""
    if nproc_per_node * nnodes > 1 and "WORLD_SIZE" not in os.environ:  # not yet a rank: launch the ranks
        raise typer.Exit(_launch(nproc_per_node, nnodes, node_rank, master_addr, master_port, dist_timeout, log_format))
    with StopRequest() as stop:  # before torch is imported: a SIGTERM from here on is honoured
        setup_logging()  # the store's warnings (a generation skipped, a retry) go to stderr
        try:
            if deadline and rental_ends:
                raise ConfigError("use either --deadline or --rental-ends, not both")
            spot = _spot_config(spot_notice, spot_endpoint, spot_interval)
            cfg = TrainConfig(
                store=store, task=task, task_config=load_task_config(config) if config else {},
                max_steps=max_steps, steps=steps, checkpoint_every=checkpoint_every,
                checkpoint_every_seconds=checkpoint_every_seconds, keep=keep, resume=resume,
                omit_rng_restore=omit_rng_restore, variant=Variant.parse(variant), seed=seed,
                deadline=None,  # set below from the run's deadline.json (a restart must not move it)
                device=device, log_every=log_every, log_format=log_format,
                allow_world_change=allow_world_change, dist_timeout_s=dist_timeout,
                allow_code_change=allow_code_change,
                sync_checkpoint=sync_checkpoint, stop_grace_s=stop_grace, fsdp=fsdp, data_workers=data_workers,
                prefetch=prefetch,
            )
            run_store = open_run(store, endpoint_url, region, path_style)
            if run_store.shared and run_store.options.signing is None and os.environ.get("RANK", "0") == "0":
                logging.getLogger("trainproof.train").warning(
                    "no signing key (TRAINPROOF_SIGNING_KEY[_FILE]): generations in this bucket are not "
                    "authenticated, so anyone who can write there can make this run resume from a state they made "
                    "(SECURITY.md)")
            cfg.deadline = _run_deadline(run_store, deadline, rental_ends)
            from trainproof.train.loop import train  # torch is slow to import: keep `--help` and config errors fast

            with SpotWatcher(spot, stop.notice):  # a notice only sets the stop flag, like SIGTERM
                outcome = train(cfg, store=run_store, stop=stop, **_deadline_work(cfg))
        except TrainError as exc:
            rank = os.environ.get("RANK") if "WORLD_SIZE" in os.environ else None
            error = fail((f"rank {rank}: " if rank else "") + " ".join(str(exc).split()), exc.exit_code)
            _exit_rank(exc.exit_code)
            raise error from None
    if outcome.exit_code == EXIT_PREEMPTED and os.environ.get("RANK", "0") == "0":
        # The last line a person sees after a SIGTERM/Ctrl-C: what was kept and what to do next (rank 0 only).
        sys.stderr.write(f"trainproof: stopped ({outcome.reason}) after committing step {outcome.step} of "
                         f"{outcome.target}; run the same command again to resume\n")
    _exit_rank(outcome.exit_code)
    raise typer.Exit(outcome.exit_code)


def _exit_rank(code: int) -> None:
    """A rank of a multi-process world ends here with ``code``, without the interpreter's finalization.

    Everything it had to do is done (committed, reported, the process group torn down on a normal end). What
    finalization would add is the destruction of torch.distributed's C++ objects (gloo worker threads, the
    rendezvous store client) in no defined order; seen here about once per full test run: ``terminate called
    without an active exception`` (SIGABRT), which turns a clean 0 or 75 into a crash the launcher reports as
    exit 1. A single process (world 1) exits normally."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        world = 1
    if world <= 1:
        return
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _deadline_work(cfg: TrainConfig) -> dict[str, Any]:
    """The deadline policy and, with a deadline, the export that finishes the run (trainproof.lifecycle)."""
    if cfg.deadline is None:
        return {}
    # The reload check is a fresh process like this one: our own start-up so far (torch imported) measures it.
    startup_s = min(time.monotonic() - trainproof.IMPORTED_AT, 120.0)
    return {"deadline": Deadline(cfg.deadline, margin_s=cfg.deadline_margin_s),
            "finisher": Finisher(startup_s, cfg.task)}


def _spot_config(provider: str, endpoint: str | None, interval: float) -> SpotConfig:
    try:
        return SpotConfig(provider=provider, endpoint=endpoint, interval_s=interval)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def _run_deadline(run_store: Any, deadline: str | None, rental_ends: str | None) -> Any:
    """The absolute deadline: a relative one counts from the run's first start (trainproof.lifecycle.finish,
    deadline.json)."""
    spec = deadline or rental_ends
    if not spec:
        return None
    from trainproof.lifecycle.finish import DEADLINE_FILE, resolve_run_deadline

    existed = run_store.exists(DEADLINE_FILE)
    at = resolve_run_deadline(run_store, spec, absolute_only=rental_ends is not None)
    if at <= datetime.now(timezone.utc) and not existed:
        raise ConfigError(f"the deadline {at.isoformat()} is already past: give a later --deadline")
    # A run whose recorded deadline has passed is not misconfigured (it is restarted after its rental ended):
    # the trainer then only finishes it (export and reload check) instead of failing the Job with exit 2.
    return at


def _launch(nproc_per_node: int, nnodes: int, node_rank: int, master_addr: str, master_port: int,
            dist_timeout: float, log_format: str) -> int:
    """Run this same command line once per local rank (trainproof.train.launch); the world's exit code."""
    from trainproof.train.launch import LaunchConfig, launch

    try:
        cfg = LaunchConfig(nproc_per_node=nproc_per_node, nnodes=nnodes, node_rank=node_rank,
                           master_addr=master_addr, master_port=master_port, failure_grace_s=dist_timeout,
                           json_events=log_format == "json" or (log_format == "auto" and not sys.stdout.isatty()))
    except TrainError as exc:
        raise fail(str(exc), exc.exit_code) from None
    # Note: the ranks re-run this process's own command line (sys.argv), so launch from a real command line
    # (`trainproof train ...` or `python -m trainproof train ...`), not from an in-process CliRunner.
    return launch(sys.argv[1:], cfg)
