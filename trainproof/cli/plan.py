"""``trainproof plan``: checkpoint interval, retention, final reserve and ``--deadline`` for a rental.

The body only turns options into a :class:`trainproof.lifecycle.planner.PlanInputs` and prints the :class:`Plan`.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Optional

import typer

from trainproof.cli.app import app
from trainproof.cli.common import (
    EXIT_FAILURE,
    EndpointArg,
    PathStyleArg,
    RegionArg,
    UsageError,
    fail,
    handled,
    store_cli_args,
)
from trainproof.lifecycle.planner import (
    Plan,
    PlanInputs,
    format_duration,
    make_plan,
    parse_duration,
    plan_document,
    plan_from_measurements,
)

_D = "Duration: 90s, 10m, 6h, 7d, 1h30m or plain seconds."


@app.command("plan")
@handled
def plan_command(
    rental: Annotated[str, typer.Option("--rental", help=f"Length of the rental. {_D}")],
    mtbi: Annotated[str, typer.Option("--mtbi", help="Mean time between interruptions that lose work "
                                      f"(crash, kill, notice too short to save). {_D}")] = "6h",
    step_seconds: Annotated[Optional[str], typer.Option("--step-seconds", help=f"One optimizer step. {_D}")] = None,
    checkpoint_seconds: Annotated[str, typer.Option("--checkpoint-seconds",
                                                    help=f"One commit: save, upload, read back, mark. {_D}")] = "60",
    restart_seconds: Annotated[str, typer.Option("--restart-seconds",
                                                 help=f"From an interruption to training again. {_D}")] = "180",
    export_seconds: Annotated[str, typer.Option("--export-seconds", help=f"The final export bundle. {_D}")] = "300",
    verify_seconds: Annotated[str, typer.Option("--verify-seconds", help="The equivalence "
                                                                         f"verification. {_D}")] = "600",
    safety: Annotated[float, typer.Option("--safety", help="Multiplier on the finishing "
                                                           "work and the emergency save.")] = 1.5,
    rollback: Annotated[str, typer.Option("--rollback", help=f"How far back kept generations must reach. {_D}")] = "2h",
    start: Annotated[Optional[str], typer.Option("--start", help="When the rental started (ISO time, default: now); "
                                                 "gives the absolute deadline.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    as_env: Annotated[bool, typer.Option("--env", help="Print the TRAINPROOF_* lines of an env file.")] = False,
    measure: Annotated[bool, typer.Option("--measure", help="Time real steps, commits and an export against "
                                          "--store (in a scratch run <store>/plan-measure/<id>) and plan with "
                                          "them instead of --step/--checkpoint/--export-seconds.")] = False,
    store: Annotated[Optional[str], typer.Option("--store", envvar="TRAINPROOF_STORE",
                                                 help="--measure: the run's store.")] = None,
    task: Annotated[str, typer.Option("--task", help="--measure: the task to time.")] = "regression",
    config: Annotated[Optional[Path], typer.Option("--config", help="--measure: task settings file.")] = None,
    steps: Annotated[int, typer.Option("--steps", help="--measure: steps to time, each committed.")] = 5,
    endpoint_url: EndpointArg = None, region: RegionArg = None, path_style: PathStyleArg = None,
) -> None:
    """Recommend a checkpoint interval (Young/Daly), retention, the final reserve and --deadline for a rental."""
    if as_json and as_env:
        raise UsageError("use either --json or --env, not both")
    if measure and (not store or steps < 1):
        raise UsageError("--measure needs --store URL (and --steps >= 1)")
    try:
        inputs = PlanInputs(
            rental_s=parse_duration(rental), mtbi_s=parse_duration(mtbi),
            step_s=None if step_seconds is None else parse_duration(step_seconds),
            checkpoint_s=parse_duration(checkpoint_seconds), restart_s=parse_duration(restart_seconds),
            export_s=parse_duration(export_seconds), verify_s=parse_duration(verify_seconds),
            safety=safety, rollback_s=parse_duration(rollback), start=_parse_start(start),
        )
        measured = _measure(store, task, config, steps, endpoint_url, region, path_style) if measure else None
        plan = plan_from_measurements(inputs, **_timings(measured)) if measured else make_plan(inputs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if as_json:
        print(json.dumps({**plan_document(plan), **({"measured": measured} if measured else {})}, indent=2))
    elif as_env:
        print("\n".join(f"{k}={v}" for k, v in plan.env().items()))
    else:
        print(render(plan) if not measured else f"measured in {measured['scratch']}: step {measured['step_s']:.4g}s, "
              f"checkpoint {measured['checkpoint_s']:.4g}s (slowest of {measured['checkpoints']}), export + reload "
              f"check {measured['export_s']:.4g}s\n" + render(plan))


def _measure(store: str | None, task: str, config: Path | None, steps: int, endpoint_url: str | None,
             region: str | None, path_style: bool | None) -> dict[str, Any]:
    """Run the measurement (trainproof.lifecycle.measure); a failed one is exit 1, the store may be the cause."""
    from trainproof.lifecycle.measure import measure

    try:
        return measure(store or "", task, steps=steps, config=config,
                       store_args=store_cli_args(endpoint_url, region, path_style))
    except RuntimeError as exc:
        raise fail(str(exc), EXIT_FAILURE) from None


def _timings(measured: dict[str, Any]) -> dict[str, float]:
    return {k: measured[k] for k in ("checkpoint_s", "export_s", "step_s")}


def render(plan: Plan) -> str:
    """The human-readable plan."""
    i, f = plan.inputs, format_duration
    steps = f" = every {plan.interval_steps} steps" if plan.interval_steps is not None else ""
    at = plan.deadline_at.astimezone(timezone.utc).isoformat() if plan.deadline_at else None
    lines = [
        f"rental {f(i.rental_s)}, interruptions every {f(i.mtbi_s)} (M), checkpoint {f(i.checkpoint_s)} (C), "
        f"restart {f(i.restart_s)}, export {f(i.export_s)}, verify {f(i.verify_s)}"
        + (f", step {i.step_s:g}s" if i.step_s is not None else ""),
        f"  checkpoint interval    {f(plan.interval_s)} ({plan.interval_s} s; Young: {plan.young_s:.0f} s){steps}",
        f"  expected overhead      {plan.overhead_fraction:.1%} "
        f"(checkpoints {plan.checkpoint_fraction:.1%}, rework and restarts "
        f"{plan.overhead_fraction - plan.checkpoint_fraction:.1%})",
        f"  lost per interruption  {f(plan.lost_per_interruption_s)} (half an interval and a save, plus the restart)",
        f"  interruptions          {plan.expected_interruptions:.1f} expected over the rental",
        f"  retention              keep {plan.keep} (reaching back {f(i.rollback_s)})",
        f"  final reserve          {f(plan.reserve_s)} ({i.safety:g} x (step + save + restart + export + verify))",
        f"  stop grace             {plan.grace_s} s (terminationGracePeriodSeconds, TimeoutStopSec, stop_grace_period)",
        f"  deadline               {plan.deadline} after the start" + (f" = {at}" if at else ""),
        f"  first drill            save -> stop -> resume early on: costs about {f(plan.drill_s)}",
        "train with:",
        f"  trainproof train --checkpoint-every-seconds {plan.interval_s} "
        f"--keep {plan.keep} --deadline {at or plan.deadline}"
        + (f"   (or --checkpoint-every {plan.interval_steps})" if plan.interval_steps is not None else ""),
    ]
    lines += [f"warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _parse_start(text: str | None) -> datetime:
    # "Z" is accepted on Python 3.10 too, where fromisoformat() does not read it.
    if text is None:
        return datetime.now(timezone.utc).replace(microsecond=0)
    try:
        at = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"--start {text!r} is not an ISO time (2026-12-01T09:00:00Z)") from None
    return at if at.tzinfo else at.astimezone()
