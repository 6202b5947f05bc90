"""``trainproof plan``: checkpoint interval, retention, final reserve and ``--deadline`` for a rental.

The body only turns options into a :class:`job.planner.PlanInputs` and prints the :class:`Plan`.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone
from typing import Annotated, Optional

import typer

from job.cli import app
from job.clikit import UsageError, handled
from job.planner import Plan, PlanInputs, format_duration, make_plan, parse_duration, plan_document

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
    verify_seconds: Annotated[str, typer.Option("--verify-seconds", help=f"The equivalence verification. {_D}")] = "600",
    safety: Annotated[float, typer.Option("--safety", help="Multiplier on the finishing work and the emergency save.")] = 1.5,
    rollback: Annotated[str, typer.Option("--rollback", help=f"How far back kept generations must reach. {_D}")] = "2h",
    start: Annotated[Optional[str], typer.Option("--start", help="When the rental started (ISO time, default: now); "
                                                 "gives the absolute deadline.")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON document.")] = False,
    as_env: Annotated[bool, typer.Option("--env", help="Print the TRAINPROOF_* lines of an env file.")] = False,
) -> None:
    """Recommend a checkpoint interval (Young/Daly), retention, the final reserve and --deadline for a rental."""
    if as_json and as_env:
        raise UsageError("use either --json or --env, not both")
    try:
        inputs = PlanInputs(
            rental_s=parse_duration(rental), mtbi_s=parse_duration(mtbi),
            step_s=None if step_seconds is None else parse_duration(step_seconds),
            checkpoint_s=parse_duration(checkpoint_seconds), restart_s=parse_duration(restart_seconds),
            export_s=parse_duration(export_seconds), verify_s=parse_duration(verify_seconds),
            safety=safety, rollback_s=parse_duration(rollback), start=_parse_start(start),
        )
        # Note: a `--measure --store URL --task T` mode will time real commits, an export and steps, and
        # call job.planner.plan_from_measurements(inputs, checkpoint_s=..., export_s=..., step_s=...).
        plan = make_plan(inputs)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if as_json:
        print(json.dumps(plan_document(plan), indent=2))
    elif as_env:
        print("\n".join(f"{k}={v}" for k, v in plan.env().items()))
    else:
        print(render(plan))


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
        f"(checkpoints {plan.checkpoint_fraction:.1%}, rework and restarts {plan.overhead_fraction - plan.checkpoint_fraction:.1%})",
        f"  lost per interruption  {f(plan.lost_per_interruption_s)} (half an interval and a save, plus the restart)",
        f"  interruptions          {plan.expected_interruptions:.1f} expected over the rental",
        f"  retention              keep {plan.keep} (reaching back {f(i.rollback_s)})",
        f"  final reserve          {f(plan.reserve_s)} ({i.safety:g} x (step + save + restart + export + verify))",
        f"  stop grace             {plan.grace_s} s (terminationGracePeriodSeconds, TimeoutStopSec, stop_grace_period)",
        f"  deadline               {plan.deadline} after the start" + (f" = {at}" if at else ""),
        f"  first drill            save -> stop -> resume early on: costs about {f(plan.drill_s)}",
        "train with:",
        f"  trainproof train --checkpoint-every-seconds {plan.interval_s} --keep {plan.keep} --deadline {at or plan.deadline}"
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
