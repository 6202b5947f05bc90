"""``trainproof verify`` (the protocol, or ``--audit`` of a real run) and ``trainproof export``.

Exit codes of ``verify``: 0 the checks passed, 1 a comparison failed, 2 the verification could not be
completed (bad options, store unreachable, a path crashed, a result missing). ``export``: 0 committed and
reloaded with a matching metric, 1 the reload check failed or the store failed, 2 configuration.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from trainproof.cli.app import app
from trainproof.cli.common import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    EndpointArg,
    PathStyleArg,
    RegionArg,
    StoreArg,
    UsageError,
    fail,
    handled,
    setup_logging,
    store_cli_args,
)
from trainproof.errors import TrainError
from trainproof.storage import StoreError, StoreOptions, open_store
from trainproof.storage.limits import safe

_STEP_HELP = "Generation to export: a step number, or 'latest' (the newest usable one)."


def _opener(endpoint_url: str | None, region: str | None, path_style: bool | None, *, private: bool = False):
    # No multipart sweep from the verifier: the store it reads may belong to a training Job that is
    # uploading right now (every training process sweeps its own prefix when it starts).
    options = replace(StoreOptions.from_env(endpoint_url=endpoint_url, region=region, path_style=path_style),
                      sweep_multipart_older_than=None)
    if private and options.create_only == "require":
        options = replace(options, create_only="private")  # the audit's own prefix: no probe object (read-only)
    return lambda url: open_store(url, options)


@app.command("verify")
def verify_command(
    store: StoreArg,
    task: Annotated[Optional[str], typer.Option(
        help="Task of the protocol (default regression); with --audit the run's task, needed unless it is built "
             "in (compared with plan.json, never read from it).")] = None,
    steps: Annotated[Optional[int], typer.Option(
        help="Updates of the continuous path (default 10, tinylm 8; three epochs if longer, without --cuts).")] = None,
    cut: Annotated[Optional[int], typer.Option(help="Step of the cut (default 5; tinylm 3).")] = None,
    atol: Annotated[Optional[float], typer.Option(
        help="Absolute tolerance of floating-point comparisons (default: exact on the CPU, where a correct resume "
             "is bitwise equal; on CUDA 1e-12 plus --rtol; the audit 1e-12).")] = None,
    rtol: Annotated[Optional[float], typer.Option(
        help="Relative tolerance, times |reference| (default: 0 on the CPU; 16 epsilons of the task's dtype on "
             "CUDA).")] = None,
    seed: Annotated[Optional[int], typer.Option(help="Seed of the protocol's runs (default 1234).")] = None,
    config: Annotated[Optional[Path], typer.Option(help="Task settings file (JSON or TOML) for every path.")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda, for every process.")] = "auto",
    checkpoint_every: Annotated[int, typer.Option(
        help="Commit cadence of the continuous and resumed paths: full-state comparison at every such step.")] = 1,
    audit: Annotated[bool, typer.Option("--audit", help="Replay a run's generations --from -> --to, compare.")] = False,
    from_step: Annotated[Optional[int], typer.Option("--from", help="Audit: generation a (2nd newest).")] = None,
    to_step: Annotated[Optional[int], typer.Option("--to", help="Audit: generation b (default: newest).")] = None,
    max_replay_steps: Annotated[Optional[int], typer.Option(
        min=1, help="Audit: longest replay accepted (default: ten epochs of the run's plan, at least 1000).")] = None,
    workdir: Annotated[Optional[str], typer.Option(help="Where <id>/ goes (default <store>/verification).")] = None,
    vid: Annotated[Optional[str], typer.Option("--id", help="Verification id (default: UTC time + random).")] = None,
    export_bundle: Annotated[bool, typer.Option("--export/--no-export", help="Export the resumed result.")] = True,
    timeout: Annotated[float, typer.Option(help="Seconds each process may run.")] = 7200.0,
    sequential: Annotated[bool, typer.Option("--sequential", help="One process at a time.")] = False,
    cuts: Annotated[Optional[str], typer.Option(
        help="Every step to cut and resume at, e.g. 5,6,11 (default: the protocol's cut, every epoch boundary and "
             "the middle of every later epoch of three epochs, one step drawn from --seed, and a resume of a "
             "resume); each resumed path is compared with the continuous one.")] = None,
    world: Annotated[int, typer.Option(
        help="Ranks of every path (train --nproc-per-node W, gloo on the CPU); > 1 adds the world-size "
             "equivalence check (W ranks vs 1 rank, same global batch) and its negative control.")] = 1,
    fsdp: Annotated[bool, typer.Option(
        "--fsdp", help="Every path trains sharded (train --fsdp, FSDP2); the states are compared a group of "
                       "tensors at a time from their verified shards (TRAINPROOF_COMPARE_GROUP_MIB, default "
                       "256).")] = False,
    objective_check: Annotated[bool, typer.Option(
        "--objective-check/--no-objective-check",
        help="Run the objective-equivalence check (3 extra runs, 5 with --world W); skip it only for a task whose "
             "objective an earlier verification checked.")] = True,
    keep_evidence: Annotated[bool, typer.Option(
        "--keep-evidence", help="Keep the paths' step-* generations after a passed verdict (a failed or incomplete "
                                "one always keeps them; --reuse-reference needs them).")] = False,
    samples: Annotated[Optional[int], typer.Option(
        min=0, help="Train every path on the dataset's first N samples: epochs of N / global batch steps, so a "
                    "large dataset's epoch boundaries are still crossed within the budget. Default: the task's "
                    "verify_samples, else all; 0: all.")] = None,
    budget_steps: Annotated[int, typer.Option(
        min=1, help="Most steps the protocol's paths may train together; a larger plan is refused before it starts, "
                    "naming what shrinks it (--samples, --cuts, --checkpoint-every).")] = 5000,
    budget_gib: Annotated[float, typer.Option(
        min=0.0, help="Most GiB their generations may take (estimated from the model's parameters).")] = 20.0,
    reuse: Annotated[Optional[str], typer.Option(
        "--reuse-reference", hidden=True,
        help="Reuse an earlier verification's continuous, cut and negative-control paths.")] = None,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Prove resume == continuous in fresh processes (or --audit a real run); upload verification.json.
    Exit 0 passed, 1 a comparison failed, 2 the verification could not be completed."""
    setup_logging()
    opener = _opener(endpoint_url, region, path_style, private=audit)
    store_args = store_cli_args(endpoint_url, region, path_style)
    common = dict(store=store, device=device, workdir=workdir, timeout=timeout, store_args=store_args,
                  **({"vid": vid} if vid else {}))
    protocol_only = dict(task=task, steps=steps, cut=cut, seed=seed, config=config, reuse=reuse, cuts=cuts,
                         samples=samples)
    try:
        from trainproof.proof.settings import given_tolerance  # torch is slow to import: keep `--help` fast

        tolerance = given_tolerance(atol, rtol)
        if audit:
            if world != 1 or fsdp:
                raise UsageError(f"{'--world' if world != 1 else '--fsdp'} is for the protocol; --audit replays "
                                 "with the run's own plan.json")
            if not objective_check:
                raise UsageError("--no-objective-check is for the protocol; --audit runs no objective check")
            runner = _audit(common, opener, tolerance, protocol_only, from_step=from_step, to_step=to_step,
                            max_replay_steps=max_replay_steps)
        else:
            if from_step is not None or to_step is not None:
                raise UsageError("--from/--to select generations for --audit")
            runner = _protocol(common, opener, tolerance, protocol_only, checkpoint_every=checkpoint_every,
                               export=export_bundle, parallel=not sequential, world=world, fsdp=fsdp,
                               objective=objective_check, budget_steps=budget_steps, budget_gib=budget_gib)
    except (UsageError, TrainError, StoreError, OSError, ValueError) as exc:
        raise fail(" ".join(str(exc).split()), EXIT_USAGE) from None
    from trainproof.proof.verification import Outcome, run_verification

    outcome = run_verification(runner, keep_evidence=keep_evidence)
    raise typer.Exit({Outcome.PASSED: EXIT_OK, Outcome.FAILED: EXIT_FAILURE, Outcome.INCOMPLETE: EXIT_USAGE}[outcome])


def _audit(common: dict[str, Any], opener: Any, tolerance: Any, protocol_only: dict[str, Any], **steps: Any):
    task = protocol_only.pop("task")  # the audit's task is trusted from here, compared with plan.json
    given = [f"--{k.replace('reuse', 'reuse-reference')}" for k, v in protocol_only.items() if v is not None]
    if given:
        raise UsageError(f"--audit replays with the run's own plan.json; drop {', '.join(given)}")
    from trainproof.proof.audit import Audit, AuditSettings
    from trainproof.proof.compare import Tolerance

    private = {"TRAINPROOF_S3_CREATE_ONLY": "private"} if StoreOptions.from_env().create_only == "require" else {}
    return Audit(AuditSettings(tolerance=tolerance or Tolerance(), task=task, replay_env=private, **steps, **common),
                 opener)


def _protocol(common: dict[str, Any], opener: Any, tolerance: Any, protocol_only: dict[str, Any], **more: Any):
    from trainproof.proof.cuts import parse_cuts
    from trainproof.proof.protocol import Protocol
    from trainproof.proof.settings import ProtocolSettings, default_schedule

    o = protocol_only
    task = o["task"] or "regression"
    default_steps, default_cut = default_schedule(task)
    pick = lambda given, default: default if given is None else given  # noqa: E731  (0 is not "unset")
    chosen = None if o["cuts"] is None else parse_cuts(o["cuts"])
    # With --cuts and no --cut, the smallest listed cut is the protocol's (the cut and negative paths).
    protocol_cut = pick(o["cut"], default_cut if chosen is None else chosen[0])
    fixed = tuple(f"--{k}" for k in ("steps", "cut", "cuts", "samples") if o[k] is not None)
    settings = ProtocolSettings(task=task, config=o["config"], steps=pick(o["steps"], default_steps),
                                cut=protocol_cut, seed=pick(o["seed"], 1234), cuts=chosen, fixed=fixed,
                                tolerance=tolerance, reuse=o["reuse"], samples=o["samples"], **more, **common)
    return Protocol(settings, opener)


@app.command("export")
@handled
def export_command(
    store: StoreArg,
    step: Annotated[str, typer.Option(help=_STEP_HELP)] = "latest",
    task: Annotated[Optional[str], typer.Option(
        envvar="TRAINPROOF_TASK", help="The run's task (needed unless it is built in): compared with plan.json, "
        "never read from it.")] = None,
    dest: Annotated[Optional[str], typer.Option(help="Export root (default <store>/exports); the bundle is "
                                                     "<dest>/step-%08d/.")] = None,
    timeout: Annotated[float, typer.Option(help="Seconds the reload-check process may run.")] = 3600.0,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Write the export bundle (write -> verify -> mark usable), then reload it from its destination in a
    fresh process and re-run the evaluation. Exit 0 ok, 1 the reload check failed, 2 configuration."""
    setup_logging()
    if step != "latest" and not step.isdigit():
        raise UsageError(f"--step must be a step number or 'latest' (got {step!r})")
    opener = _opener(endpoint_url, region, path_style)
    try:
        from trainproof.proof.paths import VerificationIncomplete
        from trainproof.proof.reload import export_and_check

        checked = export_and_check(opener(store), step=None if step == "latest" else int(step),
                                   dest=opener(dest) if dest else None, task=task, timeout=timeout,
                                   store_args=store_cli_args(endpoint_url, region, path_style),
                                   exported=lambda b: print(f"{'reused' if b.reused else 'committed'} {b.url}"))
    except TrainError as exc:
        raise fail(" ".join(str(exc).split()), exc.exit_code) from None
    except VerificationIncomplete as exc:
        raise fail(str(exc), EXIT_FAILURE) from None
    record = checked.record
    print(f"reload check ({record['metric']}): recorded {record['recorded']:.10g}, reloaded bf16 "
          f"{record['reloaded_bf16']:.10g}: {'passed' if checked.passed else 'FAILED'} -> {checked.location}")
    others = record.get("others")
    others = others if isinstance(others, dict) else {}
    shown = [f"{safe(name, 64)} {entry['reloaded']:.6g}" for name, entry in list(others.items())[:16]
             if isinstance(entry, dict) and isinstance(entry.get("reloaded"), float)]
    if shown:  # the task's other metrics (DatasetTask eval_metrics), reproduced with the rest
        print(f"other metrics: {', '.join(shown)}")
    hf = record["checks"].get("hf_from_pretrained")
    if hf is not None:  # a transformers model's Hugging Face directory (trainproof.proof.hf_reload)
        print(f"Hugging Face directory {hf.get('directory')}: from_pretrained without trainproof "
              f"{'reproduced the metric' if hf.get('passed') else 'FAILED: ' + str(hf.get('why') or hf.get('error'))}")
    adapter = record["checks"].get("hf_adapter_from_pretrained")
    if adapter is not None:  # a peft model's adapter over its base (trainproof.proof.hf_reload)
        why = adapter.get("why") or adapter.get("error")
        print(f"adapter {adapter.get('directory')}: PeftModel.from_pretrained over the base without trainproof "
              f"{'reproduced the metric' if adapter.get('passed') else 'FAILED: ' + str(why)}")
    raise typer.Exit(EXIT_OK if checked.passed else EXIT_FAILURE)


@app.command("reload-check", hidden=True)
@handled
def reload_check_command(
    bundle: Annotated[str, typer.Option("--bundle", help="Export root holding the bundle.")],
    step: Annotated[int, typer.Option(help="Step of the bundle.")],
    task: Annotated[str, typer.Option(help="The bundle's task, from the process that made it (compared with "
                                           "config.json, never read from it).")],
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Internal: reload an export bundle from its destination and print the check as one JSON line."""
    setup_logging()
    from trainproof.proof.reload import reload_check

    try:
        record = reload_check(_opener(endpoint_url, region, path_style)(bundle), step, task=task)
    except TrainError as exc:
        raise fail(" ".join(str(exc).split()), exc.exit_code) from None
    print(json.dumps(record))
    raise typer.Exit(EXIT_OK if record["passed"] else EXIT_FAILURE)
