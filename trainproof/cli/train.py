"""``trainproof train``: fills a TrainConfig from options / TRAINPROOF_* variables and runs it."""

from __future__ import annotations

import logging
import os
import sys
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
    options_from,
    pick,
    setup_logging,
)
from trainproof.errors import ConfigError, TrainError
from trainproof.lifecycle.finish import Finisher, process_age_s
from trainproof.lifecycle.signals import Deadline, StopRequest
from trainproof.lifecycle.spot import SpotConfig, SpotWatcher
from trainproof.storage.ahead import wind_up
from trainproof.train.config import TrainConfig, load_task_config
from trainproof.train.fetch import fetch_ahead
from trainproof.train.launch import LaunchConfig, launch
from trainproof.train.variant import Variant

ConfigArg = Annotated[Optional[Path], typer.Option(envvar="TRAINPROOF_CONFIG", show_envvar=True,
                                                   help="JSON or TOML file of task settings.")]
DeadlineArg = Annotated[Optional[str], typer.Option(
    envvar="TRAINPROOF_DEADLINE", show_envvar=True, help="Stop in time to commit, export and reload-check the export "
    "before this: ISO time, or 90s/10m/2h/1d2h from the run's FIRST start (recorded in deadline.json). Then exit 0; "
    "75 if the export did not make it.")]
RentalEndsArg = Annotated[Optional[str], typer.Option(envvar="TRAINPROOF_RENTAL_ENDS", show_envvar=True,
                                                      help="Like --deadline, absolute ISO time only.")]
VariantArg = Annotated[Optional[str], typer.Option(hidden=True, help="The verifier's mode of this process, a JSON "
                                                   "object (trainproof.train.variant). Never for training; no "
                                                   "environment variable sets it.")]


@app.command("train")
@handled
@options_from(TrainConfig, SpotConfig, LaunchConfig)  # every other option: a field of these, declared there once
def train_command(store: StoreArg, config: ConfigArg = None, deadline: DeadlineArg = None,
                  rental_ends: RentalEndsArg = None, variant: VariantArg = None, endpoint_url: EndpointArg = None,
                  region: RegionArg = None, path_style: PathStyleArg = None, **settings: Any) -> None:
    """Train; resume from the latest valid generation. Exit 0 done (target reached, or deadline reached with a
    committed checkpoint and a reload-verified export), 75 stopped early after committing (signal, spot notice,
    or a deadline whose export did not make it: run again), 2 config, 1 other."""
    world = pick(LaunchConfig, settings)
    if world["nproc_per_node"] * world["nnodes"] > 1 and "WORLD_SIZE" not in os.environ:  # not yet a rank: launch
        raise typer.Exit(_launch(world, settings["dist_timeout_s"], settings["log_format"]))
    with StopRequest() as stop:  # before torch is imported: a SIGTERM from here on is honoured
        setup_logging()  # the store's warnings (a generation skipped, a retry) go to stderr
        try:
            if deadline and rental_ends:
                raise ConfigError("use either --deadline or --rental-ends, not both")
            spot = _spot_config(pick(SpotConfig, settings))
            cfg = TrainConfig(store=store, task_config=load_task_config(config) if config else {},
                              variant=Variant.parse(variant), **settings)  # deadline: from the run's deadline.json
            run_store = open_run(store, endpoint_url, region, path_style)
            if os.environ.get("RANK", "0") == "0":  # on S3 the store's probe runs beside importing torch, until
                run_store.prepare_soon()  # the first write (plan.json, or deadline.json) waits for it
            if cfg.resume == "auto":  # a restart's download of its newest generation runs beside its set-up too
                fetch_ahead(run_store)
            _warn_unsigned(run_store)
            cfg.deadline = _run_deadline(run_store, deadline, rental_ends)  # a restart must not move it
            from trainproof.train.loop import train  # torch is slow to import: keep `--help` and config errors fast

            with SpotWatcher(spot, stop.notice):  # a notice only sets the stop flag, like SIGTERM
                outcome = train(cfg, store=run_store, stop=stop, interval=_interval(cfg, run_store),
                                **_deadline_work(cfg))
        except TrainError as exc:
            rank = os.environ.get("RANK") if "WORLD_SIZE" in os.environ else None
            error = fail((f"rank {rank}: " if rank else "") + " ".join(str(exc).split()), exc.exit_code)
            _exit_rank(exc.exit_code)
            raise error from None
    if outcome.exit_code == EXIT_PREEMPTED and os.environ.get("RANK", "0") == "0":
        sys.stderr.write(stop_line(outcome) + "\n")
    _exit_rank(outcome.exit_code)
    raise typer.Exit(outcome.exit_code)


def stop_line(outcome: Any) -> str:
    """The last line a person sees after a SIGTERM/Ctrl-C (rank 0): the step that was *committed* (what a restart
    continues from), not merely reached, and what to do next."""
    committed, reached = outcome.committed_step, outcome.step
    head = f"trainproof: stopped ({outcome.reason})"
    if not committed:
        return (f"{head} at step {reached} of {outcome.target} before any step was committed; run the same command "
                "again to start it again")
    if committed < reached:
        return (f"{head} at step {reached} of {outcome.target}; the last committed step is {committed} (the "
                f"{reached - committed} after it will be trained again); run the same command again to resume")
    return f"{head} after committing step {committed} of {outcome.target}; run the same command again to resume"


def _warn_unsigned(run_store: Any) -> None:
    if run_store.shared and run_store.options.signing is None and os.environ.get("RANK", "0") == "0":
        logging.getLogger("trainproof.train").warning(
            "no signing key (TRAINPROOF_SIGNING_KEY[_FILE]): generations in this bucket are not authenticated, so "
            "anyone who can write there can make this run resume from a state they made (SECURITY.md)")


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
    wind_up()  # os._exit runs no exit hook: a fetch ahead's files, whole or partial, are deleted here
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def _interval(cfg: TrainConfig, run_store: Any) -> Any:
    """``--checkpoint-every auto``'s planner: rank 0 reads the run's attempt records (before this process's own
    exists); another rank plans from its own commits (a checkpoint is due when any rank's clock says so)."""
    if not cfg.auto_interval:
        return None
    from trainproof.lifecycle.autointerval import AutoInterval

    return AutoInterval.from_store(run_store if os.environ.get("RANK", "0") == "0" else None)


def _deadline_work(cfg: TrainConfig) -> dict[str, Any]:
    """The deadline policy and, with a deadline, the export that finishes the run (trainproof.lifecycle)."""
    if cfg.deadline is None:
        return {}
    # The reload check is a fresh process like this one: our own start-up so far (torch imported) measures it.
    startup_s = min(process_age_s(trainproof.IMPORTED_AT), 120.0)
    return {"deadline": Deadline(cfg.deadline, margin_s=cfg.deadline_margin_s),
            "finisher": Finisher(startup_s, cfg.task)}


def _spot_config(values: dict[str, Any]) -> SpotConfig:
    try:
        return SpotConfig(**values)
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


def _launch(world: dict[str, Any], dist_timeout: float, log_format: str) -> int:
    """Run this same command line once per local rank (trainproof.train.launch); the world's exit code."""
    try:
        cfg = LaunchConfig(**world, failure_grace_s=dist_timeout,
                           json_events=log_format == "json" or (log_format == "auto" and not sys.stdout.isatty()))
    except TrainError as exc:
        raise fail(str(exc), exc.exit_code) from None
    # Note: the ranks re-run this process's own command line (sys.argv), so launch from a real command line
    # (`trainproof train ...` or `python -m trainproof train ...`), not from an in-process CliRunner.
    return launch(sys.argv[1:], cfg)
